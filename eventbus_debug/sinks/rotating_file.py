"""The canonical JSON-lines log: a sink that writes every event, one line each, with rotation.

:class:`RotatingFileSink` takes its shape from :class:`logging.handlers.RotatingFileHandler`:
:meth:`~RotatingFileSink.should_rotate` and :meth:`~RotatingFileSink.rotate` are two steps, and
``namer`` / ``rotator`` callables customize backup names and the move (the default with
``compress=True`` gzips). The file names are those :func:`eventbus_debug.read_events` reads:
``events.jsonl`` (``events.rank{N}.jsonl`` for rank N > 0), backups ``.1`` (newest) … ``.N``,
``.gz`` appended when compressed.

All file I/O — encoding a batch, the write, renames, gzip, fsync — runs in the sink's own daemon
threads (``_jsonl_writer``), never on the event loop; a write that hangs (a dead network disk) is
abandoned at close and never keeps the process alive. The log stays off the training step's
path: :meth:`~RotatingFileSink.handle_batch` hands a telemetry batch to the writer thread and
returns without waiting (no thread round trip, no wake-up of the event loop); the thread writes
what was handed over every ``wake_interval`` seconds (200 ms), sooner when 4,096 events wait. A
batch holding an incident is written before ``handle_batch`` returns, so an incident is in the
file (with everything before it) as soon as the bus has handled it; past ``high_water`` events
waiting, a batch waits for the writer (flow control, nothing dropped). ``flush()``, ``rotate()``
and the close write everything. ``wake_interval=0`` writes each batch before returning.
What is handed over is encoded into one buffer and written with one system call (more only when
it crosses a rotation boundary: a line is never split between two files).

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

import contextlib
import errno
import gzip
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final

from eventbus_debug.events import Event, current_rank, has_incident
from eventbus_debug.exceptions import ArgumentTypeError
from eventbus_debug.log.files import log_file_name
from eventbus_debug.threads import DaemonWorker

from ._checks import count, seconds
from ._jsonl_writer import (
    FILE_MODE,
    FileSinkStatistics as FileSinkStatistics,
    JsonlWriter,
    LogDirectoryError as LogDirectoryError,
    LogWriteError as LogWriteError,
    os_error,
)

__all__ = (
    "DEFAULT_BACKUP_COUNT",
    "DEFAULT_MAX_BYTES",
    "FileSinkStatistics",
    "LogDirectoryError",
    "LogWriteError",
    "RotatingFileSink",
)

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
DEFAULT_WAKE_INTERVAL: Final = 0.2
"""Seconds between two writes of the batches handed over without waiting."""
DEFAULT_WAKE_EVENTS: Final = 4096
"""The writer wakes at once when this many events wait for it."""
DEFAULT_HIGH_WATER: Final = 16384
"""Beyond this many events waiting for the writer, a batch waits until the writer catches up."""
_GZIP_LEVEL: Final = 6
_COPY_CHUNK: Final = 1024 * 1024

Namer = Callable[[str], str]
"""``namer(default_name) -> name``: the path of a backup (default ``<live>.<i>``)."""
Rotator = Callable[[str, str], None]
"""``rotator(source, dest)``: move the full live file to its first backup name."""


def _default_rotator(source: str, dest: str) -> None:
    if os.path.exists(source):
        os.replace(source, dest)


def _gzip_rotator(source: str, dest: str) -> None:
    """Compress *source* into *dest* (through a temporary name, so a crash leaves no half .gz)."""
    if not os.path.exists(source):
        return
    tmp = dest + ".tmp"
    try:
        with open(source, "rb") as src, gzip.open(tmp, "wb", compresslevel=_GZIP_LEVEL) as dst:
            shutil.copyfileobj(src, dst, _COPY_CHUNK)
        os.replace(tmp, dest)
    except BaseException:
        # Disk full while compressing: give the space back; the live file is kept whole and
        # the rotation is retried.
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
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
        flush_interval: ``0`` (default) writes what the writer encodes to the operating system
            at once (with write-behind, a killed process loses at most the last
            ``wake_interval`` of telemetry, never an incident the bus handled). A positive
            value buffers up to ``buffer_size`` bytes and writes at least every this many
            seconds (from the writer thread) and on close.
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
        wake_interval: seconds between two writes of the batches handed over without
            waiting (default ``0.2``). A positive value hands batches to the sink's writer
            thread without waiting: it writes them every this many seconds (sooner when 4,096
            events wait), at once when a batch holds an incident, and :meth:`handle_batch`
            waits only when *high_water* events are waiting. ``0`` encodes and writes each
            batch before :meth:`handle_batch` returns. :meth:`flush`, :meth:`rotate` and
            the close still write everything; the bus's ``drain()`` does not (it waits for
            :meth:`handle_batch` to return: telemetry reaches the file within this interval).
        high_water: with a positive *wake_interval*, the most events waiting for the writer
            before a batch waits for it (flow control, nothing dropped).

    Raises:
        ValueError: if an option is out of range, or *directory* or *name* is empty (the
            message names it; a wrong type, a *namer* or *rotator* that is not callable
            among them, is an :class:`~eventbus_debug.exceptions.ArgumentTypeError`).
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
        wake_interval: float = DEFAULT_WAKE_INTERVAL,
        high_water: int = DEFAULT_HIGH_WATER,
    ) -> None:
        if not isinstance(directory, str | os.PathLike):
            msg = f"directory must be a str or a path, got {type(directory).__qualname__} {directory!r}"
            raise ArgumentTypeError(msg)
        if os.fspath(directory) == "":
            msg = (
                "directory must not be empty (an unset variable, most likely): pass '.' for "
                "the current directory"
            )
            raise ValueError(msg)
        for flag, value in (("compress", compress), ("fsync", fsync)):
            if not isinstance(value, bool):
                msg = f"{flag} must be a bool, got {value!r}"
                raise ArgumentTypeError(msg)
        for option, fn in (("namer", namer), ("rotator", rotator)):
            if fn is not None and not callable(fn):
                msg = f"{option} must be a callable or None, got {type(fn).__name__} {fn!r}"
                raise ArgumentTypeError(msg)
        if not isinstance(name, str):
            msg = f"name must be a str, got {type(name).__name__} {name!r}"
            raise ArgumentTypeError(msg)
        if not name:
            msg = "name must not be empty: it names the subscription (default 'rotating_file')"
            raise ValueError(msg)
        _check_int("max_bytes", max_bytes, minimum=0)
        _check_int("backup_count", backup_count, minimum=0)
        _check_int("buffer_size", buffer_size, minimum=1)
        _check_int("queue_capacity", queue_capacity, minimum=1)
        _check_int("max_pending_bytes", max_pending_bytes, minimum=1)
        _check_int("high_water", high_water, minimum=1)
        _check_seconds("wake_interval", wake_interval)
        if max_bytes > 0 and backup_count < 1:
            msg = (
                f"backup_count must be >= 1 when max_bytes > 0, got {backup_count!r}; "
                "rotation keeps the old file as a backup (pass max_bytes=0 to never rotate)"
            )
            raise ValueError(msg)
        _check_seconds("flush_interval", flush_interval)
        if rank is None:
            rank = current_rank()
        else:
            _check_int("rank", rank, minimum=0)
        self.name = name
        self.queue_capacity = queue_capacity
        self.backpressure = True  # the bus flow-controls `await publish` for the log
        self._dir = Path(directory)
        self._path = self._dir / log_file_name(rank)
        self._max_bytes = max_bytes
        self._backup_count = backup_count
        self._closed = False
        self._worker = DaemonWorker(f"eventbus-file-{name}")
        self._writer = JsonlWriter(
            self._path,
            name=name,
            max_bytes=max_bytes,
            backup_count=backup_count,
            namer=namer if namer is not None else (_gzip_namer if compress else None),
            rotator=(
                rotator
                if rotator is not None
                else (_gzip_rotator if compress else _default_rotator)
            ),
            flush_interval=float(flush_interval),
            fsync=bool(fsync),
            buffer_size=buffer_size,
            max_pending_bytes=max_pending_bytes,
            wake_interval=float(wake_interval),
            wake_events=min(DEFAULT_WAKE_EVENTS, high_water),
        )
        self._write_behind = wake_interval > 0
        self._high_water = high_water

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
        return self._writer.statistics()

    @property
    def thread_busy(self) -> bool:
        """Whether the sink's thread is inside a call now (a write that hangs keeps it busy)."""
        return self._worker.busy

    def should_rotate(self, size: int, /) -> bool:
        """Whether *size* more bytes would take the live file past ``max_bytes``.

        An empty file never needs rotating: a single line longer than ``max_bytes`` gets a file
        of its own rather than being split.
        """
        return self._writer.should_rotate(size)

    async def rotate(self) -> None:
        """Rotate now: write what is buffered, shift the backups, start a new live file.

        Raises:
            LogWriteError: if writing, renaming or compressing fails.
            ValueError: if the sink keeps no backups (``backup_count=0``): there is nowhere
                to move the live file, and deleting it would lose its events.
            RuntimeError: if the sink is closed.
        """
        self._check_open()
        if self._backup_count == 0:
            msg = (
                "rotate() needs backup_count >= 1: with backup_count=0 the live file has "
                "nowhere to go (create the sink with backup_count=1 or more)"
            )
            raise ValueError(msg)
        await self._worker.run(self._writer.rotate)

    async def start(self) -> None:
        """Open the live file (in a worker thread) and start the interval flusher, if any."""
        self._check_open()
        await self._worker.run(self._writer.open)

    async def handle(self, event: Event, /) -> None:
        """Write one event (prefer :meth:`handle_batch`; the bus does)."""
        await self.handle_batch((event,))

    async def handle_batch(self, events: Sequence[Event], /) -> None:
        """Encode and write *events* in a worker thread, in order, rotating as needed.

        Raises:
            LogWriteError: if a write fails for the first time since the last success (the
                unwritten lines are kept and retried with backoff), or an event cannot be
                written readably: a field of the wrong type, or a value JSON cannot carry (it
                is counted in ``encode_errors`` and logged with its kind and field; the others
                are written). With write-behind, the next batch raises it.
            RuntimeError: if the sink is closed.
        """
        self._check_open()
        if not events:
            return
        if not self._write_behind:
            await self._worker.run(self._writer.write_batch, events)
            return
        backlog = self._writer.submit(events)
        if backlog >= self._high_water or has_incident(events):
            await self._worker.run(self._writer.write_pending)

    async def flush(self) -> None:
        """Write everything buffered now (and fsync when enabled).

        Raises:
            LogWriteError: if the write fails.
        """
        if self._closed:
            return
        await self._worker.run(self._writer.flush)

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
        try:
            await self._worker.run(self._writer.close)
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
            if self._dir.exists() and not self._dir.is_dir():  # mkdir would say "File exists"
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(self._dir))
            self._dir.mkdir(parents=True, exist_ok=True)
            # As the writer opens it (read and write: a torn last line is read back to be
            # sealed), without blocking on a named pipe nobody reads.
            flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | getattr(os, "O_NONBLOCK", 0)
            fd = os.open(self._path, flags, FILE_MODE)
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
            raise os_error(LogDirectoryError, exc.errno, msg) from None


def _check_int(name: str, value: object, *, minimum: int) -> None:
    count(name, value, rule=f"an integer >= {minimum}", minimum=minimum)


def _check_seconds(name: str, value: object) -> None:
    seconds(name, value, rule="a finite number of seconds >= 0", zero=True)
