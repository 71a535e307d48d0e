"""``session.rebaseline()``: the data changed on purpose (fine-tuning on a new task, a
curriculum's next stage). The loss jumps at the change exactly as it would if something broke;
told, the detectors judge the new data against its own first steps."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from eventbus_debug import Session, SyncSession
from eventbus_debug.events import Anomaly, GradientExploded, LossSpiked, NonFiniteDetected
from eventbus_debug.testing import RecordingSink

SWITCH = 400


def _task(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(512, 16, generator=gen)
    w = torch.randn(16, 4, generator=gen) * 3
    return x, (x @ w).argmax(1)


def _train(rebaseline: bool, *, nan_at: int | None = None) -> RecordingSink:
    """Task A to convergence, then task B (other inputs, other labels) from SWITCH on."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    tasks = [_task(1), _task(2)]
    gen = torch.Generator().manual_seed(3)
    recorder = RecordingSink()
    with SyncSession(
        model, opt, log_dir=None, report=False, alerts=False, system_interval=None, sinks=[recorder]
    ) as session:
        for step in range(SWITCH + 200):
            if step == SWITCH and rebaseline:
                session.rebaseline()
            x, y = tasks[step >= SWITCH]
            idx = torch.randint(0, 512, (64,), generator=gen)
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
            if step == nan_at:
                loss = loss * math.nan
            torch.autograd.backward(loss)
            if session.check_step(step, loss=loss).should_step:
                opt.step()
            session.step_completed(step)
    return recorder


def _incidents(recorder: RecordingSink) -> list[tuple[str, int | None]]:
    return [(e.kind, e.step) for e in recorder.events if isinstance(e, Anomaly)]


def test_a_task_switch_told_is_not_reported() -> None:
    told = _incidents(_train(rebaseline=True))
    assert told == []


def test_the_same_switch_untold_is_reported_at_the_change() -> None:
    """The control: without the word, the jump is a spike (or an explosion) at the change."""
    untold = _incidents(_train(rebaseline=False))
    assert untold, "the switch no longer looks like a fault: this test lost its control"
    assert all(kind in ("loss_spiked", "gradient_exploded") for kind, _ in untold)
    assert min(step or 0 for _, step in untold) >= SWITCH


def test_faults_after_a_rebaseline_are_still_caught() -> None:
    recorder = _train(rebaseline=True, nan_at=SWITCH + 50)
    assert {e.step for e in recorder.of_type(NonFiniteDetected)} == {SWITCH + 50}
    assert not recorder.of_type(LossSpiked) and not recorder.of_type(GradientExploded)


def test_rebaseline_needs_a_running_session() -> None:
    model = nn.Linear(2, 1)
    session = Session(model, torch.optim.SGD(model.parameters(), lr=0.1), log_dir=None)
    with pytest.raises(RuntimeError, match="is not running"):
        session.rebaseline()
