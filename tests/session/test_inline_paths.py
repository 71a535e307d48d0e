"""The every-step path calls the probe and the safe point inline when neither has to wait,
and awaits them when one does (reductions offloaded to a thread, incidents for the engine)."""

from __future__ import annotations

import math

import anyio
import pytest
import torch
from torch import nn

from eventbus_debug import EventBus, RecoveryEngine, SafePoint, Session, StepProbe, SyncEventBus
from eventbus_debug.events import NonFiniteDetected, StepChecked, StepSkipped, TensorRole
from eventbus_debug.testing import RecordingSink


def _setup() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(32, 8)
    return model, opt, x, x.sum(dim=1, keepdim=True)


def _backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    loss = nn.functional.mse_loss(model(x), y)
    torch.autograd.backward(loss)
    return loss


class TestProbeInline:
    def test_same_verdict_as_the_awaited_check(self) -> None:
        """Two identical probes on identical gradients: inline and sync verdicts agree."""
        model, _, x, y = _setup()
        inline, blocking = StepProbe(model), StepProbe(model)
        for step in range(3):
            loss = _backward(model, x, y)
            a = inline.check_inline(step, loss)
            b = blocking.check_step_sync(step, loss=loss)
            assert a == b
            assert a is not None and a.checked and a.finite

    def test_none_when_the_reductions_go_to_a_thread(self) -> None:
        """Gradients above offload_numel on CPU: the caller must await check_step."""
        model, _, x, y = _setup()
        probe = StepProbe(model, offload_numel=1)
        assert probe.check_inline(0, _backward(model, x, y)) is None

    def test_bad_arguments_are_refused_inline_too(self) -> None:
        model, _, x, y = _setup()
        probe = StepProbe(model)
        loss = _backward(model, x, y)
        with pytest.raises(TypeError, match="step must be an int"):
            probe.check_inline("0", loss)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="scalar tensor"):
            probe.check_inline(0, torch.ones(2))


class TestSafePointInline:
    async def test_healthy_step_decided_inline(self) -> None:
        model, opt, _, _ = _setup()
        async with EventBus() as bus:
            safe = SafePoint(RecoveryEngine(bus), model, opt)
            decision = safe.before_optimizer_step_inline(0)
            assert decision is not None and decision.should_step

    async def test_none_while_an_incident_waits_for_the_engine(self) -> None:
        """An incident the engine has not handled yet: inline gives way to the awaited call,
        which waits for the engine and skips the step at once."""
        model, opt, x, y = _setup()
        recorder = RecordingSink()
        async with EventBus() as bus:
            bus.subscribe(recorder)
            safe = SafePoint(RecoveryEngine(bus), model, opt)
            _backward(model, x, y)
            bus.publish_nowait(
                NonFiniteDetected(step=0, source="test", role=TensorRole.LOSS, names=("loss",))
            )
            assert safe.before_optimizer_step_inline(0) is None
            with anyio.fail_after(10):
                decision = await safe.before_optimizer_step(0)
            assert not decision.should_step
            await bus.drain()
        assert [e.step for e in recorder.of_type(StepSkipped)] == [0]

    def test_an_engine_on_a_sync_bus_is_never_decided_inline(self) -> None:
        model, opt, _, _ = _setup()
        with SyncEventBus() as bus:
            safe = SafePoint(RecoveryEngine(bus), model, opt)
            assert safe.before_optimizer_step_inline(0) is None
            assert safe.before_optimizer_step_sync(0).should_step


async def test_session_with_offloaded_reductions_still_checks_every_step() -> None:
    """A session whose probe offloads (a large CPU model) awaits it: same verdicts, NaN skipped."""
    model, opt, x, y = _setup()
    recorder = RecordingSink()
    async with Session(model, opt, log_dir=None, report=False, alerts=False) as session:
        session.bus.subscribe(recorder)
        assert session.probe is not None
        session.probe.offload_numel = 1
        skipped = []
        for step in range(6):
            loss = _backward(model, x, y)
            if step == 4:
                loss = loss * math.nan
            with anyio.fail_after(10):
                verdict = await session.check_step(step, loss=loss)
            if verdict.should_step:
                opt.step()
            else:
                skipped.append(step)
            await session.step_completed(step, loss=verdict.loss)
    assert skipped == [4]
    # published on the loop's thread, after the worker thread judged them
    assert [e.step for e in recorder.of_type(NonFiniteDetected)] == [4]
    assert [e.step for e in recorder.of_type(StepChecked)] == list(range(6))
