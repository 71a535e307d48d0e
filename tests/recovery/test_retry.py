"""Retried calls (OOM, data and model loading), custom strategies, config errors, sync loops, AMP."""

from __future__ import annotations

from collections.abc import Iterator

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
    Session,
    StepProbe,
    SyncEventBus,
    TrainingStopped,
    retrying,
)
from eventbus_debug.events import (
    Anomaly,
    CallSettings,
    ErrorCategory,
    ErrorRaised,
    RecoveryAction,
    RecoveryApplied,
    RecoveryDecided,
    StepChecked,
    StepSkipped,
)
from eventbus_debug.recovery import (
    Decision,
    Retry,
    ScalerStepWatcher,
    ShrinkBatch,
    ShrinkBatchOnOOM,
    StrategyHistory,
    report_error,
)
from eventbus_debug.testing import RecordingSink

from ._loop import all_finite, make


class TestOutOfMemory:
    async def test_oom_above_a_batch_size_finishes_with_the_smaller_batch(
        self, bus: EventBus, recorder: RecordingSink
    ) -> None:
        """Batches above 16 raise OutOfMemoryError: the loop trains with 16 and reports it."""
        bus.subscribe(recorder)
        engine = RecoveryEngine(bus)
        model, opt, x, y = make()
        sizes: list[int] = []

        @retrying(engine, state=CallState(batch_size=64), pass_state=True, operation="train_step")
        async def train_step(step: int, *, state: CallState) -> float:
            assert state.batch_size is not None
            if state.batch_size > 16:
                raise torch.OutOfMemoryError(
                    f"CUDA out of memory. Tried to allocate batch {state.batch_size}"
                )
            sizes.append(state.batch_size)
            loss = nn.functional.mse_loss(model(x[: state.batch_size]), y[: state.batch_size])
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            opt.zero_grad()
            return loss.item()

        with anyio.fail_after(30):
            losses = [await train_step(step) for step in range(10)]  # type: ignore[call-arg]
            await bus.drain()
        assert sizes == [16] * 10
        errors = recorder.of_type(ErrorRaised)
        assert [e.category for e in errors] == [ErrorCategory.MEMORY] * 2
        assert [e.attempt for e in errors] == [1, 2]
        assert errors[0].settings is not None and errors[0].settings.batch_size == 64
        assert "torch.OutOfMemoryError" in errors[0].exception_types
        decided = recorder.of_type(RecoveryDecided)
        assert [d.decided for d in decided] == [ShrinkBatch(size=32), ShrinkBatch(size=16)]
        final = [a for a in recorder.of_type(RecoveryApplied) if "succeeded" in a.detail]
        assert len(final) == 1 and "batch_size=16" in final[0].detail
        assert losses[-1] < losses[0]
        assert all_finite(model)

    async def test_cpu_allocator_message_counts_as_oom_and_floor_exhausts(
        self, bus: EventBus, recorder: RecordingSink
    ) -> None:
        """ "can't allocate memory" shrinks to the floor, then TrainingStopped (cause kept)."""
        bus.subscribe(recorder)
        engine = RecoveryEngine(bus)
        policy = Retrying(engine, state=CallState(batch_size=4), max_attempts=10)
        err = RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 GB")
        with anyio.fail_after(30), pytest.raises(TrainingStopped) as info:
            async for attempt in policy:
                async with attempt:
                    raise err
        assert info.value.__cause__ is err
        assert policy.state.batch_size == 1
        await bus.drain()
        assert [d.action for d in recorder.of_type(RecoveryDecided)][-1] is RecoveryAction.STOP

    async def test_unhandled_errors_propagate_unchanged(self, bus: EventBus) -> None:
        """An error no strategy is registered for is raised as is, after one attempt."""
        engine = RecoveryEngine(bus)
        calls = 0

        @retrying(engine)
        async def broken() -> None:
            nonlocal calls
            calls += 1
            raise ZeroDivisionError("boom")

        with anyio.fail_after(10), pytest.raises(ZeroDivisionError, match="boom"):
            await broken()
        assert calls == 1


class TestFallbacks:
    async def test_data_loading_fewer_workers_then_no_pinning_then_main_process(
        self, bus: EventBus
    ) -> None:
        """A loader failing with workers retries with 2, then unpinned, then in the main process."""
        engine = RecoveryEngine(bus)
        seen: list[tuple[int | None, bool | None]] = []
        policy = Retrying(
            engine, state=CallState(num_workers=4, pin_memory=True), operation="data_loading"
        )
        with anyio.fail_after(10):
            async for attempt in policy:
                async with attempt:
                    seen.append((attempt.state.num_workers, attempt.state.pin_memory))
                    if attempt.state.num_workers:
                        raise RuntimeError("DataLoader worker (pid 123) exited unexpectedly")
        assert seen == [(4, True), (2, True), (2, False), (0, False)]

    async def test_model_loading_half_then_cpu_then_smaller_factory(self, bus: EventBus) -> None:
        """Model loading falls back to half precision, then the CPU, then the smaller model."""
        engine = RecoveryEngine(bus)
        state = CallState(device="cuda:0", smaller_model=False)

        @retrying(engine, state=state, pass_state=True, operation="model_loading")
        async def load(*, state: CallState) -> nn.Module:
            if not state.smaller_model:
                raise RuntimeError("Error(s) in loading state_dict: size mismatch")
            return nn.Linear(2, 2)

        with anyio.fail_after(10):
            model = await load()  # type: ignore[call-arg]
        assert isinstance(model, nn.Linear)
        assert state.half_precision and state.device == "cpu" and state.smaller_model


class TestCustomStrategies:
    async def test_registered_by_message_pattern_wins_over_builtins(self, bus: EventBus) -> None:
        """register(fn, on="CUDA out of memory") answers before the built-in OOM strategy."""
        engine = RecoveryEngine(bus)
        seen: list[str] = []

        def free_and_retry(incident: Anomaly, history: StrategyHistory) -> Decision:
            seen.append(incident.message)  # type: ignore[attr-defined]
            return Decision(action=Retry(), reason="custom")

        engine.register(free_and_retry, on="cuda OUT of memory", max_attempts=2)
        decided = await report_error(engine, torch.OutOfMemoryError("CUDA out of memory. x"))
        assert [(d.strategy, d.kind) for d in decided] == [("free_and_retry", RecoveryAction.RETRY)]
        assert seen == ["CUDA out of memory. x"]

    async def test_registered_by_exception_type_matches_subclasses(self, bus: EventBus) -> None:
        """A strategy on LookupError answers a KeyError; max_attempts bounds it, then STOP."""
        engine = RecoveryEngine(bus)
        engine.register(
            lambda i, h: Decision(action=Retry(), reason="lookup"),
            on=LookupError,
            name="lookup",
            max_attempts=1,
        )
        first = await report_error(engine, KeyError("k"))
        second = await report_error(engine, KeyError("k"))
        assert [d.strategy for d in first] == ["lookup"]
        assert [d.kind for d in second] == [RecoveryAction.STOP]

    async def test_a_raising_strategy_is_reported_and_the_next_one_decides(
        self, bus: EventBus, recorder: RecordingSink
    ) -> None:
        """A strategy that raises becomes an ErrorRaised incident; the built-in one answers."""
        bus.subscribe(recorder)
        engine = RecoveryEngine(bus)

        def broken(incident: Anomaly, history: StrategyHistory) -> Decision:
            raise ValueError("strategy bug")

        engine.register(broken, on=ErrorCategory.MEMORY)
        decided = await report_error(engine, MemoryError(), settings=CallSettings(batch_size=8))
        await bus.drain()
        assert [d.strategy for d in decided] == ["shrink_batch_on_oom"]
        failures = [e for e in recorder.of_type(ErrorRaised) if e.source == "recovery"]
        assert len(failures) == 1 and "strategy bug" in failures[0].message
        assert engine.statistics().strategy_failures == 1


class TestConfiguration:
    @pytest.mark.parametrize("factor", [0.0, 1.0, -0.5, 2.0])
    def test_shrink_factor_must_be_between_zero_and_one(self, factor: float) -> None:
        """A shrink factor <= 0 or >= 1 fails at construction, naming the argument."""
        with pytest.raises(ValueError, match="factor"):
            ShrinkBatchOnOOM(factor=factor)

    async def test_bad_bounds_and_triggers_fail_at_registration(self, bus: EventBus) -> None:
        """Negative attempts, a non-incident event type and an unknown trigger are rejected."""
        engine = RecoveryEngine(bus)
        fn = lambda i, h: None  # noqa: E731
        with pytest.raises(ValueError, match="max_attempts"):
            engine.register(fn, on=MemoryError, max_attempts=-1)
        with pytest.raises(ValueError, match="not an incident"):
            engine.register(fn, on=StepChecked)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="unknown trigger"):
            engine.register(fn, on=42)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="max_attempts"):
            Retrying(engine, max_attempts=0)


class TestSyncLoop:
    def test_sync_bus_safe_point_skips_the_nan_step(self) -> None:
        """The same recovery works in a plain for-loop with a SyncEventBus."""
        recorder = RecordingSink()
        with SyncEventBus() as bus:
            bus.subscribe(recorder)
            engine = RecoveryEngine(bus)
            model, opt, x, y = make()
            probe = StepProbe(model, bus)
            safe = SafePoint(engine, model, opt)
            skipped = []
            for step in range(20):
                loss = nn.functional.mse_loss(model(x), y)
                if step == 7:
                    loss = loss * float("nan")
                loss.backward()  # type: ignore[no-untyped-call]
                probe.check_step_sync(step, loss=loss)
                if safe.before_optimizer_step_sync(step).should_step:
                    opt.step()
                else:
                    skipped.append(step)
                opt.zero_grad()
        assert skipped == [7]
        assert [e.step for e in recorder.of_type(StepSkipped)] == [7]
        assert all_finite(model)


class TestAmp:
    async def test_scaler_skip_is_published_with_scales(
        self, bus: EventBus, recorder: RecordingSink
    ) -> None:
        """An inf gradient under GradScaler publishes StepSkipped with the scale halved."""
        bus.subscribe(recorder)
        engine = RecoveryEngine(bus)
        model, opt, x, y = make()
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        watcher = ScalerStepWatcher(scaler, opt, engine)
        ran = []
        for step in range(4):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss * (float("inf") if step == 2 else 1.0)).backward()  # type: ignore[no-untyped-call]
            ran.append(watcher.step(step))
            opt.zero_grad()
        watcher.close()
        await bus.drain()
        assert ran == [True, True, False, True]
        skipped = recorder.of_type(StepSkipped)
        assert [(s.step, s.scale_before, s.scale_after) for s in skipped] == [(2, 1024.0, 512.0)]


class TestRetriedCallsCarryTheStep:
    async def test_retry_events_inside_a_session_carry_its_step(self) -> None:
        """An OOM retried inside a Session: ErrorRaised, RecoveryDecided and RecoveryApplied
        all carry the session's step (not None)."""
        recorder = RecordingSink()
        model, opt, _, _ = make()
        async with EventBus() as bus:
            bus.subscribe(recorder)
            async with Session(model, opt, bus=bus, log_dir=None) as s:
                assert s.recovery is not None
                failures = iter([True, False])

                @retrying(s.recovery, state=CallState(batch_size=8), operation="train_step")
                async def call() -> None:
                    if next(failures):
                        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")

                await s.step_completed(12)
                await call()
            await bus.drain()
        steps = [
            (type(e).__name__, e.step)
            for e in recorder.events
            if isinstance(e, ErrorRaised | RecoveryDecided | RecoveryApplied)
        ]
        assert steps and all(step == 12 for _, step in steps), steps
        assert {name for name, _ in steps} == {"ErrorRaised", "RecoveryDecided", "RecoveryApplied"}

    def test_sync_retry_explicit_provider_and_no_session(self) -> None:
        """A sync retry takes an explicit step provider; without one and without a session
        the events carry no step; a non-callable provider is a TypeError."""
        recorder = RecordingSink()
        with SyncEventBus() as bus:
            bus.subscribe(recorder)
            engine = RecoveryEngine(bus)
            for provider, expected in ((lambda: 5, 5), (None, None)):
                failures = iter([True, False])

                @retrying(engine, state=CallState(batch_size=8), step=provider)
                def call(failures: Iterator[bool] = failures) -> None:
                    if next(failures):
                        raise torch.OutOfMemoryError("CUDA out of memory")

                call()
                bus.drain()
                applied = recorder.of_type(RecoveryApplied)
                errors = recorder.of_type(ErrorRaised)
                assert applied[-1].step == expected and errors[-1].step == expected
        with pytest.raises(TypeError, match="step must be a callable"):
            Retrying(engine, step=5)  # type: ignore[arg-type]
