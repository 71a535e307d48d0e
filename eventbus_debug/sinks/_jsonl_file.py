"""The live file of one rank's log and the lines pending for it: the writer's lower half.

Open the file, sealing a torn last line a killed run left (:func:`_seal_tail`); hold the encoded
lines not written yet, within ``max_pending_bytes``; account for a write that failed part-way
(the whole lines count, a partial one is cut off); cut a batch between lines at a rotation
boundary, shift the backups at a rotation; word the errors. :class:`~._jsonl_writer.JsonlWriter`
builds on it: it writes, rotates, retries through outages and runs the background thread.
Every method here runs under the writer's lock.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Final

from eventbus_debug.diagnostics import get_logger
from eventbus_debug.exceptions import EventDecodeError
from eventbus_debug.log.encoding import decode_event

from ._jsonl_types import LogWriteError, os_error

__all__ = ("FILE_MODE", "JsonlFile")

# The writer's records keep the logger name they always had.
_log = get_logger("eventbus_debug.sinks._jsonl_writer")

FILE_MODE: Final = 0o644
_TAIL_SCAN: Final = 1024 * 1024
_MAX_TAIL_DECODE: Final = 64 * 1024 * 1024


class JsonlFile:
    """The live log file and its pending lines (see the module's documentation).

    Args:
        path, max_bytes, backup_count, namer, rotator, fsync, max_pending_bytes: as for
            :class:`~._jsonl_writer.JsonlWriter`.
    """

    def __init__(
        self,
        path: Path,
        *,
        max_bytes: int,
        backup_count: int,
        namer: Callable[[str], str] | None,
        rotator: Callable[[str, str], None],
        fsync: bool,
        max_pending_bytes: int,
    ) -> None:
        self._path = path
        self._max_bytes = max_bytes
        self._backup_count = backup_count
        self._namer = namer
        self._rotator = rotator
        self._fsync = fsync
        self._max_pending = max_pending_bytes

        self._fd: int | None = None
        self._ino = -1
        # False when the live path is a device or a pipe (a link to /dev/null): such a file is
        # never rotated, as in logging.handlers (bpo-45401), and has no size to keep.
        self._regular = True
        self._size = 0  # bytes in the live file, always at a line boundary
        self._repair = False  # the live file may end with a partial line to truncate
        # Encoded lines not written yet: while nothing else waits, a batch's own bytes (written
        # from where they were encoded); a bytearray once lines are appended to others.
        self._buffer: bytes | bytearray = b""
        self._buffer_lines = 0
        self._closed = False
        self._outage_lost = 0  # lines given up during the outage under way (the writer's)

        self._lines_written = 0
        self._bytes_written = 0
        self._lines_lost = 0
        self._write_errors = 0

    def should_rotate(self, size: int, /) -> bool:
        """Whether *size* more bytes would take the live file past ``max_bytes``."""
        if self._max_bytes <= 0 or not self._regular:
            return False
        current = self._size + len(self._buffer)
        return current > 0 and current + size > self._max_bytes

    def _trim_pending_locked(self) -> None:
        """Give up the oldest whole lines beyond ``max_pending_bytes`` (counted as lost)."""
        excess = len(self._buffer) - self._max_pending
        if excess <= 0:
            return
        buf = self._mutable_buffer()
        cut = buf.find(b"\n", excess - 1) + 1 or len(buf)
        lost = buf.count(b"\n", 0, cut)
        del buf[:cut]
        self._buffer_lines -= lost
        self._lines_lost += lost
        self._outage_lost += lost
        _log.error("log_lines_lost", path=str(self._path), lines=lost, at="pending buffer full")

    def _buffer_append(self, data: bytes) -> None:
        """Append *data* to the pending lines; an empty buffer takes the bytes as they are.

        Copying each batch into a bytearray, cleared after the write, cost 0.06-0.1 µs an event
        on this project's machines: the copy, and the pages the cleared bytearray gave back to
        the system faulting in again for the next batch.
        """
        buf = self._buffer
        if not buf:
            self._buffer = data
        elif data:
            self._mutable_buffer().extend(data)

    def _mutable_buffer(self) -> bytearray:
        buf = self._buffer
        if not isinstance(buf, bytearray):
            buf = self._buffer = bytearray(buf)
        return buf

    def _ensure_open(self) -> int:
        fd = self._fd
        if fd is not None:
            return fd
        self._path.parent.mkdir(parents=True, exist_ok=True)  # it may have been removed under us
        fd = os.open(self._path, os.O_RDWR | os.O_APPEND | os.O_CREAT, FILE_MODE)
        try:
            st = os.fstat(fd)
            self._regular = stat.S_ISREG(st.st_mode)
            if not self._regular:
                self._size = 0  # a device or a pipe: nothing to seal, never rotated
            elif self._repair and st.st_ino == self._ino and st.st_size > self._size:
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

    def _after_failure(self, fd: int | None, written: int) -> None:
        """Account for a failed write of ``written`` bytes; keep the rest for the next attempt.

        The complete lines that reached the file count as written; a partial line after them
        is cut off at once (``ftruncate`` needs no free space), so a reader never meets it.
        """
        self._write_errors += 1
        buf = self._mutable_buffer()
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

    def _rename_backups(self) -> None:
        """Shift the backups up by one and hand the live file to the rotator (as ``.1``).

        Raises whatever a rename, the namer or the rotator raises.
        """
        base = str(self._path)
        for i in range(self._backup_count - 1, 0, -1):
            src = self._backup_name(f"{base}.{i}")
            dst = self._backup_name(f"{base}.{i + 1}")
            if os.path.exists(src):
                os.replace(src, dst)
        first = self._backup_name(f"{base}.1")
        if os.path.exists(first):
            os.remove(first)
        self._rotator(base, first)

    def _ensure_open_or_raise(self) -> None:
        try:
            self._ensure_open()
        except OSError as exc:
            self._write_errors += 1
            raise self._write_error(exc, "cannot open the log file") from None

    def _backup_name(self, default: str) -> str:
        namer = self._namer
        if namer is None:
            return default
        name = namer(default)
        if os.path.abspath(name) == os.path.abspath(self._path):
            # Rotating would delete the live file with everything in it.
            msg = f"namer returned the live file's own path {name!r} for backup {default!r}"
            raise ValueError(msg)
        return name

    def _write_error(self, exc: Exception, what: str) -> LogWriteError:
        """A :class:`LogWriteError` saying *what* failed, why, and the fate of the lines kept.

        *exc* is an ``OSError`` (its ``errno`` is carried over) or, from a namer or rotator,
        any exception (named by its type).
        """
        pending = self._buffer_lines
        if isinstance(exc, OSError):
            detail = exc.strerror or str(exc)
            code = exc.errno
        else:
            detail = f"{type(exc).__name__}: {exc}"
            code = None
        if self._closed:  # the close's last attempt: nothing comes after it
            fate = f"{pending} line(s) not written at close, lost (counted in lines_lost)"
        else:
            fate = (
                f"{pending} line(s) kept to retry with the next batch (free disk space or "
                "restore the directory)"
            )
        msg = f"{what} {str(self._path)!r}: {detail}; {fate}"
        return os_error(LogWriteError, code, msg)


def _cut_at_lines(data: bytes, base: int, max_bytes: int) -> list[bytes]:
    """*data* (whole lines) cut between lines, one piece per file, the first completing a live
    file of *base* bytes: an empty first piece when the first line does not fit there (rotate
    first); a line longer than *max_bytes* is a piece of its own."""
    chunks: list[bytes] = []
    start = 0
    while start < len(data):
        room = max_bytes - base
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
    return chunks


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
