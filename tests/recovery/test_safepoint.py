"""Each built-in strategy on a real seeded training loop with a fault injected at a known step."""

from __future__ import annotations

import math

import anyio
import pytest
import torch
from torch import nn

from eventbus_debug import EventBus, RecoveryEngine, TrainingStopped
from eventbus_debug.events import (
    GradientExploded,
    LossSpiked,
    NonFiniteDetected,
    RecoveryAction,
    RecoveryApplied,
    RecoveryDecided,
    StepSkipped,
)
from eventbus_debug.recovery import ClipOnExplosion
from eventbus_debug.testing import RecordingSink

from ._loop import all_finite, nan_at, run


@pytest.fixture(name="clean_loss")
async def _clean_loss() -> float:
    _, loss, _ = await run(None)
    return loss


class TestNonFinite:
    async def test_nan_loss_is_skipped_and_training_recovers(
        self, bus: EventBus, recorder: RecordingSink, clean_loss: float
    ) -> None:
        """A NaN loss at step 12 → incident, SKIP_STEP decided and applied at step 12 only."""
        bus.subscribe(recorder)
        engine = RecoveryEngine(bus)
        with anyio.fail_after(30):
            model, loss, skipped = await run(bus, nan_at(12), engine=engine)
            await bus.drain()
        assert skipped == [12]
        assert any(e.step == 12 for e in recorder.of_type(NonFiniteDetected))
        decided = recorder.of_type(RecoveryDecided)
        assert [(d.step, d.action) for d in decided] == [(12, RecoveryAction.SKIP_STEP)]
        assert decided[0].strategy == "skip_non_finite"
        assert [e.step for e in recorder.of_type(StepSkipped)] == [12]
        assert all_finite(model)
        assert loss < clean_loss * 1.5 + 0.05

    async def test_repeated_nan_restores_and_lowers_lr(
        self, bus: EventBus, recorder: RecordingSink
    ) -> None:
        """Aggressive policy: four NaN steps in a row: three skips, then restore + LR x0.5."""
        bus.subscribe(recorder)
        engine = RecoveryEngine(bus, policy="aggressive")
        with anyio.fail_after(30):
            model, loss, skipped = await run(bus, nan_at(10, 11, 12, 13), engine=engine)
            await bus.drain()
        assert skipped == [10, 11, 12, 13]
        applied = [(a.step, a.action) for a in recorder.of_type(RecoveryApplied)]
        assert (13, RecoveryAction.RESTORE_STATE) in applied
        assert (13, RecoveryAction.SCALE_LR) in applied
        assert all_finite(model)
        assert math.isfinite(loss)

    async def test_exhaustion_raises_training_stopped(
        self, bus: EventBus, recorder: RecordingSink
    ) -> None:
        """NaN on every step from 5: skips and restores run out and TrainingStopped is raised."""
        bus.subscribe(recorder)
        engine = RecoveryEngine(bus, policy="aggressive")
        with anyio.fail_after(30), pytest.raises(TrainingStopped, match="exhausted"):
            await run(bus, nan_at(*range(5, 40)), engine=engine)
        await bus.drain()
        stops = [d for d in recorder.of_type(RecoveryDecided) if d.action is RecoveryAction.STOP]
        assert len(stops) == 1
        assert stops[0].strategy == "exhausted"
        assert stops[0].step == 10  # 3 skips (5-7), 2 restores (8, 9), then stop
        assert engine.statistics().stop_reason is not None

    async def test_nan_parameters_are_restored_not_zeroed(
        self, bus: EventBus, recorder: RecordingSink
    ) -> None:
        """A parameter set to NaN at step 15 is restored from the last good snapshot."""
        bus.subscribe(recorder)
        engine = RecoveryEngine(bus)

        def poison(step: int, loss: torch.Tensor, model: nn.Module) -> torch.Tensor:
            if step == 15:
                first = model[0]  # type: ignore[index]
                with torch.no_grad():
                    first.weight[0, 0] = math.nan
                return nn.functional.mse_loss(model(torch.ones(2, 4)), torch.zeros(2, 1))
            return loss

        with anyio.fail_after(30):
            model, loss, _ = await run(bus, poison, engine=engine)
            await bus.drain()
        restores = [
            a for a in recorder.of_type(RecoveryApplied) if a.action is RecoveryAction.RESTORE_STATE
        ]
        assert restores and restores[0].outcome == "applied"
        assert all_finite(model)
        first = model[0]  # type: ignore[index]
        assert float(first.weight[0, 0].detach()) != 0.0
        assert math.isfinite(loss)


class TestExplosion:
    async def test_explosion_is_clipped_with_the_probe_norm(
        self, bus: EventBus, recorder: RecordingSink, clean_loss: float
    ) -> None:
        """Gradients x1e4 at step 20 → GradientExploded → clipped with the probe's norm."""
        bus.subscribe(recorder)
        engine = RecoveryEngine(bus)
        engine.register(ClipOnExplosion(max_norm=5.0), on=GradientExploded, name="clip_to_5")

        def blow(step: int, loss: torch.Tensor, model: nn.Module) -> torch.Tensor:
            if step != 20:
                return loss
            big = loss * 1e4  # same loss value, gradients x1e4: an explosion without a spike
            return loss + (big - big.detach())

        with anyio.fail_after(30):
            model, loss, skipped = await run(bus, blow, engine=engine)
            await bus.drain()
        exploded = recorder.of_type(GradientExploded)
        assert [e.step for e in exploded] == [20]
        applied = [
            a
            for a in recorder.of_type(RecoveryApplied)
            if a.action is RecoveryAction.CLIP_GRADIENTS
        ]
        assert [a.step for a in applied] == [20]
        assert applied[0].detail == f"gradients clipped from norm {exploded[0].total_norm:.4g} to 5"
        assert skipped == []
        assert all_finite(model)
        assert loss < clean_loss * 1.5 + 0.05


class TestLossSpike:
    async def test_spike_rolls_back_skips_and_lowers_lr(
        self, bus: EventBus, recorder: RecordingSink
    ) -> None:
        """A loss spike at step 25 → restore, skip, LR x0.5, all applied at step 25."""
        bus.subscribe(recorder)
        engine = RecoveryEngine(bus, policy="aggressive")

        def spike(step: int, loss: torch.Tensor, model: nn.Module) -> torch.Tensor:
            return loss * 50 if step == 25 else loss

        with anyio.fail_after(30):
            model, loss, skipped = await run(bus, spike, engine=engine)
            await bus.drain()
        assert any(e.step == 25 for e in recorder.of_type(LossSpiked))
        applied = {(a.step, a.action) for a in recorder.of_type(RecoveryApplied)}
        assert {
            (25, RecoveryAction.RESTORE_STATE),
            (25, RecoveryAction.SCALE_LR),
            (25, RecoveryAction.SKIP_STEP),
        } <= applied
        assert 25 in skipped
        assert all_finite(model)
        assert math.isfinite(loss)
