"""RotatingFileSink against the rotation and retention behaviour peer projects test.

Translated (not copied) from CPython's ``Lib/test/test_logging.py`` (``RotatingFileHandlerTest``,
the ``WatchedFileHandler`` race) and loguru's rotation, retention and compression tests, plus
the failures a training run meets: disk full, a read-only directory, a crash mid-write, two
sinks on one directory, events longer than the rotation size, a 1-byte rotation size, non-ASCII
text and numbers at the edges of the 64-bit range. The rule throughout: nothing published is
lost silently; every loss is counted and reported.

Deliberate differences from ``logging.handlers.RotatingFileHandler`` (docs/logging.md): the
live file may fill up to ``max_bytes`` exactly (logging rolls over at ``>=``), and
``backup_count=0`` with rotation on is refused instead of silently never rolling over.
"""

from __future__ import annotations

import errno
import gzip
import os
import shutil
import stat
import zlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest

from eventbus_debug import Event, EventBus, encode_event, event_type, read_events
from eventbus_debug.events import LogWriteResumed, SinkFailed, StepCompleted
from eventbus_debug.exceptions import LogReadError
from eventbus_debug.log import ReadStatistics
from eventbus_debug.sinks import (
    LogDirectoryError,
    LogWriteError,
    RotatingFileSink,
    _jsonl_writer as jw,
    rotating_file as rf,
)
from eventbus_debug.testing import RecordingSink


@event_type
class _Note(Event):
    """Text and integers at the edges of what the log can carry."""

    kind: ClassVar[str] = "tests.rotation_peer.note"
    text: str = ""
    big: int = 0
    value: float = 0.0


def _steps(start: int, n: int) -> list[StepCompleted]:
    """Steps from 100 on have lines of one length (three digits)."""
    return [StepCompleted(step=i) for i in range(start, start + n)]


_LINE = len(encode_event(StepCompleted(step=100)))


def _step_numbers(path: Path) -> list[int | None]:
    return [e.step for e in read_events(path) if isinstance(e, StepCompleted)]


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


class _Clock:
    """The writer's clock, moved by hand (retries and rotation backoffs without sleeping)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# -- CPython RotatingFileHandlerTest ----------------------------------------------------------


class TestLoggingRotatingFileHandler:
    @pytest.mark.parametrize("backup_count", [0, 3])
    async def test_max_bytes_zero_never_rotates(self, tmp_path: Path, backup_count: int) -> None:
        """maxBytes=0: never a rollover, whatever the file holds (also a non-empty file)."""
        (tmp_path / "events.jsonl").write_bytes(encode_event(StepCompleted(step=99)))
        sink = RotatingFileSink(tmp_path, max_bytes=0, backup_count=backup_count, wake_interval=0)
        await sink.start()
        assert not sink.should_rotate(10**12)
        for start in range(100, 160, 20):
            await sink.handle_batch(_steps(start, 20))
        await sink.aclose()
        assert _names(tmp_path) == ["events.jsonl"]
        assert _step_numbers(tmp_path) == [99, *range(100, 160)]
        assert sink.statistics().rotations == 0

    async def test_an_empty_file_never_rotates(self, tmp_path: Path) -> None:
        """gh-116263: an empty file is never rolled over; a line longer than max_bytes goes into
        it; after it, the next line of any size rotates (logging's test_max_bytes)."""
        sink = RotatingFileSink(tmp_path, max_bytes=100, backup_count=2, wake_interval=0)
        assert not sink.should_rotate(1) and not sink.should_rotate(101)
        await sink.handle_batch(_steps(100, 1))  # _LINE > 100 bytes
        assert _names(tmp_path) == ["events.jsonl"]
        assert sink.should_rotate(1) and sink.should_rotate(101)
        await sink.handle_batch(_steps(101, 1))
        assert _names(tmp_path) == ["events.jsonl", "events.jsonl.1"]
        assert not (tmp_path / "events.jsonl.2").exists()
        await sink.aclose()
        assert _step_numbers(tmp_path) == [100, 101]

    async def test_the_live_file_may_fill_max_bytes_exactly(self, tmp_path: Path) -> None:
        """A documented difference: logging rolls over when pos + len >= maxBytes; the sink
        only when the file would grow *past* max_bytes, so it can end at max_bytes exactly."""
        sink = RotatingFileSink(tmp_path, max_bytes=_LINE * 3, backup_count=2, wake_interval=0)
        await sink.handle_batch(_steps(100, 2))
        assert not sink.should_rotate(_LINE)
        assert sink.should_rotate(_LINE + 1)
        await sink.handle_batch(_steps(102, 1))
        assert sink.statistics().rotations == 0
        assert sink.path.stat().st_size == _LINE * 3
        await sink.handle_batch(_steps(103, 1))
        assert sink.statistics().rotations == 1
        await sink.aclose()

    @pytest.mark.parametrize("suffix", ["", ".test"])
    async def test_rollover_filenames(self, tmp_path: Path, suffix: str) -> None:
        """backupCount=2, maxBytes=1: .1 then .2 appear, never .3 (with and without a namer)."""

        def namer(default: str) -> str:
            return default + suffix

        sink = RotatingFileSink(
            tmp_path, max_bytes=1, backup_count=2, namer=namer if suffix else None, wake_interval=0
        )
        live = str(sink.path)
        seen = []
        for step in range(100, 104):
            await sink.handle_batch(_steps(step, 1))
            seen.append([os.path.exists(namer(f"{live}.{i}")) for i in (1, 2, 3)])
        await sink.aclose()
        assert seen == [
            [False, False, False],
            [True, False, False],
            [True, True, False],
            [True, True, False],
        ]
        assert sink.statistics().rotations == 3

    async def test_backup_count_zero(self, tmp_path: Path) -> None:
        """logging: backupCount=0 never rolls over (shouldRollover says yes, nothing moves).
        Here: refused when rotation is on, allowed with max_bytes=0, and rotate() says why it
        cannot rotate rather than deleting the live file or keeping a backup it was told not
        to keep."""
        with pytest.raises(ValueError, match=r"backup_count must be >= 1 when max_bytes > 0"):
            RotatingFileSink(tmp_path, max_bytes=1, backup_count=0)
        sink = RotatingFileSink(tmp_path, max_bytes=0, backup_count=0, wake_interval=0)
        await sink.handle_batch(_steps(100, 3))
        with pytest.raises(ValueError, match=r"rotate\(\) needs backup_count >= 1"):
            await sink.rotate()
        await sink.aclose()
        assert _names(tmp_path) == ["events.jsonl"]
        assert _step_numbers(tmp_path) == [100, 101, 102]

    async def test_namer_and_rotator_compress_like_logging(self, tmp_path: Path) -> None:
        """logging's test_rotator: a zlib rotator under a namer's names; each backup holds the
        lines it should, shifted at each rollover; the source is removed."""

        def namer(default: str) -> str:
            return default + ".z"

        def rotator(source: str, dest: str) -> None:
            with open(source, "rb") as src, open(dest, "wb") as dst:
                dst.write(zlib.compress(src.read(), 9))
            os.remove(source)

        def backup(i: int) -> bytes:
            return zlib.decompress((tmp_path / f"events.jsonl.{i}.z").read_bytes())

        sink = RotatingFileSink(
            tmp_path, max_bytes=1, backup_count=2, namer=namer, rotator=rotator, wake_interval=0
        )
        m1, m2, m3, m4 = _steps(100, 4)
        await sink.handle_batch([m1])
        await sink.handle_batch([m2])
        assert backup(1) == encode_event(m1)
        await sink.handle_batch([m3])
        assert (backup(2), backup(1)) == (encode_event(m1), encode_event(m2))
        await sink.handle_batch([m4])
        assert (backup(2), backup(1)) == (encode_event(m2), encode_event(m3))
        assert not (tmp_path / "events.jsonl.3.z").exists()
        await sink.aclose()
        assert sink.path.read_bytes() == encode_event(m4)

    async def test_a_namer_naming_the_live_file_is_refused(self, tmp_path: Path) -> None:
        """A namer that returns the live path would have the rotation delete the live file
        with its events: the rotation fails loudly, naming it, and every line is kept."""
        sink = RotatingFileSink(
            tmp_path,
            max_bytes=_LINE * 2,
            backup_count=2,
            namer=lambda d: d[: d.rindex(".")],
            wake_interval=0,
        )
        await sink.handle_batch(_steps(100, 2))
        with pytest.raises(LogWriteError, match=r"namer returned the live file's own path"):
            await sink.handle_batch(_steps(102, 2))
        await sink.aclose()
        assert _step_numbers(tmp_path) == [100, 101, 102, 103]
        assert sink.statistics().lines_lost == 0

    async def test_a_link_to_dev_null_never_rotates(self, tmp_path: Path) -> None:
        """bpo-45401: a live path that is not a regular file (here a link to /dev/null, the
        way to discard a log) is never rolled over: the link stays, nothing is renamed."""
        if not os.path.exists(os.devnull):
            pytest.skip("no /dev/null")
        os.symlink(os.devnull, tmp_path / "events.jsonl")
        sink = RotatingFileSink(tmp_path, max_bytes=1, backup_count=2, wake_interval=0)
        for step in range(100, 104):
            await sink.handle_batch(_steps(step, 1))
            assert not sink.should_rotate(10**6)
        await sink.rotate()  # nothing to rotate
        await sink.aclose()
        assert _names(tmp_path) == ["events.jsonl"]
        assert (tmp_path / "events.jsonl").is_symlink()
        stats = sink.statistics()
        assert (stats.lines_written, stats.rotations, stats.write_errors) == (4, 0, 0)

    async def test_a_named_pipe_neither_blocks_nor_rotates(self, tmp_path: Path) -> None:
        """A FIFO as the live file: the check at construction does not wait for a reader,
        the lines go through the pipe, and it is never rotated."""
        fifo = tmp_path / "events.jsonl"
        os.mkfifo(fifo)
        sink = RotatingFileSink(tmp_path, max_bytes=1, backup_count=2, wake_interval=0)
        reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        events = _steps(100, 3)
        try:
            await sink.handle_batch(events)
            data = os.read(reader, 1 << 16)
        finally:
            os.close(reader)
        await sink.aclose()
        assert data == b"".join(encode_event(e) for e in events)
        assert _names(tmp_path) == ["events.jsonl"]
        assert stat.S_ISFIFO((tmp_path / "events.jsonl").stat().st_mode)

    def test_dev_null_as_the_directory(self) -> None:
        """A directory path that is a device is "Not a directory", not "File exists"."""
        if not os.path.exists(os.devnull):
            pytest.skip("no /dev/null")
        with pytest.raises(LogDirectoryError, match=r"Not a directory") as info:
            RotatingFileSink(os.devnull)
        assert info.value.errno == errno.ENOTDIR


# -- logrotate: the file removed or renamed while open (WatchedFileHandler) -------------------


class TestMovedUnderTheSink:
    async def test_renamed_like_logrotate_create(self, tmp_path: Path) -> None:
        """logrotate renames the live file to .1: the sink goes on in a new live file at the
        path (no error), and the log reads back whole, in order."""
        sink = RotatingFileSink(tmp_path, max_bytes=10**6, wake_interval=0)
        await sink.handle_batch(_steps(100, 3))
        os.rename(sink.path, tmp_path / "events.jsonl.1")
        await sink.handle_batch(_steps(103, 3))
        await sink.aclose()
        assert _names(tmp_path) == ["events.jsonl", "events.jsonl.1"]
        assert _step_numbers(tmp_path / "events.jsonl.1") == [100, 101, 102]
        assert _step_numbers(tmp_path) == list(range(100, 106))
        assert sink.statistics().write_errors == 0

    async def test_renamed_to_a_foreign_name(self, tmp_path: Path) -> None:
        """Renamed to a name the reader does not know: what it held stays there; what comes
        after is in the live file (before the fix it followed the renamed file, and
        read_events found no log at all)."""
        sink = RotatingFileSink(tmp_path, wake_interval=0)
        await sink.handle_batch(_steps(100, 2))
        os.rename(sink.path, tmp_path / "archived-events")
        await sink.handle_batch(_steps(102, 2))
        await sink.aclose()
        assert _step_numbers(tmp_path) == [102, 103]
        assert (tmp_path / "archived-events").read_bytes().count(b"\n") == 2

    async def test_removed_then_writes_go_on(self, tmp_path: Path) -> None:
        """Removed while open: one SinkFailed, every later event in a new live file, the
        outage recorded in the log."""
        sink = RotatingFileSink(tmp_path, wake_interval=0)
        recorder = RecordingSink()
        async with EventBus() as bus:
            bus.subscribe(recorder, SinkFailed)
            bus.subscribe(sink)
            for event in _steps(100, 3):
                await bus.publish(event)
            await bus.drain()
            sink.path.unlink()
            for event in _steps(103, 3):
                await bus.publish(event)
            await bus.drain()
            await bus.drain()
        assert _step_numbers(tmp_path) == [103, 104, 105]
        assert len(recorder.of_type(SinkFailed)) == 1
        assert len([e for e in read_events(tmp_path) if isinstance(e, LogWriteResumed)]) == 1
        assert sink.statistics().lines_lost == 0

    async def test_removed_between_the_check_and_the_write(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The race the check before the write cannot see: the file is removed just before
        the write lands in it. The lines are written again into the new file, not lost."""
        sink = RotatingFileSink(tmp_path, wake_interval=0)
        await sink.handle_batch(_steps(100, 2))
        removed = [False]

        def remove_then_write(fd: int, data: bytes | bytearray) -> int:
            if not removed[0]:
                removed[0] = True
                sink.path.unlink()
            return os.write(fd, data)

        monkeypatch.setattr(jw, "_write_some", remove_then_write)
        with pytest.raises(LogWriteError, match="removed while open"):
            await sink.handle_batch(_steps(102, 3))
        await sink.aclose()
        assert _step_numbers(tmp_path) == [102, 103, 104]
        stats = sink.statistics()
        assert (stats.lines_written, stats.lines_lost, stats.lines_pending) == (6, 0, 0)

    async def test_truncated_in_place_like_copytruncate(self, tmp_path: Path) -> None:
        """copytruncate empties the live file in place: the sink takes its size from the file,
        so it does not rotate a nearly empty file early."""
        sink = RotatingFileSink(tmp_path, max_bytes=_LINE * 5, backup_count=3, wake_interval=0)
        await sink.handle_batch(_steps(100, 4))
        os.truncate(sink.path, 0)
        await sink.handle_batch(_steps(104, 4))
        await sink.aclose()
        assert _names(tmp_path) == ["events.jsonl"]
        assert _step_numbers(tmp_path) == list(range(104, 108))
        assert sink.statistics().rotations == 0


# -- loguru: rotation, retention, compression ---------------------------------------------------


class TestLoguruRotation:
    async def test_size_rotation_and_retention(self, tmp_path: Path) -> None:
        """Rotation by size keeps backup_count files: the newest events, contiguous, none
        split, each file within the size."""
        sink = RotatingFileSink(tmp_path, max_bytes=_LINE * 3, backup_count=2, wake_interval=0)
        for step in range(100, 120):
            await sink.handle_batch(_steps(step, 1))
        await sink.aclose()
        assert _names(tmp_path) == ["events.jsonl", "events.jsonl.1", "events.jsonl.2"]
        assert all(p.stat().st_size <= _LINE * 3 for p in tmp_path.iterdir())
        steps = _step_numbers(tmp_path)
        assert steps == list(range(120 - len(steps), 120)) and len(steps) >= 7
        assert sink.statistics().lines_written == 20

    async def test_compression_of_rotated_files(self, tmp_path: Path) -> None:
        """compress=True: every backup is gzip holding exactly the lines it rotated away; no
        temporary file is left; the whole log reads back."""
        sink = RotatingFileSink(
            tmp_path, max_bytes=_LINE * 4, backup_count=10, compress=True, wake_interval=0
        )
        events = _steps(100, 20)
        for start in range(0, 20, 4):
            await sink.handle_batch(events[start : start + 4])
        await sink.aclose()
        names = _names(tmp_path)
        assert names == ["events.jsonl", *(f"events.jsonl.{i}.gz" for i in (1, 2, 3, 4))]
        for i in (1, 2, 3, 4):
            with gzip.open(tmp_path / f"events.jsonl.{i}.gz", "rb") as fh:
                first = 4 * (4 - i)
                assert fh.read() == b"".join(encode_event(e) for e in events[first : first + 4])
        assert _step_numbers(tmp_path) == list(range(100, 120))

    async def test_a_backup_of_the_same_name_exists_already(self, tmp_path: Path) -> None:
        """A .1 left by an earlier run is shifted to .2, never overwritten, and read first."""
        (tmp_path / "events.jsonl.1").write_bytes(encode_event(StepCompleted(step=1)))
        (tmp_path / "events.jsonl").write_bytes(encode_event(StepCompleted(step=2)))
        sink = RotatingFileSink(tmp_path, max_bytes=_LINE * 2, backup_count=5, wake_interval=0)
        await sink.handle_batch(_steps(100, 3))
        await sink.aclose()
        assert _names(tmp_path) == ["events.jsonl", "events.jsonl.1", "events.jsonl.2"]
        assert _step_numbers(tmp_path) == [1, 2, 100, 101, 102]

    async def test_a_backup_name_taken_by_a_directory(self, tmp_path: Path) -> None:
        """The backup name is a directory: the rotation fails once, loudly, and the lines go
        on into the live file (which then passes max_bytes); none is lost."""
        (tmp_path / "events.jsonl.1").mkdir()
        sink = RotatingFileSink(tmp_path, max_bytes=_LINE * 2, backup_count=1, wake_interval=0)
        await sink.handle_batch(_steps(100, 2))
        with pytest.raises(LogWriteError, match="cannot rotate the log file"):
            await sink.handle_batch(_steps(102, 2))
        await sink.handle_batch(_steps(104, 2))
        await sink.aclose()
        assert _step_numbers(sink.path) == list(range(100, 106))
        stats = sink.statistics()
        assert (stats.lines_lost, stats.rotations, stats.lines_pending) == (0, 0, 0)
        assert stats.lines_written == 6 + 1  # and the LogWriteResumed closing the failure

    async def test_directory_removed_while_running(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The log directory (and its parent) removed: both are recreated at the retry,
        rotation goes on in them, and every event published after the removal is there."""
        clock = _Clock()
        monkeypatch.setattr(jw, "_clock", clock)
        logs = tmp_path / "run" / "logs"
        sink = RotatingFileSink(logs, max_bytes=_LINE * 2, backup_count=10, wake_interval=0)
        await sink.handle_batch(_steps(100, 3))
        for path in sorted(logs.iterdir()):
            path.unlink()
        logs.rmdir()
        logs.parent.rmdir()
        with pytest.raises(LogWriteError, match="removed while open"):
            await sink.handle_batch(_steps(103, 1))
        clock.now += 10.0
        await sink.handle_batch(_steps(104, 4))
        await sink.aclose()
        assert _step_numbers(logs) == list(range(103, 108))
        stats = sink.statistics()
        assert stats.rotations >= 2 and stats.lines_lost == 0
        for path in logs.iterdir():  # the LogWriteResumed line alone is longer: a file of its own
            data = path.read_bytes()
            assert len(data) <= _LINE * 2 or data.count(b"\n") == 1, path.name


# -- disk full, read-only, crashes ---------------------------------------------------------------


class TestFailures:
    async def test_disk_full_while_compressing_a_backup(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """ENOSPC in the gzip of a rotation: no temporary file is left behind, the live file
        keeps every line, the rotation is retried after its backoff and then succeeds."""
        clock = _Clock()
        monkeypatch.setattr(jw, "_clock", clock)
        fail = [True]
        real_copy = shutil.copyfileobj

        def copy(src: Any, dst: Any, length: int) -> None:
            if fail[0]:
                fail[0] = False
                dst.write(b"x" * 100)  # some of the .tmp reached the disk
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            real_copy(src, dst, length)

        monkeypatch.setattr(rf, "shutil", SimpleNamespace(copyfileobj=copy))
        sink = RotatingFileSink(
            tmp_path, max_bytes=_LINE * 2, backup_count=3, compress=True, wake_interval=0
        )
        await sink.handle_batch(_steps(100, 2))
        with pytest.raises(LogWriteError, match="No space left on device"):
            await sink.handle_batch(_steps(102, 1))
        assert _names(tmp_path) == ["events.jsonl"]  # no events.jsonl.1.gz.tmp
        clock.now += 10.0
        await sink.handle_batch(_steps(103, 1))
        await sink.aclose()
        names = _names(tmp_path)
        assert names[0] == "events.jsonl" and len(names) >= 2
        assert all(n.endswith(".gz") for n in names[1:])  # and no .tmp
        assert _step_numbers(tmp_path) == [100, 101, 102, 103]
        stats = sink.statistics()
        assert stats.lines_lost == 0 and stats.rotations == len(names) - 1

    async def test_a_long_outage_counts_and_reports_every_line_given_up(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Disk full for longer than max_pending_bytes holds: the oldest lines are given up,
        counted in lines_lost, and the LogWriteResumed in the log says how many; no line is
        torn, and published = written + lost."""
        clock = _Clock()
        monkeypatch.setattr(jw, "_clock", clock)
        full = [True]
        calls = [0]

        def write(fd: int, data: bytes | bytearray) -> int:
            """As write(2) on a full disk: a short write (half a line), then ENOSPC."""
            calls[0] += 1
            if not full[0]:
                return os.write(fd, data)
            if calls[0] % 2:
                return os.write(fd, bytes(data[: _LINE // 2]))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(jw, "_write_some", write)
        sink = RotatingFileSink(tmp_path, max_pending_bytes=_LINE * 4, wake_interval=0)
        with pytest.raises(LogWriteError, match="No space left"):
            await sink.handle_batch(_steps(100, 3))
        for start in range(103, 110):
            clock.now += 10.0
            await sink.handle_batch(_steps(start, 1))  # retried quietly, failing
        assert sink.path.read_bytes() == b""  # the half line was cut at once
        full[0] = False
        clock.now += 10.0
        await sink.handle_batch(_steps(110, 1))
        await sink.aclose()
        stats = sink.statistics()
        assert stats.lines_lost == 11 - 4
        assert _step_numbers(tmp_path) == [107, 108, 109, 110]
        (resumed,) = [e for e in read_events(tmp_path) if isinstance(e, LogWriteResumed)]
        assert resumed.lines_lost == stats.lines_lost
        assert stats.lines_written == 4 + 1  # the kept lines and the LogWriteResumed

    async def test_read_only_file_system_at_start(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A read-only directory (EROFS, as root meets it too) fails at construction, naming
        the directory, the error and the remedy."""
        real_open = os.open
        logs = tmp_path / "ro"

        def refusing(path: str | os.PathLike[str], flags: int, *args: int, **kw: int) -> int:
            if Path(path).parent == logs and flags & (os.O_WRONLY | os.O_RDWR):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))
            return real_open(path, flags, *args, **kw)

        monkeypatch.setattr(os, "open", refusing)
        with pytest.raises(LogDirectoryError, match=r"ro'.*Read-only file system") as info:
            RotatingFileSink(logs)
        assert info.value.errno == errno.EROFS
        assert "pass a directory you can write to" in str(info.value)

    @pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a 0o500 directory anyway")
    def test_read_only_directory_with_a_writable_log(self, tmp_path: Path) -> None:
        """The live file is writable but the directory is not: rotation could never rename
        it, so the sink refuses at construction."""
        (tmp_path / "events.jsonl").write_bytes(b"")
        tmp_path.chmod(0o500)
        try:
            with pytest.raises(LogDirectoryError, match="Permission denied"):
                RotatingFileSink(tmp_path)
        finally:
            tmp_path.chmod(0o700)

    async def test_crash_mid_write_then_read_and_restart(self, tmp_path: Path) -> None:
        """A killed run leaves half a line: read_events skips and counts it; the next run cuts
        it before appending; the log then reads back strictly."""
        sink = RotatingFileSink(tmp_path, wake_interval=0)
        await sink.handle_batch(_steps(100, 3))
        await sink.aclose()
        cut = encode_event(StepCompleted(step=103))
        with open(sink.path, "ab") as fh:
            fh.write(cut[: len(cut) // 3])
        stats = ReadStatistics()
        assert [e.step for e in read_events(tmp_path, stats=stats)] == [100, 101, 102]
        assert (stats.torn_lines, stats.events) == (1, 3)
        again = RotatingFileSink(tmp_path, wake_interval=0)
        await again.handle_batch(_steps(104, 2))
        await again.aclose()
        stats = ReadStatistics()
        assert [e.step for e in read_events(tmp_path, stats=stats)] == [100, 101, 102, 104, 105]
        assert stats.torn_lines == 0

    def test_a_gzip_backup_cut_short(self, tmp_path: Path) -> None:
        """A compressed backup cut short (copied while written, a full disk elsewhere): strict
        reading says where it stopped; strict=False keeps what it could read and goes on."""
        whole = gzip.compress(b"".join(encode_event(e) for e in _steps(100, 50)))
        (tmp_path / "events.jsonl.1.gz").write_bytes(whole[: len(whole) // 2])
        (tmp_path / "events.jsonl").write_bytes(encode_event(StepCompleted(step=999)))
        with pytest.raises(LogReadError, match=r"events.jsonl.1.gz' past line"):
            list(read_events(tmp_path))
        steps = [e.step for e in read_events(tmp_path, strict=False)]
        assert steps[-1] == 999 and steps[:-1] == list(range(100, 100 + len(steps) - 1))


# -- shapes of input ------------------------------------------------------------------------------


class TestInputs:
    async def test_two_sinks_on_one_directory(self, tmp_path: Path) -> None:
        """Two sinks writing one rank's file: whole lines, both copies of every event, each
        follows the other's rotations, and no file passes max_bytes."""
        a, b = (
            RotatingFileSink(
                tmp_path, max_bytes=_LINE * 10, backup_count=100, wake_interval=0, name=n
            )
            for n in ("a", "b")
        )
        for start in range(100, 160, 3):
            await a.handle_batch(_steps(start, 3))
            await b.handle_batch(_steps(start + 500, 3))
        await a.aclose()
        await b.aclose()
        stats = ReadStatistics()
        steps = [e.step for e in read_events(tmp_path, stats=stats)]
        assert sorted(s for s in steps if s is not None) == [
            *range(100, 160),
            *range(600, 660),
        ]
        assert (stats.torn_lines, stats.invalid_lines) == (0, 0)
        assert all(p.stat().st_size <= _LINE * 10 for p in tmp_path.iterdir())
        written = a.statistics().lines_written + b.statistics().lines_written
        assert written == 120 and a.statistics().lines_lost == b.statistics().lines_lost == 0

    @pytest.mark.parametrize("wake_interval", [0.0, 3600.0])
    async def test_events_longer_than_the_rotation_size(
        self, tmp_path: Path, wake_interval: float
    ) -> None:
        """A line longer than max_bytes gets a file of its own, never split; small lines
        around it still share files."""
        sink = RotatingFileSink(
            tmp_path, max_bytes=_LINE * 3, backup_count=20, wake_interval=wake_interval
        )
        big = [StepCompleted(step=200 + i, source="x" * (_LINE * 5)) for i in range(2)]
        await sink.handle_batch(_steps(100, 2))
        await sink.handle_batch([big[0], *_steps(102, 2), big[1]])
        await sink.handle_batch(_steps(104, 1))
        await sink.aclose()
        assert _step_numbers(tmp_path) == [100, 101, 200, 102, 103, 201, 104]
        for path in tmp_path.iterdir():
            data = path.read_bytes()
            assert data.endswith(b"\n")
            assert len(data) <= _LINE * 3 or data.count(b"\n") == 1, path.name
        assert sink.statistics().rotations == 4

    async def test_rotation_size_of_one_byte(self, tmp_path: Path) -> None:
        """max_bytes=1: one line per file, backup_count of them kept, every line counted."""
        sink = RotatingFileSink(tmp_path, max_bytes=1, backup_count=3, wake_interval=0)
        await sink.handle_batch(_steps(100, 10))  # one batch across nine boundaries
        await sink.aclose()
        assert _names(tmp_path) == ["events.jsonl", *(f"events.jsonl.{i}" for i in (1, 2, 3))]
        assert all(p.read_bytes().count(b"\n") == 1 for p in tmp_path.iterdir())
        assert _step_numbers(tmp_path) == [106, 107, 108, 109]
        stats = sink.statistics()
        assert (stats.lines_written, stats.rotations, stats.lines_lost) == (10, 9, 0)

    async def test_non_ascii_and_edge_numbers_round_trip(self, tmp_path: Path) -> None:
        """Text in any script, control characters and the 64-bit edges come back as written;
        the rotation size counts bytes, not characters."""
        notes = [
            _Note(text='héllo 日本語 🎉 \x00\n"\\', big=2**63 - 1, value=1.7976931348623157e308),
            _Note(text="é" * 40, big=-(2**63), value=5e-324),
            _Note(text="\u2028\u2029", big=0, value=-0.0),
        ]
        size = max(len(encode_event(n)) for n in notes)
        sink = RotatingFileSink(tmp_path, max_bytes=size, backup_count=5, wake_interval=0)
        await sink.handle_batch(notes)
        await sink.aclose()
        assert all(p.stat().st_size <= size for p in tmp_path.iterdir())
        back = [e for e in read_events(tmp_path) if isinstance(e, _Note)]
        assert [(e.text, e.big, e.value) for e in back] == [(n.text, n.big, n.value) for n in notes]

    async def test_values_the_log_cannot_carry_are_counted_and_named(self, tmp_path: Path) -> None:
        """An integer beyond 64 bits or a lone surrogate: the event is refused (counted in
        encode_errors, the batch raises naming kind and field); the others are written."""
        sink = RotatingFileSink(tmp_path, wake_interval=0)
        bad = [
            (_Note(big=2**64), "field 'big'"),
            (_Note(big=-(2**63) - 1), "field 'big'"),
            (_Note(text="\ud800"), "field 'text'"),
            (StepCompleted(step=2**70), "field 'step'"),
        ]
        for event, field in bad:
            with pytest.raises(LogWriteError, match=rf"1 event.*could not be encoded.*{field}"):
                await sink.handle_batch([_Note(text="before"), event, _Note(text="after")])
        await sink.aclose()
        stats = sink.statistics()
        assert (stats.encode_errors, stats.lines_written, stats.lines_lost) == (4, 8, 0)
        texts = [e.text for e in read_events(tmp_path) if isinstance(e, _Note)]
        assert texts == ["before", "after"] * 4
