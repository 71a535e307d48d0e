"""A sink that raises the event loop's cancellation exception without being cancelled.

A sink that awaited a future something else cancelled (an HTTP client's request future, an
``asyncio.wait_for`` inside a library) raises ``CancelledError`` although nothing asked its
task to stop. That is the sink's failure: a ``SinkFailed`` naming it, the event counted, and
delivery (and training) going on. A real cancellation of the sink's task is never swallowed.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path

import anyio
import pytest
import torch
from torch import nn

from eventbus_debug import EventBus, Session, SyncSession, read_events
from eventbus_debug._bus import _cancel
from eventbus_debug.events import (
    Event,
    SessionEnded,
    SinkCloseFailed,
    SinkDisabled,
    SinkFailed,
    StepCompleted,
)
from eventbus_debug.testing import RecordingSink

pytestmark = [
    pytest.mark.asyncio_only("cancels asyncio tasks by hand (Task.cancel)"),
    pytest.mark.skipif(
        sys.version_info < (3, 11), reason="Python 3.10 cannot tell a foreign cancellation apart"
    ),
]

GUARD_S = 20.0


async def _await_a_cancelled_future() -> None:
    future = asyncio.get_running_loop().create_future()
    future.cancel()
    await future


class _CancelledOnStep:
    """``handle`` raises CancelledError (a cancelled future it awaited) on one step."""

    name = "cancelled-on-step"

    def __init__(self, step: int) -> None:
        self.step = step
        self.seen: list[int | None] = []

    async def handle(self, event: Event, /) -> None:
        if event.step == self.step:
            await _await_a_cancelled_future()
        self.seen.append(event.step)


class _CancelledBatch:
    name = "cancelled-batch"

    def __init__(self) -> None:
        self.calls = 0

    async def handle_batch(self, events: Sequence[Event], /) -> None:
        self.calls += 1
        if self.calls == 1:
            await _await_a_cancelled_future()


class _CancelledStartAndClose:
    name = "cancelled-start-close"

    def __init__(self) -> None:
        self.seen = 0

    async def start(self) -> None:
        await _await_a_cancelled_future()

    async def handle(self, event: Event, /) -> None:
        self.seen += 1

    async def aclose(self) -> None:
        await _await_a_cancelled_future()


class TestEventBus:
    async def test_the_block_goes_on_and_the_failure_is_reported(self) -> None:
        """The adversary's case: 100 steps run, the sink's failure is a SinkFailed."""
        sink = _CancelledOnStep(step=2)
        recorder = RecordingSink()
        steps = 0
        with anyio.fail_after(GUARD_S):
            async with EventBus(close_timeout=5) as bus:
                bus.subscribe(recorder, SinkFailed)
                sub = bus.subscribe(sink, StepCompleted)
                for i in range(100):
                    bus.publish_nowait(StepCompleted(step=i))
                    await anyio.sleep(0)
                    steps += 1
                await bus.drain()
        assert steps == 100
        stats = sub.statistics()
        assert (stats.delivered, stats.failed, stats.undelivered) == (99, 1, 0)
        assert not stats.disabled
        assert sink.seen == [i for i in range(100) if i != 2]
        [failure] = recorder.of_type(SinkFailed)
        assert failure.sink == "cancelled-on-step" and failure.error_type == "CancelledError"
        assert failure.event_seq > 0 and failure.step == 2

    async def test_a_batch_sink(self) -> None:
        """A batch that raised it counts as failed; the next batches are delivered."""
        sink = _CancelledBatch()
        with anyio.fail_after(GUARD_S):
            async with EventBus() as bus:
                sub = bus.subscribe(sink, StepCompleted)
                bus.publish_nowait(StepCompleted(step=0))
                await bus.drain()
                bus.publish_nowait(StepCompleted(step=1))
                await bus.drain()
        stats = sub.statistics()
        assert (stats.failed, stats.delivered) == (1, 1)

    async def test_start_and_close(self) -> None:
        """From ``start``: a SinkFailed, then delivery; from ``aclose``: a SinkCloseFailed."""
        sink = _CancelledStartAndClose()
        recorder = RecordingSink()
        with anyio.fail_after(GUARD_S):
            async with EventBus(close_timeout=5) as bus:
                bus.subscribe(recorder)
                sub = bus.subscribe(sink, StepCompleted)
                bus.publish_nowait(StepCompleted(step=0))
                await bus.drain()
        assert sink.seen == 1 and sub.statistics().delivered == 1
        [failure] = recorder.of_type(SinkFailed)
        assert failure.event_kind == "" and failure.error_type == "CancelledError"
        [close_failure] = recorder.of_type(SinkCloseFailed)
        assert close_failure.sink == "cancelled-start-close"
        assert "CancelledError" in close_failure.message

    async def test_repeated_counts_towards_disabling(self) -> None:
        """Raised at every event, it disables the sink like any repeated failure."""

        async def always(event: Event, /) -> None:
            await _await_a_cancelled_future()

        recorder = RecordingSink()
        with anyio.fail_after(GUARD_S):
            async with EventBus(max_consecutive_failures=3) as bus:
                bus.subscribe(recorder, SinkDisabled)
                sub = bus.subscribe(always, StepCompleted)
                for i in range(5):
                    bus.publish_nowait(StepCompleted(step=i))
                await bus.drain()
        stats = sub.statistics()
        assert stats.disabled and stats.failed == 3 and stats.discarded == 2
        assert "CancelledError" in recorder.of_type(SinkDisabled)[0].reason

    async def test_a_real_cancellation_of_the_sinks_task_is_not_swallowed(self) -> None:
        """Cancelling the sink's task (code cancelling every task) ends it: the sink is
        disabled and reported, nothing is swallowed, the bus closes normally."""
        entered = anyio.Event()

        async def slow(event: Event, /) -> None:
            entered.set()
            await anyio.sleep(GUARD_S)

        recorder = RecordingSink()
        with anyio.fail_after(GUARD_S):
            async with EventBus(close_timeout=5) as bus:
                bus.subscribe(recorder, SinkDisabled)
                sub = bus.subscribe(slow, StepCompleted)
                bus.publish_nowait(StepCompleted(step=0))
                bus.publish_nowait(StepCompleted(step=1))
                await entered.wait()
                task = sub._task
                assert task is not None
                task.cancel()
                await bus.drain()
        assert task.cancelled()
        stats = sub.statistics()
        assert stats.disabled and (stats.failed, stats.discarded) == (1, 1)
        assert "cancelled" in recorder.of_type(SinkDisabled)[0].reason

    async def test_where_it_cannot_be_told_apart_the_sink_is_disabled(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Python 3.10's behaviour (no ``Task.cancelling``), checked here: the exception is
        taken as a cancellation of the task, which ends; the sink is disabled and reported,
        and the block goes on."""
        monkeypatch.setattr(_cancel, "FOREIGN_CANCELLATION_DETECTED", False)
        sink = _CancelledOnStep(step=1)
        recorder = RecordingSink()
        steps = 0
        with anyio.fail_after(GUARD_S):
            async with EventBus() as bus:
                bus.subscribe(recorder, SinkDisabled)
                sub = bus.subscribe(sink, StepCompleted)
                bus.publish_many_nowait(StepCompleted(step=i) for i in range(5))
                for _ in range(5):
                    await anyio.sleep(0)
                    steps += 1
                await bus.drain()
        assert steps == 5
        stats = sub.statistics()
        assert stats.disabled and (stats.delivered, stats.failed, stats.discarded) == (1, 1, 3)
        assert [d.sink for d in recorder.of_type(SinkDisabled)] == ["cancelled-on-step"]


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Linear(4, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


async def _webhook(event: Event, /) -> None:
    if event.kind == "step_completed" and event.step == 1:
        await _await_a_cancelled_future()


class TestSessions:
    async def test_session_trains_on(self, tmp_path: Path) -> None:
        """Session: the steps after the failure run and the log has the SinkFailed."""
        model, opt = _model()
        with anyio.fail_after(60):
            async with Session(
                model, opt, log_dir=tmp_path, sinks=[_webhook], system_interval=None
            ) as session:
                for step in range(4):
                    await session.training_step(
                        torch.randn(8, 4), torch.randn(8, 1), nn.functional.mse_loss, step=step
                    )
                    await anyio.sleep(0.15)  # past the telemetry latency: the step reaches it
        events = list(read_events(tmp_path))
        assert [e.reason for e in events if isinstance(e, SessionEnded)] == ["completed"]
        failures = [e for e in events if isinstance(e, SinkFailed)]
        assert [f.error_type for f in failures] == ["CancelledError"]

    def test_sync_session_trains_on(self, tmp_path: Path) -> None:
        """SyncSession: the same on the bus's thread."""
        model, opt = _model()
        with SyncSession(
            model, opt, log_dir=tmp_path, sinks=[_webhook], system_interval=None, close_timeout=5
        ) as session:
            for step in range(4):
                session.training_step(
                    torch.randn(8, 4), torch.randn(8, 1), nn.functional.mse_loss, step=step
                )
        events = list(read_events(tmp_path))
        assert [(e.reason, e.steps) for e in events if isinstance(e, SessionEnded)] == [
            ("completed", 4)
        ]
        assert sum(isinstance(e, SinkFailed) for e in events) == 1
