"""Vanishing gradients from a real dead-ReLU init, memory-leak incidents, LR schedulers, OOM→CPU."""

from __future__ import annotations

import anyio
import pytest
import torch
from torch import nn

from eventbus_debug import (
    CallState,
    EventBus,
    RecoveryEngine,
    Retrying,
    SafePoint,
    StepProbe,
    TrainingStopped,
)
from eventbus_debug.events import (
    ErrorCategory,
    GradientVanished,
    MemoryLeakSuspected,
    RecoveryAction,
    RecoveryApplied,
    RecoveryDecided,
)
from eventbus_debug.recovery import (
    Fallback,
    FreeMemoryOnLeak,
    ReportVanishing,
    ShrinkBatchOnOOM,
    scale_learning_rate,
)
from eventbus_debug.testing import RecordingSink

from ._loop import all_finite, make, nan_at, run

DEAD: tuple[str, ...] = ("0.bias", "0.weight", "2.weight")


DIES_AT = 5


def dead_relu_model() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    """A ReLU stack that learns, then (at DIES_AT) its first layer stops activating (bias -10)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(64, 4)
    return model, opt, x, x.sum(dim=1, keepdim=True)


async def train_dead(bus: EventBus, engine: RecoveryEngine, steps: int) -> torch.optim.Optimizer:
    model, opt, x, y = dead_relu_model()
    probe = StepProbe(model, bus)
    safe = SafePoint(engine, model, opt)
    for step in range(steps):
        if step == DIES_AT:
            with torch.no_grad():
                model[0].bias.fill_(-10.0)  # type: ignore[index]
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        await probe.check_step(step, loss=loss)
        if (await safe.before_optimizer_step(step)).should_step:
            opt.step()
        opt.zero_grad()
    assert all_finite(model)
    return opt


class TestVanishing:
    async def test_dead_layers_are_reported_once_when_they_die(
        self, bus: EventBus, recorder: RecordingSink
    ) -> None:
        """Layers that learned and then died are named once, after 10 checks; nothing changes."""
        bus.subscribe(recorder)
        engine = RecoveryEngine(bus)
        with anyio.fail_after(30):
            opt = await train_dead(bus, engine, 20)
            await bus.drain()
        vanished = recorder.of_type(GradientVanished)
        assert [v.step for v in vanished] == [DIES_AT + 9]
        assert vanished[0].layers == DEAD and not vanished[0].all_zero
        decided = recorder.of_type(RecoveryDecided)
        assert [(d.step, d.action, d.strategy) for d in decided] == [
            (DIES_AT + 9, RecoveryAction.CONTINUE, "report_vanishing")
        ]
        assert "dead layers: 0.bias, 0.weight, 2.weight" in decided[0].reason
        assert not recorder.of_type(RecoveryApplied)
        assert opt.param_groups[0]["lr"] == pytest.approx(0.05)

    async def test_configured_lr_raise_bounded(
        self, bus: EventBus, recorder: RecordingSink
    ) -> None:
        """lr_factor=2, window=1, max_raises=1: the LR is doubled once, when the layers die."""
        bus.subscribe(recorder)
        engine = RecoveryEngine(bus)
        engine.register(ReportVanishing(window=1, lr_factor=2.0, max_raises=1), on=GradientVanished)
        with anyio.fail_after(30):
            opt = await train_dead(bus, engine, 20)
            await bus.drain()
        raised = [
            (a.step, a.detail)
            for a in recorder.of_type(RecoveryApplied)
            if a.action is RecoveryAction.SCALE_LR
        ]
        assert raised == [(DIES_AT + 9, "lr x2: 0.05 -> 0.1 in 1 param group(s)")]
        assert opt.param_groups[0]["lr"] == pytest.approx(0.1)

    def test_lr_factor_must_raise(self) -> None:
        """A vanishing LR factor <= 1 is a configuration error naming the argument."""
        with pytest.raises(ValueError, match="lr_factor"):
            ReportVanishing(lr_factor=0.5)


class TestMemoryLeak:
    async def test_leak_incident_frees_memory_at_the_safe_point_bounded(
        self, bus: EventBus, recorder: RecordingSink
    ) -> None:
        """MemoryLeakSuspected at steps 3..7: freed at 3, 4 (max_frees=2), then reported only."""
        bus.subscribe(recorder)
        engine = RecoveryEngine(bus)
        engine.register(FreeMemoryOnLeak(max_frees=2), on=MemoryLeakSuspected)
        model, opt, x, y = make()
        safe = SafePoint(engine, model, opt)
        retained: list[torch.Tensor] = []
        with anyio.fail_after(30):
            for step in range(10):
                loss = nn.functional.mse_loss(model(x), y)
                retained.append(loss)  # a real leak: every step's graph is kept alive
                loss.backward(retain_graph=True)  # type: ignore[no-untyped-call]
                if 3 <= step <= 7:
                    engine.bus.publish_nowait(
                        MemoryLeakSuspected(
                            step=step,
                            source="memory_probe",
                            resource="graph",
                            slope=1.0,
                            window=3,
                            retained="loss tensors appended to a list",
                        )
                    )
                decision = await safe.before_optimizer_step(step)
                assert decision.should_step  # freeing memory never skips a step
                opt.step()
                opt.zero_grad()
            await bus.drain()
        freed = [
            a for a in recorder.of_type(RecoveryApplied) if a.action is RecoveryAction.FREE_MEMORY
        ]
        assert [a.step for a in freed] == [3, 4]
        assert all(a.detail.startswith("gc collected ") and "rss" in a.detail for a in freed)
        decided = [(d.step, d.action) for d in recorder.of_type(RecoveryDecided)]
        assert decided == [
            (3, RecoveryAction.FREE_MEMORY),
            (4, RecoveryAction.FREE_MEMORY),
            *[(s, RecoveryAction.CONTINUE) for s in (5, 6, 7)],
        ]
        assert "already freed 2 times" in recorder.of_type(RecoveryDecided)[-1].reason
        assert len(retained) == 10
        assert all_finite(model)

    async def test_default_strategies_answer_leaks(self, bus: EventBus) -> None:
        """The built-in list has a leak strategy, so a leak is never 'unmatched'."""
        engine = RecoveryEngine(bus)
        assert "free_memory_on_leak" in engine.strategy_names
        decided = engine.decide(MemoryLeakSuspected(resource="rss", slope=4096.0, window=20))
        assert [d.kind for d in decided] == [RecoveryAction.FREE_MEMORY]
        assert engine.statistics().unmatched == 0


async def _train_with_scheduler(
    bus: EventBus | None, kind: str, *, faults: tuple[int, ...] = ()
) -> list[float]:
    model, opt, x, y = make()
    scheduler: torch.optim.lr_scheduler.LRScheduler
    if kind == "lambda":
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0 / (1.0 + 0.05 * e))
    else:
        scheduler = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=40)
    engine = RecoveryEngine(bus, policy="aggressive") if bus is not None else None
    probe = StepProbe(model, bus) if bus is not None else None
    safe = SafePoint(engine, model, opt, schedulers=[scheduler]) if engine is not None else None
    lrs: list[float] = []
    fault = nan_at(*faults)
    for step in range(30):
        loss = fault(step, nn.functional.mse_loss(model(x), y), model)
        loss.backward()  # type: ignore[no-untyped-call]
        if probe is not None:
            await probe.check_step(step, loss=loss)
        if safe is None or (await safe.before_optimizer_step(step)).should_step:
            opt.step()
        opt.zero_grad()
        scheduler.step()
        lrs.append(float(opt.param_groups[0]["lr"]))
    assert all_finite(model)
    return lrs


class TestSchedulers:
    @pytest.mark.parametrize("kind", ["lambda", "one_cycle"])
    async def test_scale_lr_survives_schedulers_that_recompute(
        self, bus: EventBus, recorder: RecordingSink, kind: str
    ) -> None:
        """After restore + LR x0.5 at step 13, every later scheduled LR is half the clean one."""
        bus.subscribe(recorder)
        with anyio.fail_after(30):
            clean = await _train_with_scheduler(None, kind)
            faulty = await _train_with_scheduler(bus, kind, faults=(10, 11, 12, 13))
            await bus.drain()
        scaled = [
            a for a in recorder.of_type(RecoveryApplied) if a.action is RecoveryAction.SCALE_LR
        ]
        assert [a.step for a in scaled] == [13]
        assert "base LRs of 1 scheduler(s)" in scaled[0].detail
        assert faulty[:13] == pytest.approx(clean[:13])
        assert faulty[13:] == pytest.approx([lr * 0.5 for lr in clean[13:]])

    def test_without_the_scheduler_lambda_lr_undoes_the_decision(self) -> None:
        """The pitfall schedulers= exists for: LambdaLR recomputes the old LR from base_lrs."""
        _, opt, _, _ = make()
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0)
        scale_learning_rate(opt, 0.5)
        assert opt.param_groups[0]["lr"] == pytest.approx(0.025)
        opt.step()
        scheduler.step()
        assert opt.param_groups[0]["lr"] == pytest.approx(0.05)  # undone
        detail = scale_learning_rate(opt, 0.5, [scheduler])
        opt.step()
        scheduler.step()
        assert opt.param_groups[0]["lr"] == pytest.approx(0.025)  # kept
        assert detail == "lr x0.5: 0.05 -> 0.025 in 1 param group(s), base LRs of 1 scheduler(s)"

    async def test_sequential_lr_children_are_scaled(self, bus: EventBus) -> None:
        """SequentialLR is followed into its children; a non-scheduler is refused."""
        model, opt, _, _ = make()
        warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=3)
        cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
        seq = torch.optim.lr_scheduler.SequentialLR(opt, [warm, cos], milestones=[3])
        scale_learning_rate(opt, 0.5, [seq])
        assert warm.base_lrs == pytest.approx([0.025]) and cos.base_lrs == pytest.approx([0.025])
        with pytest.raises(TypeError, match="schedulers"):
            SafePoint(RecoveryEngine(bus), model, opt, schedulers=[object()])


class TestOutOfMemoryCpuFallback:
    async def test_floor_then_cpu_fallback_then_success(
        self, bus: EventBus, recorder: RecordingSink
    ) -> None:
        """OOM on the 'GPU' at every size: 4 -> 2 -> 1, then FALLBACK to the CPU, which works."""
        bus.subscribe(recorder)
        engine = RecoveryEngine(bus)
        engine.register(ShrinkBatchOnOOM(cpu_fallback=True), on=ErrorCategory.MEMORY)
        model, opt, x, y = make()
        runs: list[tuple[str | None, int | None]] = []
        policy = Retrying(
            engine, state=CallState(batch_size=4, device="cuda:0"), operation="train_step"
        )
        with anyio.fail_after(30):
            async for attempt in policy:
                async with attempt:
                    state = attempt.state
                    runs.append((state.device, state.batch_size))
                    if state.device != "cpu":  # deterministic stand-in for a full GPU
                        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8 GiB")
                    assert state.batch_size is not None
                    loss = nn.functional.mse_loss(
                        model.to(state.device)(x[: state.batch_size]), y[: state.batch_size]
                    )
                    loss.backward()  # type: ignore[no-untyped-call]
                    opt.step()
            await bus.drain()
        assert runs == [("cuda:0", 4), ("cuda:0", 2), ("cuda:0", 1), ("cpu", 1)]
        decided = [(d.action, d.decided) for d in recorder.of_type(RecoveryDecided)]
        assert decided[-1] == (RecoveryAction.FALLBACK, Fallback(cpu=True, free_memory=True))
        final = [a for a in recorder.of_type(RecoveryApplied) if "succeeded" in a.detail]
        assert len(final) == 1 and "device cuda:0 -> cpu" in final[0].detail
        assert all_finite(model)

    async def test_oom_on_the_cpu_too_stops(self, bus: EventBus) -> None:
        """Already on the CPU at the floor: no fallback left, TrainingStopped."""
        engine = RecoveryEngine(bus)
        engine.register(ShrinkBatchOnOOM(cpu_fallback=True), on=ErrorCategory.MEMORY)
        policy = Retrying(engine, state=CallState(batch_size=1, device="cpu"))
        with anyio.fail_after(10), pytest.raises(TrainingStopped, match="exhausted"):
            async for attempt in policy:
                async with attempt:
                    raise MemoryError("out of memory")


async def test_clean_loop_helper_runs(bus: EventBus) -> None:
    """Sanity: the shared loop trains without faults (guards the helpers above)."""
    with anyio.fail_after(30):
        model, loss, skipped = await run(None)
    assert skipped == [] and all_finite(model) and loss < 1.0
