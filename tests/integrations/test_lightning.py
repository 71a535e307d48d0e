"""Lightning: the callback checks pre-clip gradients, skips through a no-op step, ends cleanly."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from eventbus_debug import SyncSession, TrainingStopped, read_events
from eventbus_debug.events import (
    GradientExploded,
    NonFiniteDetected,
    SessionEnded,
    StepCompleted,
    StepSkipped,
)
from eventbus_debug.integrations.lightning import EventBusDebugCallback

BATCHES = 8


class Tiny(pl.LightningModule):
    """A small regression model with faults planted at chosen batches."""

    def __init__(
        self,
        *,
        nan_at: int | None = None,
        explode_at: int | None = None,
        fail_at: int | None = None,
        scheduler: bool = True,
        optimizers: int = 1,
    ) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
        self.nan_at, self.explode_at, self.fail_at = nan_at, explode_at, fail_at
        self.use_scheduler = scheduler
        self.n_optimizers = optimizers
        if optimizers > 1:
            self.automatic_optimization = False

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        if batch_idx == self.fail_at:
            raise RuntimeError("data loader went away")
        if batch_idx == self.nan_at:
            x = x.clone()
            x[0, 0] = math.nan
        loss = nn.functional.mse_loss(self.net(x), y)
        if batch_idx == self.explode_at:
            loss = loss * 1e9
        return loss

    def configure_optimizers(self) -> Any:
        if self.n_optimizers > 1:
            return [torch.optim.SGD(self.parameters(), lr=0.01) for _ in range(self.n_optimizers)]
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        if not self.use_scheduler:
            return optimizer
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


class Watch(pl.Callback):
    """Records, per batch, whether the parameters changed, the global step and the scheduler."""

    def __init__(self) -> None:
        self.changed: list[bool] = []
        self.global_steps: list[int] = []
        self.schedulers: tuple[Any, ...] = ()
        self.scaler: Any = None
        self._before: list[torch.Tensor] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        debug = next(c for c in trainer.callbacks if isinstance(c, EventBusDebugCallback))  # type: ignore[attr-defined]
        assert debug.session is not None
        self.schedulers = debug.session.schedulers
        self.scaler = debug.session.scaler

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._before = [p.detach().clone() for p in pl_module.parameters()]

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        after = list(pl_module.parameters())
        self.changed.append(
            any(not torch.equal(a, b) for a, b in zip(self._before, after, strict=True))
        )
        self.global_steps.append(trainer.global_step)


def _loader() -> DataLoader[tuple[torch.Tensor, ...]]:
    x = torch.randn(BATCHES * 8, 4)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


def _fit(module: Tiny, callbacks: list[pl.Callback], **trainer_options: Any) -> pl.Trainer:
    trainer = pl.Trainer(
        max_epochs=1,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        **trainer_options,
    )
    trainer.fit(module, _loader())
    return trainer


def test_nan_step_is_skipped_and_explosion_seen_before_clipping(tmp_path: Path) -> None:
    """A NaN step leaves the parameters untouched; a 1e9 explosion is seen unclipped."""
    debug = EventBusDebugCallback(log_dir=tmp_path, alerts=False, system_interval=None)
    watch = Watch()
    trainer = _fit(Tiny(nan_at=3, explode_at=6), [debug, watch], gradient_clip_val=1.0)

    assert watch.changed == [True, True, True, False, True, True, True, True]
    # Lightning's counters stay consistent: the skipped step still counts as a step.
    assert watch.global_steps == list(range(1, BATCHES + 1))
    assert trainer.global_step == BATCHES
    assert debug.steps_checked == BATCHES and debug.steps_skipped == 1
    events = list(read_events(tmp_path))
    nan = [e for e in events if isinstance(e, NonFiniteDetected)]
    assert nan and {e.step for e in nan} == {3}
    assert [e.step for e in events if isinstance(e, StepSkipped)] == [3]
    exploded = [e for e in events if isinstance(e, GradientExploded)]
    # gradient_clip_val=1.0 would have shown a norm of 1.0: the check saw the pre-clip norm.
    assert [e.step for e in exploded] == [6] and exploded[0].total_norm > 1e6
    completed = [e for e in events if isinstance(e, StepCompleted)]
    assert [e.step for e in completed] == list(range(BATCHES))
    assert completed[0].loss is not None and math.isfinite(completed[0].loss)
    assert isinstance(events[-1], SessionEnded) and events[-1].reason == "completed"
    assert debug.session is None


def test_scheduler_is_handed_to_the_session(tmp_path: Path) -> None:
    """The trainer's LR scheduler reaches the session (LR decisions survive its step())."""
    watch = Watch()
    module = Tiny()
    trainer = _fit(module, [EventBusDebugCallback(log_dir=None, alerts=False), watch])
    assert len(watch.schedulers) == 1
    assert watch.schedulers[0] is trainer.lr_scheduler_configs[0].scheduler
    assert watch.scaler is None


def test_fp16_scaler_is_handed_over_and_overflow_is_the_scalers(tmp_path: Path) -> None:
    """Under 16-mixed the plugin's GradScaler reaches the session; overflow is no incident."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=1000)
    precision = MixedPrecision("16-mixed", "cpu", scaler=scaler)
    debug = EventBusDebugCallback(log_dir=tmp_path, alerts=False, system_interval=None)
    watch = Watch()
    _fit(Tiny(scheduler=False), [debug, watch], plugins=[precision])

    assert watch.scaler is scaler
    events = list(read_events(tmp_path))
    skipped = [e for e in events if isinstance(e, StepSkipped)]
    # the first steps overflow at a huge scale: the scaler halves it and skips, we only count
    assert skipped and skipped[0].step == 0
    assert skipped[0].scale_before is not None and skipped[0].scale_after is not None
    assert skipped[0].scale_after < skipped[0].scale_before
    assert not [e for e in events if isinstance(e, NonFiniteDetected)]
    # each overflow step left the parameters alone; the halved scale let training go on
    assert 0 < len(skipped) < BATCHES
    overflowed = {e.step for e in skipped}
    assert watch.changed == [i not in overflowed for i in range(BATCHES)]


def test_gradient_accumulation_checks_once_per_optimizer_step(tmp_path: Path) -> None:
    """With accumulate_grad_batches=2 each optimizer step is checked once, with its mean loss."""
    debug = EventBusDebugCallback(log_dir=tmp_path, alerts=False, system_interval=None)
    _fit(Tiny(scheduler=False), [debug], accumulate_grad_batches=2)
    assert debug.steps_checked == BATCHES // 2
    completed = [e for e in read_events(tmp_path) if isinstance(e, StepCompleted)]
    assert [e.step for e in completed] == list(range(BATCHES // 2))


def test_an_exception_in_training_ends_the_session_with_its_reason(tmp_path: Path) -> None:
    """A training_step that raises ends the session, and SessionEnded says why."""
    debug = EventBusDebugCallback(log_dir=tmp_path, alerts=False, system_interval=None)
    with pytest.raises(RuntimeError, match="data loader went away"):
        _fit(Tiny(fail_at=2), [debug])
    assert debug.session is None
    ended = [e for e in read_events(tmp_path) if isinstance(e, SessionEnded)]
    assert len(ended) == 1 and "data loader went away" in ended[0].reason


def test_training_stopped_at_the_safe_point_ends_fit_and_session(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop decided at the safe point propagates out of fit; SessionEnded says stopped."""
    original = SyncSession.check_step

    def stop_at_two(self: SyncSession, step: int, **kwargs: Any) -> Any:
        if step == 2:
            raise TrainingStopped("planted stop")
        return original(self, step, **kwargs)

    monkeypatch.setattr(SyncSession, "check_step", stop_at_two)
    debug = EventBusDebugCallback(log_dir=tmp_path, alerts=False, system_interval=None)
    with pytest.raises(TrainingStopped, match="planted stop"):
        _fit(Tiny(scheduler=False), [debug])
    assert debug.session is None and debug.steps_checked == 2
    ended = [e for e in read_events(tmp_path) if isinstance(e, SessionEnded)]
    assert [(e.reason, e.detail) for e in ended] == [("stopped", "planted stop")]


def test_more_than_one_optimizer_is_a_clear_error(tmp_path: Path) -> None:
    """Two optimizers (manual optimization) are refused with a message naming the count."""
    debug = EventBusDebugCallback(log_dir=None, alerts=False)
    with pytest.raises(ValueError, match="2 optimizers"):
        _fit(Tiny(optimizers=2), [debug])


def test_the_pytorch_lightning_namespace_works_too(tmp_path: Path) -> None:
    """pytorch_lightning (installed with lightning) calls the same hooks: the skip works."""
    import pytorch_lightning as legacy

    class Legacy(legacy.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(4, 1)

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            if batch_idx == 2:
                x = x.clone()
                x[0, 0] = math.nan
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    debug = EventBusDebugCallback(log_dir=tmp_path, alerts=False, system_interval=None)
    trainer = legacy.Trainer(
        max_epochs=1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[debug],  # type: ignore[list-item]
    )
    trainer.fit(Legacy(), _loader())
    assert debug.steps_checked == BATCHES and debug.steps_skipped == 1
    assert [e.step for e in read_events(tmp_path) if isinstance(e, StepSkipped)] == [2]


def test_model_or_optimizer_as_session_options_is_rejected() -> None:
    """The model and optimizer come from Lightning: passing them as options is a TypeError."""
    with pytest.raises(TypeError, match="model"):
        EventBusDebugCallback(model=nn.Linear(1, 1))
