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
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Final

from eventbus_debug._logging import get_logger

from .encoding import decode_event
from .events import Event
from .exceptions import EventDecodeError, LogReadError

__all__ = ("LOG_STEM", "LOG_SUFFIX", "log_file_name", "log_files", "read_events")

_log = get_logger(__name__)

LOG_STEM: Final = "events"
LOG_SUFFIX: Final = ".jsonl"
_FILE_RE: Final = re.compile(
    rf"^{LOG_STEM}(?:\.rank(?P<rank>\d+))?{re.escape(LOG_SUFFIX)}(?:\.(?P<n>\d+))?(?P<gz>\.gz)?$"
)


def log_file_name(rank: int = 0) -> str:
    """The name of the live log file of *rank* (``events.jsonl``, ``events.rank3.jsonl``)."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        msg = f"rank must be a non-negative integer, got {rank!r}"
        raise ValueError(msg)
    return f"{LOG_STEM}{LOG_SUFFIX}" if rank == 0 else f"{LOG_STEM}.rank{rank}{LOG_SUFFIX}"


def log_files(directory: str | os.PathLike[str], /) -> dict[int, list[Path]]:
    """The log files in *directory*, per rank, oldest first (backups ``.N`` … ``.1``, then live).

    Raises:
        LogReadError: if *directory* does not exist or is not a directory.
    """
    root = Path(directory)
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


def read_events(path: str | os.PathLike[str], /, *, strict: bool = True) -> Iterator[Event]:
    """Yield the typed events of a log file, or of every rank's files in a log directory.

    A directory's ranks are merged by event time; each rank's files are read oldest first. A
    last line cut short by a crash is skipped (logged once). With ``strict=False``, any line
    that cannot be decoded is skipped instead of raising.

    Raises:
        LogReadError: if *path* does not exist, or a directory holds no log file.
        EventDecodeError: if a complete line cannot be decoded (``strict=True``); the message
            names the file and line number.
    """
    p = Path(path)
    if p.is_dir():
        per_rank = log_files(p)
        if not per_rank:
            msg = f"no event log ({LOG_STEM}*{LOG_SUFFIX}) in directory {str(p)!r}"
            raise LogReadError(msg)
        streams = [_read_many(files, strict) for files in per_rank.values()]
        if len(streams) == 1:
            yield from streams[0]
        else:
            yield from heapq.merge(*streams, key=lambda e: (e.time_ns, e.rank, e.seq))
        return
    if not p.exists():
        msg = f"log file {str(p)!r} does not exist"
        raise LogReadError(msg)
    yield from _read_file(p, strict)


def _read_many(files: list[Path], strict: bool) -> Iterator[Event]:
    for f in files:
        yield from _read_file(f, strict)


def _open(path: Path) -> IO[bytes] | gzip.GzipFile:
    if path.suffix == ".gz":
        return gzip.open(path, "rb")
    return open(path, "rb")


def _read_file(path: Path, strict: bool) -> Iterator[Event]:
    try:
        fh = _open(path)
    except OSError as exc:
        msg = f"cannot read log file {str(path)!r}: {exc.strerror or exc}"
        raise LogReadError(msg) from None
    with fh:
        lineno = 0
        try:
            for line in fh:
                lineno += 1
                if not line.endswith(b"\n"):
                    # The last line of a file cut by a crash: decode it if it is whole.
                    try:
                        yield decode_event(line)
                    except EventDecodeError:
                        _log.warning("truncated_log_line", file=str(path), line=lineno)
                    return
                if not line.strip():
                    continue
                try:
                    event = decode_event(line)
                except EventDecodeError as exc:
                    if strict:
                        msg = f"{path}:{lineno}: {exc}"
                        raise EventDecodeError(msg) from None
                    _log.warning("undecodable_log_line", file=str(path), line=lineno)
                    continue
                yield event
        except (OSError, EOFError) as exc:
            # e.g. a gzip backup cut short: keep what was read, say where it stopped.
            if strict:
                msg = f"cannot read log file {str(path)!r} past line {lineno}: {exc}"
                raise LogReadError(msg) from None
            _log.warning("log_read_stopped", file=str(path), line=lineno, error=str(exc))
