"""The report writer: a sink that keeps a typed run summary and writes it as JSON and HTML.

:class:`ReportWriter` folds every event it receives into a :class:`RunSummary` (bounded memory:
counters, running statistics, downsampled series, the most recent incidents) and writes
``report.json`` and a self-contained ``report.html`` every ``interval`` seconds and at close.
The bus closes sinks only after draining their queues, so the report written at close accounts
for every event the writer was sent.

The same aggregation runs over a JSON-lines log (:func:`build_report`, or
``eventbus-debug report LOGDIR``), and gives the same summary as the live writer. A log
directory that several runs appended to (a script rerun into the same ``log_dir``) is never
merged silently: each ``SessionStarted`` carries a run id, the report shows the latest run by
default and lists the others.

Every string in the page comes from events, that is from a log anyone could have written:
all of it is escaped (see :mod:`sinks.report_html`). The files are written with mode 0644 so
that colleagues can open them.

Example::

    async with EventBus() as bus:
        report = ReportWriter("runs/exp1")
        bus.subscribe(report)
        ...  # train
    # runs/exp1/report.json and runs/exp1/report.html now describe the whole run
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import anyio
import anyio.lowlevel
import orjson

from eventbus_debug.diagnostics import get_logger
from eventbus_debug.events import Event
from eventbus_debug.log.files import read_events
from eventbus_debug.threads import run_in_daemon_thread

from .._checks import seconds
from .aggregate import DEFAULT_MAX_INCIDENTS, DEFAULT_MAX_POINTS, RunAggregator, summarize_runs
from .html import render_html
from .summary import RunSummary, summary_to_dict

__all__ = (
    "FILE_MODE",
    "REPORT_FORMAT",
    "ReportPaths",
    "ReportWriter",
    "build_report",
    "write_atomically",
    "write_report",
)

_log = get_logger(__name__)

REPORT_FORMAT: Final = "eventbus-debug.report/1"
JSON_NAME: Final = "report.json"
HTML_NAME: Final = "report.html"
DEFAULT_INTERVAL: Final = 30.0
FILE_MODE: Final = 0o644
"""Report files are readable by everyone who can reach the directory (mkstemp's 0600 is not)."""


@dataclass(frozen=True, slots=True)
class ReportPaths:
    """Where a report was written (``html`` is ``None`` when HTML was disabled)."""

    json: Path
    html: Path | None


def write_atomically(path: Path, data: bytes) -> None:
    """Write *data* to *path* through a temporary file in the same directory, renamed over it
    (mode :data:`FILE_MODE`): readers (a browser refreshing the page, the HTTP endpoint, a
    resumed job reading a checkpoint) see the old file or the new one, never half of one, and
    a failed write leaves no temporary file behind.

    Raises:
        OSError: if the directory cannot be created or the file written.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, FILE_MODE)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_report(
    summary: RunSummary,
    directory: str | os.PathLike[str],
    /,
    *,
    html: bool = True,
    title: str = "eventbus-debug report",
    generated_ns: int | None = None,
) -> ReportPaths:
    """Write ``report.json`` (and ``report.html``) for *summary* into *directory* (blocking).

    ``report.json`` holds ``{"format", "generated_ns", "title", "run_id", "summary"}``; only
    ``generated_ns`` depends on when it was written. Both files are written atomically, mode
    0644.

    Raises:
        OSError: if the directory cannot be created or the files cannot be written.
    """
    root = Path(directory)
    stamp = time.time_ns() if generated_ns is None else generated_ns
    document = {
        "format": REPORT_FORMAT,
        "generated_ns": stamp,
        "title": title,
        "run_id": summary.run_id,
        "summary": summary_to_dict(summary),
    }
    json_path = root / JSON_NAME
    write_atomically(json_path, orjson.dumps(document, option=orjson.OPT_INDENT_2))
    html_path: Path | None = None
    if html:
        html_path = root / HTML_NAME
        page = render_html(summary, title=title, generated_ns=stamp)
        write_atomically(html_path, page.encode("utf-8"))
    return ReportPaths(json=json_path, html=html_path)


def build_report(
    log: str | os.PathLike[str],
    /,
    out_dir: str | os.PathLike[str] | None = None,
    *,
    html: bool = True,
    title: str = "eventbus-debug report",
    strict: bool = False,
    max_points: int = DEFAULT_MAX_POINTS,
    max_incidents: int = DEFAULT_MAX_INCIDENTS,
    run: str = "latest",
) -> tuple[RunSummary, ReportPaths]:
    """Rebuild the report of a run from its JSON-lines log (every rank, rotated files too).

    A log that several runs appended to is split by run id (see
    :func:`~sinks.report_summary.summarize_runs`): the report shows the latest run and says
    which others the log holds. The logs of several ranks make one report of the job: each
    step counted once, throughput summed over the ranks, one incident row naming the ranks
    that had it (see :class:`~sinks.report_summary.RunSummary`).

    Args:
        log: a log directory (or one log file).
        out_dir: where to write; the log directory (or the file's directory) by default.
        html: also write ``report.html``.
        title: the page title.
        strict: raise on an undecodable line instead of skipping it.
        max_points: as in :class:`ReportWriter`; keep equal to the live writer's for equal
            reports.
        max_incidents: as in :class:`ReportWriter`.
        run: ``"latest"``, ``"all"`` (every run folded together) or a run id.

    Raises:
        LogReadError: if *log* does not exist or holds no log file.
        EventDecodeError: with *strict*, if a line cannot be decoded.
        ValueError: if *run* is not a run of the log.
    """
    summary = summarize_runs(
        read_events(log, strict=strict),
        run=run,
        max_points=max_points,
        max_incidents=max_incidents,
    )
    source = Path(log)
    target = (
        Path(out_dir) if out_dir is not None else (source if source.is_dir() else source.parent)
    )
    return summary, write_report(summary, target, html=html, title=title)


class ReportWriter:
    """A sink that aggregates the run into a :class:`RunSummary` and writes the report files.

    Args:
        directory: where ``report.json`` and ``report.html`` are written.
        interval: write at most every *interval* seconds while events arrive (``None``: only
            at close and on :meth:`write`).
        html: also write ``report.html``.
        title: the page title.
        max_points: the most points each plotted series keeps (memory stays bounded).
        max_incidents: the most incidents listed: the run's first tenth of them and the
            most recent rest (all are counted).
        clock: a monotonic clock in seconds, for the write interval (inject one in tests).

    Raises:
        ArgumentTypeError: if *interval* is neither None nor a number, or a bound is not an int
            (a ``TypeError``, and the ``ValueError`` earlier releases raised).
        ValueError: if *interval* is not positive (NaN included) or a bound is smaller than 2.
        TypeError: if *clock* is not callable.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        interval: float | None = DEFAULT_INTERVAL,
        html: bool = True,
        title: str = "eventbus-debug report",
        max_points: int = DEFAULT_MAX_POINTS,
        max_incidents: int = DEFAULT_MAX_INCIDENTS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if interval is not None:
            interval = seconds(
                "interval",
                interval,
                rule="None or a positive number of seconds (math.inf: only at close)",
                infinite=True,
            )
        self.directory = Path(directory)
        self._interval = interval
        self._html = html
        self._title = title
        if not callable(clock):
            msg = f"clock must be a function returning seconds (time.monotonic), got {clock!r}"
            raise TypeError(msg)
        self._clock = clock
        self._aggregator = RunAggregator(max_points=max_points, max_incidents=max_incidents)
        self._last_write = clock()
        self._writes = 0
        self._closed = False
        # Made at the first write, in the event loop that writes: an anyio lock belongs to the
        # backend running where it is made (a SyncSession built inside a trio program writes
        # from its own asyncio thread); a write on another backend (the writer reused by a
        # later run on trio) makes its own.
        self._lock: anyio.Lock | None = None
        self._lock_backend: type | None = None  # the type of the loop's native token
        self._writing = 0  # writes inside their thread now (an abandoned one that hangs stays)
        self._writing_lock = threading.Lock()

    @property
    def thread_busy(self) -> bool:
        """Whether a write is inside its thread now (one that hangs keeps it busy)."""
        return self._writing > 0

    @property
    def writes(self) -> int:
        """How many times the report files were written."""
        return self._writes

    def summary(self) -> RunSummary:
        """The summary of every event received so far (cheap; safe at any time)."""
        return self._aggregator.summary()

    def clear(self) -> None:
        """Forget everything aggregated so far (the files keep their content until the next write)."""
        self._aggregator.clear()
        _log.info("report_cleared", directory=str(self.directory))

    def continue_run(self, log: str | os.PathLike[str], run_id: str, /) -> int:
        """Fold the events of run *run_id* that *log* already holds: the earlier parts of a run
        resumed from a checkpoint (or restarted with the same ``$EVENTBUS_DEBUG_RUN_ID``), so
        that this writer's report covers the whole run, as ``eventbus-debug report`` does.
        Call it before the new part's events arrive. A session does it at its start.

        Returns how many events were folded (0: the log holds none of that run). A log that
        cannot be read is a warning, never an error: the report then covers the new part only.

        Raises:
            TypeError: if *log* is not a path or *run_id* not a str.
        """
        try:
            events = read_events(log, strict=False, run=run_id)
            before = self._aggregator.summary().events
            self._aggregator.add_all(events)
        except ValueError:  # the log holds no such run: a first part, or another log dir
            return 0
        except OSError as exc:  # LogReadError: no log yet, or unreadable
            if Path(log).exists():
                _log.warning("report_run_not_continued", log=str(log), run=run_id, error=str(exc))
            return 0
        folded = self._aggregator.summary().events - before
        _log.info("report_run_continued", log=str(log), run=run_id, events=folded)
        return folded

    def add(self, events: Iterable[Event], /) -> None:
        """Fold *events* synchronously (what :meth:`handle_batch` does, without writing)."""
        self._aggregator.add_all(events)
        self._closed = False

    async def handle(self, event: Event, /) -> None:
        """Fold one event; write when the interval elapsed."""
        await self.handle_batch((event,))

    async def handle_batch(self, events: Sequence[Event], /) -> None:
        """Fold a batch of events; write when the interval elapsed."""
        self._aggregator.add_all(events)
        # Events after a close: the writer was subscribed again (a session entered again with
        # this writer, a second bus); the next close must write the report again.
        self._closed = False
        if self._interval is not None and self._clock() - self._last_write >= self._interval:
            await self.write()

    async def write(self) -> ReportPaths:
        """Write the report files now, in a worker thread.

        Raises:
            OSError: if the files cannot be written.
        """
        backend = type(anyio.lowlevel.current_token().native_token)
        if self._lock is None or self._lock_backend is not backend:
            self._lock = anyio.Lock()
            self._lock_backend = backend
        async with self._lock:
            summary = self._aggregator.summary()
            self._last_write = self._clock()
            # A daemon thread, not anyio's worker: a write that hangs (a stuck network disk)
            # can then be abandoned on every backend (the bus's close bound cancels this
            # await; on trio, where the bus joins the sink's task, an uncancellable wait would
            # hold the close), and it never keeps the process alive at exit.
            paths = await run_in_daemon_thread(self._write_sync, summary, name="eventbus-report")
            self._writes += 1
            return paths

    def _write_sync(self, summary: RunSummary) -> ReportPaths:
        with self._writing_lock:
            self._writing += 1
        try:
            return write_report(summary, self.directory, html=self._html, title=self._title)
        finally:
            with self._writing_lock:
                self._writing -= 1

    async def aclose(self) -> None:
        """Write the final report (the bus has drained this sink's queue).

        Idempotent: a second close writes again only if events arrived since the first (the
        writer was reused on another bus or by a session entered again).
        """
        if self._closed:
            return
        self._closed = True
        paths = await self.write()
        _log.info(
            "report_written",
            json=str(paths.json),
            html=str(paths.html) if paths.html else None,
            events=self._aggregator.summary().events,
        )

    def __repr__(self) -> str:
        return f"ReportWriter({str(self.directory)!r})"
