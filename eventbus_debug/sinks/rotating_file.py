"""The canonical JSON-lines log: a sink that writes every event, one line each, with rotation.

:class:`RotatingFileSink` takes its shape from :class:`logging.handlers.RotatingFileHandler`:
:meth:`~RotatingFileSink.should_rotate` and :meth:`~RotatingFileSink.rotate` are two steps, and
``namer`` / ``rotator`` callables customize backup names and the move (the default with
``compress=True`` gzips). The file names are those :func:`eventbus_debug.read_events` reads:
``events.jsonl`` (``events.rank{N}.jsonl`` for rank N > 0), backups ``.1`` (newest) … ``.N``,
``.gz`` appended when compressed.

All file I/O — encoding a batch, the write, renames, gzip, fsync — runs in the sink's own daemon
thread, never on the event loop; a write that hangs (a dead network disk) is abandoned at close
and never keeps the process alive. A batch is encoded into one buffer and written with one system
call (more only when the batch crosses a rotation boundary: a line is never split between two
files).

The log is the one sink that must not shed: it asks the bus for a large queue
(``queue_capacity``) and for flow control (``backpressure``), so ``await bus.publish(...)``
waits for it rather than dropping events when it falls behind.

Disk full (or any write error): the lines not written are kept (up to ``max_pending_bytes``,
the oldest given up and counted beyond that) and retried with exponential backoff; the first
failure of an outage raises :class:`LogWriteError` (one ``SinkFailed`` incident), later ones
during the same outage do not, so the bus never disables the log for a transient error. When a
write succeeds again, a :class:`~eventbus_debug.events.LogWriteResumed` line records the outage.
A partial line left by a failed write is cut off at once: the file only ever holds whole lines.

Example::

    async with EventBus() as bus:
        bus.subscribe(RotatingFileSink("debug_logs", max_bytes=50_000_000, backup_count=5))
        ...
    for event in read_events("debug_logs"):
        ...
"""

from __future__ import annotations

import errno
import gzip
import os
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, TypeVar

# The submodules, not the package: mypy cannot see the package's computed __all__.
from eventbus_debug.diagnostics import get_logger
from eventbus_debug.events import Event, LogWriteResumed, current_rank
from eventbus_debug.exceptions import EventBusError, EventDecodeError
from eventbus_debug.log.encoding import decode_event, encode_event, encode_events
from eventbus_debug.log.files import log_file_name
from eventbus_debug.threads import DaemonWorker

__all__ = (
    "DEFAULT_BACKUP_COUNT",
    "DEFAULT_MAX_BYTES",
    "FileSinkStatistics",
    "LogDirectoryError",
    "LogWriteError",
    "RotatingFileSink",
)

_log = get_logger(__name__)

DEFAULT_MAX_BYTES: Final = 100 * 1024 * 1024
"""Rotate when the live file would exceed 100 MiB."""
DEFAULT_BACKUP_COUNT: Final = 5
"""Keep five rotated files."""
DEFAULT_BUFFER_SIZE: Final = 256 * 1024
"""With ``flush_interval > 0``, write at once when this many bytes are buffered."""
DEFAULT_QUEUE_CAPACITY: Final = 32768
"""Events the bus may queue for the log (flow control starts at half of it)."""
DEFAULT_MAX_PENDING_BYTES: Final = 64 * 1024 * 1024
"""Encoded lines kept for retry while writes fail (disk full); older ones are given up."""
RETRY_INITIAL: Final = 0.05
RETRY_MAX: Final = 5.0
"""Backoff between write attempts during an outage: 50 ms, doubling, at most 5 s."""
_GZIP_LEVEL: Final = 6
_COPY_CHUNK: Final = 1024 * 1024
_FILE_MODE: Final = 0o644
_TAIL_SCAN: Final = 1024 * 1024
_clock: Callable[[], float] = time.monotonic
"""The backoff's clock (a seam for tests)."""
_MAX_TAIL_DECODE: Final = 64 * 1024 * 1024

Namer = Callable[[str], str]
"""``namer(default_name) -> name``: the path of a backup (default ``<live>.<i>``)."""
Rotator = Callable[[str, str], None]
"""``rotator(source, dest)``: move the full live file to its first backup name."""


class LogDirectoryError(EventBusError, OSError):
    """Raised by :class:`RotatingFileSink` when its directory cannot be created or written.

    The message names the path and the operating system's error; ``errno`` and ``filename``
    are set as on :class:`OSError`. Pass a directory you can write to, or fix its permissions.
    """


class LogWriteError(EventBusError, OSError):
    """Raised by :meth:`RotatingFileSink.handle_batch` when writing the log fails at run time.

    The bus turns it into a ``SinkFailed`` incident; training goes on. The lines that could not
    be written are kept and retried with backoff (see the sink's documentation).
    """


@dataclass(frozen=True, slots=True)
class FileSinkStatistics:
    """A snapshot of a :class:`RotatingFileSink`'s counters.

    Attributes:
        path: the live log file.
        lines_written: events written to the operating system (in every file, over the run).
        bytes_written: bytes written to the operating system.
        lines_pending: lines encoded but not written yet (buffered, or kept after a failure).
        lines_lost: lines given up during a write outage (the pending buffer is bounded by
            ``max_pending_bytes``) or because the final write at close failed.
        rotations: how many times the live file was rotated.
        write_errors: write, open or rotation failures (the first of an outage raised from
            ``handle_batch``, the others retried quietly with backoff).
        encode_errors: events that could not be encoded (they hold values JSON cannot carry).
        current_size: bytes in the live file.
        failing: whether writes are failing now (an outage under way, retried with backoff).
    """

    path: str
    lines_written: int
    bytes_written: int
    lines_pending: int
    lines_lost: int
    rotations: int
    write_errors: int
    encode_errors: int
    current_size: int
    failing: bool = False


def _default_rotator(source: str, dest: str) -> None:
    if os.path.exists(source):
        os.replace(source, dest)


def _gzip_rotator(source: str, dest: str) -> None:
    """Compress *source* into *dest* (through a temporary name, so a crash leaves no half .gz)."""
    if not os.path.exists(source):
        return
    tmp = dest + ".tmp"
    with open(source, "rb") as src, gzip.open(tmp, "wb", compresslevel=_GZIP_LEVEL) as dst:
        shutil.copyfileobj(src, dst, _COPY_CHUNK)
    os.replace(tmp, dest)
    os.remove(source)


def _gzip_namer(default_name: str) -> str:
    return default_name + ".gz"


class RotatingFileSink:
    """Write every event as one JSON line into ``directory``, rotating by size.

    Subscribe it to a bus (``bus.subscribe(RotatingFileSink("logs"))``); the bus hands it
    everything queued at once through :meth:`handle_batch`. Read the log back with
    :func:`eventbus_debug.read_events`.

    Failure behaviour: a write that fails (disk full, file removed, directory gone) raises
    :class:`LogWriteError` from :meth:`handle_batch` once per outage, which the bus reports as
    a ``SinkFailed`` incident; training is not affected. The lines that were not written are
    kept (at most *max_pending_bytes*, the oldest given up beyond that and counted in
    ``statistics().lines_lost``) and retried with exponential backoff (50 ms to 5 s) into a
    reopened file; when a write succeeds again a ``LogWriteResumed`` line says how long the
    outage lasted and how many lines it cost. A partial line left by a failed write is cut off
    at once, so the file only ever holds whole lines.

    Args:
        directory: where the log lives; created (with parents) if missing.
        max_bytes: rotate before the live file would grow past this size; ``0`` never rotates.
        backup_count: rotated files kept (``.1`` newest … ``.N`` oldest); older ones are
            deleted. Must be >= 1 when rotating.
        compress: gzip rotated files (``events.jsonl.1.gz``); compression runs in the worker
            thread during rotation.
        flush_interval: ``0`` (default) writes every batch to the operating system as it
            arrives, so a killed process loses nothing already handled. A positive value
            buffers up to ``buffer_size`` bytes and writes at least every this many seconds
            (from a background thread) and on close.
        fsync: also ``os.fsync`` the file after every write and at close (survives power loss;
            costs a disk round trip per write).
        rank: the rank whose file this is; defaults to :func:`eventbus_debug.current_rank`.
        namer: ``namer(default_path) -> path`` of a backup, as in :mod:`logging.handlers`.
            Keep the names :func:`~eventbus_debug.read_events` recognizes if you read them back.
        rotator: ``rotator(source, dest)`` moves the full live file to its first backup.
            ``compress=True`` supplies a gzip namer and rotator unless you pass your own.
        buffer_size: bytes buffered before a write when ``flush_interval > 0``.
        name: the subscription name the bus uses.
        queue_capacity: events the bus may queue for this sink (its ``queue_capacity``
            attribute; the bus starts flow control at half of it).
        max_pending_bytes: encoded lines kept for retry while writes fail.

    Raises:
        ValueError: if an option is out of range (the message names it).
        LogDirectoryError: if *directory* cannot be created or its log file cannot be opened
            for writing (the message names the path and the OS error).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        backup_count: int = DEFAULT_BACKUP_COUNT,
        compress: bool = False,
        flush_interval: float = 0.0,
        fsync: bool = False,
        rank: int | None = None,
        namer: Namer | None = None,
        rotator: Rotator | None = None,
        buffer_size: int = DEFAULT_BUFFER_SIZE,
        name: str = "rotating_file",
        queue_capacity: int = DEFAULT_QUEUE_CAPACITY,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
    ) -> None:
        _check_int("max_bytes", max_bytes, minimum=0)
        _check_int("backup_count", backup_count, minimum=0)
        _check_int("buffer_size", buffer_size, minimum=1)
        _check_int("queue_capacity", queue_capacity, minimum=1)
        _check_int("max_pending_bytes", max_pending_bytes, minimum=1)
        if max_bytes > 0 and backup_count < 1:
            msg = (
                f"backup_count must be >= 1 when max_bytes > 0, got {backup_count!r}; "
                "rotation keeps the old file as a backup (pass max_bytes=0 to never rotate)"
            )
            raise ValueError(msg)
        if (
            isinstance(flush_interval, bool)
            or not isinstance(flush_interval, (int, float))
            or not flush_interval >= 0
            or flush_interval == float("inf")
        ):
            msg = f"flush_interval must be a finite number of seconds >= 0, got {flush_interval!r}"
            raise ValueError(msg)
        if rank is None:
            rank = current_rank()
        self.name = name
        self.queue_capacity = queue_capacity
        self.backpressure = True  # the bus flow-controls `await publish` for the log
        self._max_pending = max_pending_bytes
        self._dir = Path(directory)
        self._path = self._dir / log_file_name(rank)
        self._rank = rank
        self._max_bytes = max_bytes
        self._backup_count = backup_count
        self._flush_interval = float(flush_interval)
        self._fsync = bool(fsync)
        self._buffer_size = buffer_size
        self._namer = namer if namer is not None else (_gzip_namer if compress else None)
        self._rotator = (
            rotator if rotator is not None else (_gzip_rotator if compress else _default_rotator)
        )

        self._lock = threading.Lock()  # guards everything below; held by worker threads only
        self._fd: int | None = None
        self._ino = -1
        self._size = 0  # bytes in the live file, always at a line boundary
        self._repair = False  # the live file may end with a partial line to truncate
        self._buffer = bytearray()  # encoded lines not written yet
        self._buffer_lines = 0
        self._deferred: LogWriteError | None = None  # a background flush failure, for next batch
        self._closed = False
        self._worker = DaemonWorker(f"eventbus-file-{name}")
        # An outage: writes failing since _outage_since, retried from _next_attempt on.
        self._outage_since: float | None = None
        self._next_attempt = 0.0
        self._backoff = RETRY_INITIAL
        self._outage_errors = 0
        self._outage_lost = 0
        self._outage_error = ""
        self._flusher: threading.Thread | None = None
        self._stop_flusher = threading.Event()

        self._lines_written = 0
        self._bytes_written = 0
        self._lines_lost = 0
        self._rotations = 0
        self._write_errors = 0
        self._encode_errors = 0

        self._check_directory()

    # -- public API ----------------------------------------------------------------------------

    @property
    def path(self) -> Path:
        """The live log file (``<directory>/events.jsonl`` or ``events.rank{N}.jsonl``)."""
        return self._path

    @property
    def directory(self) -> Path:
        """The log directory."""
        return self._dir

    def __repr__(self) -> str:
        return f"<RotatingFileSink {str(self._path)!r} max_bytes={self._max_bytes}>"

    def statistics(self) -> FileSinkStatistics:
        """A snapshot of the sink's counters (lines, bytes, rotations, errors)."""
        return FileSinkStatistics(
            path=str(self._path),
            lines_written=self._lines_written,
            bytes_written=self._bytes_written,
            lines_pending=self._buffer_lines,
            lines_lost=self._lines_lost,
            rotations=self._rotations,
            write_errors=self._write_errors,
            encode_errors=self._encode_errors,
            current_size=self._size,
            failing=self._outage_since is not None,
        )

    @property
    def thread_busy(self) -> bool:
        """Whether the sink's thread is inside a call now (a write that hangs keeps it busy)."""
        return self._worker.busy

    def should_rotate(self, size: int, /) -> bool:
        """Whether *size* more bytes would take the live file past ``max_bytes``.

        An empty file never needs rotating: a single line longer than ``max_bytes`` gets a file
        of its own rather than being split.
        """
        if self._max_bytes <= 0:
            return False
        current = self._size + len(self._buffer)
        return current > 0 and current + size > self._max_bytes

    async def rotate(self) -> None:
        """Rotate now: write what is buffered, shift the backups, start a new live file.

        Raises:
            LogWriteError: if writing, renaming or compressing fails.
            RuntimeError: if the sink is closed.
        """
        self._check_open()
        await self._worker.run(self._locked_rotate)

    async def start(self) -> None:
        """Open the live file (in a worker thread) and start the interval flusher, if any."""
        self._check_open()
        await self._worker.run(self._locked_open)

    async def handle(self, event: Event, /) -> None:
        """Write one event (prefer :meth:`handle_batch`; the bus does)."""
        await self.handle_batch((event,))

    async def handle_batch(self, events: Sequence[Event], /) -> None:
        """Encode and write *events* in a worker thread, in order, rotating as needed.

        Raises:
            LogWriteError: if a write fails for the first time since the last success (the
                unwritten lines are kept and retried with backoff), or an event cannot be
                encoded (the others are written).
            RuntimeError: if the sink is closed.
        """
        self._check_open()
        if not events:
            return
        await self._worker.run(self._write_batch, events)

    async def flush(self) -> None:
        """Write everything buffered now (and fsync when enabled).

        Raises:
            LogWriteError: if the write fails.
        """
        if self._closed:
            return
        await self._worker.run(self._locked_flush)

    async def aclose(self) -> None:
        """Write what is buffered, fsync if enabled, close the file. Idempotent.

        Cancelling the caller (the bus's close deadline) abandons a write that hangs: the
        sink's daemon thread is left behind and :attr:`thread_busy` stays true.

        Raises:
            LogWriteError: if the final write fails (the lines are then counted as lost).
        """
        if self._closed:
            return
        self._closed = True
        self._stop_flusher.set()
        try:
            await self._worker.run(self._close_sync)
        finally:
            self._worker.stop()

    # -- event-loop side helpers ---------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            msg = f"{self!r} is closed; create a new sink to write again"
            raise RuntimeError(msg)

    def _check_directory(self) -> None:
        """Create the directory and prove that the live file can be opened for appending."""
        try:
            self._dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, _FILE_MODE)
            os.close(fd)
            if not os.access(self._dir, os.W_OK | os.X_OK):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self._dir))
        except OSError as exc:
            where = f" ({exc.filename})" if exc.filename not in (None, str(self._dir)) else ""
            msg = (
                f"cannot write the event log in directory {str(self._dir)!r}: "
                f"{exc.strerror or exc}{where}; pass a directory you can write to "
                "(it is created if missing) or fix its permissions"
            )
            raise _os_error(LogDirectoryError, exc.errno, msg) from None

    # -- worker-thread side (everything below holds self._lock) --------------------------------

    def _write_batch(self, events: Sequence[Event]) -> None:
        data, bad = _encode_all(events)
        with self._lock:
            self._encode_errors += len(bad)
            try:
                deferred, self._deferred = self._deferred, None
                try:
                    self._append_locked(data)
                    self._trim_pending_locked()
                    if self._outage_since is not None:
                        if _clock() >= self._next_attempt:
                            self._flush_locked()  # a retry, on the backoff schedule
                    elif self._flush_interval == 0 or len(self._buffer) >= self._buffer_size:
                        self._flush_locked()
                except LogWriteError as exc:
                    if self._note_outage_locked(exc):
                        raise  # the first failure of an outage: one SinkFailed incident
                if deferred is not None:
                    raise deferred  # the background flusher's first failure of an outage
            finally:
                self._ensure_flusher()
        if bad:
            event, error = bad[0]
            msg = (
                f"{len(bad)} event(s) of the batch could not be encoded and were not written "
                f"(first: {type(event).__name__} seq={event.seq}: {error})"
            )
            raise LogWriteError(msg)

    def _note_outage_locked(self, exc: LogWriteError) -> bool:
        """Schedule the next attempt with backoff; returns True if this failure starts an outage."""
        now = _clock()
        self._outage_error = str(exc)
        if self._outage_since is None:
            self._outage_since = now
            self._outage_errors = 1
            self._outage_lost = 0
            self._backoff = RETRY_INITIAL
            self._next_attempt = now + self._backoff
            _log.warning("log_write_failing", path=str(self._path), error=str(exc))
            return True
        self._outage_errors += 1
        self._backoff = min(self._backoff * 2, RETRY_MAX)
        self._next_attempt = now + self._backoff
        return False

    def _end_outage_locked(self, fd: int) -> None:
        """Writes succeed again: record the outage in the log itself."""
        since = self._outage_since
        assert since is not None
        self._outage_since = None
        event = LogWriteResumed(
            source=self.name,
            path=str(self._path),
            outage_s=_clock() - since,
            write_errors=self._outage_errors,
            lines_lost=self._outage_lost,
            error=self._outage_error,
        )
        _log.warning(
            "log_write_resumed",
            path=str(self._path),
            outage_s=round(event.outage_s, 3),
            lines_lost=event.lines_lost,
        )
        line = encode_event(event)
        try:
            written = _write_some(fd, line)
        except OSError:
            return
        if written == len(line):
            self._size += written
            self._bytes_written += written
            self._lines_written += 1
        else:  # cannot happen for a few hundred bytes; never leave a partial line
            os.ftruncate(fd, self._size)

    def _trim_pending_locked(self) -> None:
        """Give up the oldest whole lines beyond ``max_pending_bytes`` (counted as lost)."""
        buf = self._buffer
        excess = len(buf) - self._max_pending
        if excess <= 0:
            return
        cut = buf.find(b"\n", excess - 1) + 1 or len(buf)
        lost = buf.count(b"\n", 0, cut)
        del buf[:cut]
        self._buffer_lines -= lost
        self._lines_lost += lost
        self._outage_lost += lost
        _log.error("log_lines_lost", path=str(self._path), lines=lost, at="pending buffer full")

    def _append_locked(self, data: bytes) -> None:
        """Buffer whole lines, rotating between lines so that no file passes ``max_bytes``.

        Encoded events never contain a raw newline (JSON escapes it), so line boundaries are
        found with ``rfind`` on the joined batch instead of tracking each line.
        """
        if not data:
            return
        base = self._size + len(self._buffer)
        if self._max_bytes <= 0 or base + len(data) <= self._max_bytes:
            self._buffer += data
            self._buffer_lines += data.count(b"\n")
            return
        # The batch crosses a rotation boundary: cut it between lines, one piece per file.
        chunks: list[bytes] = []
        start = 0
        while start < len(data):
            room = self._max_bytes - base
            end = data.rfind(b"\n", start, start + room) + 1 if room > 0 else 0
            if end <= start:
                if base > 0:
                    chunks.append(b"")  # the next line does not fit: rotate first
                    base = 0
                    continue
                end = data.find(b"\n", start) + 1 or len(data)  # one line longer than max_bytes
            chunks.append(data[start:end])
            start = end
            base = 0  # the next chunk, if any, starts a fresh file
        for k, chunk in enumerate(chunks):
            self._buffer += chunk
            self._buffer_lines += chunk.count(b"\n")
            if k == len(chunks) - 1:
                break
            try:
                self._rotate_locked()
            except BaseException:
                # Keep the rest for the next attempt (the live file may then exceed max_bytes).
                for rest in chunks[k + 1 :]:
                    self._buffer += rest
                    self._buffer_lines += rest.count(b"\n")
                raise

    def _locked_open(self) -> None:
        with self._lock:
            try:
                self._ensure_open()
            except OSError as exc:
                self._write_errors += 1
                raise self._write_error(exc, "cannot open the log file") from None
            self._ensure_flusher()

    def _locked_flush(self) -> None:
        with self._lock:
            self._flush_locked()

    def _locked_rotate(self) -> None:
        with self._lock:
            self._rotate_locked()

    def _ensure_flusher(self) -> None:
        if self._flush_interval > 0 and self._flusher is None and not self._closed:
            self._flusher = threading.Thread(
                target=self._flush_periodically, name=f"eventbus-flush-{self.name}", daemon=True
            )
            self._flusher.start()

    def _flush_periodically(self) -> None:
        while not self._stop_flusher.wait(self._flush_interval):
            with self._lock:
                if self._closed:
                    return
                if not self._buffer:
                    continue
                if self._outage_since is not None and _clock() < self._next_attempt:
                    continue
                try:
                    self._flush_locked()
                except LogWriteError as exc:
                    if self._note_outage_locked(exc):
                        self._deferred = exc  # reported (once) by the next handle_batch

    def _ensure_open(self) -> int:
        fd = self._fd
        if fd is not None:
            return fd
        self._dir.mkdir(parents=True, exist_ok=True)  # it may have been removed under us
        fd = os.open(self._path, os.O_RDWR | os.O_APPEND | os.O_CREAT, _FILE_MODE)
        try:
            st = os.fstat(fd)
            if self._repair and st.st_ino == self._ino and st.st_size > self._size:
                # The same file, ending with the prefix of a line we are about to drop.
                os.ftruncate(fd, self._size)
            else:
                self._size = _seal_tail(fd, st.st_size, self._path)
            self._repair = False
            self._ino = st.st_ino
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return fd

    def _close_fd(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def _flush_locked(self) -> None:
        """Write the buffer with one system call (a loop only on short writes)."""
        if not self._buffer:
            if self._fsync and self._fd is not None:
                self._fsync_locked()
            return
        written = 0
        fd: int | None = None
        try:
            fd = self._ensure_open()
            if os.fstat(fd).st_nlink == 0:
                raise FileNotFoundError(
                    errno.ENOENT, "the log file was removed while open", str(self._path)
                )
            buf = self._buffer
            total = len(buf)
            written = _write_some(fd, buf)
            while written < total:  # short writes are rare: copying the rest is fine
                written += _write_some(fd, buf[written:])
            if self._fsync:
                os.fsync(fd)
        except OSError as exc:
            self._after_failure(fd, written)
            raise self._write_error(exc, "cannot write the log file") from None
        self._size += written
        self._bytes_written += written
        self._lines_written += self._buffer_lines
        self._buffer.clear()
        self._buffer_lines = 0
        if self._outage_since is not None:
            self._end_outage_locked(fd)

    def _after_failure(self, fd: int | None, written: int) -> None:
        """Account for a failed write of ``written`` bytes; keep the rest for the next attempt.

        The complete lines that reached the file count as written; a partial line after them
        is cut off at once (``ftruncate`` needs no free space), so a reader never meets it.
        """
        self._write_errors += 1
        buf = self._buffer
        whole = buf.rfind(b"\n", 0, written) + 1  # bytes of complete lines that reached the file
        if whole:
            lines = buf.count(b"\n", 0, whole)
            self._size += whole
            self._bytes_written += whole
            self._lines_written += lines
            self._buffer_lines -= lines
            del buf[:whole]
        if written > whole:
            try:
                if fd is None:
                    raise OSError(errno.EBADF, "the log file is not open")
                os.ftruncate(fd, self._size)
            except OSError:
                self._repair = True  # truncate it when the file is reopened
        self._close_fd()  # reopen (and repair) at the next attempt

    def _fsync_locked(self) -> None:
        assert self._fd is not None
        try:
            os.fsync(self._fd)
        except OSError as exc:
            self._write_errors += 1
            raise self._write_error(exc, "cannot fsync the log file") from None

    def _rotate_locked(self) -> None:
        self._flush_locked()
        if self._fsync and self._fd is not None:
            self._fsync_locked()
        self._close_fd()
        base = str(self._path)
        try:
            for i in range(self._backup_count - 1, 0, -1):
                src = self._backup_name(f"{base}.{i}")
                dst = self._backup_name(f"{base}.{i + 1}")
                if os.path.exists(src):
                    os.replace(src, dst)
            first = self._backup_name(f"{base}.1")
            if os.path.exists(first):
                os.remove(first)
            self._rotator(base, first)
        except OSError as exc:
            self._write_errors += 1
            raise self._write_error(exc, "cannot rotate the log file") from None
        self._size = 0
        self._rotations += 1
        self._ensure_open_or_raise()

    def _ensure_open_or_raise(self) -> None:
        try:
            self._ensure_open()
        except OSError as exc:
            self._write_errors += 1
            raise self._write_error(exc, "cannot open the log file") from None

    def _backup_name(self, default: str) -> str:
        namer = self._namer
        return namer(default) if namer is not None else default

    def _write_error(self, exc: OSError, what: str) -> LogWriteError:
        pending = self._buffer_lines
        detail = exc.strerror or str(exc)
        msg = (
            f"{what} {str(self._path)!r}: {detail}; {pending} line(s) kept "
            "to retry with the next batch (free disk space or restore the directory)"
        )
        return _os_error(LogWriteError, exc.errno, msg)

    def _close_sync(self) -> None:
        with self._lock:
            try:
                if self._buffer:
                    self._flush_locked()  # a last attempt for everything, backoff or not
                elif self._fsync and self._fd is not None:
                    self._fsync_locked()
            except LogWriteError:
                lost = self._buffer_lines
                self._lines_lost += lost
                self._buffer.clear()
                self._buffer_lines = 0
                _log.error("log_lines_lost", path=str(self._path), lines=lost, at="close")
                raise
            finally:
                self._close_fd()


def _encode_all(events: Sequence[Event]) -> tuple[bytes, list[tuple[Event, Exception]]]:
    try:
        return encode_events(events), []
    except TypeError:
        pass
    lines: list[bytes] = []
    bad: list[tuple[Event, Exception]] = []
    for event in events:
        try:
            lines.append(encode_event(event))
        except TypeError as exc:
            bad.append((event, exc))
    return b"".join(lines), bad


_E = TypeVar("_E", LogDirectoryError, LogWriteError)


def _os_error(cls: type[_E], code: int | None, msg: str) -> _E:
    """An OSError subclass carrying *code* as ``errno`` whose text is exactly *msg*."""
    err = cls(code, msg) if code is not None else cls(msg)
    return err


def _write_some(fd: int, data: bytes | bytearray) -> int:
    """One ``write(2)``; the seam tests replace to inject disk-full errors."""
    return os.write(fd, data)


def _seal_tail(fd: int, size: int, path: Path) -> int:
    """Make an existing log end at a line boundary before appending; returns the new size.

    A previous run killed mid-write leaves a partial last line. Appending after it would glue
    our first line to it and put an undecodable line in the middle of the log, so: a tail that
    is a whole event missing only its newline gets the newline; anything else is cut off.
    """
    if size == 0:
        return 0
    if os.pread(fd, 1, size - 1) == b"\n":
        return size
    # Scan back for the last newline, a chunk at a time: a torn line may be very long.
    end = size
    line_start = 0
    while end > 0:
        start = max(0, end - _TAIL_SCAN)
        nl = os.pread(fd, end - start, start).rfind(b"\n")
        if nl >= 0:
            line_start = start + nl + 1
            break
        end = start
    length = size - line_start
    if length <= _MAX_TAIL_DECODE:
        try:
            decode_event(os.pread(fd, length, line_start))
        except EventDecodeError:
            pass
        else:  # a whole event that only lacks its newline
            os.write(fd, b"\n")
            return size + 1
    os.ftruncate(fd, line_start)
    _log.warning("log_partial_line_removed", path=str(path), bytes=length)
    return line_start


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        msg = f"{name} must be an integer >= {minimum}, got {value!r}"
        raise ValueError(msg)
