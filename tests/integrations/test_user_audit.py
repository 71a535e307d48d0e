"""What a new user of each integration ran into, written down as tests.

Found by following README.md and docs/integrations.md to the letter: bad arguments fail at once
and clearly, a session the user ends mid-fit never fails the fit, a fit without an optimizer is
a clear error, one fault is one incident under Ignite's gradient accumulation, the README's
quickstarts run on their own. The long healthy runs (``slow``) check that nothing fires and the
trained parameters are bit-identical to the same seeded run without the integration.
"""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from ignite.engine import Engine, Events, create_supervised_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from eventbus_debug import read_events
from eventbus_debug.events import NonFiniteDetected, SessionEnded, StepSkipped, TensorRole
from eventbus_debug.integrations.ignite import EventBusDebugHandler
from eventbus_debug.integrations.lightning import EventBusDebugCallback as LightningCallback
from eventbus_debug.integrations.transformers import EventBusDebugCallback as HFCallback

from ._lightning import quiet_trainer

ROOT = Path(__file__).resolve().parents[2]
TELEMETRY = {
    "session_started",
    "session_ended",
    "step_checked",
    "step_completed",
    "system_sampled",
    "memory_sampled",
    "report_written",
}


def _notable(log_dir: Path) -> list[str]:
    """The kinds of the log's events that are not routine telemetry."""
    return [e.kind for e in read_events(log_dir) if e.kind not in TELEMETRY]


# -- bad arguments: at once, clearly -----------------------------------------------------------


@pytest.mark.parametrize("bad", [123, 1.5, b"logs", ["logs"]])
def test_a_log_dir_that_is_not_a_path_is_refused_when_the_integration_is_built(bad: Any) -> None:
    """Before: accepted, and the fit failed at its start (Ignite: at ``run``)."""
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    builders = (
        lambda: LightningCallback(log_dir=bad),
        lambda: HFCallback(log_dir=bad),
        lambda: EventBusDebugHandler(model, optimizer, log_dir=bad),
    )
    for build in builders:
        with pytest.raises(TypeError, match="log_dir must be a path"):
            build()


def test_an_empty_log_dir_is_refused_when_the_integration_is_built() -> None:
    with pytest.raises(ValueError, match="log_dir must not be empty"):
        LightningCallback(log_dir="")


# -- Lightning ---------------------------------------------------------------------------------


class _Regressor(pl.LightningModule):
    def __init__(self, *, optimizer: bool = True) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.with_optimizer = optimizer

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        if not self.with_optimizer:
            return None
        return torch.optim.SGD(self.parameters(), lr=0.02)


def _loader(n: int = 320) -> DataLoader[tuple[torch.Tensor, ...]]:
    x = torch.randn(n, 8)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=16)


def test_lightning_without_an_optimizer_is_a_clear_error(tmp_path: Path) -> None:
    """``configure_optimizers`` returning None: Lightning steps a mock optimizer; the callback
    used to fail deep in the snapshot code with ``KeyError: 'state'``."""
    callback = LightningCallback(log_dir=tmp_path)
    with (
        pytest.warns(UserWarning, match="no optimizer"),
        pytest.raises(ValueError, match="0 optimizers"),
    ):
        quiet_trainer([callback]).fit(_Regressor(optimizer=False), _loader(64))
    assert callback.session is None


class _EndSessionAt(pl.Callback):
    def __init__(self, debug: LightningCallback, step: int) -> None:
        self.debug, self.step = debug, step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        session = self.debug.session
        if trainer.global_step == self.step and session is not None:
            session.__exit__(None, None, None)


def test_lightning_a_session_the_user_ends_mid_fit_lets_the_fit_go_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: the next hook raised ``RuntimeError: session 'lightning' is not running; use
    `with SyncSession(...)``` and the fit died."""
    callback = LightningCallback(log_dir=tmp_path, alerts=False)
    trainer = quiet_trainer([callback, _EndSessionAt(callback, 5)])
    with caplog.at_level(logging.WARNING, logger="eventbus_debug.integrations"):
        trainer.fit(_Regressor(), _loader())
    assert trainer.global_step == 20
    assert callback.session is None and callback.steps_checked == 5
    assert "ended during the fit" in caplog.text
    ended = [e for e in read_events(tmp_path) if isinstance(e, SessionEnded)]
    assert len(ended) == 1


# -- Ignite ------------------------------------------------------------------------------------


def _ignite_setup(tmp_path: Path, **options: Any) -> tuple[nn.Module, EventBusDebugHandler]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
    return model, EventBusDebugHandler(model, optimizer, log_dir=tmp_path, alerts=False, **options)


def _ignite_batches(n: int, nan_at: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x = torch.randn(n * 8, 8)
    y = x.sum(1, keepdim=True)
    if nan_at is not None:
        x[nan_at * 8, 0] = math.nan
    return [(x[i : i + 8], y[i : i + 8]) for i in range(0, n * 8, 8)]


def test_ignite_accumulation_without_track_loss_reports_one_fault_once(tmp_path: Path) -> None:
    """A NaN batch in the first iteration of a 4-iteration window, the loss not tracked: the
    step's check finds the NaN gradients and skips. Before, the skip's own reset of the
    gradients looked like a window that ended without a step, and the NaN output was reported
    a second time (role OUTPUT, with a recovery decision of its own)."""
    model, handler = _ignite_setup(tmp_path)
    trainer = create_supervised_trainer(
        model, handler.optimizer, nn.MSELoss(), gradient_accumulation_steps=4
    )
    handler.attach(trainer)
    trainer.run(_ignite_batches(40, nan_at=20), max_epochs=1)
    events = list(read_events(tmp_path))
    incidents = [e for e in events if isinstance(e, NonFiniteDetected)]
    assert [(e.role, e.step) for e in incidents] == [(TensorRole.GRADIENT, 23)]
    assert [e.step for e in events if isinstance(e, StepSkipped)] == [23]
    assert handler.steps_checked == 10 and handler.steps_skipped == 1
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_ignite_a_session_the_user_ends_mid_run_lets_the_run_go_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model, handler = _ignite_setup(tmp_path)
    trainer = create_supervised_trainer(model, handler.optimizer, nn.MSELoss())
    handler.attach(trainer)

    @trainer.on(Events.ITERATION_COMPLETED(once=5))
    def end_it(_: Engine) -> None:
        assert handler.session is not None
        handler.session.__exit__(None, None, None)

    with caplog.at_level(logging.WARNING, logger="eventbus_debug.integrations"):
        trainer.run(_ignite_batches(12, nan_at=8), max_epochs=1)
    assert trainer.state.iteration == 12
    assert handler.session is None and handler.steps_checked == 5
    assert "ended during the fit" in caplog.text


# -- Hugging Face ------------------------------------------------------------------------------


def test_hf_a_session_the_user_ends_mid_train_lets_training_go_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The Trainer clips by itself again once the session is let go, and ``max_grad_norm`` is
    given back as a plain float at the end."""
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    torch.manual_seed(0)
    sizes: dict[str, Any] = {
        "hidden_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 32,
        "vocab_size": 50,
        "num_labels": 1,  # a regression head (a PretrainedConfig keyword)
    }
    config = BertConfig(**sizes)
    data = [{"input_ids": torch.randint(1, 50, (8,)), "labels": torch.randn(())} for _ in range(64)]
    args = TrainingArguments(
        str(tmp_path / "out"),
        max_steps=8,
        per_device_train_batch_size=8,
        max_grad_norm=1.0,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
    )
    debug = HFCallback(log_dir=tmp_path / "logs", alerts=False)

    class EndAt(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == 3 and debug.session is not None:
                debug.session.__exit__(None, None, None)

    trainer = Trainer(
        model=BertForSequenceClassification(config),
        args=args,
        train_dataset=data,
        callbacks=[debug, EndAt()],
    )
    with caplog.at_level(logging.WARNING, logger="eventbus_debug.integrations"):
        trainer.train()
    assert trainer.state.global_step == 8
    assert debug.session is None and debug.steps_checked == 3
    assert type(args.max_grad_norm) is float and args.max_grad_norm == 1.0
    assert "ended during the fit" in caplog.text


# -- the README's quickstarts, each on its own ---------------------------------------------------


def _readme_integration_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## Integrations: Lightning") : text.index("## Exporters")]
    return re.findall(r"^```python\n(.*?)^```", section, re.S | re.M)


def test_the_readme_ignite_quickstart_runs_on_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user copies one framework's block: before, the HF and Ignite blocks used names
    (``torch``, ``nn``, ``math``, ``read_events``, ``x``, ``y``) of the Lightning block above."""
    blocks = _readme_integration_blocks()
    assert len(blocks) == 3
    for block in blocks:
        for name in ("torch", "math", "read_events"):
            if re.search(rf"\b{name}\.|\b{name}\(", block):
                assert re.search(rf"^(import|from) .*\b{name}\b", block, re.M), name
    monkeypatch.chdir(tmp_path)
    exec(compile(blocks[2], "README.md[ignite]", "exec"), {"__name__": "readme_ignite"})


# -- long healthy runs: nothing fires, nothing changes -------------------------------------------


def _classification(n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Noisy 5-class data: labels from a linear teacher with noise, 2 % of them flipped."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 20, generator=g)
    teacher = torch.randn(20, 5, generator=g)
    y = (x @ teacher + 0.8 * torch.randn(n, 5, generator=g)).argmax(1)
    flip = torch.rand(n, generator=g) < 0.02
    y[flip] = torch.randint(0, 5, (int(flip.sum()),), generator=g)
    return x, y


def _classifier() -> nn.Module:
    return nn.Sequential(
        nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5)
    )


class _Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _classifier()

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-3)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=1000)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_lightning_a_long_healthy_run_is_left_alone(tmp_path: Path, precision: str) -> None:
    """1,000 optimizer steps of noisy minibatches, 2 micro-batches each, clipping, a
    scheduler: no incident, no action, and the parameters of the run without the callback."""
    x, y = _classification(16 * 2 * 1000)

    def fit(callbacks: list[pl.Callback]) -> nn.Module:
        torch.manual_seed(0)
        module = _Classifier()
        loader = DataLoader(
            TensorDataset(x, y),
            batch_size=16,
            shuffle=True,
            generator=torch.Generator().manual_seed(2),
        )
        trainer = quiet_trainer(
            callbacks, accumulate_grad_batches=2, gradient_clip_val=1.0, precision=precision
        )
        trainer.fit(module, loader)
        assert trainer.global_step == 1000
        return module

    callback = LightningCallback(log_dir=tmp_path)
    with_debug, without = fit([callback]), fit([])
    assert callback.steps_checked == 1000 and callback.steps_skipped == 0
    assert _notable(tmp_path) == []
    for a, b in zip(with_debug.state_dict().values(), without.state_dict().values(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("autocast", [False, True])
def test_ignite_a_long_healthy_run_is_left_alone(tmp_path: Path, autocast: bool) -> None:
    """1,000 steps of 2 accumulated iterations; with CPU bf16 autocast the update function
    clips, or the handler does (``max_grad_norm=``): the same parameters either way."""
    x, y = _classification(16 * 2 * 1000)
    batches = [(x[i : i + 16], y[i : i + 16]) for i in range(0, len(x), 16)]

    def run(debug: bool) -> tuple[nn.Module, EventBusDebugHandler | None]:
        torch.manual_seed(0)
        model = _classifier()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        handler = (
            EventBusDebugHandler(
                model, optimizer, log_dir=tmp_path, max_grad_norm=1.0 if autocast else None
            )
            if debug
            else None
        )
        loss_fn: Any = nn.CrossEntropyLoss()
        if handler is not None:
            loss_fn = handler.track_loss(loss_fn)
        if not autocast:
            trainer = create_supervised_trainer(
                model, optimizer, loss_fn, gradient_accumulation_steps=2
            )
        else:

            def update(engine: Engine, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
                iteration = engine.state.iteration
                if (iteration - 1) % 2 == 0:
                    optimizer.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = loss_fn(model(batch[0]), batch[1]) / 2
                loss.backward()
                if iteration % 2 == 0:
                    if handler is None:
                        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    optimizer.step()
                return float(loss.detach()) * 2

            trainer = Engine(update)
        if handler is not None:
            handler.attach(trainer)
        trainer.run(batches, max_epochs=1)
        return model, handler

    (with_debug, handler), (without, _) = run(True), run(False)
    assert handler is not None
    assert handler.steps_checked == 1000 and handler.steps_skipped == 0
    assert _notable(tmp_path) == []
    for a, b in zip(with_debug.state_dict().values(), without.state_dict().values(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_hf_a_long_healthy_gpt2_run_is_left_alone(tmp_path: Path) -> None:
    """A tiny GPT-2 from a config, 1,000 steps of 2 accumulated micro-batches of noisy
    arithmetic sequences, warm-up and linear decay, clipping at 1.0: no incident, no action,
    and the parameters and logged losses/norms of the run without the callback."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed

    g = torch.Generator().manual_seed(3)
    data = []
    for _ in range(1000 * 2 * 8):
        start = torch.randint(0, 64, (1,), generator=g)
        stride = torch.randint(1, 4, (1,), generator=g)
        seq = (start + stride * torch.arange(16)) % 64
        noise = torch.rand(16, generator=g) < 0.1
        seq[noise] = torch.randint(0, 64, (int(noise.sum()),), generator=g)
        data.append({"input_ids": seq, "labels": seq.clone()})

    def train(callbacks: list[Any]) -> tuple[nn.Module, list[Any]]:
        set_seed(0)
        model = GPT2LMHeadModel(
            GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
        )
        args = TrainingArguments(
            str(tmp_path / "out"),
            max_steps=1000,
            per_device_train_batch_size=8,
            gradient_accumulation_steps=2,
            learning_rate=3e-3,
            warmup_steps=100,
            max_grad_norm=1.0,
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            disable_tqdm=True,
            logging_steps=50,
            seed=0,
        )
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
        trainer.train()
        logged = [(h.get("loss"), h.get("grad_norm")) for h in trainer.state.log_history]
        return model, logged

    callback = HFCallback(log_dir=tmp_path / "logs")
    (with_debug, logged), (without, logged_without) = train([callback]), train([])
    assert callback.steps_checked == 1000 and callback.steps_skipped == 0
    assert _notable(tmp_path / "logs") == []
    assert logged == logged_without
    for a, b in zip(with_debug.state_dict().values(), without.state_dict().values(), strict=True):
        assert torch.equal(a, b)
