"""The canonical JSON-lines log: file naming and a crash-tolerant reader.

A log directory holds one file per rank, ``events.jsonl`` for rank 0 and
``events.rank{N}.jsonl`` for the others; rotation renames older content to ``.1``, ``.2``, …
(``.1`` is the newest backup), optionally gzipped (``.1.gz``). The writer is
:class:`sinks.RotatingFileSink`; this module is the reader every consumer shares (reports, the
command line, your scripts).
"""

from __future__ import annotations

import gzip
import heapq
import os
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Final

import orjson

from eventbus_debug.diagnostics import get_logger

from ..events import Event
from ..exceptions import EventDecodeError, LogReadError
from .encoding import decode_event
from .runs import RunSplitter, check_run

if TYPE_CHECKING:
    import structlog

__all__ = (
    "LOG_STEM",
    "LOG_SUFFIX",
    "ReadStatistics",
    "log_file_name",
    "log_files",
    "read_events",
)

_log = get_logger(__name__)

LOG_STEM: Final = "events"
LOG_SUFFIX: Final = ".jsonl"
_FILE_RE: Final = re.compile(
    rf"^{LOG_STEM}(?:\.rank(?P<rank>\d+))?{re.escape(LOG_SUFFIX)}(?:\.(?P<n>\d+))?(?P<gz>\.gz)?$"
)


_LINE_START: Final = b'{"kind":'
"""How every line the writer produces starts: a torn line is a prefix of such a line."""


@dataclass(slots=True)
class ReadStatistics:
    """What :func:`read_events` met, filled in as it reads (pass one as ``stats=``).

    Attributes:
        events: events yielded.
        torn_lines: partial lines skipped (cut by a crash, a kill or a full disk; anywhere in
            a file, not only at its end).
        recovered: whole events found glued after a torn prefix, and yielded.
        invalid_lines: complete lines that could not be decoded, skipped (``strict=False``).
    """

    events: int = 0
    torn_lines: int = 0
    recovered: int = 0
    invalid_lines: int = 0


def log_file_name(rank: int = 0) -> str:
    """The name of the live log file of *rank* (``events.jsonl``, ``events.rank3.jsonl``)."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        msg = f"rank must be a non-negative integer, got {rank!r}"
        raise ValueError(msg)
    return f"{LOG_STEM}{LOG_SUFFIX}" if rank == 0 else f"{LOG_STEM}.rank{rank}{LOG_SUFFIX}"


def _backup_number(path: Path) -> int | None:
    """The backup number in a log file's name (``.3`` or ``.3.gz``: 3; a live file: 0), or
    None for a name that is not a log file's."""
    m = _FILE_RE.match(path.name)
    return None if m is None else int(m["n"] or 0)


def log_files(directory: str | os.PathLike[str], /) -> dict[int, list[Path]]:
    """The log files in *directory*, per rank, oldest first (backups ``.N`` … ``.1``, then live).

    Raises:
        TypeError: if *directory* is not a ``str`` or an ``os.PathLike``.
        LogReadError: if *directory* does not exist or is not a directory.
    """
    root = _as_path(directory, "directory")
    if not root.exists():
        msg = f"log directory {str(root)!r} does not exist"
        raise LogReadError(msg)
    if not root.is_dir():
        msg = f"{str(root)!r} is not a directory"
        raise LogReadError(msg)
    found: dict[int, list[tuple[int, Path]]] = {}
    for path in root.iterdir():
        m = _FILE_RE.match(path.name)
        if m is None or not path.is_file():
            continue
        rank = int(m["rank"] or 0)
        backup = int(m["n"] or 0)
        found.setdefault(rank, []).append((backup, path))
    return {
        rank: [p for _, p in sorted(entries, key=lambda e: -e[0])]
        for rank, entries in sorted(found.items())
    }


def read_events(
    path: str | os.PathLike[str],
    /,
    *,
    strict: bool = True,
    stats: ReadStatistics | None = None,
    run: str = "all",
) -> Iterator[Event]:
    """Yield the typed events of a log file, or of every rank's files in a log directory.

    A directory's ranks are merged by event time; each rank's files are read oldest first.
    Logs are untrusted input: every field is checked against its declared type.

    A rerun into the same directory appends to the same files. *run* picks the events of one
    run: ``"all"`` (default: every event of the log), ``"latest"`` (the run whose session
    started last) or a run id (``SessionStarted.run_id``, as ``eventbus-debug summary``
    lists them). Each rank's events belong to the run its latest ``SessionStarted``
    announced (:mod:`eventbus_debug.log.runs`); a run is found by a first pass over the
    session starts, then read.

    A *torn* line — the prefix of an event cut by a crash, a kill or a full disk, anywhere in
    a file — is skipped in both modes (and an event glued after it is recovered); it is
    counted in *stats* and logged. A complete line that cannot be decoded (not JSON, unknown
    kind, a field of the wrong type) raises with ``strict=True`` and is skipped and counted
    with ``strict=False``.

    The arguments are checked when it is called; the files are opened as it is iterated.

    Raises:
        TypeError: at the call, if *path* is not a ``str`` or an ``os.PathLike`` (a
            ``pathlib.Path``), *strict* is not a ``bool``, *stats* is not a
            :class:`ReadStatistics` or *run* is not a ``str``.
        ValueError: at the call, if *run* is empty; as it is iterated, if *run* is a run id
            that the log does not hold (the message lists those it does).
        LogReadError: if *path* does not exist, or a directory holds no log file.
        EventDecodeError: if a complete line cannot be decoded (``strict=True``); the message
            names the file, the line number and the field.
    """
    p = _as_path(path, "path")
    if not isinstance(strict, bool):
        msg = f"strict must be a bool, got {type(strict).__name__} {strict!r}"
        raise TypeError(msg)
    if stats is not None and not isinstance(stats, ReadStatistics):
        msg = f"stats must be a ReadStatistics or None, got {type(stats).__name__} {stats!r}"
        raise TypeError(msg)
    run = check_run(run)
    stats = ReadStatistics() if stats is None else stats
    if run == "all":
        return _read_path(p, strict, stats)
    return _read_run(p, strict, stats, run)


_STARTS: Final = b"session_started"
"""In every line of a ``SessionStarted``, whatever wrote it (the first pass of a run's read
decodes no other line)."""


def _read_run(p: Path, strict: bool, stats: ReadStatistics, run: str) -> Iterator[Event]:
    """The events of the run *run* selects (two passes: the session starts, then the run)."""
    starts = RunSplitter()
    for event in _read_path(p, strict, ReadStatistics(), only=_STARTS):
        starts.assign(event)
    chosen = starts.choose(run)
    splitter = RunSplitter()
    for event in _read_path(p, strict, stats):
        key, event = splitter.assign(event)
        if key == chosen:
            yield event


def _as_path(value: object, argument: str) -> Path:
    """*value* as a :class:`Path`; a ``TypeError`` naming *argument* and the accepted types."""
    if isinstance(value, str | os.PathLike):
        try:
            return Path(value)
        except TypeError:  # an os.PathLike of bytes
            pass
    msg = (
        f"{argument} must be a str or an os.PathLike (e.g. pathlib.Path) naming a log file "
        f"or directory, got {type(value).__name__} {value!r}"
    )
    raise TypeError(msg)


def _read_path(
    p: Path, strict: bool, stats: ReadStatistics, only: bytes | None = None
) -> Iterator[Event]:
    """The events of file or directory *p*; *only*: of the lines holding these bytes."""
    if p.is_dir():
        per_rank = log_files(p)
        if not per_rank:
            msg = f"no event log ({LOG_STEM}*{LOG_SUFFIX}) in directory {str(p)!r}"
            raise LogReadError(msg)
        streams = [_read_many(files, strict, stats, only) for files in per_rank.values()]
        if len(streams) == 1:
            yield from streams[0]
        else:
            yield from heapq.merge(*streams, key=lambda e: (e.time_ns, e.rank, e.seq))
        return
    if not p.exists():
        msg = f"log file {str(p)!r} does not exist"
        raise LogReadError(msg)
    yield from _read_file(p, strict, stats, only)


def _read_many(
    files: list[Path], strict: bool, stats: ReadStatistics, only: bytes | None
) -> Iterator[Event]:
    for f in files:
        yield from _read_file(f, strict, stats, only)


def _open(path: Path) -> IO[bytes] | gzip.GzipFile:
    if path.suffix == ".gz":
        return gzip.open(path, "rb")
    return open(path, "rb")


def _torn(line: bytes) -> tuple[bool, Event | None]:
    """Whether a line that is not valid JSON is torn, and the whole event glued after it.

    A torn line starts like an event (``{``) and was cut; when the next run appended to it,
    a whole event follows the cut part on the same line and is recovered.
    """
    body = line.rstrip(b"\r\n")
    glued = body.rfind(_LINE_START)
    if glued > 0:
        try:
            return True, decode_event(body[glued:])
        except EventDecodeError:
            return True, None
    return body.startswith(b"{"), None


def _decode_line(
    line: bytes, path: Path, lineno: int | None, *, strict: bool, stats: ReadStatistics
) -> Event | None:
    """One complete, non-blank line of *path* as its event, counted in *stats*; ``None`` when
    it is skipped.

    A torn line (cut by a crash) is skipped in both modes, counted and logged; a whole event
    glued after it is returned instead. An undecodable line is skipped, counted and logged
    unless *strict*. What :func:`read_events` and :class:`~.follow.LogFollower` read with
    (*lineno* is ``None`` where it is not known: a follower started at a file's end).

    Raises:
        EventDecodeError: with *strict*, for an undecodable line, naming the file and the
            line (an :class:`UnknownEventKindError` stays one).
    """
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError:
        is_torn, found = _torn(line)
        if is_torn:
            stats.torn_lines += 1
            _log.warning("torn_log_line_skipped", file=str(path), line=lineno)
            if found is not None:
                stats.recovered += 1
                stats.events += 1
            return found
        obj = None
    try:
        if obj is None:
            msg = "not a JSON event line"
            raise EventDecodeError(msg)
        event = decode_event(obj)
    except EventDecodeError as exc:
        if strict:
            where = f"{path}:{lineno}" if lineno is not None else str(path)
            raise type(exc)(f"{where}: {exc}") from None
        stats.invalid_lines += 1
        _log.warning("undecodable_log_line", file=str(path), line=lineno, error=str(exc))
        return None
    stats.events += 1
    return event


def _read_file(
    path: Path, strict: bool, stats: ReadStatistics, only: bytes | None = None
) -> Iterator[Event]:
    try:
        fh = _open(path)
    except OSError as exc:
        msg = f"cannot read log file {str(path)!r}: {exc.strerror or exc}"
        raise LogReadError(msg) from None
    torn, invalid = stats.torn_lines, stats.invalid_lines
    with fh:
        lineno = 0
        try:
            for line in fh:
                lineno += 1
                if not line.strip() or (only is not None and only not in line):
                    continue
                event = _decode_line(line, path, lineno, strict=strict, stats=stats)
                if event is not None:
                    yield event
        except (OSError, EOFError, zlib.error) as exc:
            # e.g. a gzip backup cut short or corrupt: keep what was read, say where it stopped.
            _read_stopped(path, lineno, exc, strict=strict, log=_log)
    torn, invalid = stats.torn_lines - torn, stats.invalid_lines - invalid
    if torn or invalid:
        _log.warning("log_lines_skipped", file=str(path), torn=torn, invalid=invalid)


def _read_stopped(
    path: Path,
    lineno: int,
    error: BaseException,
    *,
    strict: bool,
    log: structlog.stdlib.BoundLogger,
) -> None:
    """A file that could not be read past *lineno* (a cut-short or corrupt gzip): a
    :class:`LogReadError` naming it when *strict*, else the stop logged (``log_read_stopped``)
    on *log*, the lines before it kept by the caller.

    Raises:
        LogReadError: when *strict*.
    """
    if strict:
        msg = f"cannot read log file {str(path)!r} past line {lineno}: {error}"
        raise LogReadError(msg) from None
    log.warning("log_read_stopped", file=str(path), line=lineno, error=str(error))
