"""eventbus_debug.session.budget: the session's own cost per step, and the overhead budget."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Iterator

import anyio.lowlevel
import pytest
import torch
from torch import nn

from eventbus_debug import Cadence, Session
from eventbus_debug.events import SessionEnded
from eventbus_debug.probes import StepProbe
from eventbus_debug.session.boundary import StepBoundary
from eventbus_debug.session.budget import MAX_STRETCH, OverheadMeter
from eventbus_debug.testing import RecordingSink
from tests._doubles import RecordingPublisher

from ._helpers import batch, setup


def _meter(budget: float | None, *, window: int = 4) -> OverheadMeter:
    model, _ = setup()
    return OverheadMeter(StepProbe(model), budget, window=window)


def _run(meter: OverheadMeter, steps: int, *, own: float, step: float, start: float = 0.0) -> float:
    """Feed *steps* steps of *step* seconds, *own* of them spent in the session; the end time."""
    now = start
    for _ in range(steps):
        meter.add(own)
        now += step
        meter.step_finished(now)
    return now


class TestOverheadMeter:
    def test_measures_without_a_budget(self) -> None:
        """Without a budget the meter measures the share and never touches the cadence."""
        meter = _meter(None)
        assert meter.overhead is None
        _run(meter, 50, own=0.01, step=0.11)
        assert meter.overhead == pytest.approx(0.1)
        assert meter.stretch == 1 and meter.probe.cadence == meter.base

    def test_slow_steps_within_budget_keep_the_cadence(self) -> None:
        """A slow step (1 ms of 101 ms in the session: 1 %) stays within 2 %: nothing changes."""
        meter = _meter(0.02)
        _run(meter, 200, own=0.001, step=0.101)
        assert meter.overhead == pytest.approx(0.01)
        assert meter.stretch == 1 and meter.probe.cadence == Cadence()

    def test_over_budget_stretches_the_costly_checks_only(self) -> None:
        """Over budget, the costly checks' periods double per window up to the cap; the loss
        and gradient checks (the non-finite check) keep theirs."""
        meter = _meter(0.02)
        _run(meter, 2000, own=0.01, step=0.11)
        assert meter.stretch == MAX_STRETCH
        cadence = meter.probe.cadence
        assert cadence.loss_every == 1 and cadence.grad_every == 1
        assert cadence.param_every == 10 * MAX_STRETCH
        assert cadence.vanishing_every == 10 * MAX_STRETCH
        assert cadence.activation_every == MAX_STRETCH

    def test_an_unreachable_budget_is_said_once(self, caplog: pytest.LogCaptureFixture) -> None:
        """Still over budget at the cap: one warning naming the overhead, nothing relaxed; a
        budget met at the cap never warns."""
        meter = _meter(0.02)
        with caplog.at_level(logging.WARNING, logger="eventbus_debug"):
            _run(meter, 4000, own=0.01, step=0.11)
        assert meter.unreachable and meter.stretch == MAX_STRETCH
        warned = [r for r in caplog.records if "overhead_budget_unreachable" in r.getMessage()]
        assert len(warned) == 1 and "overhead" in warned[0].getMessage()
        assert meter.probe.cadence.grad_every == 1
        fine = _meter(0.02)
        _run(fine, 2000, own=0.001, step=0.101)
        assert not fine.unreachable

    def test_relaxes_well_under_budget(self) -> None:
        """Once the cost falls well under the budget the stretch is halved back, window by window."""
        meter = _meter(0.02)
        end = _run(meter, 21, own=0.01, step=0.11)
        assert meter.stretch == 2
        _run(meter, 400, own=0.0001, step=0.11, start=end)
        assert meter.stretch == 1 and meter.probe.cadence == Cadence()

    def test_windows_cover_two_periods_of_the_slowest_check(self) -> None:
        """A window is never shorter than two periods of the slowest stretched check."""
        meter = _meter(0.02, window=1)
        end = _run(meter, 21, own=0.01, step=0.11)  # 20 measured steps: one decision
        assert meter.stretch == 2
        _run(meter, 39, own=0.01, step=0.11, start=end)  # periods are 20 now: not yet 40 steps
        assert meter.stretch == 2


def _nan_grads(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad = torch.full_like(p, math.nan)


def test_non_finite_caught_every_step_under_the_budget() -> None:
    """Stretched to the cap by an impossible budget, the session still catches a NaN gradient
    at the very step it appears."""
    model, opt = setup()
    probe = StepProbe(model)
    boundary = StepBoundary(
        model=model,
        optimizer=opt,
        name="t",
        publisher=RecordingPublisher(),
        probe=probe,
        overhead_budget=0.01,
    )
    ticks: Iterator[float] = (0.001 * i for i in range(10**6))
    boundary.meter = OverheadMeter(probe, 0.01, window=1, clock=lambda: next(ticks))
    stretch_at_nan: list[int] = []
    for step in range(400):
        x, y = batch()
        torch.autograd.backward(nn.functional.mse_loss(model(x), y))
        if step in (301, 333):
            _nan_grads(model)
            stretch_at_nan.append(boundary.meter.stretch)
        verdict = boundary.check_sync(step, loss=None)
        assert verdict.finite is (step not in (301, 333)), step
        opt.zero_grad(set_to_none=True)
        boundary.completed_sync(step)
    assert min(stretch_at_nan) >= 8  # the costly checks ran 8x less often, or less
    assert probe.cadence.grad_every == 1


@pytest.mark.asyncio_only("watches asyncio's current task")
async def test_one_yield_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A healthy async step yields to the event loop once (in step_completed), not twice."""
    model, opt = setup()
    me = asyncio.current_task()
    yields: list[int] = []
    real = anyio.lowlevel.checkpoint
    real_sleep = asyncio.sleep

    async def counting() -> None:
        if asyncio.current_task() is me:
            yields.append(1)
        await real()

    async def counting_sleep(delay: float, result: object = None) -> object:
        if delay <= 0 and asyncio.current_task() is me:
            yields.append(1)  # the bus's checkpoint on asyncio (see _waiters.checkpointer)
        return await real_sleep(delay, result)

    async with Session(model, opt, log_dir=None, report=False, alerts=False) as session:
        monkeypatch.setattr(anyio.lowlevel, "checkpoint", counting)
        monkeypatch.setattr(asyncio, "sleep", counting_sleep)
        for step in range(5):
            x, y = batch()
            loss = nn.functional.mse_loss(model(x), y)
            torch.autograd.backward(loss)
            verdict = await session.check_step(step, loss=loss)
            assert verdict.should_step
            opt.step()
            opt.zero_grad(set_to_none=True)
            await session.step_completed(step, loss=verdict.loss)
        monkeypatch.undo()
    assert len(yields) == 5


async def test_session_reports_its_overhead() -> None:
    """SessionEnded carries the measured overhead and the budget the session kept."""
    model, opt = setup()
    recorder = RecordingSink()
    async with Session(
        model,
        opt,
        log_dir=None,
        report=False,
        alerts=False,
        sinks=[recorder],
        overhead_budget=0.5,
    ) as session:
        for step in range(4):
            await session.training_step(*batch(), loss_fn=nn.functional.mse_loss, step=step)
    ended = recorder.of_type(SessionEnded)[0]
    assert ended.overhead_budget == 0.5
    assert ended.overhead is not None and ended.overhead >= 0.0
