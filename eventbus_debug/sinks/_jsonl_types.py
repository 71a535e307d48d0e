"""The log writer's public values: its two errors and its statistics.

:class:`LogDirectoryError` and :class:`LogWriteError` are what :class:`RotatingFileSink` raises
(each an ``OSError`` carrying the operating system's ``errno``); :class:`FileSinkStatistics` is
its counters' snapshot. They are re-exported by :mod:`.rotating_file` and the package.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from eventbus_debug.exceptions import EventBusError

__all__ = ("FileSinkStatistics", "LogDirectoryError", "LogWriteError", "os_error")


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
        encode_errors: events not written because they could not be written readably: a
            field holds a value of the wrong type for it, or one JSON cannot carry (each is
            logged with its kind and field; the batch's other events are written).
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


_E = TypeVar("_E", LogDirectoryError, LogWriteError)


def os_error(cls: type[_E], code: int | None, msg: str) -> _E:
    """An OSError subclass carrying *code* as ``errno`` whose text is exactly *msg*."""
    err = cls(code, msg) if code is not None else cls(msg)
    return err
