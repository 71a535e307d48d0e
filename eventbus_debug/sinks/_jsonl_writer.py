"""The thread side of the log: encode, buffer, rotate at line ends, write, fsync, retry.

A :class:`JsonlWriter` is driven from two threads at most, the sink's worker (a batch the event
loop waits for: open, rotate, flush, close, an incident) and its own background thread (the
batches handed over without waiting, every ``wake_interval`` seconds or sooner when the backlog
grows); one lock serializes them, so lines reach the file in the order the batches were handed
over. The event loop itself only appends to the backlog under a second, tiny lock, never the
one held across a disk write.

The live file and its pending lines are :class:`~._jsonl_file.JsonlFile`'s (this class builds on
it), a batch's encoding is :mod:`._jsonl_encode`'s, the errors and statistics are
:mod:`._jsonl_types`'. Everything that reads the two seams tests replace, :data:`_clock` and
:func:`_write_some`, stays here.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from collections.abc import Callable, Sequence
from itertools import chain
from pathlib import Path
from typing import Final

from eventbus_debug.diagnostics import get_logger
from eventbus_debug.events import Event, LogWriteResumed
from eventbus_debug.log.encoding import encode_event

from ._jsonl_encode import encode_all, refused
from ._jsonl_file import FILE_MODE as FILE_MODE, JsonlFile, _cut_at_lines
from ._jsonl_types import (
    FileSinkStatistics,
    LogDirectoryError as LogDirectoryError,
    LogWriteError,
    os_error as os_error,
)

__all__ = ("FileSinkStatistics", "JsonlWriter", "LogDirectoryError", "LogWriteError")

_log = get_logger(__name__)

RETRY_INITIAL: Final = 0.05
RETRY_MAX: Final = 5.0
ROTATE_RETRY_MAX: Final = 60.0
"""A rotation that keeps failing is retried after 50 ms, doubling, at most every 60 s; meanwhile
the live file grows past ``max_bytes`` (the lines are safe; only the rotation waits)."""
"""Backoff between write attempts during an outage: 50 ms, doubling, at most 5 s."""
_clock: Callable[[], float] = time.monotonic
"""The backoff's clock (a seam for tests)."""


class JsonlWriter(JsonlFile):
    """The log file of one rank: whole JSON lines, rotated by size, retried through outages.

    Args:
        path: the live file.
        name: the sink's name (the ``source`` of ``LogWriteResumed``, the thread's name).
        max_bytes, backup_count, namer, rotator, flush_interval, fsync, buffer_size,
            max_pending_bytes: as for :class:`~eventbus_debug.sinks.RotatingFileSink`.
        wake_interval: seconds between two writes of the backlog by the background thread.
        wake_events: the background thread is woken at once when the backlog holds this many
            events.
    """

    def __init__(
        self,
        path: Path,
        *,
        name: str,
        max_bytes: int,
        backup_count: int,
        namer: Callable[[str], str] | None,
        rotator: Callable[[str, str], None],
        flush_interval: float,
        fsync: bool,
        buffer_size: int,
        max_pending_bytes: int,
        wake_interval: float,
        wake_events: int,
    ) -> None:
        super().__init__(
            path,
            max_bytes=max_bytes,
            backup_count=backup_count,
            namer=namer,
            rotator=rotator,
            fsync=fsync,
            max_pending_bytes=max_pending_bytes,
        )
        self.name = name
        self._flush_interval = flush_interval
        self._buffer_size = buffer_size
        # The background thread's tick: the write-behind interval, or the flush interval when
        # only that is set; no thread at all when neither is (every write is waited for).
        ticks = [t for t in (wake_interval, flush_interval) if t > 0]
        self._tick: float | None = min(ticks) if ticks else None
        self._wake_events = wake_events

        self._lock = threading.Lock()  # guards the file's state; held across disk writes
        # The backlog: batches handed over by the event loop, not encoded yet. Its own lock is
        # only ever held for a list operation, so the loop never waits behind a disk write.
        self._backlog_lock = threading.Lock()
        self._backlog: list[Sequence[Event]] = []
        self._backlog_events = 0
        self._deferred: LogWriteError | None = None  # a background failure, for the next batch
        # An outage: writes failing since _outage_since, retried from _next_attempt on.
        self._outage_since: float | None = None
        self._next_attempt = 0.0
        self._backoff = RETRY_INITIAL
        self._outage_errors = 0
        self._outage_error = ""
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._last_flush = _clock()

        # A rotation failing (a rename refused, a user's rotator raising): the lines go on into
        # the live file, the rotation is retried from _rotate_retry_at; only the first failure
        # of a streak is raised (one SinkFailed), so a rename that keeps failing never gets the
        # log disabled by the bus (five failures in a row) while every write succeeds.
        self._rotate_retry_at: float | None = None
        self._rotate_backoff = RETRY_INITIAL

        self._rotations = 0
        self._encode_errors = 0

    def statistics(self) -> FileSinkStatistics:
        """A snapshot of the counters (the backlog counts as pending lines)."""
        return FileSinkStatistics(
            path=str(self._path),
            lines_written=self._lines_written,
            bytes_written=self._bytes_written,
            lines_pending=self._buffer_lines + self._backlog_events,
            lines_lost=self._lines_lost,
            rotations=self._rotations,
            write_errors=self._write_errors,
            encode_errors=self._encode_errors,
            current_size=self._size,
            failing=self._outage_since is not None,
        )

    # -- the event loop's side: never blocks on the file ------------------------------------------

    def submit(self, events: Sequence[Event], /) -> int:
        """Hand *events* over without waiting; returns the events in the backlog now.

        Raises the background thread's first failure of an outage, once (the events are kept).
        """
        with self._backlog_lock:
            self._backlog.append(events)
            backlog = self._backlog_events = self._backlog_events + len(events)
            deferred, self._deferred = self._deferred, None
        if self._thread is None:
            self._start_thread()
        if backlog >= self._wake_events:
            self._wake.set()
        if deferred is not None:
            raise deferred
        return backlog

    def _start_thread(self) -> None:
        with self._backlog_lock:
            if self._thread is not None or self._closed or self._tick is None:
                return
            self._thread = threading.Thread(
                target=self._run, name=f"eventbus-log-{self.name}", daemon=True
            )
        self._thread.start()

    # -- the background thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._tick)
            self._wake.clear()
            with self._lock:
                if self._closed:
                    return
                try:
                    self._write_backlog_locked(background=True)
                    due = self._flush_interval > 0 and (
                        _clock() - self._last_flush >= self._flush_interval
                    )
                    if due and self._buffer and self._retry_due():
                        self._flush_due_locked()
                except LogWriteError as exc:
                    with self._backlog_lock:
                        self._deferred = self._deferred or exc  # the next submit raises it
                except Exception:  # never let the writer die quietly: log and go on
                    _log.exception("log_writer_failed", path=str(self._path))

    def _flush_due_locked(self) -> None:
        """The writer thread's interval flush: a failure is an outage like a batch's."""
        try:
            self._flush_locked()
        except LogWriteError as exc:
            self._note_outage_locked(exc, background=True)  # kept for the next batch

    def _retry_due(self) -> bool:
        return self._outage_since is None or _clock() >= self._next_attempt

    # -- the worker's side (a call the event loop waits for) -----------------------------------------

    def write_batch(self, events: Sequence[Event], /) -> None:
        """Write the backlog, then *events*, now (the sink's synchronous mode).

        Raises:
            LogWriteError: the first failure of an outage (also one the background thread met
                since the last batch), or an event that cannot be encoded.
        """
        with self._lock:
            with self._backlog_lock:
                deferred, self._deferred = self._deferred, None
            self._write_backlog_locked()
            self._write_batch_locked(events)
            if deferred is not None:
                raise deferred
        if self._thread is None:
            self._start_thread()  # the interval flusher, when flush_interval > 0

    def write_pending(self) -> None:
        """Write the backlog now (an incident, or a backlog over the high-water mark).

        Raises:
            LogWriteError: the first failure of an outage, or an event that cannot be encoded.
        """
        with self._lock:
            with self._backlog_lock:
                deferred, self._deferred = self._deferred, None
            self._write_backlog_locked()
            if deferred is not None:
                raise deferred

    def _write_backlog_locked(self, *, background: bool = False) -> None:
        """Encode the backlog into the buffer and write it (as the flush settings say).

        *background*: the writer thread writes; a failure that starts an outage is kept for
        the next batch (see :meth:`_note_outage_locked`).
        """
        with self._backlog_lock:
            batches, self._backlog = self._backlog, []
            self._backlog_events = 0
        if not batches:
            return
        events = batches[0] if len(batches) == 1 else list(chain.from_iterable(batches))
        self._write_batch_locked(events, background=background)

    def _write_batch_locked(self, events: Sequence[Event], *, background: bool = False) -> None:
        data, lines, bad = encode_all(events)
        self._encode_errors += len(bad)
        try:
            try:
                self._append_locked(data, lines)
            finally:
                # Also when a rotation failed: the lines kept for it stay within the bound.
                self._trim_pending_locked()
            if self._outage_since is not None:
                if _clock() >= self._next_attempt:
                    self._flush_locked()  # a retry, on the backoff schedule
            elif self._flush_interval == 0 or len(self._buffer) >= self._buffer_size:
                self._flush_locked()
        except LogWriteError as exc:
            if self._note_outage_locked(exc, background=background):
                raise  # the first failure of an outage: one SinkFailed incident
        if bad:
            raise refused(bad, self._path)

    def _note_outage_locked(self, exc: LogWriteError, *, background: bool = False) -> bool:
        """Schedule the next attempt with backoff; returns True if this failure starts an outage.

        *background*: the writer thread met it; the failure is kept for the next batch to raise
        before the outage shows in :meth:`statistics` (whoever sees ``failing`` and submits
        gets the error).
        """
        now = _clock()
        self._outage_error = str(exc)
        if self._outage_since is None:
            if background:
                with self._backlog_lock:
                    self._deferred = self._deferred or exc
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

    def _end_outage_locked(self) -> None:
        """Writes succeed again: record the outage in the log itself.

        The record is the next line, written now and rotated like any other (a file stays
        within ``max_bytes``); the flushes it makes see no outage, so they do not come back.
        """
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
        self._append_locked(encode_event(event), 1)
        self._flush_locked()

    def _append_locked(self, data: bytes, lines: int) -> None:
        """Buffer *lines* whole lines, rotating between lines so that no file passes ``max_bytes``.

        Encoded events never contain a raw newline (JSON escapes it), so line boundaries are
        found with ``rfind`` on the joined batch instead of tracking each line, and *lines* (the
        events encoded) is the batch's line count: ``data.count(b"\\n")`` cost 0.13 µs an event
        of a 4,096-event batch on this project's machines. Only the pieces before a rotation
        boundary are counted.
        """
        if not data:
            return
        if self._max_bytes > 0 and self._outage_since is None:
            # The size the file has now (another writer, a truncation): where to cut.
            with contextlib.suppress(OSError):  # the write meets it again and reports it
                self._live_fd_locked()
        base = self._size + len(self._buffer)
        retry_at = self._rotate_retry_at
        if (
            self._max_bytes <= 0
            or not self._regular  # a device or a pipe (/dev/null): never rotated
            or base + len(data) <= self._max_bytes
            or (retry_at is not None and _clock() < retry_at)  # a failed rotation waits
        ):
            self._buffer_append(data)
            self._buffer_lines += lines
            return
        # The batch crosses a rotation boundary: cut it between lines, one piece per file.
        chunks = _cut_at_lines(data, base, self._max_bytes)
        left = lines  # the lines of the chunks not buffered yet
        for k, chunk in enumerate(chunks):
            if k == len(chunks) - 1:
                self._buffer_append(chunk)
                self._buffer_lines += left
                break
            count = chunk.count(b"\n")
            self._buffer_append(chunk)
            self._buffer_lines += count
            left -= count
            rotated = False
            try:
                rotated = self._rotate_locked(streak=True)
            finally:
                if not rotated:
                    # Keep the rest for the live file (it then exceeds max_bytes until the
                    # rotation succeeds).
                    for rest in chunks[k + 1 :]:
                        self._buffer_append(rest)
                    self._buffer_lines += left
            if not rotated:
                break

    def open(self) -> None:
        """Open the live file (sealing a torn last line) and start the background thread."""
        with self._lock:
            try:
                self._ensure_open()
            except OSError as exc:
                self._write_errors += 1
                raise self._write_error(exc, "cannot open the log file") from None
        self._start_thread()

    def flush(self) -> None:
        """Write the backlog and the buffer now (and fsync when enabled)."""
        with self._lock:
            self._write_backlog_locked()
            self._flush_locked()

    def rotate(self) -> None:
        """Write the backlog, then rotate."""
        with self._lock:
            self._write_backlog_locked()
            self._rotate_locked()

    def _flush_locked(self) -> None:
        """Write the buffer with one system call (a loop only on short writes)."""
        if not self._buffer:
            if self._fsync and self._fd is not None:
                self._fsync_locked()
            return
        written = 0
        fd: int | None = None
        try:
            fd = self._live_fd_locked()
            buf = self._buffer
            total = len(buf)
            written = _write_some(fd, buf)
            while written < total:  # short writes are rare: copying the rest is fine
                written += _write_some(fd, buf[written:])
            if self._fsync:
                os.fsync(fd)
            if self._regular and os.fstat(fd).st_nlink == 0:
                # Removed between the check and the write: the lines went with the file;
                # they are kept and written again into a new one.
                written = 0
                raise _removed(self._path)
        except OSError as exc:
            self._after_failure(fd, written)
            raise self._write_error(exc, "cannot write the log file") from None
        self._last_flush = _clock()
        self._size += written
        self._bytes_written += written
        self._lines_written += self._buffer_lines
        self._buffer = b""
        self._buffer_lines = 0
        if self._outage_since is not None:
            self._end_outage_locked()

    def _live_fd_locked(self) -> int:
        """The open live file, checked before a write.

        Removed (``rm``, the directory deleted): a ``FileNotFoundError``, the outage that
        reopens it. Moved away (logrotate's rename, another sink's rotation of the same file):
        what it holds stays under its new name and a new live file is opened, quietly, as
        :class:`logging.handlers.WatchedFileHandler` does. Its size is taken from the file
        itself, so a file truncated in place (logrotate's ``copytruncate``) or appended to by
        another writer rotates at ``max_bytes`` all the same.
        """
        fd = self._ensure_open()
        st = os.fstat(fd)
        if st.st_nlink == 0:
            raise _removed(self._path)
        if not self._regular:
            return fd
        try:
            named = os.stat(self._path)
        except FileNotFoundError:
            named = None
        if named is None or (named.st_ino, named.st_dev) != (st.st_ino, st.st_dev):
            _log.info("log_file_moved", path=str(self._path), size=st.st_size)
            self._close_fd()
            fd = self._ensure_open()
            st = os.fstat(fd)
        self._size = st.st_size
        return fd

    def _rotate_locked(self, *, streak: bool = False) -> bool:
        """Rotate now: True when done.

        Raises:
            LogWriteError: if the flush before it or the rotation fails; with *streak* (the
                rotations at ``max_bytes``), only the first failure of a streak raises: later
                ones return False, the lines going on into the live file, and the rotation is
                retried after a backoff (:data:`ROTATE_RETRY_MAX`).
        """
        self._flush_locked()
        if self._fsync and self._fd is not None:
            self._fsync_locked()
        if self._fd is None:
            self._ensure_open_or_raise()  # what the live path is: a file, or a device
        if not self._regular:
            return True  # a device or a pipe (/dev/null): nothing to rotate
        self._close_fd()
        try:
            self._rename_backups()
        except Exception as exc:
            # Also a namer or rotator of the user's raising something else (a ValueError).
            self._write_errors += 1
            error = self._write_error(exc, "cannot rotate the log file")
            new_streak = self._rotate_retry_at is None
            self._rotate_retry_at = _clock() + self._rotate_backoff
            self._rotate_backoff = min(self._rotate_backoff * 2, ROTATE_RETRY_MAX)
            self._ensure_open_or_raise()  # the live file goes on taking the lines
            if new_streak or not streak:
                raise error from None
            _log.warning("log_rotation_failed_again", path=str(self._path), error=str(exc))
            return False
        self._rotate_retry_at = None
        self._rotate_backoff = RETRY_INITIAL
        self._size = 0
        self._rotations += 1
        self._ensure_open_or_raise()
        return True

    def close(self) -> None:
        """Write everything (backlog, buffer), fsync if enabled, close the file; stop the thread.

        Raises:
            LogWriteError: if the final write fails (the lines are then counted as lost).
        """
        self._stop.set()
        self._wake.set()
        with self._lock:
            self._closed = True
            try:
                try:
                    self._write_backlog_locked()
                except LogWriteError:
                    if not self._buffer:
                        raise  # an encoding error: everything else was written
                if self._buffer:
                    self._flush_locked()  # a last attempt for everything, backoff or not
                elif self._fsync and self._fd is not None:
                    self._fsync_locked()
            except LogWriteError:
                lost = self._buffer_lines
                self._lines_lost += lost
                self._buffer = b""
                self._buffer_lines = 0
                _log.error("log_lines_lost", path=str(self._path), lines=lost, at="close")
                raise
            finally:
                self._close_fd()


def _removed(path: Path) -> FileNotFoundError:
    return FileNotFoundError(errno.ENOENT, "the log file was removed while open", str(path))


def _write_some(fd: int, data: bytes | bytearray) -> int:
    """One ``write(2)``; the seam tests replace to inject disk-full errors."""
    return os.write(fd, data)
