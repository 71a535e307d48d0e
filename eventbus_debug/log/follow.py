"""Following a log as it grows: the new complete lines of every rank's file, across rotation.

What ``eventbus-debug tail --follow`` reads with; :func:`~eventbus_debug.log.read_events` reads
a log once, :class:`LogFollower` polls it for what was written since.

How a rotation is followed, whatever the moment a poll meets it. A rotation shifts the backups
(``.1`` → ``.2`` …), moves the live file to ``.1`` (renamed; or gzipped through a temporary
``.1.gz.tmp`` renamed to ``.1.gz``, then deleted) and starts a new live file; between two polls
none, part of one or many rotations may happen, and a directory listing taken while they do can
be stale by the time it is used. So the follower relies on no listing:

- the live file followed is held open; it is finished once the live name no longer leads to it
  (renamed, deleted, or a new file in its place; not while it is being compressed): nothing
  more is written to it, its rest is read through the open file, and its *head* (a digest of
  its first 4 KiB) is remembered;
- the backups are then looked up by name and checked to be as they were at one instant (every
  name stat-ed twice, the live file, ``.1`` and ``.1.gz`` held open in between, where new
  files appear; or looked up again);
- a backup is known by its head, the same compressed or not. Taken newest first, the backups
  before two known ones in a row were written after the file followed: they are read, oldest
  first, through a descriptor checked to be the file looked up, then the new live file from
  its start (a backup with the live file's head is its compressed copy, not read). Until the
  new live file exists, the follower only waits: it never starts over.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import os
import stat
import zlib
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from typing_extensions import Self

from eventbus_debug.diagnostics import get_logger

from ..events import Event
from ..exceptions import LogReadError
from .files import (
    ReadStatistics,
    _backup_number,
    _decode_line,
    _read_stopped,
    log_file_name,
    log_files,
)

__all__ = ("LogFollower",)

_log = get_logger(__name__)


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


_READ_CHUNK: Final = 1 << 20
_HEAD: Final = 4096
"""Bytes of a file's beginning that identify it, in a compressed backup as in the live file."""
_UNREADABLE: Final = b"?"
"""Starts the identity of a backup of which nothing can be read (made from its raw bytes): it
keeps such a file from being read (and reported) again, but two damaged files can share one,
so it never ends the look for new backups."""
_FOLLOWED_KEPT: Final = 16
"""Heads of the last files followed, remembered even when no backup holds them (a rotator
that moves the file to a backup name later)."""
_TRIES: Final = 100
"""Attempts at looking the backups up while rotations keep changing them (then the next poll
tries again)."""
_GAP: Final = 2
"""Backup numbers probed past the last one found: a rotation leaves one number free while it
shifts the others (and ``.1`` while it compresses)."""
_WINDOW: Final = 8
"""Backup numbers looked up first after a rotation (all of them when these are not enough)."""
_KNOWN_RUN: Final = 2
"""Known backups in a row that end the look for new ones (newest first)."""


@dataclass
class _Rank:
    """What the follower knows of one rank's log."""

    cursor: _Cursor | None = None
    """The live file followed; ``None`` before it, or after a rotation until the new one exists."""
    known: set[bytes] = field(default_factory=set)
    """Heads of the backups read or passed over (as of the last look at the backups)."""
    followed: deque[bytes] = field(default_factory=lambda: deque(maxlen=_FOLLOWED_KEPT))
    """Heads of the last live files followed to their end."""


@dataclass
class _Entry:
    """A file of a rank's log as it was looked up: its name, inode, and whether it is gzip."""

    path: Path
    inode: int
    gz: bool
    fd: int | None = None
    """Held open from the look-up (the live file, ``.1`` and ``.1.gz``), or ``None``."""


class _Changed(Exception):
    """A file was replaced under its name since the backups were looked up: look again."""


class LogFollower:
    """Reads the complete new lines of every rank's log, across rotation (and gzipped backups).

    Each call to :meth:`poll` returns the events written since the previous call, each event
    once, in the order written, whatever the moment a rotation (renames, compression, the new
    live file) happens. The live file being followed is held open: when a rotation moves it
    away, its rest is read through it, then every backup written since (oldest first, gzipped
    or not; a backup is recognised by its first bytes, so the compressed copy of the file
    followed is never read again), then the new live file from its start. Backups deleted by
    ``backup_count`` before a poll could read them are lost to the follower (poll more often
    than the log rotates ``backup_count`` times). :meth:`close` (or leaving a ``with`` block)
    lets the files go; a later :meth:`poll` starts over, as a new follower with
    ``from_end=False`` would.

    Args:
        directory: the log directory.
        from_end: start at the end of the current files (only new events are returned; a
            line being written is returned once complete).
        strict: raise on an undecodable complete line (not JSON, an unknown kind, a field of
            the wrong type) instead of skipping it; skipped lines are logged
            (``undecodable_log_line``, as :func:`~eventbus_debug.log.read_events` does) and
            counted in :attr:`stats` (``invalid_lines``). A torn line (cut by a crash) is
            skipped in both modes, and an event glued after it recovered. A backup that cannot
            be read to its end (a corrupt or cut-short gzip) raises :class:`LogReadError`
            naming it and the line where reading stopped; with ``strict=False`` the events
            read before the stop are kept, the stop is logged (``log_read_stopped``, as
            :func:`~eventbus_debug.log.read_events` does) and counted in :attr:`read_stops`.

    Raises:
        LogReadError: from the constructor and :meth:`poll`, if *directory* does not exist
            or is not a directory, or a file of the log cannot be read (see *strict*).
    """

    def __init__(self, directory: Path, *, from_end: bool, strict: bool = False) -> None:
        self._dir = Path(directory)
        self._strict = strict
        self._ranks: dict[int, _Rank] = {}
        self.stats = ReadStatistics()
        """What the follower met: events, torn lines, lines skipped (``strict=False``)."""
        self.read_stops = 0
        """Backups whose reading stopped at an error, the events before it kept
        (``strict=False``; each one logged as ``log_read_stopped``)."""
        if from_end:
            for rank, files in log_files(self._dir).items():
                self._ranks[rank] = self._skip_to_end(rank, files)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Let the followed files go (idempotent); a later :meth:`poll` starts over."""
        ranks, self._ranks = self._ranks, {}
        for state in ranks.values():
            if state.cursor is not None:
                _close(state.cursor)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def poll(self) -> list[Event]:
        """The events written since the last poll, merged over ranks by time."""
        out: list[Event] = []
        listed = log_files(self._dir)
        for rank in sorted(listed.keys() | self._ranks.keys()):
            out.extend(self._poll_rank(rank, listed.get(rank, [])))
        if len(self._ranks) > 1:
            out.sort(key=lambda e: (e.time_ns, e.rank, e.seq))
        return out

    # -- one rank ----------------------------------------------------------------------------

    def _skip_to_end(self, rank: int, files: list[Path]) -> _Rank:
        """A rank's state at the end of its current files (``from_end=True``): the newest
        backups known, the live file followed from the end of its last complete line."""
        state = _Rank()
        for _ in range(_TRIES):
            with _Lookup(self._dir, rank, files, _WINDOW) as lookup:
                if not lookup.consistent:
                    continue
                try:
                    state.known = {h for h in map(_head, lookup.backups[::-1][:_WINDOW]) if h}
                except _Changed:
                    continue
                live = lookup.take_live()
                if live is not None and live.fd is not None:
                    end = _last_line_end(live.fd, os.fstat(live.fd).st_size)
                    state.cursor = _Cursor(live.inode, end, lines=None, path=live.path, fd=live.fd)
                return state
        return state  # rotating all along: the first poll reads what it finds

    def _poll_rank(self, rank: int, files: list[Path]) -> Iterator[Event]:
        state = self._ranks.get(rank)
        if state is None:  # a rank seen for the first time: everything, oldest first
            state = self._ranks[rank] = _Rank()
        cursor = state.cursor
        if cursor is not None:
            yield from self._read_fd(cursor)
            if _inode(self._dir / log_file_name(rank)) == cursor.inode:
                return  # still the live file (perhaps being compressed: it is read to its end)
            # Rotated: nothing more is written to it. Its rest (also what was written between
            # the read above and the rotation), then what was written since.
            yield from self._read_fd(cursor)
            if cursor.partial.strip():  # a line cut at the end of the rotated file
                yield from self._decode([cursor.partial], cursor.path or self._dir, None)
            head = _head_of_fd(cursor)
            if head:
                state.followed.append(head)
            state.cursor = None
            _close(cursor)
        yield from self._catch_up(rank, state, files)

    def _catch_up(self, rank: int, state: _Rank, files: list[Path]) -> Iterator[Event]:
        """The backups not read yet, oldest first, then the live file from its start.

        The backups are taken newest first until :data:`_KNOWN_RUN` in a row are known: the
        ones before are new (written after the file followed), the ones after older still.
        Only the newest :data:`_WINDOW` numbers are looked up first, all of them if needed.
        """
        window: int | None = _WINDOW
        tries = 0
        while tries < _TRIES:
            tries += 1
            with _Lookup(self._dir, rank, files, window) as lookup:
                if not lookup.consistent:
                    continue
                seen = state.known | set(state.followed)
                live = lookup.live
                try:
                    if live is not None:
                        # Compressed, not yet deleted: the live file's copy is read as the
                        # live file (a backup with the live file's head).
                        seen.add(_head(live))
                    heads: set[bytes] = set()
                    new: list[tuple[_Entry, bytes]] = []
                    run = 0
                    for entry in reversed(lookup.backups):
                        head = _head(entry)
                        if not head:
                            continue  # an empty file: nothing to read, nothing to know it by
                        heads.add(head)
                        if head in seen:
                            if head.startswith(_UNREADABLE):
                                continue  # read already, but it may not be that file
                            run += 1
                            if run == _KNOWN_RUN:
                                break
                        else:
                            run = 0
                            new.append((entry, head))
                    else:
                        if not lookup.complete:
                            window = None  # more backups than looked up: look at all of them
                            tries -= 1
                            continue
                    for entry, head in reversed(new):
                        yield from self._read_backup(entry)
                        state.known.add(head)
                except _Changed:
                    continue  # a rotation moved a backup: look again (what was read is known)
                state.known = heads  # the newest backups: enough to tell the next new ones
                live = lookup.take_live()
                if live is not None:
                    state.cursor = _Cursor(live.inode, 0, path=live.path, fd=live.fd)
                    yield from self._read_fd(state.cursor)
                return

    # -- reading -----------------------------------------------------------------------------

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
            yield from self._split(cursor, b"".join(chunks), cursor.path or self._dir)

    def _read_backup(self, entry: _Entry) -> Iterator[Event]:
        """Every line of a backup; one that cannot be read to its end is an error (*strict*),
        or its lines before the stop are kept and the stop logged and counted."""
        with _opened(entry) as fd:
            data, error = _read_all(fd, entry.gz)
        if error is None:
            yield from self._split(_Cursor(-1, 0), data + b"\n", entry.path)
            return
        whole = data[: data.rfind(b"\n") + 1]  # a line the stop cut is not a complete line
        _read_stopped(entry.path, whole.count(b"\n"), error, strict=self._strict, log=_log)
        self.read_stops += 1
        yield from self._split(_Cursor(-1, 0), whole, entry.path)

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


class _Lookup:
    """A rank's files looked up by name as they were at one instant (:attr:`consistent`).

    Every name (the live file, ``.N`` and ``.N.gz`` up to the highest number listed, and
    :data:`_GAP` past the last one found) is stat-ed, the live file, ``.1`` and ``.1.gz`` (where
    new files appear, so where an inode number could come back) are opened, then every name is
    stat-ed again: if nothing changed, every name led to its file at the moment between the two
    passes. The files held open are closed on leaving the ``with`` block, but for the live one
    once :meth:`take_live` handed it over.
    """

    def __init__(self, directory: Path, rank: int, files: list[Path], limit: int | None) -> None:
        self._live = directory / log_file_name(rank)
        self._dir = directory
        listed = [_backup_number(p) for p in files]
        self._hint = max([n for n in listed if n is not None], default=0)
        self._limit = limit
        self._held: dict[Path, int] = {}
        self.backups: list[_Entry] = []
        """Oldest first."""
        self.live: _Entry | None = None
        self.consistent = False
        """Whether the names were found as they were at one instant (else look again)."""
        self.complete = False
        """Whether every backup was looked up (not only the newest *limit* numbers)."""

    def __enter__(self) -> Self:
        try:
            self._look()
        except BaseException:
            self._close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._close()

    def take_live(self) -> _Entry | None:
        """The live file, its descriptor now the caller's to close."""
        live = self.live
        if live is not None and live.fd is not None:
            del self._held[live.path]
        return live

    def _names(self) -> Iterator[tuple[Path, int, bool]]:
        """(path, backup number, gzip) of every name to look at: the live file, then the
        backups from ``.1`` up (the caller says where to stop)."""
        yield self._live, 0, False
        n = 1
        while True:
            for gz in (False, True):
                yield self._dir / f"{self._live.name}.{n}{'.gz' if gz else ''}", n, gz
            n += 1

    def _look(self) -> None:
        first: dict[Path, tuple[int, int, bool]] = {}  # path -> (inode or -1, number, gz)
        last = 0
        for path, n, gz in self._names():
            if n > max(self._hint, last + _GAP):
                self.complete = True
                break
            if self._limit is not None and n > self._limit:
                break
            inode = _regular_inode(path)
            first[path] = (inode, n, gz)
            if inode != -1:
                last = max(last, n)
        for path, (_, n, _gz) in first.items():
            if n <= 1:
                fd = _open_regular(path)
                if fd is not None:
                    self._held[path] = fd
        for path, (inode, n, _gz) in first.items():
            if _regular_inode(path) != inode:
                return  # a rotation is under way: the caller looks again
            fd = self._held.get(path)
            if n <= 1 and (os.fstat(fd).st_ino if fd is not None else -1) != inode:
                return
        found = [(n, gz, path, inode) for path, (inode, n, gz) in first.items() if inode != -1]
        # Oldest first: the highest number first (a .N and a .N.gz of switched runs: .N first).
        found.sort(key=lambda f: (-f[0], f[1]))
        for n, gz, path, inode in found:
            entry = _Entry(path, inode, gz, self._held.get(path))
            if n == 0:
                self.live = entry
            else:
                self.backups.append(entry)
        self.consistent = True

    def _close(self) -> None:
        held, self._held = self._held, {}
        for fd in held.values():
            with contextlib.suppress(OSError):
                os.close(fd)


def _regular_inode(path: Path) -> int:
    """The inode of the regular file *path* names, or -1 (none, or not a regular file)."""
    try:
        st = os.stat(path)
    except OSError:
        return -1
    return st.st_ino if stat.S_ISREG(st.st_mode) else -1


def _open_regular(path: Path) -> int | None:
    """A descriptor of the regular file *path* names; None if there is none (a named pipe is
    not waited on: opened without blocking, then let go)."""
    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return None
    except OSError as exc:
        msg = f"cannot read log file {str(path)!r}: {exc}"
        raise LogReadError(msg) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd


@contextlib.contextmanager
def _opened(entry: _Entry) -> Iterator[int]:
    """A descriptor of *entry*'s file (held since the look-up, or opened by its name and
    checked to be the same file: :class:`_Changed` if a rotation has put another there)."""
    if entry.fd is not None:
        yield entry.fd
        return
    fd = _open_regular(entry.path)
    if fd is None:
        raise _Changed
    try:
        if os.fstat(fd).st_ino != entry.inode:
            raise _Changed
        yield fd
    finally:
        os.close(fd)


def _read_all(fd: int, gz: bool, limit: int | None = None) -> tuple[bytes, Exception | None]:
    """The content of *fd* (decompressed when *gz*), at least *limit* bytes of it if given, and
    the error that stopped the read early (a corrupt or cut-short gzip), if one did.

    The first :data:`_HEAD` bytes are read in pieces of that size, so a read that stops early
    stops at the same place whether it reads the head or everything.
    """
    chunks: list[bytes] = []
    size = 0
    try:
        if gz:
            with os.fdopen(os.dup(fd), "rb") as raw:
                raw.seek(0)
                with gzip.GzipFile(fileobj=raw, mode="rb") as fh:
                    while limit is None or size < limit:
                        chunk = fh.read1(_HEAD if size < _HEAD else _READ_CHUNK)
                        if not chunk:
                            break
                        chunks.append(chunk)
                        size += len(chunk)
        else:
            while limit is None or size < limit:
                chunk = _pread(fd, _HEAD if size < _HEAD else _READ_CHUNK, size)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
    except (OSError, EOFError, zlib.error) as exc:
        return b"".join(chunks), exc
    return b"".join(chunks), None


def _head(entry: _Entry) -> bytes:
    """What identifies a backup: a digest of its first :data:`_HEAD` bytes once decompressed
    (the same as the live file it was); for a gzip of which nothing can be read, of its first
    raw bytes (starting with :data:`_UNREADABLE`). ``b""`` for a file that holds nothing
    (identifies nothing: nothing to read in it either)."""
    with _opened(entry) as fd:
        data, error = _read_all(fd, entry.gz, _HEAD)
        if data or error is None:
            return _digest(data[:_HEAD])
        raw = _pread(fd, _HEAD, 0)
    return _UNREADABLE + _digest(raw)[1:]


def _head_of_fd(cursor: _Cursor) -> bytes:
    """The head (:func:`_head`) of the file *cursor* followed, read through its descriptor."""
    if cursor.fd is None:
        return b""
    try:
        return _digest(_pread(cursor.fd, _HEAD, 0))
    except OSError:
        return b""


def _digest(head: bytes) -> bytes:
    """The identity kept for a file's head (``b""`` for none)."""
    return b"=" + hashlib.blake2b(head, digest_size=16).digest() if head else b""


def _last_line_end(fd: int, size: int) -> int:
    """Where the last complete line among the first *size* bytes of *fd* ends (0: none)."""
    end = size
    while end > 0:
        start = max(0, end - _READ_CHUNK)
        found = _pread(fd, end - start, start).rfind(b"\n")
        if found >= 0:
            return start + found + 1
        end = start
    return 0


def _inode(path: Path) -> int:
    try:
        return os.stat(path).st_ino
    except OSError:  # rotated away
        return -1


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
