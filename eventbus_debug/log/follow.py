"""Following a log as it grows: the new complete lines of every rank's file, across rotation.

What ``eventbus-debug tail --follow`` reads with; :func:`~eventbus_debug.log.read_events` reads
a log once, :class:`LogFollower` polls it for what was written since.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from typing_extensions import Self

from ..events import Event
from ..exceptions import LogReadError
from .files import _FILE_RE, ReadStatistics, _decode_line, _open, log_files

__all__ = ("LogFollower",)


@dataclass
class _Cursor:
    """Where reading one rank's live log stopped: the file (by inode, held open), the offset in
    it, and an incomplete last line waiting for the rest."""

    inode: int
    offset: int
    partial: bytes = b""
    lines: int | None = 0
    """Complete lines read before *offset* (``None``: started at the end of a file)."""
    path: Path | None = None
    """The name it had when it was opened (for messages)."""
    fd: int | None = None
    """The followed file, held open: its rest is read after a rotation renamed, compressed or
    deleted it, and while it is open its inode number cannot be reused by the next live file
    (which would pass for the followed one and have its first lines skipped)."""


_READ_CHUNK = 1 << 20
_HEAD = 4096
"""Bytes of a file's beginning compared to recognise it in a compressed backup."""


class LogFollower:
    """Reads the complete new lines of every rank's log, across rotation (and gzipped backups).

    Each call to :meth:`poll` returns the events written since the previous call. The live file
    being followed is held open, so a rotation never loses or repeats a line: the rest of the
    rotated file is read (renamed, compressed or already deleted), then every backup written
    since, then the new live file from its start. :meth:`close` (or leaving a ``with`` block)
    lets the files go.

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
                live = _live(files)
                if live is None:
                    continue
                cursor = _follow(live, lines=None)
                if cursor is not None and cursor.fd is not None:
                    cursor.offset = os.fstat(cursor.fd).st_size
                    self._cursors[rank] = cursor

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Let the followed files go (idempotent); a later :meth:`poll` opens them again."""
        cursors, self._cursors = self._cursors, {}
        for cursor in cursors.values():
            _close(cursor)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def poll(self) -> list[Event]:
        """The events written since the last poll, merged over ranks by time."""
        out: list[Event] = []
        for rank, files in log_files(self._dir).items():
            out.extend(self._poll_rank(rank, files))
        if len(self._cursors) > 1:
            out.sort(key=lambda e: (e.time_ns, e.rank, e.seq))
        return out

    def _poll_rank(self, rank: int, files: list[Path]) -> Iterator[Event]:
        live = _live(files)
        backups = files[:-1] if live is not None else files
        cursor = self._cursors.get(rank)
        if cursor is None:
            if live is None:  # between a rotation's rename and the new live file: wait
                return
            newer = backups  # a rank seen for the first time: everything, oldest first
        else:
            yield from self._read_fd(cursor)
            live_inode = _inode(live) if live is not None else -1
            if cursor.inode == live_inode or live is None:
                return
            # Rotated: the rest of our file was read above; what was written since follows.
            if cursor.partial.strip():  # a line cut at the end of the rotated file
                yield from self._decode([cursor.partial], self._where(cursor), None)
            newer = _newer_backups(backups, cursor)
            _close(cursor)
            del self._cursors[rank]
        for path in newer:
            yield from self._read_path(path)
        follow = _follow(live)
        if follow is not None:
            self._cursors[rank] = follow
            yield from self._read_fd(follow)

    def _where(self, cursor: _Cursor) -> Path:
        return self._dir / f"<inode {cursor.inode}>"

    def _read_fd(self, cursor: _Cursor) -> Iterator[Event]:
        if cursor.fd is None:
            return
        chunks = []
        while True:
            try:
                chunk = _pread(cursor.fd, _READ_CHUNK, cursor.offset)
            except OSError as exc:
                msg = f"cannot read the log file being followed in {str(self._dir)!r}: {exc}"
                raise LogReadError(msg) from None
            if not chunk:
                break
            chunks.append(chunk)
            cursor.offset += len(chunk)
        if chunks:
            yield from self._split(cursor, b"".join(chunks), cursor.path or self._where(cursor))

    def _read_path(self, path: Path) -> Iterator[Event]:
        try:
            with _open(path) as fh:
                data = fh.read()
        except FileNotFoundError:
            return
        except (OSError, EOFError) as exc:
            msg = f"cannot read log file {str(path)!r}: {exc}"
            raise LogReadError(msg) from None
        cursor = _Cursor(-1, 0)
        yield from self._split(cursor, data + b"\n", path)

    def _split(self, cursor: _Cursor, data: bytes, path: Path) -> Iterator[Event]:
        data = cursor.partial + data
        lines = data.split(b"\n")
        cursor.partial = lines.pop()  # an incomplete last line waits for the next poll
        before = cursor.lines
        if before is not None:
            cursor.lines = before + len(lines)
        yield from self._decode(lines, path, before)

    def _decode(self, lines: list[bytes], path: Path, before: int | None) -> Iterator[Event]:
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            lineno = None if before is None else before + i + 1
            event = _decode_line(line, path, lineno, strict=self._strict, stats=self.stats)
            if event is not None:
                yield event


def _live(files: list[Path]) -> Path | None:
    """The live file among one rank's files (the last, without a ``.N`` suffix), if any."""
    if files:
        m = _FILE_RE.match(files[-1].name)
        if m is not None and m["n"] is None and m["gz"] is None:
            return files[-1]
    return None


def _inode(path: Path) -> int:
    try:
        return path.stat().st_ino
    except OSError:  # rotated away between listing and stat
        return -1


def _follow(path: Path, *, lines: int | None = 0) -> _Cursor | None:
    """Open *path* to follow it; None if it is gone already (the next poll finds its heir)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    except OSError as exc:
        msg = f"cannot read log file {str(path)!r}: {exc}"
        raise LogReadError(msg) from None
    return _Cursor(os.fstat(fd).st_ino, 0, lines=lines, path=path, fd=fd)


def _pread(fd: int, size: int, offset: int) -> bytes:
    """Up to *size* bytes of *fd* at *offset* (``os.pread`` where it exists: not on Windows)."""
    if hasattr(os, "pread"):
        return os.pread(fd, size, offset)
    os.lseek(fd, offset, os.SEEK_SET)
    return os.read(fd, size)


def _close(cursor: _Cursor) -> None:
    fd, cursor.fd = cursor.fd, None
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)


def _newer_backups(backups: list[Path], cursor: _Cursor) -> list[Path]:
    """The backups (oldest first) written after the rotated file *cursor* followed."""
    assert cursor.fd is not None
    st = os.fstat(cursor.fd)
    for i, path in enumerate(backups):  # renamed: the same inode
        if _inode(path) == st.st_ino:
            return backups[i + 1 :]
    if st.st_nlink > 0:  # under another name (being compressed): nothing newer yet
        return []
    # Deleted: compressed into a backup (recognised by its beginning), or beyond backup_count.
    head = _pread(cursor.fd, _HEAD, 0)
    if head:
        for i in range(len(backups) - 1, -1, -1):
            try:
                with _open(backups[i]) as fh:
                    if fh.read(len(head)) == head:
                        return backups[i + 1 :]
            except (OSError, EOFError):
                continue
    return backups  # older than every backup left: all of them are newer
