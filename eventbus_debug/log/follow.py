"""Following a log as it grows: the new complete lines of every rank's file, across rotation.

What ``eventbus-debug tail --follow`` reads with; :func:`~eventbus_debug.log.read_events` reads
a log once, :class:`LogFollower` polls it for what was written since.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..events import Event
from ..exceptions import LogReadError
from .files import ReadStatistics, _decode_line, _open, log_files

__all__ = ("LogFollower",)


@dataclass
class _Cursor:
    """Where reading one rank's log stopped: the file (by inode), the offset in it, and an
    incomplete last line waiting for the rest."""

    inode: int
    offset: int
    partial: bytes = b""
    lines: int | None = 0
    """Complete lines read before *offset* (``None``: started at the end of a file)."""


class LogFollower:
    """Reads the complete new lines of every rank's log, across rotation (and gzipped backups).

    Each call to :meth:`poll` returns the events written since the previous call. A file being
    followed is recognized by its inode, so a rotation (rename to ``.1``) never loses or
    repeats a line: the rest of the renamed file is read, then the new live file from its start.

    Args:
        directory: the log directory.
        from_end: start at the end of the current files (only new events are returned).
        strict: raise on an undecodable complete line (not JSON, an unknown kind, a field of
            the wrong type) instead of skipping it; skipped lines are logged
            (``undecodable_log_line``, as :func:`~eventbus_debug.log.read_events` does) and
            counted in :attr:`stats` (``invalid_lines``). A torn line (cut by a crash) is
            skipped in both modes, and an event glued after it recovered.
    """

    def __init__(self, directory: Path, *, from_end: bool, strict: bool = False) -> None:
        self._dir = directory
        self._strict = strict
        self._cursors: dict[int, _Cursor] = {}
        self.stats = ReadStatistics()
        """What the follower met: events, torn lines, lines skipped (``strict=False``)."""
        if from_end:
            for rank, files in log_files(directory).items():
                live = files[-1]
                st = live.stat()
                self._cursors[rank] = _Cursor(st.st_ino, st.st_size, lines=None)

    def poll(self) -> list[Event]:
        """The events written since the last poll, merged over ranks by time."""
        out: list[Event] = []
        for rank, files in log_files(self._dir).items():
            out.extend(self._poll_rank(rank, files))
        if len(self._cursors) > 1:
            out.sort(key=lambda e: (e.time_ns, e.rank, e.seq))
        return out

    def _poll_rank(self, rank: int, files: list[Path]) -> Iterator[Event]:
        inodes = []
        for f in files:
            try:
                inodes.append(f.stat().st_ino)
            except FileNotFoundError:  # rotated away between listing and stat
                inodes.append(-1)
        cursor = self._cursors.get(rank)
        if cursor is None:
            start = 0
            cursor = _Cursor(inodes[0], 0)
        elif cursor.inode in inodes:
            start = inodes.index(cursor.inode)
        else:
            # Our file was compressed into a new backup: continue in the newest backup.
            start = max(len(files) - 2, 0)
            cursor = _Cursor(inodes[start], cursor.offset, cursor.partial, cursor.lines)
        for i in range(start, len(files)):
            if i > start:
                cursor = _Cursor(inodes[i], 0)
            yield from self._read_from(files[i], cursor)
        self._cursors[rank] = cursor

    def _read_from(self, path: Path, cursor: _Cursor) -> Iterator[Event]:
        try:
            with _open(path) as fh:
                fh.seek(cursor.offset)
                data = fh.read()
        except FileNotFoundError:
            return
        except (OSError, EOFError) as exc:
            msg = f"cannot read log file {str(path)!r}: {exc}"
            raise LogReadError(msg) from None
        cursor.offset += len(data)
        data = cursor.partial + data
        lines = data.split(b"\n")
        cursor.partial = lines.pop()  # an incomplete last line waits for the next poll
        before = cursor.lines
        if before is not None:
            cursor.lines = before + len(lines)
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            lineno = None if before is None else before + i + 1
            event = _decode_line(line, path, lineno, strict=self._strict, stats=self.stats)
            if event is not None:
                yield event
