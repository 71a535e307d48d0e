"""Regression tests of the tenth session's audit of the bus and the log (docs/bus.md,
docs/logging.md): a rotation that fails with something other than an ``OSError`` (a namer or
rotator of the user's raising) is an outage like a failed write, never a silent loss; the
lines kept meanwhile stay within ``max_pending_bytes``; and the sink's callables and name are
checked at construction."""

from __future__ import annotations

import contextlib
import errno
from pathlib import Path

import pytest

from eventbus_debug import EventBus, read_events
from eventbus_debug.events import SinkFailed, StepCompleted
from eventbus_debug.exceptions import ArgumentTypeError
from eventbus_debug.sinks import LogWriteError, RotatingFileSink, _jsonl_writer as jw
from eventbus_debug.testing import RecordingSink


def _buggy_rotator(source: str, dest: str) -> None:
    msg = "my rotator is buggy"
    raise ValueError(msg)


async def test_rotator_raising_a_value_error_loses_nothing_with_write_behind(
    tmp_path: Path,
) -> None:
    """Before the fix, the writer thread logged the ValueError and kept the lines in its buffer
    for ever: 25 of 30 events neither written nor counted as lost, no SinkFailed."""
    sink = RotatingFileSink(tmp_path, max_bytes=1000, rotator=_buggy_rotator)
    async with EventBus() as bus:
        bus.subscribe(sink)
        for step in range(30):
            await bus.publish(StepCompleted(step=step))
        await bus.drain()
    stats = sink.statistics()
    assert stats.lines_pending == 0
    assert stats.write_errors >= 1
    steps = [e.step for e in read_events(tmp_path) if isinstance(e, StepCompleted)]
    assert steps == list(range(30))


async def test_rotator_raising_a_value_error_is_one_sink_failed_naming_it(tmp_path: Path) -> None:
    recorder = RecordingSink()
    sink = RotatingFileSink(tmp_path, max_bytes=1000, rotator=_buggy_rotator, wake_interval=0)
    async with EventBus() as bus:
        bus.subscribe(recorder)
        bus.subscribe(sink)
        for step in range(30):  # one batch: one rotation attempt
            bus.publish_nowait(StepCompleted(step=step))
        await bus.drain()
    (failed,) = recorder.of_type(SinkFailed)
    assert failed.error_type == "LogWriteError"
    assert "cannot rotate the log file" in failed.message
    assert "ValueError: my rotator is buggy" in failed.message
    assert sink.statistics().lines_pending == 0
    steps = [e.step for e in read_events(tmp_path) if isinstance(e, StepCompleted)]
    assert steps == list(range(30))


def test_writer_rotation_error_is_a_log_write_error(tmp_path: Path) -> None:
    sink = RotatingFileSink(tmp_path, max_bytes=0, rotator=_buggy_rotator, wake_interval=0)
    writer = sink._writer
    writer.open()
    writer.write_batch([StepCompleted(step=1)])
    with pytest.raises(LogWriteError, match="ValueError: my rotator is buggy") as info:
        writer.rotate()
    assert info.value.errno is None
    writer.close()


def test_lines_kept_while_a_rotation_fails_stay_within_max_pending_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk full once the live file reached ``max_bytes``: every batch tries to rotate first
    and fails. Before the fix, that failure skipped the trim: the buffer grew without bound
    and nothing was counted as lost."""
    sink = RotatingFileSink(tmp_path, max_bytes=1000, wake_interval=0, max_pending_bytes=2000)
    writer = sink._writer
    writer.open()
    writer.write_batch([StepCompleted(step=i) for i in range(5)])  # the live file is full

    def disk_full(fd: int, data: bytes | bytearray) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(jw, "_write_some", disk_full)
    total = 5
    for batch in range(20):
        events = [StepCompleted(step=100 + batch * 10 + i) for i in range(10)]
        total += len(events)
        with contextlib.suppress(LogWriteError):
            writer.write_batch(events)
        assert len(writer._buffer) <= 2000
    stats = writer.statistics()
    assert stats.lines_lost > 0
    assert stats.lines_written + stats.lines_lost + stats.lines_pending == total
    monkeypatch.undo()
    writer.close()
    stats = writer.statistics()
    assert stats.lines_pending == 0
    assert stats.lines_written == total - stats.lines_lost + 1  # + LogWriteResumed


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"namer": "abc"}, ArgumentTypeError, "namer must be a callable or None, got str"),
        ({"rotator": 1}, ArgumentTypeError, "rotator must be a callable or None, got int"),
        ({"name": 3}, ArgumentTypeError, "name must be a str, got int 3"),
        ({"name": ""}, ValueError, "name must not be empty"),
    ],
)
def test_bad_callables_and_names_are_refused_at_construction(
    tmp_path: Path, options: dict[str, object], error: type[Exception], match: str
) -> None:
    """Before the fix, a namer that is not callable failed at the first rotation, in the
    writer thread, and a non-str name silently gave the subscription another name."""
    with pytest.raises(error, match=match):
        RotatingFileSink(tmp_path, **options)  # type: ignore[arg-type]


def test_a_sync_bus_whose_close_gave_up_refuses_later_publishes() -> None:
    """A sink holding the bus's loop (a blocking call in an async handler) makes close() give
    up after its bound; a publish after that is refused, not queued where nothing reads it."""
    import time as _time

    from eventbus_debug import BusClosedError, SyncEventBus
    from eventbus_debug.events import StepCompleted

    async def blocker(event: object) -> None:
        _time.sleep(6)  # the mistake: a blocking call holding the loop, past the close bound

    bus = SyncEventBus(close_timeout=0.2)
    with bus:
        bus.subscribe(blocker)
        bus.publish(StepCompleted(step=0, loss=1.0))
        bus.flush()
        _time.sleep(0.1)  # the sink now holds the loop
    for publish in (bus.publish, bus.publish_nowait):
        with pytest.raises(BusClosedError, match="closed"):
            publish(StepCompleted(step=1, loss=1.0))
    with pytest.raises(BusClosedError, match="closed"):
        bus.publish_many([StepCompleted(step=2, loss=1.0)])


def _refused_rename(source: str, dest: str) -> None:
    raise PermissionError(errno.EACCES, "Permission denied")


async def test_a_rotation_that_keeps_failing_never_gets_the_log_disabled(tmp_path: Path) -> None:
    """A rename refused for good (the directory's permissions changed under a long run): the
    lines go on into the live file past max_bytes, the rotation is retried with a backoff,
    and only the first failure of the streak is a SinkFailed. Before, every batch raised and the
    bus disabled the log after five: 31 of 400 events reached it."""
    from eventbus_debug.events import SinkDisabled

    recorder = RecordingSink()
    sink = RotatingFileSink(tmp_path, max_bytes=2000, rotator=_refused_rename, wake_interval=0)
    async with EventBus() as bus:
        bus.subscribe(recorder)
        bus.subscribe(sink)
        for step in range(400):
            await bus.publish(StepCompleted(step=step))
            if step % 10 == 9:
                await bus.drain()
    assert len(recorder.of_type(SinkFailed)) == 1
    assert recorder.of_type(SinkDisabled) == []
    steps = [e.step for e in read_events(tmp_path) if isinstance(e, StepCompleted)]
    assert steps == list(range(400))
    stats = sink.statistics()
    assert (stats.lines_pending, stats.lines_lost, stats.rotations) == (0, 0, 0)
