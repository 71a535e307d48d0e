"""Lightning: listed twice is an error; an accumulation window's loss and samples are those of
the micro-batches it accumulated; manual optimization is checked before ``self.clip_gradients``;
clipping with the callback is bit for bit Lightning's."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, cast

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from eventbus_debug import SyncSession, read_events
from eventbus_debug.events import (
    GradientExploded,
    SessionEnded,
    StepChecked,
    StepCompleted,
    StepSkipped,
)
from eventbus_debug.integrations.lightning import EventBusDebugCallback
from eventbus_debug.session import Verdict

from ._lightning import quiet_trainer


class Regression(pl.LightningModule):
    """A small regression model; the micro-batch losses are kept by global step."""

    def __init__(self, *, manual: bool = False, clip: float = 1.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.1), nn.Linear(32, 1))
        self.automatic_optimization = not manual
        self.clip = clip
        self.micro: dict[int, list[float]] = {}

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor | None:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.micro.setdefault(self.trainer.global_step, []).append(float(loss.detach()))
        if self.automatic_optimization:
            return loss
        optimizer = self.optimizers()
        assert isinstance(optimizer, pl.core.optimizer.LightningOptimizer)
        optimizer.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(
            cast(torch.optim.Optimizer, optimizer),
            gradient_clip_val=self.clip,
            gradient_clip_algorithm="norm",
        )
        optimizer.step()
        return None

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _loader(
    n: int, *, batch: int = 8, explode_at: int | None = None, nan_at: int | None = None
) -> DataLoader[Any]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n, 8, generator=gen)
    y = x[:, :3].sum(1, keepdim=True)
    if explode_at is not None:
        y[explode_at * batch : (explode_at + 1) * batch] *= 1e4
    if nan_at is not None:
        x[nan_at * batch, 0] = math.nan
    return DataLoader(TensorDataset(x, y), batch_size=batch)


def _samples(event: StepCompleted) -> int | None:
    if event.samples_per_s is None or event.duration_s is None:
        return None
    return round(event.samples_per_s * event.duration_s)


def test_the_callback_listed_twice_is_a_clear_error(tmp_path: Path) -> None:
    """callbacks=[cb, cb] would check every step twice: a ValueError before training."""
    callback = EventBusDebugCallback(log_dir=tmp_path, alerts=False)
    with pytest.raises(ValueError, match="2 EventBusDebugCallback"):
        quiet_trainer([callback, callback]).fit(Regression(), _loader(64))
    assert callback.session is None and callback.steps_checked == 0


def test_a_short_accumulation_window_logs_its_own_mean_loss_and_samples(tmp_path: Path) -> None:
    """13 micro-batches of 8, 4 a step: windows of 4, 4, 4 and 1. Each step's loss is the mean
    of its micro-batches' (Lightning divides by 4 even in the short window); its samples are
    those of all its micro-batches."""
    callback = EventBusDebugCallback(log_dir=tmp_path, alerts=False, system_interval=None)
    module = Regression()
    quiet_trainer([callback], accumulate_grad_batches=4).fit(module, _loader(100))
    events = list(read_events(tmp_path))
    checked = {e.step: e.loss for e in events if isinstance(e, StepChecked)}
    assert list(checked) == [0, 1, 2, 3] and [len(module.micro[s]) for s in range(4)] == [
        4,
        4,
        4,
        1,
    ]
    for step, losses in module.micro.items():
        assert checked[step] == pytest.approx(sum(losses) / len(losses), rel=1e-5)
    completed = [e for e in events if isinstance(e, StepCompleted)]
    assert [_samples(e) for e in completed][1:] == [32, 32, 4]  # the first has no duration


def test_manual_optimization_is_checked_before_the_users_clip(tmp_path: Path) -> None:
    """self.clip_gradients(...) in training_step: the explosion is seen at its real norm, a NaN
    step is skipped, and the wrapper is gone after the fit."""
    callback = EventBusDebugCallback(log_dir=tmp_path, alerts=False, system_interval=None)
    trainer = quiet_trainer([callback])
    trainer.fit(Regression(manual=True), _loader(160, explode_at=12, nan_at=5))
    events = list(read_events(tmp_path))
    exploded = [e for e in events if isinstance(e, GradientExploded)]
    assert exploded and exploded[0].step == 12 and exploded[0].total_norm > 1e3
    assert [e.step for e in events if isinstance(e, StepSkipped)][:1] == [5]
    checked = [e.step for e in events if isinstance(e, StepChecked)]
    assert checked == list(range(20))  # once a step: not again at opt.step()
    assert [e.reason for e in events if isinstance(e, SessionEnded)] == ["completed"]
    assert "clip_gradients" not in vars(trainer.precision_plugin)


@pytest.mark.parametrize("manual", [False, True])
def test_clipping_with_the_callback_is_bit_for_bit_lightnings(tmp_path: Path, manual: bool) -> None:
    """gradient_clip_val (automatic) or self.clip_gradients (manual), every step clipping: the
    parameters are exactly those of the run without the callback (dropout on: no RNG used)."""
    tiny = 1e-3
    runs = []
    for debug in (False, True):
        pl.seed_everything(3)  # (no verbose=: lightning 2.2, the extra's floor, lacks it)
        module = Regression(manual=manual, clip=tiny)
        callbacks: list[pl.Callback] = (
            [EventBusDebugCallback(log_dir=tmp_path / "logs", alerts=False)] if debug else []
        )
        options = {} if manual else {"gradient_clip_val": tiny}
        quiet_trainer(callbacks, **options).fit(module, _loader(800))
        runs.append(module)
    plain, debugged = runs
    for a, b in zip(plain.parameters(), debugged.parameters(), strict=True):
        assert torch.equal(a, b)
    checked = [e for e in read_events(tmp_path / "logs") if isinstance(e, StepChecked)]
    assert len(checked) == 100
    assert all(e.grad_norm is not None and e.grad_norm > 100 * tiny for e in checked)


def test_manual_optimization_under_16_mixed_is_checked_at_the_step_where_a_skip_is_safe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under 16-mixed a step skipped at self.clip_gradients would leave the GradScaler no
    gradient to unscale at opt.step(), and scaler.step() fails: the check stays at opt.step(),
    after the unscale. A skip decided there is a no-op step; a healthy run has no incident."""
    from lightning.pytorch.plugins import MixedPrecision

    original = SyncSession.check_step

    def skip_five(self: SyncSession, step: int, **kwargs: Any) -> Verdict:
        verdict = original(self, step, **kwargs)
        return dataclasses.replace(verdict, should_step=False) if step == 5 else verdict

    monkeypatch.setattr(SyncSession, "check_step", skip_five)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=1000)
    callback = EventBusDebugCallback(log_dir=tmp_path, alerts=False, system_interval=None)
    trainer = quiet_trainer([callback], plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    trainer.fit(Regression(manual=True), _loader(160))
    assert callback.steps_skipped == 1 and trainer.global_step == 20
    events = list(read_events(tmp_path))
    assert not [e for e in events if isinstance(e, GradientExploded)]
    checked = [e for e in events if isinstance(e, StepChecked)]
    assert [e.step for e in checked] == list(range(20))
    assert all(e.grad_norm is not None and e.grad_norm < 100 for e in checked)
