"""The prose claims of docs/bus.md, docs/logging.md, docs/reports.md, docs/cli.md and the
README's bus, log, report and CLI sections, one test per claim (the executed examples are
tested by tests/test_docs.py; these check what the text around them promises)."""

from __future__ import annotations

import dataclasses
import gzip
import io
import json
import logging
import math
import os
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import anyio
import numpy as np
import pytest

from eventbus_debug import (
    Delivery,
    Event,
    EventBus,
    Severity,
    SyncEventBus,
    decode_event,
    encode_event,
    event_type,
    read_events,
)
from eventbus_debug.cli import LogFollower, main
from eventbus_debug.events import (
    Anomaly,
    EventsDropped,
    GradientExploded,
    NonFiniteDetected,
    SessionEnded,
    SessionStarted,
    StepChecked,
    StepCompleted,
    TensorRole,
)
from eventbus_debug.exceptions import (
    ArgumentTypeError,
    BusClosedError,
    EventDecodeError,
    SubscriptionError,
)
from eventbus_debug.log import log_file_name
from eventbus_debug.log.files import ReadStatistics
from eventbus_debug.sinks import ConsoleSink, ReportWriter, RotatingFileSink, build_report
from eventbus_debug.sinks.report import RunAggregator, summarize, summarize_runs
from eventbus_debug.testing import RecordingSink

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

EXE = Path(sys.executable).with_name("eventbus-debug")


async def _noop(event: Event) -> None:
    return None


def _write_log(directory: Path, events: Sequence[Event], name: str = "events.jsonl") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_bytes(b"".join(encode_event(e) for e in events))
    return path


def _sample_run(directory: Path) -> Path:
    events: list[Event] = [StepCompleted(step=i, loss=1.0) for i in range(30)]
    events.append(GradientExploded(step=12, total_norm=250.0, threshold=10.0))
    events.append(SessionEnded(name="x", steps=30))
    return _write_log(directory, events)


# -- docs/bus.md: events ------------------------------------------------------------------------


def test_event_type_refuses_a_non_event_class_and_a_missing_kind_with_type_error() -> None:
    class NotAnEvent:
        kind: ClassVar[str] = "claims.not_an_event"

    with pytest.raises(TypeError):
        event_type(NotAnEvent)  # type: ignore[type-var]

    class NoKind(Event):
        pass

    with pytest.raises(TypeError):
        event_type(NoKind)


def test_event_type_refuses_a_kind_already_in_use_with_value_error() -> None:
    class Duplicate(Event):
        kind: ClassVar[str] = StepCompleted.kind

    with pytest.raises(ValueError, match="step_completed"):
        event_type(Duplicate)


@event_type
class _BatchSkipped(Event):
    kind: ClassVar[str] = "claims_bus_log.batch_skipped"
    delivery: ClassVar[Delivery] = Delivery.INCIDENT
    severity: Severity = Severity.WARNING
    batch_index: int
    reason: str = ""


def test_event_constructor_checks_a_field_type_with_the_documented_message() -> None:
    with pytest.raises(TypeError) as info:
        _BatchSkipped(batch_index="7")  # type: ignore[arg-type]
    assert str(info.value) == "_BatchSkipped.batch_index must be an int, got str '7'"


def test_event_seq_is_minus_one_before_dispatch_and_stamped_in_publish_order() -> None:
    async def run() -> list[int]:
        recorder = RecordingSink()
        event = StepCompleted(step=1)
        assert event.seq == -1
        async with EventBus() as bus:
            bus.subscribe(recorder, StepCompleted)
            bus.publish_nowait(event)
            for step in range(2, 5):
                bus.publish_nowait(StepCompleted(step=step))
            await bus.drain()
        return [e.seq for e in recorder.events]

    seqs = anyio.run(run)
    assert seqs == sorted(seqs) and len(set(seqs)) == 4 and min(seqs) >= 0


def test_an_int_beyond_64_bits_passes_the_constructor_and_is_counted_in_encode_errors(
    tmp_path: Path,
) -> None:
    sink = RotatingFileSink(tmp_path)

    async def run() -> None:
        async with EventBus() as bus:
            bus.subscribe(sink)
            bus.publish_nowait(_BatchSkipped(batch_index=2**70))
            bus.publish_nowait(_BatchSkipped(batch_index=3))

    anyio.run(run)
    assert sink.statistics().encode_errors == 1
    assert [e.batch_index for e in read_events(tmp_path) if isinstance(e, _BatchSkipped)] == [3]


# -- docs/bus.md: subscribe -----------------------------------------------------------------------


async def test_subscribe_refuses_bad_arguments_with_subscription_error_a_type_error() -> None:
    class Sink:
        async def handle(self, event: Event) -> None:
            return None

    async with EventBus() as bus:
        bus.subscribe(_noop, name="taken")
        cases: list[tuple[Any, dict[str, Any], str]] = [
            (42, {}, "42"),
            (lambda e: None, {}, "async"),
            (Sink, {}, "class"),
            (_noop, {"capacity": 0}, "capacity"),
            (_noop, {"name": "taken"}, "taken"),
        ]
        for sink, options, word in cases:
            with pytest.raises(SubscriptionError, match=word):
                bus.subscribe(sink, **options)
        with pytest.raises(SubscriptionError, match="event_types"):
            bus.subscribe(_noop, int)  # type: ignore[arg-type]
        assert issubclass(SubscriptionError, TypeError)


async def test_subscription_names_are_derived_from_the_sink_with_numbered_duplicates() -> None:
    class LossTracker:
        async def handle(self, event: Event) -> None:
            return None

    class Named:
        name = "my-name"

        async def handle(self, event: Event) -> None:
            return None

    async def hangs(event: Event) -> None:
        return None

    async with EventBus() as bus:
        tracker = LossTracker()
        names = [
            bus.subscribe(hangs).name,
            bus.subscribe(hangs).name,
            bus.subscribe(hangs).name,
            bus.subscribe(tracker.handle).name,
            bus.subscribe(LossTracker()).name,
            bus.subscribe(Named()).name,
        ]
    assert names == ["hangs", "hangs-2", "hangs-3", "LossTracker.handle", "LossTracker", "my-name"]


async def test_cancel_discards_what_was_queued_and_does_not_close_the_sink() -> None:
    release = anyio.Event()
    closed: list[bool] = []

    class Slow:
        async def handle(self, event: Event) -> None:
            await release.wait()

        async def aclose(self) -> None:
            closed.append(True)

    async with EventBus() as bus:
        sub = bus.subscribe(Slow(), StepCompleted)
        for step in range(5):
            bus.publish_nowait(StepCompleted(step=step))
        with anyio.fail_after(5):
            while sub.pending < 5:
                await anyio.sleep(0.01)
        sub.cancel()
        with anyio.fail_after(5):
            while sub.statistics().discarded < 5:
                await anyio.sleep(0.01)
        assert sub.statistics().discarded == 5 and sub.statistics().delivered == 0
    assert closed == []


async def test_default_capacity_is_1024_or_the_sinks_queue_capacity() -> None:
    class Big:
        queue_capacity = 77

        async def handle(self, event: Event) -> None:
            return None

    async with EventBus() as bus:
        assert bus.subscribe(_noop).statistics().capacity == 1024
        assert bus.subscribe(Big()).statistics().capacity == 77
        assert bus.subscribe(Big(), capacity=5).statistics().capacity == 5


# -- docs/bus.md: delivery guarantees ----------------------------------------------------------


async def test_overflow_sheds_oldest_telemetry_keeps_incidents_and_reports_events_dropped() -> None:
    release = anyio.Event()
    started = anyio.Event()
    seen: list[Event] = []

    async def slow(event: Event) -> None:
        started.set()
        await release.wait()
        seen.append(event)

    recorder = RecordingSink()
    async with EventBus() as bus:
        bus.subscribe(recorder, EventsDropped)
        sub = bus.subscribe(slow, StepCompleted, GradientExploded, capacity=4)
        bus.publish_nowait(StepCompleted(step=0))
        with anyio.fail_after(5):
            await started.wait()  # step 0 is in the sink's hands
        for step in range(1, 11):
            bus.publish_nowait(StepCompleted(step=step))
        for step in range(6):  # more incidents than the queue's bound
            bus.publish_nowait(GradientExploded(step=step, total_norm=1.0, threshold=0.5))
        with anyio.fail_after(5):
            while sub.statistics().shed == 0:
                await anyio.sleep(0.01)
        release.set()
        with anyio.fail_after(10):
            await bus.drain()
        shed = sub.statistics().shed
        assert bus.statistics().shed >= shed > 0
    incidents = [e for e in seen if isinstance(e, GradientExploded)]
    assert len(incidents) == 6  # every incident, even beyond the bound
    steps = [e.step for e in seen if isinstance(e, StepCompleted)]
    assert steps[0] == 0 and steps[1:] == list(range(11 - len(steps[1:]), 11))  # oldest went
    assert shed == 10 - len(steps[1:])
    assert sum(e.dropped for e in recorder.of_type(EventsDropped) if e.sink == "slow") == shed


async def test_a_failing_sink_gives_sink_failed_and_is_disabled_after_max_consecutive_failures() -> (
    None
):
    async def flaky(event: Event) -> None:
        raise ValueError("disk on fire")

    recorder = RecordingSink()
    async with EventBus() as bus:
        assert bus.statistics() is not None
        bus.subscribe(recorder)
        sub = bus.subscribe(flaky, StepCompleted)
        for step in range(8):
            bus.publish_nowait(StepCompleted(step=step))
        with anyio.fail_after(5):
            await bus.drain()
    assert len(recorder.of_type(_failed())) == 5  # the default max_consecutive_failures
    assert len(recorder.of_type(_disabled())) == 1
    assert sub.statistics().disabled


def _failed() -> type[Event]:
    from eventbus_debug.events import SinkFailed

    return SinkFailed


def _disabled() -> type[Event]:
    from eventbus_debug.events import SinkDisabled

    return SinkDisabled


async def test_drain_with_subscriptions_refuses_other_things_and_another_bus_subscription() -> None:
    async with EventBus() as bus, EventBus() as other:
        theirs = other.subscribe(_noop)
        with pytest.raises(TypeError):
            await bus.drain("x")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="another bus"):
            await bus.drain(theirs)


@pytest.mark.parametrize("timeout", [math.nan, -1.0, math.inf, "1"])
async def test_drain_refuses_a_nan_negative_infinite_or_non_number_timeout_naming_it(
    timeout: Any,
) -> None:
    async with EventBus() as bus:
        with pytest.raises(ValueError, match="timeout"):
            await bus.drain(timeout=timeout)


async def test_drain_timeout_raises_timeout_error_naming_the_busy_sink() -> None:
    busy = anyio.Event()

    async def stuck(event: Event) -> None:
        busy.set()
        await anyio.sleep(30)

    async with EventBus(close_timeout=0.2) as bus:
        bus.subscribe(stuck)
        bus.publish_nowait(StepCompleted(step=1))
        with anyio.fail_after(5):
            await busy.wait()  # in the sink (a drain before the dispatch names no sink yet)
        with pytest.raises(TimeoutError, match="stuck"):
            await bus.drain(timeout=0)


async def test_publishing_before_start_and_after_close_raises_bus_closed_error() -> None:
    bus = EventBus()
    with pytest.raises(BusClosedError):
        bus.publish_nowait(StepCompleted(step=1))
    async with bus:
        with pytest.raises(TypeError):
            bus.publish_nowait("x")  # type: ignore[arg-type]
    with pytest.raises(BusClosedError):
        bus.publish_nowait(StepCompleted(step=1))
    with pytest.raises(BusClosedError):
        await bus.publish(StepCompleted(step=1))
    await bus.aclose()  # idempotent


async def test_close_abandons_a_hung_sink_and_reports_events_undelivered() -> None:
    async def hangs(event: Event) -> None:
        await anyio.sleep_forever()

    recorder = RecordingSink()
    with anyio.fail_after(10):
        async with EventBus(close_timeout=0.2) as bus:
            bus.subscribe(recorder)
            sub = bus.subscribe(hangs, StepCompleted)
            for step in range(3):
                bus.publish_nowait(StepCompleted(step=step))
    from eventbus_debug.events import EventsUndelivered, SinkUnresponsive

    (undelivered,) = recorder.of_type(EventsUndelivered)
    assert undelivered.sink == "hangs" and undelivered.undelivered == 3
    assert sub.statistics().undelivered == 3
    assert any(e.phase == "drain" for e in recorder.of_type(SinkUnresponsive))


async def test_the_block_exception_leaves_unwrapped() -> None:
    with pytest.raises(ValueError, match="mine"):
        async with EventBus() as bus:
            bus.subscribe(_noop)
            raise ValueError("mine")


async def test_statistics_fields_and_has_undispatched_and_pending() -> None:
    async with EventBus() as bus:
        sub = bus.subscribe(_noop)
        assert bus.has_undispatched(Anomaly) is False
        bus.publish_nowait(GradientExploded(step=1, total_norm=1.0, threshold=0.5))
        assert bus.has_undispatched(Anomaly) is True
        await bus.drain()
        assert bus.has_undispatched(Anomaly) is False
        assert isinstance(sub.pending, int) and sub.pending == 0
        stats = bus.statistics()
        for field in ("published", "dispatched", "pending", "closed", "shed", "subscriptions"):
            assert hasattr(stats, field)
        (one,) = stats.subscriptions
        fields = ("name", "capacity", "queued", "delivered", "failed", "shed", "discarded")
        for field in (*fields, "undelivered", "disabled"):
            assert hasattr(one, field)
        assert stats.published == 1 and one.delivered == 1


# -- docs/bus.md: SyncEventBus ------------------------------------------------------------------


def test_sync_bus_methods_before_with_raise_bus_closed_error_naming_the_with_block() -> None:
    bus = SyncEventBus()
    calls = [
        lambda: bus.publish(StepCompleted(step=1)),
        lambda: bus.publish_nowait(StepCompleted(step=1)),
        lambda: bus.publish_many([StepCompleted(step=1)]),
        lambda: bus.publish_many_nowait([StepCompleted(step=1)]),
        lambda: bus.subscribe(_noop),
        bus.flush,
        bus.drain,
    ]
    for call in calls:
        with pytest.raises(BusClosedError, match=r"with SyncEventBus\(\) as bus:"):
            call()


def test_sync_bus_drain_from_its_own_sink_is_a_runtime_error_and_flush_does_not_wait() -> None:
    out: dict[str, Any] = {}
    with SyncEventBus() as bus:

        async def sink(event: Event) -> None:
            try:
                bus.drain()
            except RuntimeError as exc:
                out["drain"] = exc
            bus.flush()
            out["flushed"] = True

        bus.subscribe(sink, StepCompleted)
        bus.publish(StepCompleted(step=1))
        bus.flush()
        bus.drain(timeout=5)
    assert isinstance(out["drain"], RuntimeError) and out["flushed"]


def test_sync_bus_drain_timeout_gives_up_naming_what_holds_the_loop() -> None:
    gate = threading.Event()
    with SyncEventBus(close_timeout=2) as bus:

        async def blocker(event: Event) -> None:
            gate.wait(5)  # a synchronous call holding the bus's event loop

        bus.subscribe(blocker, StepCompleted)
        bus.publish(StepCompleted(step=1))
        bus.flush()
        try:
            with pytest.raises(TimeoutError, match="blocker"):
                bus.drain(timeout=0.1)
        finally:
            gate.set()


def test_sync_bus_refuses_publishing_after_close() -> None:
    with SyncEventBus() as bus:
        bus.subscribe(_noop)
    with pytest.raises(BusClosedError):
        bus.publish(StepCompleted(step=1))


def test_sync_bus_never_wraps_the_with_block_exception() -> None:
    with pytest.raises(KeyError), SyncEventBus() as bus:
        bus.subscribe(_noop)
        raise KeyError("mine")


# -- docs/bus.md: threads -----------------------------------------------------------------------


async def test_subscribe_from_another_thread_raises_runtime_error_before_changing_anything() -> (
    None
):
    async with EventBus() as bus:
        with pytest.raises(RuntimeError):
            await anyio.to_thread.run_sync(lambda: bus.subscribe(_noop))
        assert bus.statistics().subscriptions == ()


async def test_publish_nowait_from_another_thread_hands_the_event_over_and_warns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    recorder = RecordingSink()
    async with EventBus() as bus:
        bus.subscribe(recorder)
        with caplog.at_level(logging.WARNING, logger="eventbus_debug"):
            await anyio.to_thread.run_sync(lambda: bus.publish_nowait(StepCompleted(step=7)))
            await anyio.to_thread.run_sync(lambda: bus.publish_nowait(StepCompleted(step=8)))
        with anyio.fail_after(5):
            await bus.drain()
    assert [e.step for e in recorder.events] == [7, 8]
    warnings = [r for r in caplog.records if "publish_nowait_from_thread" in r.getMessage()]
    assert len(warnings) == 1


# -- docs/bus.md: encoding and reading -----------------------------------------------------------


def test_nan_and_infinities_are_written_as_strings_and_read_back() -> None:
    line = encode_event(StepCompleted(step=1, loss=math.nan, learning_rate=-math.inf))
    assert b'"NaN"' in line and b'"-Infinity"' in line
    back = decode_event(line)
    assert isinstance(back, StepCompleted) and back.loss is not None and math.isnan(back.loss)
    assert back.learning_rate == -math.inf


def test_a_torn_line_is_skipped_and_a_bad_line_names_file_line_and_field(tmp_path: Path) -> None:
    good = encode_event(StepCompleted(step=4, loss=0.5))
    bad = good.replace(b'"step":4', b'"step":"abc"')
    (tmp_path / "events.jsonl").write_bytes(good[:20] + b"\n" + good + bad)
    with pytest.raises(EventDecodeError) as info:
        list(read_events(tmp_path))
    assert isinstance(info.value, ValueError)
    assert "events.jsonl:3" in str(info.value) and "'step'" in str(info.value)
    stats = ReadStatistics()
    assert [e.step for e in read_events(tmp_path, strict=False, stats=stats)] == [4]
    assert (stats.torn_lines, stats.invalid_lines) == (1, 1)


def test_decode_event_names_an_unknown_kind_and_a_missing_field() -> None:
    with pytest.raises(EventDecodeError, match="unknown event kind"):
        decode_event(b'{"kind":"nobody.knows"}\n')
    with pytest.raises(EventDecodeError, match="batch_index"):
        decode_event(b'{"kind":"claims_bus_log.batch_skipped"}\n')
    with pytest.raises(EventDecodeError):
        decode_event(b"not json\n")


def test_read_events_merges_ranks_by_time_and_reads_rotated_gzipped_files(tmp_path: Path) -> None:
    t0 = 1_700_000_000_000_000_000
    _write_log(tmp_path, [StepCompleted(step=s, rank=0, time_ns=t0 + 10 * s) for s in (2, 3)])
    (tmp_path / "events.jsonl.1.gz").write_bytes(
        gzip.compress(
            b"".join(encode_event(StepCompleted(step=s, time_ns=t0 + 10 * s)) for s in (0, 1))
        )
    )
    _write_log(
        tmp_path,
        [StepCompleted(step=s, rank=1, time_ns=t0 + 10 * s + 5) for s in range(4)],
        log_file_name(1),
    )
    got = [(e.step, e.rank) for e in read_events(tmp_path)]
    assert got == [(s, r) for s in range(4) for r in (0, 1)]


# -- docs/logging.md ------------------------------------------------------------------------------


def test_rotating_file_sink_defaults_match_the_reference() -> None:
    import inspect

    params = inspect.signature(RotatingFileSink).parameters
    defaults = {name: p.default for name, p in params.items() if name != "directory"}
    assert defaults == {
        "max_bytes": 100 * 1024 * 1024,
        "backup_count": 5,
        "compress": False,
        "flush_interval": 0.0,
        "fsync": False,
        "rank": None,
        "namer": None,
        "rotator": None,
        "buffer_size": 256 * 1024,
        "name": "rotating_file",
        "queue_capacity": 32768,
        "max_pending_bytes": 64 * 1024 * 1024,
        "wake_interval": 0.2,
        "high_water": 16384,
    }


def test_rotating_file_sink_asks_for_backpressure_and_its_queue_capacity(tmp_path: Path) -> None:
    async def run() -> int:
        async with EventBus() as bus:
            return bus.subscribe(RotatingFileSink(tmp_path)).statistics().capacity

    sink = RotatingFileSink(tmp_path)
    assert sink.backpressure is True
    assert anyio.run(run) == 32768


def test_rotation_names_newest_dot_one_and_deletes_beyond_backup_count(tmp_path: Path) -> None:
    sink = RotatingFileSink(tmp_path, max_bytes=400, backup_count=2, rank=3)

    async def run() -> None:
        async with EventBus() as bus:
            bus.subscribe(sink)
            for step in range(20):
                await bus.publish(StepCompleted(step=step, loss=1.0))

    anyio.run(run)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["events.rank3.jsonl", "events.rank3.jsonl.1", "events.rank3.jsonl.2"]
    for path in tmp_path.iterdir():
        assert path.stat().st_size <= 400
    newest = [e.step or 0 for e in read_events(tmp_path / "events.rank3.jsonl.1")]
    oldest = [e.step or 0 for e in read_events(tmp_path / "events.rank3.jsonl.2")]
    assert max(oldest) < min(newest)
    steps = [e.step or 0 for e in read_events(tmp_path)]
    assert steps == sorted(steps) and steps[-1] == 19
    assert sink.statistics().rotations >= 3


def test_compress_writes_gzipped_backups_read_back_by_read_events(tmp_path: Path) -> None:
    sink = RotatingFileSink(tmp_path, max_bytes=400, backup_count=50, compress=True)

    async def run() -> None:
        async with EventBus() as bus:
            bus.subscribe(sink)
            for step in range(10):
                await bus.publish(StepCompleted(step=step, loss=1.0))

    anyio.run(run)
    assert (tmp_path / "events.jsonl.1.gz").exists()
    assert [e.step for e in read_events(tmp_path)] == list(range(10))


def test_rotating_file_sink_checks_its_arguments_at_construction(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="backup_count"):
        RotatingFileSink(tmp_path, backup_count=0)
    RotatingFileSink(tmp_path, max_bytes=0, backup_count=0)  # never rotates: allowed
    with pytest.raises(ArgumentTypeError, match="namer"):
        RotatingFileSink(tmp_path, namer=1)  # type: ignore[arg-type]
    with pytest.raises(ArgumentTypeError, match="rotator"):
        RotatingFileSink(tmp_path, rotator="x")  # type: ignore[arg-type]


def test_an_unwritable_directory_is_a_log_directory_error_naming_path_and_remedy(
    tmp_path: Path,
) -> None:
    from eventbus_debug.sinks import LogDirectoryError

    (tmp_path / "f").write_text("x")
    with pytest.raises(LogDirectoryError) as info:
        RotatingFileSink(tmp_path / "f" / "logs")
    assert isinstance(info.value, OSError) and info.value.errno is not None
    text = str(info.value)
    assert "cannot write the event log in directory" in text and "f/logs" in text
    assert "pass a directory you can write to" in text


def test_file_sink_statistics_fields_and_path_is_a_str(tmp_path: Path) -> None:
    sink = RotatingFileSink(tmp_path)
    stats = sink.statistics()
    for field in (
        "lines_written",
        "bytes_written",
        "lines_pending",
        "lines_lost",
        "rotations",
        "write_errors",
        "encode_errors",
        "current_size",
        "failing",
    ):
        assert hasattr(stats, field)
    assert isinstance(stats.path, str) and stats.path.endswith("events.jsonl")
    assert isinstance(sink.thread_busy, bool)


def test_restart_removes_a_partial_last_line_but_keeps_an_event_missing_its_newline(
    tmp_path: Path,
) -> None:
    good = encode_event(StepCompleted(step=1, loss=1.0))

    async def append() -> None:
        async with EventBus() as bus:
            bus.subscribe(RotatingFileSink(tmp_path))
            bus.publish_nowait(StepCompleted(step=2))

    (tmp_path / "events.jsonl").write_bytes(good + good[:30])
    anyio.run(append)
    assert [e.step for e in read_events(tmp_path)] == [1, 2]
    (tmp_path / "events.jsonl").write_bytes(good + good[:-1])
    anyio.run(append)
    assert [e.step for e in read_events(tmp_path)] == [1, 1, 2]


def test_aclose_is_idempotent_and_handle_batch_after_close_is_a_runtime_error(
    tmp_path: Path,
) -> None:
    async def run() -> None:
        sink = RotatingFileSink(tmp_path)
        await sink.aclose()
        await sink.aclose()
        with pytest.raises(RuntimeError):
            await sink.handle_batch([StepCompleted(step=1)])

    anyio.run(run)


def test_console_sink_shows_incidents_only_by_default_and_never_closes_the_stream() -> None:
    class Stream(io.StringIO):
        closes = 0

        def close(self) -> None:
            self.closes += 1

    stream = Stream()

    async def run() -> None:
        async with EventBus() as bus:
            bus.subscribe(ConsoleSink(stream))
            bus.publish_nowait(StepCompleted(step=1, loss=1.0))
            bus.publish_nowait(GradientExploded(step=1, total_norm=250.0, threshold=10.0))

    anyio.run(run)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1 and "gradient_exploded" in lines[0] and "WARNING" in lines[0]
    assert stream.closes == 0


def test_console_sink_default_stream_is_sys_stderr_at_the_time_of_writing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sink = ConsoleSink()
    late = io.StringIO()
    monkeypatch.setattr(sys, "stderr", late)

    async def run() -> None:
        async with EventBus() as bus:
            bus.subscribe(sink)
            bus.publish_nowait(GradientExploded(step=3, total_norm=250.0, threshold=10.0))

    anyio.run(run)
    assert "gradient_exploded" in late.getvalue()


def test_console_sink_refuses_bad_arguments_naming_them() -> None:
    with pytest.raises(ArgumentTypeError, match="stream"):
        ConsoleSink("not a stream")  # type: ignore[arg-type]
    with pytest.raises(ArgumentTypeError, match="colors"):
        ConsoleSink(colors="yes")  # type: ignore[arg-type]
    with pytest.raises(ArgumentTypeError, match="min_severity"):
        ConsoleSink(min_severity="warning")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="step_every"):
        ConsoleSink(step_every=0)


def test_console_sink_formats_floats_to_four_significant_digits_and_spells_nan() -> None:
    from eventbus_debug.sinks.lines import format_event

    line = format_event(StepCompleted(step=10, loss=1.0 / 11), colors=False)
    assert "step=10" in line and "loss=0.09091" in line and "step_completed" in line
    assert "loss=nan" in format_event(StepCompleted(step=1, loss=math.nan), colors=False)


def test_the_package_logger_carries_only_a_null_handler() -> None:
    handlers = logging.getLogger("eventbus_debug").handlers
    assert [type(h) for h in handlers] == [logging.NullHandler]


def test_a_failing_log_handler_never_raises_into_training() -> None:
    from eventbus_debug.diagnostics import get_logger

    class Boom(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            raise OSError("closed pipe")

    package = logging.getLogger("eventbus_debug")
    handler = Boom()
    package.addHandler(handler)
    try:
        get_logger("eventbus_debug.claims").error("sink_slow", sink="console")
    finally:
        package.removeHandler(handler)


# -- docs/reports.md ------------------------------------------------------------------------------


def test_report_files_are_0644_and_json_has_the_documented_format(tmp_path: Path) -> None:
    report = ReportWriter(tmp_path, interval=None)

    async def run() -> None:
        async with EventBus() as bus:
            bus.subscribe(report)
            bus.publish_nowait(StepCompleted(step=1))

    anyio.run(run)
    for name in ("report.json", "report.html"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o644
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["format"] == "eventbus-debug.report/1"
    assert {"generated_ns", "title", "summary"} <= set(data)


def test_report_writer_refuses_bad_bounds_naming_them(tmp_path: Path) -> None:
    with pytest.raises(ArgumentTypeError, match="interval"):
        ReportWriter(tmp_path, interval="30")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="interval"):
        ReportWriter(tmp_path, interval=0)
    with pytest.raises(ArgumentTypeError, match="max_incidents"):
        ReportWriter(tmp_path, max_incidents=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_points"):
        ReportWriter(tmp_path, max_points=1)


def test_report_bounds_have_the_documented_defaults() -> None:
    import inspect

    params = inspect.signature(RunAggregator).parameters
    assert params["max_points"].default == 1000 and params["max_incidents"].default == 500
    assert params["max_layers"].default == 64 and params["layer_points"].default == 48


def test_steps_count_step_completed_else_step_checked() -> None:
    assert summarize([StepChecked(step=i) for i in range(5)]).steps == 5
    mixed = [StepChecked(step=i) for i in range(5)] + [StepCompleted(step=i) for i in range(3)]
    assert summarize(mixed).steps == 3


def test_merged_ranks_nan_loss_on_one_rank_and_nan_grads_on_both_are_two_rows() -> None:
    t0 = 1_700_000_000_000_000_000
    events: list[Event] = []
    for rank in (0, 1):
        for step in range(120):
            t = t0 + step * 1000 + rank
            if step == 100:
                if rank == 1:
                    events.append(
                        NonFiniteDetected(
                            step=step, rank=rank, time_ns=t, role=TensorRole.LOSS, names=("loss",)
                        )
                    )
                events.append(
                    NonFiniteDetected(
                        step=step, rank=rank, time_ns=t, role=TensorRole.GRADIENT, names=("w",)
                    )
                )
            if step == 110:
                events.append(
                    EventsDropped(
                        step=step,
                        rank=rank,
                        time_ns=t,
                        sink="console",
                        dropped=5,
                        total_dropped=5,
                        by_kind={"step_completed": 5},
                    )
                )
            events.append(StepCompleted(step=step, rank=rank, time_ns=t + 1, samples_per_s=10.0))
    events.sort(key=lambda e: e.time_ns)
    s = summarize(events)
    rows = sorted(r.ranks for r in s.incidents if r.kind == "non_finite_detected")
    assert rows == [(0, 1), (1,)]
    assert s.non_finite == 2 and s.steps == 120 and s.steps_by_rank == {0: 120, 1: 120}
    assert s.samples_per_s[0].mean == 20.0  # summed over the ranks
    assert s.sinks.dropped == {"console": 10}  # what each rank shed adds up


def test_an_unknown_run_id_is_a_value_error_naming_the_runs() -> None:
    events: list[Event] = [
        SessionStarted(name="train", run_id="monday", time_ns=1),
        StepCompleted(step=1, time_ns=2),
    ]
    with pytest.raises(ValueError, match="monday"):
        summarize_runs(events, run="tuesday")


def test_ranks_starting_sessions_of_one_name_within_60_s_are_one_run() -> None:
    t0 = 1_700_000_000_000_000_000
    events: list[Event] = [
        SessionStarted(name="train", rank=0, time_ns=t0),
        SessionStarted(name="train", rank=1, time_ns=t0 + 10**9),
        StepCompleted(step=1, rank=0, time_ns=t0 + 2 * 10**9),
        StepCompleted(step=1, rank=1, time_ns=t0 + 2 * 10**9),
    ]
    (run,) = summarize_runs(events).runs
    assert run.ranks == (0, 1)


def test_build_report_shows_the_latest_run_by_default(tmp_path: Path) -> None:
    events: list[Event] = []
    for run_id, steps, t0 in (("monday", 5, 1), ("tuesday", 3, 10**15)):
        events.append(SessionStarted(name="train", run_id=run_id, time_ns=t0))
        events += [StepCompleted(step=s, time_ns=t0 + s + 1) for s in range(steps)]
    _write_log(tmp_path / "log", events)
    latest, _ = build_report(tmp_path / "log", tmp_path / "out")
    assert latest.run_id == "tuesday" and latest.steps == 3
    everything, _ = build_report(tmp_path / "log", tmp_path / "all", run="all")
    assert everything.steps == 8 and everything.mixed_runs


# -- docs/cli.md ----------------------------------------------------------------------------------


def test_cli_version_prints_the_installed_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("eventbus-debug ")


def test_cli_missing_directory_or_no_log_is_exit_1_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "empty").mkdir()
    for command in ("summary", "tail", "report"):
        for where in ("nope", "empty"):
            assert main([command, str(tmp_path / where)]) == 1
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and "Traceback" not in err


def test_cli_corrupt_gzip_backup_is_exit_1(tmp_path: Path) -> None:
    _write_log(tmp_path, [StepCompleted(step=1)])
    (tmp_path / "events.jsonl.1.gz").write_bytes(b"not gzip")
    assert main(["summary", str(tmp_path)]) == 1
    assert main(["tail", str(tmp_path)]) == 1


def test_cli_unknown_kind_without_import_is_exit_1_naming_file_line_and_import(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = encode_event(StepCompleted(step=1))
    (tmp_path / "events.jsonl").write_bytes(good + b'{"kind":"myproject.zz","seq":1}\n' + good)
    for command in ("summary", "tail", "report"):
        assert main([command, str(tmp_path)]) == 1
        err = capsys.readouterr().err
        assert "events.jsonl:2" in err and "myproject.zz" in err and "--import" in err


def test_cli_skip_bad_lines_goes_on_and_logs_undecodable_log_line_on_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = encode_event(StepCompleted(step=1))
    (tmp_path / "events.jsonl").write_bytes(good + b'{"kind":"myproject.zz","seq":1}\n' + good)
    assert main(["summary", str(tmp_path), "--skip-bad-lines", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["events"] == 2
    assert "undecodable_log_line" in captured.err


def test_cli_import_makes_your_own_kinds_readable_and_a_bad_module_is_exit_2(
    tmp_path: Path,
) -> None:
    (tmp_path / "claims_mod_kinds.py").write_text(
        "from typing import ClassVar\n"
        "from eventbus_debug import Event, event_type\n"
        "@event_type\n"
        "class Mine(Event):\n"
        "    kind: ClassVar[str] = 'claims_mod.mine'\n"
        "    value: int = 0\n"
    )
    line = b'{"kind":"claims_mod.mine","seq":0,"time_ns":1,"step":1,"rank":0,"source":"",'
    line += b'"severity":"warning","value":3}\n'
    (tmp_path / "log").mkdir()
    (tmp_path / "log" / "events.jsonl").write_bytes(line)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def run(*args: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            [str(EXE), *args], cwd=tmp_path, env=env, capture_output=True, timeout=60, check=False
        )

    # the current directory is on the import path, as for `python -m`
    done = run("tail", "log", "--import", "claims_mod_kinds", "--kind", "claims_mod.mine")
    assert done.returncode == 0 and b"claims_mod.mine" in done.stdout
    assert run("summary", "log").returncode == 1  # without --import
    assert run("summary", "log", "--import", "no_such_module_xyz").returncode == 2


def test_cli_unknown_kind_and_unknown_run_are_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _sample_run(tmp_path)
    assert main(["tail", str(tmp_path), "--kind", "nope"]) == 2
    assert "gradient_exploded" in capsys.readouterr().err  # lists the valid kinds
    assert main(["summary", str(tmp_path), "--run", "nope"]) == 2


@pytest.mark.parametrize(
    "bad",
    [
        ["--poll-interval", "nan"],
        ["--poll-interval", "-1"],
        ["--timeout", "-1"],
        ["--timeout", "nan"],
    ],
)
def test_cli_tail_bad_poll_interval_or_timeout_is_exit_2_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], bad: list[str]
) -> None:
    _sample_run(tmp_path)
    assert main(["tail", str(tmp_path), "-f", *bad]) == 2
    err = capsys.readouterr()
    assert bad[0] in err.err and err.out == ""


def test_cli_demo_bad_steps_is_exit_2_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", "--log-dir", str(tmp_path), "--steps", "0"]) == 2
    assert "--steps" in capsys.readouterr().err


def test_cli_tail_prints_the_last_20_by_default_and_json_lines_as_in_the_log(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _sample_run(tmp_path)
    assert main(["tail", str(tmp_path)]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 20
    assert main(["tail", str(tmp_path), "--all"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 32
    assert main(["tail", str(tmp_path), "--json", "-n", "2"]) == 0
    assert capsys.readouterr().out.encode() == b"".join(path.read_bytes().splitlines(True)[-2:])


def test_cli_tail_follow_exits_on_session_end_and_waits_for_a_missing_directory(
    tmp_path: Path,
) -> None:
    _sample_run(tmp_path / "run")
    args = ["tail", str(tmp_path / "run"), "-f", "--exit-on-end", "--timeout", "30"]
    assert main(args) == 0  # returns at the session_ended event, long before the timeout
    assert main(["tail", str(tmp_path / "later"), "-f", "--timeout", "0.3"]) == 0


def test_cli_summary_names_the_latest_run_and_the_others(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    events: list[Event] = []
    for run_id, steps, t0 in (("monday", 30, 1), ("tuesday", 12, 10**15)):
        events.append(SessionStarted(name="train", run_id=run_id, time_ns=t0))
        events += [StepCompleted(step=s, loss=1.0, time_ns=t0 + s + 1) for s in range(steps)]
    _write_log(tmp_path, events)
    assert main(["summary", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["run", "tuesday", "(the", "latest),", "1", "of", "2"]
    assert lines[1].startswith("other runs") and "monday (31 events)" in lines[1]
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "tuesday (the latest)" in out and "monday (31 events)" in out


def test_cli_summary_of_one_run_shows_its_id_in_a_run_row_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    events: list[Event] = [SessionStarted(name="train", run_id="only", time_ns=1)]
    events += [StepCompleted(step=s, time_ns=s + 2) for s in range(3)]
    _write_log(tmp_path, events)
    assert main(["summary", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["run", "only"]
    assert not any(line.startswith("other runs") for line in lines)


def test_cli_report_writes_both_files_and_no_html_only_the_json(tmp_path: Path) -> None:
    _sample_run(tmp_path / "run")
    assert main(["report", str(tmp_path / "run"), "--out", str(tmp_path / "a")]) == 0
    assert {p.name for p in (tmp_path / "a").iterdir()} == {"report.json", "report.html"}
    assert main(["report", str(tmp_path / "run"), "--out", str(tmp_path / "b"), "--no-html"]) == 0
    assert {p.name for p in (tmp_path / "b").iterdir()} == {"report.json"}


def test_cli_piped_into_a_reader_that_goes_away_exits_quietly(tmp_path: Path) -> None:
    _write_log(tmp_path, [StepCompleted(step=s) for s in range(20000)])
    done = subprocess.run(
        ["bash", "-c", f"'{EXE}' tail '{tmp_path}' --all | head -1"],
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert done.stdout.count(b"\n") == 1
    assert done.stderr == b""


def test_cli_summary_json_prints_json_only(tmp_path: Path) -> None:
    _sample_run(tmp_path)
    env = {**os.environ, "NO_COLOR": "1"}
    done = subprocess.run(
        [str(EXE), "summary", str(tmp_path), "--json"],
        capture_output=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert done.returncode == 0
    assert json.loads(done.stdout)["steps"] == 30


def test_log_follower_reads_the_rest_of_a_rotated_file_and_keeps_a_half_line(
    tmp_path: Path,
) -> None:
    live = tmp_path / "events.jsonl"
    live.write_bytes(encode_event(StepCompleted(step=0)))
    follower = LogFollower(tmp_path, from_end=True)
    assert follower.poll() == []
    with live.open("ab") as fh:
        fh.write(encode_event(StepCompleted(step=1)))
    live.rename(tmp_path / "events.jsonl.1")
    line = encode_event(StepCompleted(step=2))
    live.write_bytes(line[:10])
    assert [e.step for e in follower.poll()] == [1]
    with live.open("ab") as fh:
        fh.write(line[10:])
    assert [e.step for e in follower.poll()] == [2]


# -- more of docs/bus.md -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        {"close_timeout": -1},
        {"close_timeout": math.nan},
        {"close_timeout": "1"},
        {"max_consecutive_failures": 0},
        {"telemetry_latency": math.nan},
        {"drop_report_interval": -1},
        {"stall_threshold": math.nan},
    ],
)
def test_bus_options_are_checked_naming_the_argument(options: dict[str, Any]) -> None:
    (name,) = options
    with pytest.raises(ValueError, match=name):
        EventBus(**options)


async def test_flow_control_slows_await_publish_instead_of_shedding() -> None:
    class Slow:
        backpressure = True

        async def handle(self, event: Event) -> None:
            await anyio.sleep(0.001)

    async with EventBus() as bus:
        sub = bus.subscribe(Slow(), capacity=8)
        with anyio.fail_after(10):
            for step in range(60):
                await bus.publish(StepCompleted(step=step))
            await bus.drain()
        assert (sub.statistics().shed, sub.statistics().delivered) == (0, 60)


async def test_a_flow_controlled_sink_that_completes_nothing_for_1_s_stops_holding_back() -> None:
    class Hung:
        backpressure = True

        async def handle(self, event: Event) -> None:
            await anyio.sleep_forever()

    async with EventBus(close_timeout=0.2) as bus:
        sub = bus.subscribe(Hung(), capacity=8)
        with anyio.fail_after(10):
            for step in range(60):
                await bus.publish(StepCompleted(step=step))
        assert sub.statistics().shed > 0  # shedding, the last resort, counted


async def test_publish_threadsafe_without_wake_waits_for_the_next_wake_up() -> None:
    recorder = RecordingSink()
    async with EventBus() as bus:
        bus.subscribe(recorder)
        await anyio.to_thread.run_sync(
            lambda: bus.publish_threadsafe(StepCompleted(step=1), wake=False)
        )
        await anyio.sleep(0.05)
        assert recorder.events == []
        bus.wake_threadsafe()
        with anyio.fail_after(5):
            while not recorder.events:
                await anyio.sleep(0.01)
    assert [e.step for e in recorder.events] == [1]


async def test_cancel_works_from_another_thread() -> None:
    async with EventBus() as bus:
        sub = bus.subscribe(_noop)
        with anyio.fail_after(5):
            await anyio.to_thread.run_sync(sub.cancel)
        assert bus.statistics().subscriptions == ()


async def test_drain_timeout_zero_only_checks_and_returns_on_an_idle_bus() -> None:
    async with EventBus() as bus:
        bus.subscribe(_noop)
        bus.publish_nowait(StepCompleted(step=1))
        with anyio.fail_after(5):
            await bus.drain()
        await bus.drain(timeout=0)


async def test_close_closes_sinks_in_reverse_order_of_subscription() -> None:
    order: list[str] = []

    class Closing:
        def __init__(self, name: str) -> None:
            self.name = name

        async def handle(self, event: Event) -> None:
            return None

        async def aclose(self) -> None:
            order.append(self.name)

    async with EventBus() as bus:
        for name in ("first", "second", "third"):
            bus.subscribe(Closing(name))
    assert order == ["third", "second", "first"]


async def test_sink_failed_is_never_delivered_to_the_sink_it_is_about() -> None:
    seen: list[Event] = []

    async def flaky(event: Event) -> None:
        seen.append(event)
        raise ValueError("boom")

    recorder = RecordingSink()
    async with EventBus() as bus:
        bus.subscribe(recorder)
        bus.subscribe(flaky)
        bus.publish_nowait(StepCompleted(step=1))
        with anyio.fail_after(5):
            await bus.drain()
            await bus.drain()
    assert [e.kind for e in seen] == ["step_completed"]
    assert len(recorder.of_type(_failed())) == 1


# -- more of docs/logging.md ---------------------------------------------------------------------


async def test_two_step_rotation_should_rotate_and_rotate(tmp_path: Path) -> None:
    sink = RotatingFileSink(tmp_path, max_bytes=1000, wake_interval=0)
    assert sink.should_rotate(5000) is False  # never for an empty file
    await sink.handle_batch([StepCompleted(step=1)])
    assert sink.should_rotate(900) is True and sink.should_rotate(10) is False
    await sink.rotate()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["events.jsonl", "events.jsonl.1"]
    await sink.aclose()


async def test_a_line_longer_than_max_bytes_goes_into_a_file_of_its_own(tmp_path: Path) -> None:
    sink = RotatingFileSink(tmp_path, max_bytes=1000, wake_interval=0)
    await sink.handle_batch([StepCompleted(step=1)])
    await sink.handle_batch([SessionStarted(name="x" * 3000)])
    await sink.handle_batch([StepCompleted(step=2)])
    await sink.aclose()
    files = {p.name: [e.kind for e in read_events(p)] for p in tmp_path.iterdir()}
    assert files == {
        "events.jsonl.2": ["step_completed"],
        "events.jsonl.1": ["session_started"],
        "events.jsonl": ["step_completed"],
    }


async def test_write_behind_writes_an_incident_before_handle_batch_returns(tmp_path: Path) -> None:
    sink = RotatingFileSink(tmp_path, wake_interval=30)
    await sink.handle_batch([StepCompleted(step=1)])
    await sink.handle_batch([GradientExploded(step=2, total_norm=1.0, threshold=0.5)])
    assert [e.step for e in read_events(tmp_path)] == [1, 2]
    await sink.aclose()


async def test_an_event_the_log_cannot_write_is_counted_named_and_the_rest_written(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from eventbus_debug.events import SinkFailed

    recorder = RecordingSink()
    sink = RotatingFileSink(tmp_path, wake_interval=0)
    with caplog.at_level(logging.WARNING, logger="eventbus_debug"):
        async with EventBus() as bus:
            bus.subscribe(recorder, SinkFailed)
            bus.subscribe(sink)
            bus.publish_nowait(StepCompleted(step=1, loss="0.5"))  # type: ignore[arg-type]
            bus.publish_nowait(StepCompleted(step=2, loss=0.5))
    (failed,) = recorder.of_type(SinkFailed)
    assert failed.error_type == "LogWriteError" and "loss" in failed.message
    assert sink.statistics().encode_errors == 1
    assert [e.step for e in read_events(tmp_path)] == [2]
    assert any("log_events_not_written" in r.getMessage() for r in caplog.records)


async def test_a_removed_live_file_fails_that_batch_and_goes_into_a_new_file(
    tmp_path: Path,
) -> None:
    from eventbus_debug.events import SinkFailed

    recorder = RecordingSink()
    sink = RotatingFileSink(tmp_path, wake_interval=0)
    async with EventBus() as bus:
        bus.subscribe(recorder, SinkFailed)
        bus.subscribe(sink)
        bus.publish_nowait(StepCompleted(step=1))
        with anyio.fail_after(5):
            await bus.drain()
        (tmp_path / "events.jsonl").unlink()
        bus.publish_nowait(GradientExploded(step=2, total_norm=1.0, threshold=0.5))
        with anyio.fail_after(5):
            await bus.drain()
        bus.publish_nowait(GradientExploded(step=3, total_norm=1.0, threshold=0.5))
    (failed,) = recorder.of_type(SinkFailed)
    assert "the log file was removed while open" in failed.message
    steps = [e.step for e in read_events(tmp_path) if isinstance(e, GradientExploded)]
    assert steps == [2, 3]


# -- more of docs/cli.md -------------------------------------------------------------------------


def test_cli_a_crafted_line_is_exit_1_naming_file_and_line_and_a_torn_line_is_skipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = encode_event(StepCompleted(step=4))
    crafted = good.replace(b'"step":4', b'"step":"abc"')
    _write_log(tmp_path / "c", [])
    (tmp_path / "c" / "events.jsonl").write_bytes(good + crafted + good)
    _write_log(tmp_path / "t", [])
    (tmp_path / "t" / "events.jsonl").write_bytes(good + good[:25] + b"\n" + good)
    for command in ("tail", "summary", "report"):
        assert main([command, str(tmp_path / "c")]) == 1
        assert "events.jsonl:2" in capsys.readouterr().err
        assert main([command, str(tmp_path / "t")]) == 0


def test_cli_color_always_and_never(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _sample_run(tmp_path)
    for command in ("tail", "summary"):
        assert main([command, str(tmp_path), "--color", "always"]) == 0
        assert "\x1b[" in capsys.readouterr().out
        assert main([command, str(tmp_path), "--color", "never"]) == 0
        assert "\x1b[" not in capsys.readouterr().out


def test_cli_summary_json_is_the_summary_report_writes_into_report_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _sample_run(tmp_path / "run")
    assert main(["summary", str(tmp_path / "run"), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert main(["report", str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 0
    written = json.loads((tmp_path / "out" / "report.json").read_text())["summary"]
    assert printed == written


async def test_with_subscription_stops_delivery_and_close_sink_closes_it() -> None:
    recorder = RecordingSink()
    async with EventBus() as bus:
        with bus.subscribe(recorder) as sub:
            bus.publish_nowait(StepCompleted(step=1))
            with anyio.fail_after(5):
                await bus.drain()
        bus.publish_nowait(StepCompleted(step=2))
        with anyio.fail_after(5):
            await bus.drain()
        assert recorder.closed == 0  # the caller owns the sink
        with anyio.fail_after(5):
            await sub.close_sink(1.0)
    assert [e.step for e in recorder.events] == [1] and recorder.closed == 1


async def test_start_batch_and_a_sync_close_in_a_daemon_thread() -> None:
    calls: list[tuple[str, object]] = []

    class Batching:
        async def start(self) -> None:
            calls.append(("start", None))

        async def handle_batch(self, events: Sequence[Event]) -> None:
            calls.append(("batch", len(events)))

        def close(self) -> None:
            calls.append(("close", threading.current_thread().daemon))

    async with EventBus() as bus:
        bus.subscribe(Batching())
        for step in range(5):
            bus.publish_nowait(StepCompleted(step=step))
    assert calls[0] == ("start", None) and calls[-1] == ("close", True)
    batches = [n for what, n in calls if what == "batch" and isinstance(n, int)]
    assert sum(batches) == 5 and all(batches)  # never empty


async def test_a_sink_cancelling_its_own_subscription_finishes_its_current_call() -> None:
    done: list[int | None] = []
    holder: dict[str, Any] = {}

    async def self_cancel(event: Event) -> None:
        holder["sub"].cancel()
        await anyio.sleep(0.02)
        done.append(event.step)

    async with EventBus() as bus:
        holder["sub"] = bus.subscribe(self_cancel)
        bus.publish_nowait(StepCompleted(step=1))
        bus.publish_nowait(StepCompleted(step=2))
        with anyio.fail_after(5):
            while holder["sub"].statistics().discarded < 1 or not done:
                await anyio.sleep(0.01)
    assert done == [1] and holder["sub"].statistics().discarded == 1


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_a_sink_raising_a_base_exception_gives_a_group_with_the_block_exception_first() -> (
    None
):
    from eventbus_debug._bus.bus import OWN_TASKS_FAILED

    class Fatal(BaseException):
        pass

    async def fatal(event: Event) -> None:
        raise Fatal("sink")

    with pytest.raises(BaseExceptionGroup) as info:
        async with EventBus() as bus:
            bus.subscribe(fatal)
            bus.publish_nowait(StepCompleted(step=1))
            raise ValueError("block")  # the sink fails during the close
    group = info.value
    assert group.message == OWN_TASKS_FAILED
    assert isinstance(group.exceptions[0], ValueError)
    assert any(isinstance(e, Fatal) for e in group.exceptions[1:])


async def test_flush_interval_buffers_lines_and_writes_them_within_the_interval(
    tmp_path: Path,
) -> None:
    sink = RotatingFileSink(tmp_path, flush_interval=0.1, wake_interval=0)
    async with EventBus() as bus:
        bus.subscribe(sink)
        bus.publish_nowait(StepCompleted(step=1))
        with anyio.fail_after(5):
            await bus.drain()
            while sink.statistics().lines_written == 0:
                await anyio.sleep(0.02)
    assert [e.step for e in read_events(tmp_path)] == [1]


async def test_disk_full_raises_once_keeps_the_lines_and_a_failed_close_counts_them_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import errno

    from eventbus_debug.sinks import LogWriteError, _jsonl_writer as jw

    def full(fd: int, data: bytes | bytearray) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(jw, "_write_some", full)
    sink = RotatingFileSink(tmp_path, wake_interval=0)
    with pytest.raises(LogWriteError):
        await sink.handle_batch([StepCompleted(step=s) for s in range(3)])
    await sink.handle_batch([StepCompleted(step=s) for s in range(3)])  # quiet retry
    assert sink.statistics().lines_pending == 6 and sink.statistics().failing
    with caplog.at_level(logging.ERROR, logger="eventbus_debug"):
        with pytest.raises(LogWriteError, match="6 line"):
            await sink.aclose()
    assert sink.statistics().lines_lost == 6
    assert any("log_lines_lost" in r.getMessage() for r in caplog.records)


def test_cli_colours_on_a_terminal_unless_no_color(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _sample_run(tmp_path)

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    for no_color, expect in ((None, True), ("1", False)):
        if no_color is None:
            monkeypatch.delenv("NO_COLOR", raising=False)
        else:
            monkeypatch.setenv("NO_COLOR", no_color)
        out = Terminal()
        monkeypatch.setattr(sys, "stdout", out)
        assert main(["tail", str(tmp_path)]) == 0
        assert ("\x1b[" in out.getvalue()) is expect


async def test_a_sink_holding_the_loop_is_named_by_loop_stalled() -> None:
    from eventbus_debug.events import LoopStalled

    async def blocking(event: Event) -> None:
        time.sleep(0.3)  # synchronous work in an async handler

    recorder = RecordingSink()
    async with EventBus() as bus:
        bus.subscribe(recorder, LoopStalled)
        bus.subscribe(blocking, StepCompleted)
        bus.publish_nowait(StepCompleted(step=1))
        with anyio.fail_after(5):
            await bus.drain()
    (stalled,) = recorder.of_type(LoopStalled)
    assert stalled.sink == "blocking" and stalled.stall_s >= 0.25


async def test_drop_reports_are_coalesced_with_a_final_one_at_cancel() -> None:
    release = anyio.Event()

    async def slow(event: Event) -> None:
        await release.wait()

    recorder = RecordingSink()
    async with EventBus(drop_report_interval=30) as bus:
        bus.subscribe(recorder, EventsDropped)
        sub = bus.subscribe(slow, StepCompleted, capacity=2)
        for _ in range(5):
            for step in range(10):
                bus.publish_nowait(StepCompleted(step=step))
            await anyio.sleep(0.02)
        await anyio.sleep(0.05)
        assert len(recorder.events) == 1  # one report per interval
        shed = sub.statistics().shed
        sub.cancel()
        with anyio.fail_after(5):
            while len(recorder.events) < 2:
                await anyio.sleep(0.01)
        release.set()
    reports = recorder.of_type(EventsDropped)
    assert len(reports) == 2 and sum(e.dropped for e in reports) == shed
    assert reports[-1].total_dropped == shed


async def test_telemetry_latency_holds_telemetry_but_not_incidents_or_drain() -> None:
    recorder = RecordingSink()
    async with EventBus(telemetry_latency=30) as bus:
        bus.subscribe(recorder)
        bus.publish_nowait(StepCompleted(step=0))  # the first after a quiet spell: at once
        with anyio.fail_after(5):
            while not recorder.events:
                await anyio.sleep(0.01)
        for step in range(1, 4):
            bus.publish_nowait(StepCompleted(step=step))
            await anyio.sleep(0.01)
        assert len(recorder.events) == 1  # held
        bus.publish_nowait(GradientExploded(step=4, total_norm=1.0, threshold=0.5))
        with anyio.fail_after(5):
            while len(recorder.events) < 5:
                await anyio.sleep(0.01)  # the incident takes everything before it along
        for step in range(600):  # a buffer of 512 waiting events goes at once
            bus.publish_nowait(StepCompleted(step=step))
        with anyio.fail_after(5):
            while len(recorder.events) < 5 + 512:
                await anyio.sleep(0.01)
        bus.publish_nowait(StepCompleted(step=9))
        with anyio.fail_after(5):
            await bus.drain()
        assert len(recorder.events) == 5 + 600 + 1


# -- more of docs/reports.md ---------------------------------------------------------------------


async def test_report_writer_writes_every_interval_and_at_close(tmp_path: Path) -> None:
    clock = [0.0]
    report = ReportWriter(tmp_path, interval=10, clock=lambda: clock[0])
    async with EventBus() as bus:
        bus.subscribe(report)
        bus.publish_nowait(StepCompleted(step=1))
        with anyio.fail_after(5):
            await bus.drain()
        assert report.writes == 0
        clock[0] = 11
        bus.publish_nowait(StepCompleted(step=2))
        with anyio.fail_after(5):
            await bus.drain()
            while report.writes == 0:
                await anyio.sleep(0.01)
        assert (tmp_path / "report.json").exists()
    assert report.writes == 2
    assert json.loads((tmp_path / "report.json").read_text())["summary"]["steps"] == 2


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"port": "80"}, ArgumentTypeError),
        ({"port": 1.5}, ArgumentTypeError),
        ({"port": True}, ArgumentTypeError),
        ({"port": None}, ArgumentTypeError),
        ({"port": 70000}, ValueError),
        ({"ring_size": 0}, ValueError),
        ({"ring_size": "3"}, ArgumentTypeError),
        ({"allowed_hosts": [1]}, ArgumentTypeError),
        ({"allowed_hosts": [""]}, ValueError),
        ({"allowed_origins": [None]}, ArgumentTypeError),
        ({"allowed_origins": [""]}, ValueError),
    ],
)
def test_debug_server_checks_its_arguments_when_built(
    options: dict[str, Any], error: type[Exception]
) -> None:
    http = pytest.importorskip("eventbus_debug.sinks.http")
    (name,) = options
    with pytest.raises(error, match=name):
        http.DebugServer(**options)


@pytest.mark.asyncio_only(
    "serves with uvicorn, which runs only on asyncio (README: on trio it says so at start)"
)
async def test_debug_server_serves_once_and_refuses_a_non_loopback_bind_without_token() -> None:
    http = pytest.importorskip("eventbus_debug.sinks.http")
    with pytest.raises(ValueError, match="token"):
        http.DebugServer(host="0.0.0.0")
    server = http.DebugServer()
    with anyio.fail_after(10):
        async with server:
            assert server.port > 0
        with pytest.raises(RuntimeError):
            async with server:
                pass


@event_type
class _Fields(Event):
    kind: ClassVar[str] = "claims_bus_log.fields"
    f: float = 0.0
    i: int = 0
    t: tuple[int, ...] = ()
    m: dict[str, float] = dataclasses.field(default_factory=dict)
    a: Any = None


@pytest.mark.parametrize(
    ("options", "ok"),
    [
        ({"f": 1}, True),
        ({"f": True}, False),
        ({"f": np.float64(1.0)}, False),
        ({"i": True}, False),
        ({"t": [1, 2]}, True),
        ({"t": (1, "x")}, False),
        ({"m": {1: 1.0}}, False),
        ({"a": object()}, True),
    ],
)
def test_event_fields_are_checked_by_the_log_readers_rules(
    options: dict[str, Any], ok: bool
) -> None:
    if ok:
        _Fields(**options)
    else:
        with pytest.raises(TypeError, match=f"_Fields.{next(iter(options))}"):
            _Fields(**options)


def test_events_are_immutable() -> None:
    event = _Fields()
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.f = 2.0  # type: ignore[misc]


def test_console_sink_filters_by_type_exclude_severity_and_step_every() -> None:
    stream = io.StringIO()

    async def run() -> None:
        async with EventBus() as bus:
            bus.subscribe(
                ConsoleSink(
                    stream,
                    telemetry=True,
                    exclude=(StepChecked,),
                    step_every=5,
                    min_severity=Severity.DEBUG,
                )
            )
            for step in range(10):
                bus.publish_nowait(StepCompleted(step=step, loss=1.0))
                bus.publish_nowait(StepChecked(step=step))
            bus.publish_nowait(GradientExploded(step=3, total_norm=2.0, threshold=1.0))

    anyio.run(run)
    kinds = [line.split()[2] for line in stream.getvalue().splitlines()]
    assert kinds == ["step_completed", "step_completed", "gradient_exploded"]


@pytest.mark.parametrize("compress", [False, True])
async def test_log_follower_loses_nothing_across_several_rotations_between_polls(
    tmp_path: Path, compress: bool
) -> None:
    """Before the fix the follower knew the followed file by its inode number alone: the new
    live file reused the number of the rotated (deleted) one and was read from the old offset,
    so every event after a compressed rotation, or after several rotations, was missed."""
    sink = RotatingFileSink(tmp_path, max_bytes=10**6, backup_count=2, compress=compress)
    sink_steps = iter(range(100))

    async def write(rotate: bool) -> None:
        await sink.handle_batch([StepCompleted(step=next(sink_steps))])
        await sink.flush()
        if rotate:
            await sink.rotate()

    await write(False)
    with LogFollower(tmp_path, from_end=False) as follower:
        assert [e.step for e in follower.poll()] == [0]
        await write(True)
        await write(False)
        assert [e.step for e in follower.poll()] == [1, 2]
        for _ in range(3):  # more rotations than backups kept
            await write(True)
        await write(False)
        assert [e.step for e in follower.poll()] == [3, 4, 5, 6]
        assert follower.poll() == []
    await sink.aclose()
