from __future__ import annotations

import errno
import gzip
import math
import os
import shutil
import threading
from collections.abc import Mapping
from dataclasses import field
from pathlib import Path
from typing import ClassVar

import anyio
import pytest

from eventbus_debug import Delivery, Event, EventBus, encode_event, event_type, read_events
from eventbus_debug.events import (
    LogWriteResumed,
    NonFiniteDetected,
    SinkFailed,
    StepCompleted,
    TensorRole,
)
from eventbus_debug.exceptions import EventDecodeError
from eventbus_debug.sinks import (
    FileSinkStatistics,
    LogDirectoryError,
    LogWriteError,
    RotatingFileSink,
    _jsonl_writer as jw,
)
from eventbus_debug.testing import RecordingSink


@event_type
class _Values(Event):
    """Floats in every shape the encoder has to care about."""

    kind: ClassVar[str] = "tests.file_sink.values"
    scalar: float = 0.0
    maybe: float | None = None
    many: tuple[float, ...] = ()
    named: Mapping[str, float] = field(default_factory=dict)


@event_type
class _Opaque(Event):
    """An event holding something JSON cannot carry (a user bug the sink must survive)."""

    kind: ClassVar[str] = "tests.file_sink.opaque"
    payload: object = None


@event_type
class _OpaqueTelemetry(Event):
    """Telemetry holding something JSON cannot carry: written by the writer thread, not awaited."""

    kind: ClassVar[str] = "tests.file_sink.opaque_telemetry"
    delivery: ClassVar[Delivery] = Delivery.TELEMETRY
    payload: object = None


def _steps(start: int, n: int) -> list[StepCompleted]:
    return [StepCompleted(step=i, loss=i / 7, learning_rate=1e-3) for i in range(start, start + n)]


def _step_numbers(path: Path) -> list[int | None]:
    return [e.step for e in read_events(path) if isinstance(e, StepCompleted)]


def _resumed(path: Path) -> list[LogWriteResumed]:
    return [e for e in read_events(path) if isinstance(e, LogWriteResumed)]


def _line_size() -> int:
    return len(encode_event(StepCompleted(step=100, loss=100 / 7, learning_rate=1e-3, seq=100)))


async def _publish_all(bus: EventBus, events: list[StepCompleted]) -> None:
    for event in events:
        bus.publish_nowait(event)
    with anyio.fail_after(10):
        await bus.drain()


class TestConstruction:
    def test_creates_directory_and_names_file_by_rank(self, tmp_path: Path) -> None:
        """The directory is created with its parents; rank 0 writes events.jsonl."""
        sink = RotatingFileSink(tmp_path / "a" / "b", rank=0)
        assert sink.path == tmp_path / "a" / "b" / "events.jsonl"
        assert sink.path.exists()

    def test_parent_is_a_regular_file(self, tmp_path: Path) -> None:
        """A directory under a regular file fails at construction, even for root."""
        blocker = tmp_path / "not_a_dir"
        blocker.write_text("x")
        with pytest.raises(LogDirectoryError, match=r"not_a_dir/logs.*Not a directory") as info:
            RotatingFileSink(blocker / "logs")
        assert info.value.errno == errno.ENOTDIR
        assert isinstance(info.value, OSError)
        assert "pass a directory you can write to" in str(info.value)

    @pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a 0o500 directory anyway")
    def test_read_only_directory(self, tmp_path: Path) -> None:
        """A directory without write permission fails at construction with EACCES."""
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        try:
            with pytest.raises(LogDirectoryError, match=r"locked.*Permission denied"):
                RotatingFileSink(locked)
        finally:
            locked.chmod(0o700)

    @pytest.mark.parametrize(
        ("kwargs", "message"),
        [
            ({"max_bytes": -1}, "max_bytes must be an integer >= 0, got -1"),
            ({"backup_count": 0}, "backup_count must be >= 1 when max_bytes > 0, got 0"),
            ({"flush_interval": math.nan}, "flush_interval must be a finite number"),
            ({"buffer_size": 0}, "buffer_size must be an integer >= 1, got 0"),
            ({"wake_interval": -0.1}, "wake_interval must be a finite number of seconds >= 0"),
            ({"wake_interval": math.inf}, "wake_interval must be a finite number of seconds"),
            ({"high_water": 0}, "high_water must be an integer >= 1, got 0"),
        ],
    )
    def test_bad_options(self, tmp_path: Path, kwargs: dict[str, object], message: str) -> None:
        """Out-of-range options raise ValueError naming the option and the value."""
        with pytest.raises(ValueError, match=message):
            RotatingFileSink(tmp_path, **kwargs)  # type: ignore[arg-type]

    def test_no_rotation_needs_no_backups(self, tmp_path: Path) -> None:
        """max_bytes=0 never rotates, so backup_count=0 is fine."""
        sink = RotatingFileSink(tmp_path, max_bytes=0, backup_count=0)
        assert not sink.should_rotate(10**12)


class TestRotation:
    async def test_n_backups_sizes_order_nothing_lost(self, tmp_path: Path) -> None:
        """Files stay under max_bytes, backups are .1 (newest) … .N, and every event reads back."""
        line = _line_size()
        sink = RotatingFileSink(tmp_path, max_bytes=line * 50, backup_count=10, rank=0)
        published = _steps(0, 400)
        async with EventBus() as bus:
            bus.subscribe(sink, capacity=10_000)
            for start in range(0, 400, 37):  # batches that straddle rotation boundaries
                await _publish_all(bus, published[start : start + 37])
        names = sorted(p.name for p in tmp_path.iterdir())
        backups = [f"events.jsonl.{i}" for i in range(1, sink.statistics().rotations + 1)]
        assert names == sorted(["events.jsonl", *backups])
        assert len(backups) >= 7
        for name in names:
            size = (tmp_path / name).stat().st_size
            assert 0 < size <= line * 50, name
        first_of_1 = next(read_events(tmp_path / "events.jsonl.1"))
        first_of_2 = next(read_events(tmp_path / "events.jsonl.2"))
        assert first_of_2.seq < first_of_1.seq
        back = list(read_events(tmp_path))
        assert [e.step for e in back] == list(range(400))
        assert [e.seq for e in back] == sorted(e.seq for e in back)

    async def test_older_backups_deleted(self, tmp_path: Path) -> None:
        """Only backup_count backups are kept; what remains is the newest events, contiguous."""
        line = _line_size()
        sink = RotatingFileSink(tmp_path, max_bytes=line * 20, backup_count=3)
        async with EventBus() as bus:
            bus.subscribe(sink, capacity=10_000)
            await _publish_all(bus, _steps(0, 300))
        names = sorted(p.name for p in tmp_path.iterdir())
        assert names == ["events.jsonl", "events.jsonl.1", "events.jsonl.2", "events.jsonl.3"]
        steps = [e.step for e in read_events(tmp_path)]
        assert steps == list(range(300 - len(steps), 300))
        assert sink.statistics().rotations > 3

    async def test_gzip_rotation(self, tmp_path: Path) -> None:
        """compress=True gzips the backups (.1.gz …) and read_events reads through them."""
        line = _line_size()
        sink = RotatingFileSink(tmp_path, max_bytes=line * 40, backup_count=20, compress=True)
        async with EventBus() as bus:
            bus.subscribe(sink, capacity=10_000)
            await _publish_all(bus, _steps(0, 250))
        names = sorted(p.name for p in tmp_path.iterdir())
        assert "events.jsonl" in names
        gz = [n for n in names if n != "events.jsonl"]
        assert gz and all(n.endswith(".gz") for n in gz)
        with gzip.open(tmp_path / "events.jsonl.1.gz", "rb") as fh:
            assert fh.read().count(b"\n") > 0
        assert [e.step for e in read_events(tmp_path)] == list(range(250))

    async def test_custom_namer_and_rotator(self, tmp_path: Path) -> None:
        """namer and rotator are called as in logging.handlers, with full paths."""
        moves: list[tuple[str, str]] = []

        def namer(default: str) -> str:
            return default.replace(".jsonl.", ".jsonl.b")

        def rotator(source: str, dest: str) -> None:
            moves.append((source, dest))
            os.replace(source, dest)

        sink = RotatingFileSink(tmp_path, max_bytes=1, backup_count=2, namer=namer, rotator=rotator)
        async with EventBus() as bus:
            bus.subscribe(sink)
            await _publish_all(bus, _steps(0, 3))
        live = str(tmp_path / "events.jsonl")
        assert moves == [(live, live + ".b1")] * 2
        assert sorted(p.name for p in tmp_path.iterdir()) == [
            "events.jsonl",
            "events.jsonl.b1",
            "events.jsonl.b2",
        ]

    async def test_should_rotate_and_manual_rotate(self, tmp_path: Path) -> None:
        """should_rotate answers for the next write; rotate() starts a new file on demand."""
        sink = RotatingFileSink(tmp_path, max_bytes=1000, backup_count=1)
        assert not sink.should_rotate(5000)  # an empty file takes any line
        await sink.handle_batch(_steps(0, 1))
        await sink.flush()  # the batch was handed to the writer; now it is in the file
        size = sink.statistics().current_size
        assert not sink.should_rotate(1000 - size)
        assert sink.should_rotate(1001 - size)
        await sink.rotate()
        assert sink.statistics().current_size == 0
        assert (tmp_path / "events.jsonl.1").stat().st_size == size
        await sink.aclose()

    @pytest.mark.parametrize("wake_interval", [0.0, 3600.0])
    async def test_one_batch_across_many_boundaries(
        self, tmp_path: Path, wake_interval: float
    ) -> None:
        """One batch cut into many files: every line counted once, every file under max_bytes."""
        line = _line_size()
        sink = RotatingFileSink(
            tmp_path, max_bytes=line * 30, backup_count=100, wake_interval=wake_interval
        )
        await sink.handle_batch(_steps(0, 10))
        await sink.handle_batch(_steps(10, 1000))
        await sink.aclose()
        stats = sink.statistics()
        assert (stats.lines_written, stats.lines_pending, stats.lines_lost) == (1010, 0, 0)
        lines = 0
        for path in tmp_path.iterdir():
            data = path.read_bytes()
            assert 0 < len(data) <= line * 30 and data.endswith(b"\n"), path.name
            lines += data.count(b"\n")
        assert lines == 1010 and stats.rotations == len(list(tmp_path.iterdir())) - 1
        assert stats.bytes_written == sum(p.stat().st_size for p in tmp_path.iterdir())
        assert _step_numbers(tmp_path) == list(range(1010))

    async def test_rotation_failing_mid_batch_keeps_every_line(self, tmp_path: Path) -> None:
        """A rotation that fails inside a batch: the rest of the batch is kept, counted, written."""
        line = _line_size()
        calls = [0]

        def rotator(source: str, dest: str) -> None:
            calls[0] += 1
            if calls[0] == 2:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            os.replace(source, dest)

        sink = RotatingFileSink(
            tmp_path, max_bytes=line * 10, backup_count=100, rotator=rotator, wake_interval=0
        )
        with pytest.raises(LogWriteError, match="cannot rotate"):
            await sink.handle_batch(_steps(0, 35))
        writer = sink._writer
        stats = sink.statistics()
        assert stats.lines_pending == writer._buffer.count(b"\n") == 35 - stats.lines_written
        assert stats.lines_written == 20  # the first file, and the second before its rotation
        await sink.aclose()
        stats = sink.statistics()
        assert (stats.lines_written, stats.lines_pending, stats.lines_lost) == (36, 0, 0)
        assert _step_numbers(tmp_path) == list(range(35))
        assert len(_resumed(tmp_path)) == 1  # the 36th line


class TestContent:
    async def test_million_events_make_million_lines(self, tmp_path: Path) -> None:
        """1,000,000 events published, bus closed: exactly 1,000,000 lines in the rotated files."""
        total, burst = 1_000_000, 50_000
        sink = RotatingFileSink(tmp_path, max_bytes=16 * 1024 * 1024, backup_count=50)
        async with EventBus() as bus:
            sub = bus.subscribe(sink, capacity=burst)
            step = 0
            for _ in range(total // burst):
                bus.publish_many_nowait([StepCompleted(step=step + i) for i in range(burst)])
                step += burst
                with anyio.fail_after(30):
                    await bus.drain(sub)
        assert sub.statistics().shed == 0
        files = sorted(tmp_path.iterdir())
        assert len(files) > 1
        lines = 0
        for path in files:
            data = path.read_bytes()
            assert data.endswith(b"\n")
            lines += data.count(b"\n")
        assert lines == total
        stats = sink.statistics()
        assert (stats.lines_written, stats.lines_lost, stats.write_errors) == (total, 0, 0)
        last = (tmp_path / "events.jsonl").read_bytes().splitlines()[-1]
        assert b'"step":999999' in last

    async def test_nan_and_inf_round_trip(self, tmp_path: Path) -> None:
        """NaN, +Inf and -Inf come back from the file as the same floats, in every shape."""
        sink = RotatingFileSink(tmp_path)
        async with EventBus() as bus:
            bus.subscribe(sink)
            bus.publish_nowait(
                _Values(
                    scalar=math.nan,
                    maybe=math.inf,
                    many=(1.5, -math.inf, math.nan),
                    named={"a": math.inf, "b": 2.0},
                )
            )
            bus.publish_nowait(StepCompleted(step=1, loss=math.nan, learning_rate=-math.inf))
        values, step = list(read_events(tmp_path))
        assert isinstance(values, _Values) and isinstance(step, StepCompleted)
        assert math.isnan(values.scalar)
        assert values.maybe == math.inf
        assert values.many[0] == 1.5 and values.many[1] == -math.inf and math.isnan(values.many[2])
        assert dict(values.named) == {"a": math.inf, "b": 2.0}
        assert step.loss is not None and math.isnan(step.loss)
        assert step.learning_rate == -math.inf

    async def test_truncated_last_line_tolerated(self, tmp_path: Path) -> None:
        """A crash mid-write loses only the cut line; a restarted sink removes it first."""
        sink = RotatingFileSink(tmp_path)
        await sink.handle_batch(_steps(0, 5))
        await sink.aclose()
        cut = encode_event(StepCompleted(step=5, seq=6))
        with open(sink.path, "ab") as fh:
            fh.write(cut[: len(cut) // 2])  # the process died here
        assert [e.step for e in read_events(tmp_path)] == [0, 1, 2, 3, 4]

        again = RotatingFileSink(tmp_path)
        await again.handle_batch(_steps(6, 2))
        await again.aclose()
        assert [e.step for e in read_events(tmp_path)] == [0, 1, 2, 3, 4, 6, 7]

    async def test_whole_line_missing_newline_kept(self, tmp_path: Path) -> None:
        """A last line cut exactly before its newline is a whole event: a restart keeps it."""
        path = tmp_path / "events.jsonl"
        path.write_bytes(encode_event(StepCompleted(step=1, seq=1)).rstrip(b"\n"))
        sink = RotatingFileSink(tmp_path)
        await sink.handle_batch(_steps(2, 1))
        await sink.aclose()
        assert [e.step for e in read_events(tmp_path)] == [1, 2]

    async def test_per_rank_file_names(self, tmp_path: Path) -> None:
        """Rank > 0 writes events.rank{N}.jsonl (and .rank{N}.jsonl.1 backups), read by rank."""
        line = _line_size()
        sinks = [
            RotatingFileSink(tmp_path, rank=r, max_bytes=line * 5, backup_count=9, name=f"r{r}")
            for r in (0, 3)
        ]
        async with EventBus() as bus:
            for sink in sinks:
                bus.subscribe(sink)
            await _publish_all(bus, _steps(0, 12))
        names = {p.name for p in tmp_path.iterdir()}
        assert {"events.jsonl", "events.rank3.jsonl", "events.rank3.jsonl.1"} <= names
        assert sinks[1].path.name == "events.rank3.jsonl"
        assert len(list(read_events(tmp_path))) == 24  # both ranks' copies, merged by time

    async def test_close_flushes_buffered_lines(self, tmp_path: Path) -> None:
        """With a long flush interval lines wait in memory; closing the bus writes them all."""
        sink = RotatingFileSink(tmp_path, flush_interval=3600.0)
        async with EventBus() as bus:
            bus.subscribe(sink)
            await _publish_all(bus, _steps(0, 10))
            assert sink.statistics().lines_pending == 10
            assert sink.path.stat().st_size == 0
        assert [e.step for e in read_events(tmp_path)] == list(range(10))
        assert sink.statistics().lines_pending == 0

    async def test_interval_flush(self, tmp_path: Path) -> None:
        """A positive flush_interval writes buffered lines from the background flusher."""
        sink = RotatingFileSink(tmp_path, flush_interval=0.01, fsync=True)
        await sink.handle_batch(_steps(0, 3))
        with anyio.fail_after(5):
            while sink.statistics().lines_written < 3:
                await anyio.sleep(0.01)
        assert sink.path.read_bytes().count(b"\n") == 3
        await sink.aclose()

    async def test_aclose_twice_and_write_after_close(self, tmp_path: Path) -> None:
        """aclose is idempotent; handling after close raises a clear RuntimeError."""
        sink = RotatingFileSink(tmp_path)
        await sink.handle_batch(_steps(0, 1))
        await sink.aclose()
        await sink.aclose()
        with pytest.raises(RuntimeError, match="is closed; create a new sink"):
            await sink.handle_batch(_steps(1, 1))

    async def test_unencodable_event_does_not_lose_the_batch(self, tmp_path: Path) -> None:
        """An event JSON cannot carry fails its batch loudly; the other events are written."""
        sink = RotatingFileSink(tmp_path)
        with pytest.raises(LogWriteError, match=r"1 event.*could not be encoded.*_Opaque"):
            await sink.handle_batch(
                [StepCompleted(step=1), _Opaque(payload={1, 2}), StepCompleted(step=2)]
            )
        await sink.aclose()
        assert [e.step for e in read_events(tmp_path)] == [1, 2]
        assert sink.statistics().encode_errors == 1


class _DiskFull:
    """Stands in for write(2): writes *partial* bytes, then fails with ENOSPC, *times* times."""

    def __init__(self, times: int, partial: int = 0) -> None:
        self.times = times
        self.partial = partial
        self.calls = 0

    def __call__(self, fd: int, data: bytes | bytearray) -> int:
        self.calls += 1
        if self.times <= 0:
            return os.write(fd, data)
        if self.partial and self.calls % 2 == 1:
            return os.write(fd, data[: self.partial])
        self.times -= 1
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


async def _until_failing(sink: RotatingFileSink) -> None:
    """Wait (bounded) until the writer thread's outage shows in the sink's statistics."""
    with anyio.fail_after(5):
        while not sink.statistics().failing:
            await anyio.sleep(0.005)


class TestFailures:
    """The synchronous writer (``wake_interval=0``): each batch is written, or fails, in turn."""

    async def test_disk_full_becomes_sink_failed_and_recovers(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """ENOSPC mid-line: SinkFailed on the bus, the publisher unaffected, nothing lost."""
        sink = RotatingFileSink(tmp_path, wake_interval=0)
        recorder = RecordingSink()
        published = 0
        async with EventBus() as bus:
            bus.subscribe(recorder, SinkFailed)
            sub = bus.subscribe(sink)
            await _publish_all(bus, _steps(0, 5))
            monkeypatch.setattr(jw, "_write_some", _DiskFull(times=1, partial=30))
            for event in _steps(5, 5):  # the training loop goes on publishing
                bus.publish_nowait(event)
                published += 1
            with anyio.fail_after(10):
                await bus.drain()
                await bus.drain()  # the SinkFailed published while the first drain waited
            assert published == 5
            (failure,) = recorder.of_type(SinkFailed)
            assert failure.sink == "rotating_file"
            assert failure.error_type == "LogWriteError"
            assert "No space left on device" in failure.message
            assert "5 line(s) kept to retry" in failure.message
            assert sub.statistics().failed == 5 and not sub.statistics().disabled
            await _publish_all(bus, _steps(10, 5))
        stats = sink.statistics()
        assert stats.write_errors == 1 and stats.lines_lost == 0
        assert _step_numbers(tmp_path) == list(range(15))
        (resumed,) = _resumed(tmp_path)
        assert resumed.write_errors == 1 and resumed.lines_lost == 0

    async def test_outage_is_retried_with_backoff_and_never_disables(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Many failures in one outage raise once; retries back off; nothing is lost."""
        clock = [1000.0]
        monkeypatch.setattr(jw, "_clock", lambda: clock[0])
        sink = RotatingFileSink(tmp_path, wake_interval=0)
        await sink.handle_batch(_steps(0, 2))
        disk = _DiskFull(times=4, partial=45)
        monkeypatch.setattr(jw, "_write_some", disk)
        with pytest.raises(LogWriteError, match="No space left"):
            await sink.handle_batch(_steps(2, 3))
        calls = disk.calls
        await sink.handle_batch(_steps(5, 1))  # within the backoff: no attempt, no raise
        assert disk.calls == calls and sink.statistics().failing
        for k in range(3):  # each retry fails quietly, the backoff doubles
            clock[0] += 10.0
            await sink.handle_batch(_steps(6 + k, 1))
        assert disk.times == 0 and sink.statistics().failing
        clock[0] += 10.0
        await sink.handle_batch(_steps(9, 1))
        assert not sink.statistics().failing
        await sink.aclose()
        stats = sink.statistics()
        assert _step_numbers(tmp_path) == list(range(10))  # strict read: no torn line
        assert (stats.write_errors, stats.lines_lost) == (4, 0)
        (resumed,) = _resumed(tmp_path)
        assert resumed.write_errors == 4 and resumed.outage_s == pytest.approx(40.0)

    async def test_pending_lines_are_bounded_during_an_outage(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Beyond max_pending_bytes the oldest pending lines are given up, and counted."""
        line = _line_size()
        sink = RotatingFileSink(tmp_path, max_pending_bytes=line * 5, wake_interval=0)
        monkeypatch.setattr(jw, "_write_some", _DiskFull(times=1))
        with pytest.raises(LogWriteError):
            await sink.handle_batch(_steps(10, 3))
        await sink.handle_batch(_steps(13, 4))  # 7 pending > 5 lines' worth
        await sink.aclose()
        stats = sink.statistics()
        assert stats.lines_lost == 2
        assert _step_numbers(tmp_path) == [12, 13, 14, 15, 16]
        assert _resumed(tmp_path)[0].lines_lost == 2

    async def test_partial_line_is_cut_at_once(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A failed write leaves no torn line in the file, even if no write ever succeeds."""
        sink = RotatingFileSink(tmp_path, wake_interval=0)
        await sink.handle_batch(_steps(0, 2))
        monkeypatch.setattr(jw, "_write_some", _DiskFull(times=10, partial=45))
        with pytest.raises(LogWriteError):
            await sink.handle_batch(_steps(2, 3))
        data = sink.path.read_bytes()
        assert data.endswith(b"\n") and data.count(b"\n") == 2
        assert _step_numbers(tmp_path) == [0, 1]
        sink._writer._stop.set()  # the sink is abandoned without a close: no more writes

    async def test_file_removed_under_the_sink(self, tmp_path: Path) -> None:
        """A removed live file fails one batch, then a new file holds that batch and the next."""
        sink = RotatingFileSink(tmp_path, wake_interval=0)
        recorder = RecordingSink()
        async with EventBus() as bus:
            bus.subscribe(recorder, SinkFailed)
            bus.subscribe(sink)
            await _publish_all(bus, _steps(0, 3))
            sink.path.unlink()
            await _publish_all(bus, _steps(3, 2))
            await bus.drain()  # the SinkFailed published while the first drain waited
            (failure,) = recorder.of_type(SinkFailed)
            assert "removed while open" in failure.message
            await _publish_all(bus, _steps(5, 2))
        assert _step_numbers(tmp_path) == [3, 4, 5, 6]

    async def test_directory_removed_under_the_sink(self, tmp_path: Path) -> None:
        """A removed directory is recreated at the next batch."""
        logs = tmp_path / "logs"
        sink = RotatingFileSink(logs, wake_interval=0)
        await sink.handle_batch(_steps(0, 1))
        shutil.rmtree(logs)
        with pytest.raises(LogWriteError, match="removed while open"):
            await sink.handle_batch(_steps(1, 1))
        await sink.handle_batch(_steps(2, 1))
        await sink.aclose()
        assert _step_numbers(logs) == [1, 2]

    async def test_failure_at_close_counts_lost_lines(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """If the last write at close fails, aclose raises and the lines are counted lost; the
        message says they are lost (not "kept to retry": nothing comes after the close)."""
        sink = RotatingFileSink(tmp_path, flush_interval=3600.0, wake_interval=0)
        await sink.handle_batch(_steps(0, 4))
        monkeypatch.setattr(jw, "_write_some", _DiskFull(times=1))
        with pytest.raises(LogWriteError, match=r"4 line\(s\) not written at close, lost") as info:
            await sink.aclose()
        assert "retry" not in str(info.value)
        assert sink.statistics().lines_lost == 4
        await sink.aclose()

    def test_statistics_is_a_frozen_snapshot(self, tmp_path: Path) -> None:
        """statistics() returns a frozen dataclass."""
        stats = RotatingFileSink(tmp_path).statistics()
        assert isinstance(stats, FileSinkStatistics)
        with pytest.raises(AttributeError):
            stats.lines_written = 1  # type: ignore[misc]


class _HungWrite:
    """Stands in for write(2): blocks until released (a dead network disk)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def __call__(self, fd: int, data: bytes | bytearray) -> int:
        self.release.wait(30)
        return os.write(fd, data)


class TestWriteBehind:
    """The default: batches are handed to the writer thread; the event loop does not wait."""

    async def test_telemetry_is_handed_over_without_writing(self, tmp_path: Path) -> None:
        """A telemetry batch returns at once (pending, file empty); flush writes it in order."""
        sink = RotatingFileSink(tmp_path, wake_interval=3600.0)
        await sink.start()
        await sink.handle_batch(_steps(0, 5))
        await sink.handle_batch(_steps(5, 5))
        stats = sink.statistics()
        assert (stats.lines_pending, stats.lines_written) == (10, 0)
        assert sink.path.stat().st_size == 0
        await sink.flush()
        assert _step_numbers(tmp_path) == list(range(10))
        assert sink.statistics().lines_pending == 0
        await sink.aclose()

    async def test_the_timer_writes_the_backlog(self, tmp_path: Path) -> None:
        """Without flush or close, the writer thread writes the backlog on its timer."""
        sink = RotatingFileSink(tmp_path, wake_interval=0.01)
        await sink.handle_batch(_steps(0, 3))
        with anyio.fail_after(5):
            while sink.statistics().lines_written < 3:
                await anyio.sleep(0.01)
        assert _step_numbers(tmp_path) == [0, 1, 2]
        await sink.aclose()

    async def test_an_incident_is_written_before_handle_batch_returns(self, tmp_path: Path) -> None:
        """A batch holding an incident is written at once, after the telemetry before it."""
        sink = RotatingFileSink(tmp_path, wake_interval=3600.0)
        await sink.handle_batch(_steps(0, 4))
        incident = NonFiniteDetected(role=TensorRole.LOSS, names=("loss",), step=4)
        await sink.handle_batch([incident])
        kinds = [(e.kind, e.step) for e in read_events(tmp_path)]
        assert kinds == [*(("step_completed", i) for i in range(4)), ("non_finite_detected", 4)]
        await sink.aclose()

    async def test_no_background_thread_when_every_write_is_waited_for(
        self, tmp_path: Path
    ) -> None:
        """wake_interval=0 without a flush interval starts no thread; with one, it flushes."""
        plain = RotatingFileSink(tmp_path / "a", wake_interval=0)
        await plain.handle_batch(_steps(0, 2))
        assert plain.statistics().lines_written == 2
        assert plain._writer._thread is None
        await plain.aclose()
        timed = RotatingFileSink(tmp_path / "b", wake_interval=0, flush_interval=0.01)
        await timed.handle_batch(_steps(0, 3))
        with anyio.fail_after(5):
            while timed.statistics().lines_written < 3:
                await anyio.sleep(0.01)
        await timed.aclose()

    async def test_high_water_makes_the_batch_wait(self, tmp_path: Path) -> None:
        """Past high_water events waiting, handle_batch writes them all before returning."""
        sink = RotatingFileSink(tmp_path, wake_interval=3600.0, high_water=10)
        await sink.handle_batch(_steps(0, 6))
        assert sink.statistics().lines_written == 0
        await sink.handle_batch(_steps(6, 6))
        assert sink.statistics().lines_written == 12
        assert _step_numbers(tmp_path) == list(range(12))
        await sink.aclose()

    async def test_close_writes_the_backlog_and_rotates(self, tmp_path: Path) -> None:
        """Closing writes every handed-over event, rotating at line ends; nothing is lost."""
        line = _line_size()
        sink = RotatingFileSink(tmp_path, max_bytes=line * 20, backup_count=10, wake_interval=60.0)
        for start in range(0, 100, 7):
            await sink.handle_batch(_steps(start, min(7, 100 - start)))
        await sink.aclose()
        assert _step_numbers(tmp_path) == list(range(100))
        assert sink.statistics().rotations >= 4
        assert all(p.stat().st_size <= line * 20 for p in tmp_path.iterdir())

    async def test_order_holds_between_the_timer_and_incidents(self, tmp_path: Path) -> None:
        """Batches written by the timer thread and by the worker (incidents) stay in order."""
        sink = RotatingFileSink(tmp_path, wake_interval=0.001)
        events: list[Event] = []
        for i in range(300):
            batch: list[Event] = [StepCompleted(step=i)]
            if i % 37 == 0:
                batch.append(NonFiniteDetected(role=TensorRole.LOSS, names=("loss",), step=i))
            events += batch
            await sink.handle_batch(batch)
            if i % 50 == 0:
                await anyio.sleep(0.002)
        await sink.aclose()
        assert [(e.kind, e.step) for e in read_events(tmp_path)] == [
            (e.kind, e.step) for e in events
        ]

    @pytest.mark.parametrize("flush_interval", [0.0, 0.01], ids=["write", "timed_flush"])
    async def test_a_background_failure_is_raised_once_and_nothing_is_lost(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flush_interval: float
    ) -> None:
        """Disk full met by the writer thread, on a write or (``flush_interval > 0``) on its
        timed flush: the next batch raises it once, later batches do not, close writes all."""
        sink = RotatingFileSink(tmp_path, wake_interval=0.005, flush_interval=flush_interval)
        await sink.start()
        monkeypatch.setattr(jw, "_write_some", _DiskFull(times=1))
        await sink.handle_batch(_steps(0, 3))
        await _until_failing(sink)
        with pytest.raises(LogWriteError, match="No space left"):
            await sink.handle_batch(_steps(3, 1))
        await sink.handle_batch(_steps(4, 1))  # the outage is reported once
        await sink.aclose()
        assert _step_numbers(tmp_path) == list(range(5))
        stats = sink.statistics()
        assert (stats.write_errors, stats.lines_lost) == (1, 0)
        assert not stats.failing
        assert len(_resumed(tmp_path)) == 1

    async def test_a_background_outage_is_kept_for_the_next_batch_before_it_shows(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Whoever sees ``failing`` and hands a batch over gets the error: the writer thread
        keeps the failure for the next batch before the outage shows in the statistics."""
        sink = RotatingFileSink(tmp_path, wake_interval=0.005)
        await sink.start()
        seen: list[tuple[bool, bool]] = []
        note = jw.JsonlWriter._note_outage_locked

        def noting(self: jw.JsonlWriter, exc: LogWriteError, *, background: bool = False) -> bool:
            starts = note(self, exc, background=background)
            seen.append((self._outage_since is not None, self._deferred is not None))
            return starts

        monkeypatch.setattr(jw.JsonlWriter, "_note_outage_locked", noting)
        monkeypatch.setattr(jw, "_write_some", _DiskFull(times=1))
        await sink.handle_batch(_steps(0, 3))
        await _until_failing(sink)
        with anyio.fail_after(5):  # the outage shows inside _note_outage_locked, seen after it
            while not seen:
                await anyio.sleep(0.001)
        assert seen[0] == (True, True)
        with pytest.raises(LogWriteError, match="No space left"):
            await sink.handle_batch(_steps(3, 1))
        await sink.aclose()
        assert _step_numbers(tmp_path) == list(range(4))

    async def test_unencodable_event_is_reported_by_the_next_batch(self, tmp_path: Path) -> None:
        """An event JSON cannot carry, met by the writer thread: the next batch raises it."""
        sink = RotatingFileSink(tmp_path, wake_interval=3600.0)
        await sink.handle_batch([StepCompleted(step=1), _OpaqueTelemetry(payload={1, 2})])
        with pytest.raises(LogWriteError, match=r"1 event.*could not be encoded"):
            await sink.flush()
        await sink.handle_batch(_steps(2, 1))
        await sink.aclose()
        assert _step_numbers(tmp_path) == [1, 2]
        assert sink.statistics().encode_errors == 1

    async def test_hung_disk_at_close_is_bounded_and_counted(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A write that hangs at close: the bus's close is bounded; the lines show as pending."""
        hung = _HungWrite()
        sink = RotatingFileSink(tmp_path, wake_interval=3600.0)
        try:
            with anyio.fail_after(10):
                async with EventBus(close_timeout=0.2) as bus:
                    bus.subscribe(sink)
                    monkeypatch.setattr(jw, "_write_some", hung)
                    await _publish_all(bus, _steps(0, 10))
            assert sink.thread_busy
            assert sink.statistics().lines_pending == 10
        finally:
            hung.release.set()


def test_decode_error_is_raised_for_a_corrupt_middle_line(tmp_path: Path) -> None:
    """Sanity check of the reader the sink relies on: corruption mid-file is not hidden."""
    (tmp_path / "events.jsonl").write_bytes(b"[oops]\n" + encode_event(StepCompleted(step=1)))
    with pytest.raises(EventDecodeError):
        list(read_events(tmp_path))


def test_restart_cuts_a_torn_tail_longer_than_the_scan(tmp_path: Path) -> None:
    """A kill in the middle of a line longer than the 1 MiB tail scan: the next run cuts it."""
    torn = b'{"kind":"step_completed","source":"' + b"x" * (2 * 1024 * 1024)
    (tmp_path / "events.jsonl").write_bytes(encode_event(StepCompleted(step=0)) + torn)

    async def main() -> None:
        sink = RotatingFileSink(tmp_path)
        await sink.start()
        await sink.handle_batch(_steps(1, 1))
        await sink.aclose()

    anyio.run(main)
    assert _step_numbers(tmp_path) == [0, 1]
