"""Scenarios the frameworks' own test suites put callbacks through (copies, resumes, AMP)."""

from __future__ import annotations

import copy
import math
import pickle
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from ignite.engine import Engine, Events, supervised_training_step_amp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from eventbus_debug import read_events
from eventbus_debug.events import NonFiniteDetected, SessionEnded, StepCompleted, TensorRole
from eventbus_debug.integrations.ignite import EventBusDebugHandler
from eventbus_debug.integrations.lightning import EventBusDebugCallback as LightningCallback

from ._lightning import quiet_trainer

BATCHES = 8


def _data(nan_at: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCHES * 8, 4, generator=g)
    y = x.sum(1, keepdim=True)
    if nan_at is not None:
        x[nan_at * 8, 0] = math.nan
    return [(x[i : i + 8], y[i : i + 8]) for i in range(0, BATCHES * 8, 8)]


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))


def _copies(obj: Any) -> list[Any]:
    return [copy.deepcopy(obj), pickle.loads(pickle.dumps(obj))]


def _assert_idle_copies(copies: list[Any], steps: int) -> None:
    for other in copies:
        assert other.session is None
        assert other.steps_checked == steps


# -- Lightning ------------------------------------------------------------------------------------


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _net()

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


def _loader() -> DataLoader[tuple[torch.Tensor, ...]]:
    x, y = (torch.cat(t) for t in zip(*_data(), strict=True))
    return DataLoader(TensorDataset(x, y), batch_size=8)


def test_lightning_callback_copies_and_pickles_mid_fit(tmp_path: Path) -> None:
    """deepcopy/pickle of the running callback give an idle copy; the fit goes on unharmed."""
    debug = LightningCallback(log_dir=tmp_path / "log", alerts=False, system_interval=None)
    copies: list[Any] = []

    class CopyMidFit(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step == 3:
                copies.extend(_copies(debug))

    quiet_trainer([debug, CopyMidFit()], default_root_dir=tmp_path).fit(Tiny(), _loader())
    assert debug.steps_checked == BATCHES and debug.session is None
    _assert_idle_copies(copies, 3)
    events = list(read_events(tmp_path / "log"))
    assert [e.step for e in events if isinstance(e, StepCompleted)] == list(range(BATCHES))
    assert [e.reason for e in events if isinstance(e, SessionEnded)] == ["completed"]
    # a copy is a working callback of its own
    other = copies[0]
    other._fit.log_dir = tmp_path / "copy"
    quiet_trainer([other], default_root_dir=tmp_path).fit(Tiny(), _loader())
    assert other.steps_checked == BATCHES


def test_lightning_resume_from_checkpoint_matches_the_run_without_callback(
    tmp_path: Path,
) -> None:
    """fit(ckpt_path=...) with the callback: steps continue the count, parameters unchanged."""
    finals = []
    for use in (True, False):
        run = tmp_path / str(use)
        debug = [LightningCallback(log_dir=run / "log", alerts=False, system_interval=None)]
        first = quiet_trainer(debug if use else [], default_root_dir=run)
        first.fit(Tiny(), _loader())
        first.save_checkpoint(run / "last.ckpt")
        resumed_debug = [
            LightningCallback(log_dir=run / "log2", alerts=False, system_interval=None)
        ]
        module = Tiny()
        trainer = quiet_trainer(resumed_debug if use else [], default_root_dir=run, max_epochs=2)
        trainer.fit(module, _loader(), ckpt_path=run / "last.ckpt")
        assert trainer.global_step == 2 * BATCHES
        if use:
            completed = [e for e in read_events(run / "log2") if isinstance(e, StepCompleted)]
            assert [e.step for e in completed] == list(range(BATCHES, 2 * BATCHES))
        finals.append(list(module.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(*finals, strict=True))


# -- Hugging Face Trainer -------------------------------------------------------------------------


def test_transformers_callback_copies_and_pickles_mid_train(tmp_path: Path) -> None:
    """deepcopy/pickle of the running callback: an idle copy, not the Trainer or the model."""
    import transformers

    from eventbus_debug.integrations.transformers import EventBusDebugCallback

    class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
        def __init__(self) -> None:
            g = torch.Generator().manual_seed(3)
            self.ids = torch.randint(0, 64, (16, 8), generator=g)

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=8)
    model = transformers.GPT2LMHeadModel(config)
    debug = EventBusDebugCallback(log_dir=tmp_path / "log", alerts=False, system_interval=None)
    copies: list[Any] = []

    class CopyMidTrain(transformers.TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == 2:
                copies.extend(_copies(debug))

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        max_steps=4,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=Tokens(), callbacks=[debug, CopyMidTrain()]
    )
    trainer.train()
    assert debug.steps_checked == 4 and debug.session is None
    _assert_idle_copies(copies, 2)
    assert all(c._trainer is None and c._model is None for c in copies)
    assert type(args.max_grad_norm) is float


# -- Ignite ---------------------------------------------------------------------------------------


def test_ignite_handler_copies_and_pickles_mid_run(tmp_path: Path) -> None:
    """deepcopy/pickle of the running handler: an idle copy; the run ends cleanly."""
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    handler = EventBusDebugHandler(
        model, optimizer, log_dir=tmp_path, alerts=False, system_interval=None
    )

    def update(engine: Engine, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(batch[0]), batch[1])
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        return loss.item()

    engine = Engine(update)
    handler.attach(engine)
    copies: list[Any] = []
    engine.add_event_handler(
        Events.ITERATION_COMPLETED(once=3), lambda _: copies.extend(_copies(handler))
    )
    engine.run(_data(), max_epochs=1)
    assert handler.steps_checked == BATCHES and handler.session is None
    _assert_idle_copies(copies, 3)
    assert all(c._engine is None and c._hook is None for c in copies)


def test_ignite_amp_overflow_loss_does_not_leak_into_the_next_step(tmp_path: Path) -> None:
    """A NaN batch under GradScaler: scaler.step skips optimizer.step (no check), and its NaN
    loss (track_loss) must not make the next, healthy step a NonFiniteDetected and skip it."""
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    handler = EventBusDebugHandler(
        model, optimizer, log_dir=tmp_path, alerts=False, system_interval=None, scaler=scaler
    )
    step = supervised_training_step_amp(
        model, optimizer, handler.track_loss(nn.MSELoss()), device="cpu", scaler=scaler
    )
    engine = Engine(step)
    handler.attach(engine)
    with pytest.warns(UserWarning, match="autocast"):  # Ignite's autocast("cuda") on a CPU
        engine.run(_data(nan_at=3), max_epochs=1)

    assert scaler.get_scale() < 2.0**16  # the scaler skipped the NaN step itself
    assert handler.steps_checked == BATCHES - 1 and handler.steps_skipped == 0
    events = list(read_events(tmp_path))
    nan = [e for e in events if isinstance(e, NonFiniteDetected)]
    assert [(e.step, e.role) for e in nan] == [(3, TensorRole.OUTPUT)]
    completed = [e for e in events if isinstance(e, StepCompleted)]
    assert [e.step for e in completed] == [0, 1, 2, 4, 5, 6, 7]
    assert all(e.loss is not None and math.isfinite(e.loss) for e in completed)


def test_ignite_update_function_that_skips_its_own_step_does_not_leak(tmp_path: Path) -> None:
    """An update function that skips optimizer.step on a NaN loss and zero_grads: the next
    step is checked with its own loss, not that NaN one."""
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    handler = EventBusDebugHandler(
        model, optimizer, log_dir=tmp_path, alerts=False, system_interval=None
    )
    loss_fn = handler.track_loss(nn.MSELoss())

    def update(engine: Engine, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        loss = loss_fn(model(batch[0]), batch[1])
        loss.backward()  # type: ignore[no-untyped-call]
        if torch.isfinite(loss):
            optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    engine = Engine(update)
    handler.attach(engine)
    engine.run(_data(nan_at=2), max_epochs=1)
    assert handler.steps_checked == BATCHES - 1 and handler.steps_skipped == 0
    events = list(read_events(tmp_path))
    assert [(e.step, e.role) for e in events if isinstance(e, NonFiniteDetected)] == [
        (2, TensorRole.OUTPUT)
    ]
    completed = [e for e in events if isinstance(e, StepCompleted)]
    assert all(e.loss is not None and math.isfinite(e.loss) for e in completed)


class ClipsWithoutStepping(pl.LightningModule):
    """Manual optimization: batch 1 clips but never steps; batch 2 has NaN gradients."""

    def __init__(self, *, clip_nan_batch: bool) -> None:
        super().__init__()
        self.net = _net()
        self.automatic_optimization = False
        self.clip_nan_batch = clip_nan_batch

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        optimizer: Any = self.optimizers()
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.manual_backward(loss)
        if batch_idx == 2:
            grad = next(self.net.parameters()).grad
            assert grad is not None
            grad[0, 0] = math.nan
        if batch_idx != 2 or self.clip_nan_batch:
            self.clip_gradients(optimizer, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
        if batch_idx != 1:
            optimizer.step()
        optimizer.zero_grad()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)


@pytest.mark.parametrize("clip_nan_batch", [True, False])
def test_lightning_manual_clip_without_step_does_not_vouch_for_the_next_batch(
    tmp_path: Path, clip_nan_batch: bool
) -> None:
    """A batch that calls self.clip_gradients but never opt.step() leaves no verdict behind:
    the next batch's NaN gradients are checked, reported and the step skipped."""
    debug = LightningCallback(log_dir=tmp_path / "log", alerts=False, system_interval=None)
    module = ClipsWithoutStepping(clip_nan_batch=clip_nan_batch)
    quiet_trainer([debug], default_root_dir=tmp_path, max_epochs=-1, max_steps=3).fit(
        module, _loader()
    )
    assert debug.steps_skipped == 1
    assert all(bool(torch.isfinite(p).all()) for p in module.parameters())
    events = list(read_events(tmp_path / "log"))
    nan = [(e.step, e.role) for e in events if isinstance(e, NonFiniteDetected)]
    assert nan == [(1, TensorRole.GRADIENT)]
    assert [e.step for e in events if isinstance(e, StepCompleted)] == [0, 1, 2]
