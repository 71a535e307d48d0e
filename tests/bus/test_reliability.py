"""Issue 12's guarantees: a lossless log, linear bursts, bounded close, sink health as events."""

from __future__ import annotations

import io
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest
import torch

from eventbus_debug import EventBus, Session, read_events
from eventbus_debug._bus import _dispatch, _queue, subscription as _subscription
from eventbus_debug.events import (
    Event,
    EventsDropped,
    EventsUndelivered,
    LoopStalled,
    SessionEnded,
    SinkCloseFailed,
    SinkFailed,
    SinkUnresponsive,
    StepCompleted,
)
from eventbus_debug.log.files import ReadStatistics
from eventbus_debug.sinks import (
    ConsoleSink,
    RotatingFileSink,
    _jsonl_writer as jw,
    rotating_file as rf,
)
from eventbus_debug.testing import RecordingSink


def _incident(i: int) -> SinkFailed:
    return SinkFailed(sink="elsewhere", error_type="E", message="m", step=i)


class _SlowBatches:
    """A batch sink that takes a short await per batch (slower than the publisher)."""

    def __init__(self, backpressure: bool) -> None:
        self.backpressure = backpressure
        self.steps: list[int | None] = []

    async def handle_batch(self, events: Sequence[Event], /) -> None:
        await anyio.sleep(0.002)
        self.steps.extend(e.step for e in events if isinstance(e, StepCompleted))


class _Gate:
    """Holds every batch until opened."""

    def __init__(self) -> None:
        self.open = anyio.Event()
        self.got: list[Event] = []

    async def handle_batch(self, events: Sequence[Event], /) -> None:
        await self.open.wait()
        self.got.extend(events)


class TestLosslessLog:
    async def test_flow_controlled_sink_never_sheds(self) -> None:
        """`await publish` waits for a flow-controlled sink instead of shedding its telemetry."""
        sink = _SlowBatches(backpressure=True)
        async with EventBus(capacity=64) as bus:
            sub = bus.subscribe(sink)
            assert sub.backpressure
            for i in range(3000):
                await bus.publish(StepCompleted(step=i))
        assert sub.statistics().shed == 0
        assert sink.steps == list(range(3000))

    async def test_without_flow_control_the_same_load_sheds(self) -> None:
        """The control case: the same sink without flow control sheds (and counts it)."""
        sink = _SlowBatches(backpressure=False)
        recorder = RecordingSink()
        async with EventBus(capacity=64) as bus:
            bus.subscribe(recorder, EventsDropped)
            sub = bus.subscribe(sink, StepCompleted)
            for i in range(3000):
                await bus.publish(StepCompleted(step=i))
        shed = sub.statistics().shed
        assert shed > 0 and len(sink.steps) == 3000 - shed
        assert sum(r.dropped for r in recorder.of_type(EventsDropped)) == shed

    def test_file_sink_asks_for_a_large_flow_controlled_queue(self, tmp_path: Path) -> None:
        """RotatingFileSink's defaults: flow control on, a 32k-event queue."""
        sink = RotatingFileSink(tmp_path)
        assert sink.backpressure is True and sink.queue_capacity == rf.DEFAULT_QUEUE_CAPACITY

    async def test_file_sink_keeps_every_event_of_a_publish_loop(self, tmp_path: Path) -> None:
        """The documented `await bus.publish` loop into the default file sink loses nothing."""
        sink = RotatingFileSink(tmp_path, queue_capacity=256)
        async with EventBus() as bus:
            sub = bus.subscribe(sink)
            for i in range(5000):
                await bus.publish(StepCompleted(step=i, loss=0.5))
        assert sub.statistics().shed == 0
        assert [e.step for e in read_events(tmp_path)] == list(range(5000))

    async def test_stuck_flow_controlled_sink_stops_holding_publishers(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A flow-controlled sink that makes no progress is released; shedding is the last resort."""
        monkeypatch.setattr(_queue, "FLOW_STALL_TIMEOUT", 0.05)
        gate = _Gate()
        gate_sub: _subscription.Subscription | None = None
        async with EventBus(capacity=8) as bus:
            gate_sub = bus.subscribe(gate, StepCompleted, backpressure=True)
            with anyio.fail_after(10):
                for i in range(40):
                    await bus.publish(StepCompleted(step=i))
            assert gate_sub.statistics().shed > 0
            gate.open.set()
        assert gate_sub.statistics().shed + len(gate.got) == 40

    def test_backpressure_must_be_a_bool(self) -> None:
        """subscribe(backpressure=...) rejects anything but True, False or None."""

        async def main() -> None:
            async with EventBus() as bus:
                with pytest.raises(TypeError, match="backpressure must be"):
                    bus.subscribe(RecordingSink(), backpressure="yes")  # type: ignore[arg-type]

        anyio.run(main)


class TestBursts:
    async def test_incident_burst_into_a_full_queue_keeps_every_incident(self) -> None:
        """20,000 incidents into a blocked 16-slot queue: all kept in order, telemetry shed."""
        gate = _Gate()
        async with EventBus(capacity=16) as bus:
            sub = bus.subscribe(gate)
            for i in range(16):
                bus.publish_nowait(StepCompleted(step=-1 - i))
            for i in range(20_000):
                bus.publish_nowait(_incident(i))
                if i % 1000 == 0:
                    bus.publish_nowait(StepCompleted(step=100_000 + i))
            await anyio.lowlevel.checkpoint()
            gate.open.set()
        incidents = [e.step for e in gate.got if isinstance(e, SinkFailed)]
        assert incidents == list(range(20_000))
        telemetry = [e for e in gate.got if isinstance(e, StepCompleted)]
        assert sub.statistics().shed == 16 + 20 - len(telemetry)
        assert sub.statistics().shed >= 16

    async def test_dispatcher_yields_between_rounds_of_a_huge_burst(self) -> None:
        """A burst larger than a dispatch round is fanned out in rounds; other tasks run between."""
        seen: list[int] = []
        total = 3 * _dispatch.DISPATCH_ROUND
        async with EventBus() as bus:
            bus.subscribe(RecordingSink())

            async def observe() -> None:
                for _ in range(50):
                    seen.append(bus.statistics().dispatched)
                    await anyio.lowlevel.checkpoint()

            async with anyio.create_task_group() as tg:
                for i in range(total):
                    bus.publish_nowait(_incident(i))
                tg.start_soon(observe)
        assert any(0 < n < total for n in seen)

    async def test_incident_burst_then_close_reaches_the_log(self, tmp_path: Path) -> None:
        """A burst of 5,000 incidents published right before close is all in the log."""
        async with EventBus() as bus:
            bus.subscribe(RotatingFileSink(tmp_path))
            for i in range(5000):
                bus.publish_nowait(_incident(i))
        assert [e.step for e in read_events(tmp_path)] == list(range(5000))

    @pytest.mark.slow
    async def test_fifty_thousand_incidents_then_close(self, tmp_path: Path) -> None:
        """The issue's case: 50,000 incidents then close, every one in the log."""
        async with EventBus() as bus:
            bus.subscribe(RotatingFileSink(tmp_path))
            for i in range(50_000):
                bus.publish_nowait(_incident(i))
        assert sum(1 for _ in read_events(tmp_path)) == 50_000

    @pytest.mark.slow
    async def test_three_hundred_thousand_events_lossless(self, tmp_path: Path) -> None:
        """The issue's volume case: 300,000 `await publish` into the default file sink."""
        sink = RotatingFileSink(tmp_path)
        async with EventBus() as bus:
            sub = bus.subscribe(sink)
            for i in range(300_000):
                await bus.publish(StepCompleted(step=i, loss=0.25))
        assert sub.statistics().shed == 0 and sink.statistics().lines_written == 300_000


class TestCancellation:
    async def test_cancelled_scope_around_the_bus_loses_nothing(self, tmp_path: Path) -> None:
        """move_on_after around the bus: the close still drains every event into the log."""
        with anyio.fail_after(10):
            with anyio.move_on_after(0.05):
                async with EventBus() as bus:
                    bus.subscribe(RotatingFileSink(tmp_path))
                    for i in range(2000):
                        bus.publish_nowait(StepCompleted(step=i))
                    await anyio.sleep(30)
        assert [e.step for e in read_events(tmp_path)] == list(range(2000))

    async def test_cancelled_session_writes_session_ended(self, tmp_path: Path) -> None:
        """A Session cancelled from outside flushes and logs SessionEnded(reason='cancelled')."""
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        with anyio.fail_after(20):
            with anyio.move_on_after(0.5):
                async with Session(model, log_dir=tmp_path, system_interval=None) as session:
                    for step in range(50):
                        await session.step_completed(step, loss=0.5)
                    await anyio.sleep(60)
        events = list(read_events(tmp_path))
        assert [e.step for e in events if isinstance(e, StepCompleted)] == list(range(50))
        ended = [e for e in events if isinstance(e, SessionEnded)]
        assert [e.reason for e in ended] == ["cancelled"]


class _HangingClose:
    """A sink whose close never returns."""

    name = "hanging_close"

    async def handle_batch(self, events: Sequence[Event], /) -> None:
        pass

    async def aclose(self) -> None:
        await anyio.sleep_forever()


class _FailingClose:
    name = "failing_close"

    async def handle_batch(self, events: Sequence[Event], /) -> None:
        pass

    async def aclose(self) -> None:
        raise OSError("flush failed")


class _Blocking:
    """Blocks the event loop inside an async handler (the bug LoopStalled reports)."""

    name = "blocking"

    def __init__(self, seconds: float, awaiting: bool = False) -> None:
        self.seconds = seconds
        self.awaiting = awaiting

    async def handle(self, event: Event, /) -> None:
        if self.awaiting:
            await anyio.sleep(self.seconds)
        else:
            time.sleep(self.seconds)


class TestSinkHealth:
    async def test_hung_write_thread_is_abandoned_at_close(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A file sink stuck in write(2): close is bounded, the loss is reported as events."""
        monkeypatch.setattr(_subscription, "CLOSE_GRACE", 0.1)
        release = threading.Event()

        def hung_write(fd: int, data: bytes | bytearray) -> int:
            release.wait(30)
            return os.write(fd, data)

        recorder = RecordingSink()
        sink = RotatingFileSink(tmp_path, wake_interval=0)  # each batch written before it returns
        try:
            with anyio.fail_after(10):
                async with EventBus(close_timeout=0.2) as bus:
                    bus.subscribe(recorder)
                    bus.subscribe(sink)
                    monkeypatch.setattr(jw, "_write_some", hung_write)
                    for i in range(10):
                        bus.publish_nowait(StepCompleted(step=i))
            assert sink.thread_busy
        finally:
            release.set()
        (lost,) = recorder.of_type(EventsUndelivered)
        assert lost.sink == "rotating_file" and lost.undelivered == 10
        phases = {(e.phase, e.thread_abandoned) for e in recorder.of_type(SinkUnresponsive)}
        assert ("drain", True) in phases

    async def test_console_on_a_full_pipe_does_not_hang_the_close(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A console whose stream blocks forever (a full pipe): the close is still bounded."""
        monkeypatch.setattr(_subscription, "CLOSE_GRACE", 0.05)
        release = threading.Event()

        class _FullPipe(io.StringIO):
            def write(self, text: str) -> int:
                release.wait(30)
                return super().write(text)

            def flush(self) -> None:
                release.wait(30)

        recorder = RecordingSink()
        try:
            with anyio.fail_after(10):
                async with EventBus(close_timeout=0.2) as bus:
                    bus.subscribe(recorder)
                    bus.subscribe(ConsoleSink(_FullPipe()), name="console")
                    bus.publish_nowait(_incident(1))
        finally:
            release.set()
        assert [e.sink for e in recorder.of_type(SinkUnresponsive)][:1] == ["console"]

    async def test_hanging_close_is_bounded_and_reported(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A sink whose aclose hangs is abandoned; a SinkUnresponsive(phase='close') says so."""
        monkeypatch.setattr(_subscription, "CLOSE_GRACE", 0.05)
        recorder = RecordingSink()
        with anyio.fail_after(10):
            async with EventBus(close_timeout=0.1) as bus:
                bus.subscribe(recorder)
                bus.subscribe(_HangingClose())
        (report,) = recorder.of_type(SinkUnresponsive)
        assert report.sink == "hanging_close" and report.phase == "close"
        assert recorder.closed == 1

    async def test_failing_close_becomes_an_event(self) -> None:
        """A sink whose aclose raises is reported to the sinks closed after it."""
        recorder = RecordingSink()
        async with EventBus() as bus:
            bus.subscribe(recorder)
            bus.subscribe(_FailingClose())
        (report,) = recorder.of_type(SinkCloseFailed)
        assert report.sink == "failing_close" and "flush failed" in report.message

    async def test_sink_blocking_the_loop_is_reported(self) -> None:
        """Synchronous sleep in an async handler becomes a LoopStalled incident naming the sink."""
        recorder = RecordingSink()
        async with EventBus(stall_threshold=0.02) as bus:
            bus.subscribe(recorder, LoopStalled)
            bus.subscribe(_Blocking(0.05), StepCompleted)
            bus.publish_nowait(StepCompleted(step=1))
            await bus.drain()
        (stall,) = recorder.of_type(LoopStalled)
        assert stall.sink == "blocking" and stall.stall_s >= stall.threshold_s == 0.02

    async def test_awaiting_sink_is_not_a_stall(self) -> None:
        """A handler that awaits (does not hold the loop) is never reported."""
        recorder = RecordingSink()
        async with EventBus(stall_threshold=0.02) as bus:
            bus.subscribe(recorder, LoopStalled)
            bus.subscribe(_Blocking(0.05, awaiting=True), StepCompleted)
            bus.publish_nowait(StepCompleted(step=1))
            await bus.drain()
        assert recorder.of_type(LoopStalled) == []

    def test_stall_threshold_is_validated(self) -> None:
        """A non-positive stall_threshold is rejected with a message naming it."""
        with pytest.raises(ValueError, match="stall_threshold"):
            EventBus(stall_threshold=0)

    async def test_disk_full_through_the_bus_never_disables_the_log(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Twenty failing batches raise one SinkFailed; the log resumes and is never disabled."""
        failures = [20]

        def full(fd: int, data: bytes | bytearray) -> int:
            if failures[0] > 0:
                failures[0] -= 1
                raise OSError(28, "No space left on device")
            return os.write(fd, data)

        clock = [0.0]
        monkeypatch.setattr(jw, "_clock", lambda: clock[0])
        recorder = RecordingSink()
        sink = RotatingFileSink(tmp_path, wake_interval=0)  # each batch written before it returns
        async with EventBus() as bus:
            bus.subscribe(recorder, SinkFailed)
            sub = bus.subscribe(sink)
            monkeypatch.setattr(jw, "_write_some", full)
            for i in range(40):
                clock[0] += 10.0  # past every backoff: each batch retries
                bus.publish_nowait(StepCompleted(step=i))
                await bus.drain()
            assert not sub.statistics().disabled
        assert len(recorder.of_type(SinkFailed)) == 1
        assert [e.step for e in read_events(tmp_path) if isinstance(e, StepCompleted)] == list(
            range(40)
        )


_KILLED_WRITER = """
import sys, anyio
from eventbus_debug import EventBus
from eventbus_debug.events import StepCompleted
from eventbus_debug.sinks import RotatingFileSink

async def main():
    async with EventBus() as bus:
        bus.subscribe(RotatingFileSink(sys.argv[1], max_bytes=100_000, backup_count=50))
        print("ready", flush=True)
        step = 0
        while True:
            await bus.publish(StepCompleted(step=step, source="x" * (step % 700)))
            step += 1

anyio.run(main)
"""


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(5))
def test_kill_9_then_restart_leaves_a_readable_log(tmp_path: Path, seed: int) -> None:
    """SIGKILL at a random moment, twice (with a restart between): strict reading never fails."""
    rng = random.Random(seed)
    for _ in range(2):
        proc = subprocess.Popen(
            [sys.executable, "-c", _KILLED_WRITER, str(tmp_path)],
            stdout=subprocess.PIPE,
            cwd=Path(__file__).resolve().parents[2],
        )
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == b"ready"
        time.sleep(rng.uniform(0.05, 0.5))
        proc.kill()
        proc.wait()
        proc.stdout.close()
    stats = ReadStatistics()
    events = list(read_events(tmp_path, stats=stats))
    assert events and stats.invalid_lines == 0
