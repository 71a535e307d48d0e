"""The engine: one take(step) per safe point, call decisions kept apart, either bus."""

from __future__ import annotations

import anyio
import pytest
import torch

from eventbus_debug import EventBus, RecoveryEngine, SyncEventBus
from eventbus_debug.events import (
    Event,
    GradientVanished,
    NonFiniteDetected,
    RecoveryAction,
    TensorRole,
)
from eventbus_debug.recovery import (
    Pending,
    SkipStep,
    StrategySpec,
    report_error,
    report_error_sync,
)


def _nan_loss(step: int) -> NonFiniteDetected:
    return NonFiniteDetected(step=step, role=TensorRole.LOSS, names=("loss",))


class TestTake:
    async def test_a_healthy_step_is_clean_with_nothing_to_apply(self, bus: EventBus) -> None:
        """No incident: take() says clean, with no actions and no agreement."""
        engine = RecoveryEngine(bus)
        assert engine.take(0) == Pending(actions=(), clean=True, agreed=None)

    async def test_pending_actions_are_taken_once(self, bus: EventBus) -> None:
        """A NaN loss gives one SkipStep at the next take, nothing at the one after."""
        engine = RecoveryEngine(bus)
        engine.decide(_nan_loss(3))
        first = engine.take(3)
        assert [d.action for d in first.actions] == [SkipStep()]
        assert not first.clean
        assert engine.take(4) == Pending()

    async def test_a_reported_incident_is_not_a_clean_step(self, bus: EventBus) -> None:
        """A CONTINUE (vanishing gradients reported) takes nothing but the step is not clean."""
        engine = RecoveryEngine(bus)
        engine.decide(GradientVanished(step=5, mean_abs=0.0, threshold=1e-6, all_zero=True))
        pending = engine.take(5)
        assert pending.actions == () and not pending.clean

    async def test_a_clean_take_restarts_the_consecutive_counts(self, bus: EventBus) -> None:
        """Three NaN steps in a row skip 1/∞, 2/∞, 3/∞; a clean take in between restarts at 1."""
        engine = RecoveryEngine(bus)
        reasons = []
        for step in (1, 2, 4):
            if step == 4:
                assert engine.take(3).clean  # step 3 was healthy
            reasons.append(engine.decide(_nan_loss(step))[-1].reason)
            engine.take(step)
        assert "skip 1 in a row" in reasons[0] and "skip 2 in a row" in reasons[1]
        assert "skip 1 in a row" in reasons[2]


class TestCalls:
    async def test_a_retried_calls_decisions_are_its_own(self, bus: EventBus) -> None:
        """An error reported for a call is answered to the call, never queued for a safe point."""
        engine = RecoveryEngine(bus)
        decided = await report_error(engine, torch.OutOfMemoryError("CUDA out of memory"))
        assert [d.kind for d in decided] == [RecoveryAction.RETRY]
        assert engine.take(0) == Pending()

    def test_sync_bus_reports_and_waits_with_the_blocking_twin(self) -> None:
        """On a SyncEventBus report_error_sync blocks until the engine answered."""
        with SyncEventBus() as bus:
            engine = RecoveryEngine(bus)
            assert engine.blocking
            decided = report_error_sync(engine, MemoryError("out of memory"))
        assert [d.kind for d in decided] == [RecoveryAction.RETRY]

    async def test_the_wrong_twin_is_a_clear_error(self, bus: EventBus) -> None:
        """Blocking calls on an async engine (and the reverse) name the call to use."""
        engine = RecoveryEngine(bus)
        with pytest.raises(TypeError, match=r"await report_error\(\)"):
            report_error_sync(engine, MemoryError())
        with pytest.raises(TypeError, match=r"await drain\(\)"):
            engine.drain_sync()
        with SyncEventBus() as sync_bus:
            sync_engine = RecoveryEngine(sync_bus)
            with pytest.raises(TypeError, match=r"call drain_sync\(\)"):
                await sync_engine.drain()
            with pytest.raises(TypeError, match=r"call report_error_sync\(\)"):
                await report_error(sync_engine, MemoryError())


class TestConstruction:
    def test_a_publisher_it_cannot_subscribe_to_is_refused(self) -> None:
        """RecoveryEngine needs a bus it can subscribe to; a bare Publisher is a TypeError."""

        class Recorder:
            def publish_nowait(self, event: Event, /) -> None:
                return None

            def publish_many_nowait(self, events: object, /) -> None:
                return None

        with pytest.raises(TypeError, match="bus must be an EventBus or a SyncEventBus"):
            RecoveryEngine(Recorder())

    async def test_bad_timeout_and_specs_are_refused(self, bus: EventBus) -> None:
        """drain_timeout must be positive seconds; strategies must be StrategySpec objects."""
        with pytest.raises(ValueError, match="drain_timeout must be a finite number of seconds"):
            RecoveryEngine(bus, drain_timeout=0)
        with pytest.raises(TypeError, match="strategies must hold StrategySpec"):
            RecoveryEngine(bus, strategies=[object()])  # type: ignore[list-item]
        with pytest.raises(ValueError, match=r"max_attempts must be an int >= 1.*or None"):
            RecoveryEngine(
                bus,
                strategies=[StrategySpec(strategy=lambda i, h: None, on=TypeError, max_attempts=0)],
            )

    async def test_a_strategy_returning_a_bare_action_is_reported(self, bus: EventBus) -> None:
        """Returning SkipStep() instead of a Decision is a strategy failure, not a crash."""
        engine = RecoveryEngine(
            bus,
            strategies=[StrategySpec(strategy=lambda i, h: SkipStep(), on=NonFiniteDetected)],  # type: ignore[arg-type, return-value]
        )
        with anyio.fail_after(10):
            decided = engine.decide(_nan_loss(1))
            await bus.drain()
        assert engine.statistics().strategy_failures == 1
        assert [d.kind for d in decided] == [RecoveryAction.STOP]
