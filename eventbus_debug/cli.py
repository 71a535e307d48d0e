"""The ``eventbus-debug`` command: run the demo, rebuild reports, follow and summarize logs.

Commands::

    eventbus-debug --version
    eventbus-debug demo [--log-dir DIR] [--steps N] [--quiet]
    eventbus-debug report LOGDIR [--out DIR] [--no-html] [--title T] [--run RUN]
    eventbus-debug tail LOGDIR [-n N | --all] [--follow] [--json] [--kind K ...] [--min-severity S]
    eventbus-debug summary LOGDIR [--json] [--run RUN]

(and, for every command that reads a log, ``--skip-bad-lines`` and ``--import MODULE``; see
docs/cli.md for the rest).

A log that several runs appended to (reruns into one directory) is never merged silently:
``report`` and ``summary`` show the latest run and name the others; ``--run ID`` picks one,
``--run all`` folds them together (and says so).

Every command reads the JSON-lines log of every rank, rotated (and gzipped) files included.
Errors are one line on standard error and a non-zero exit status, never a traceback: 1 for a
run-time error (missing directory, no log inside, unreadable, undecodable or crafted file), 2
for bad arguments (an unknown ``--kind`` or ``--run`` included). On a terminal, ``tail`` and ``summary``
use colours (``--color never`` or ``NO_COLOR`` turns them off).
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import importlib
import importlib.metadata
import logging
import math
import os
import re
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Final, TextIO

import orjson

from .diagnostics import LOGGER_NAME
from .events import Event, SessionEnded, SessionStarted, Severity, event_types
from .events.describe import printable as _printable, terminal_line
from .exceptions import EventBusError, EventDecodeError, LogReadError, UnknownEventKindError
from .log.encoding import encode_event
from .log.files import log_files, read_events
from .log.follow import LogFollower as LogFollower, _Cursor as _Cursor

if TYPE_CHECKING:
    from .sinks.report import RunSummary

__all__ = ("CommandError", "LogFollower", "UsageError", "format_event", "main")

PROG: Final = "eventbus-debug"
DEFAULT_TAIL_LINES: Final = 20
DEFAULT_POLL_INTERVAL: Final = 0.25
_SEVERITIES: Final = tuple(s.value for s in Severity)


class CommandError(EventBusError):
    """A command failed in an expected way; its message is the one line shown to the user."""


class UsageError(CommandError):
    """The arguments are wrong (exit status 2, as argparse's own usage errors)."""


# -- argument parsing ---------------------------------------------------------------------------


def _path(value: str) -> Path:
    """A path argument; an empty one (an unset variable, most likely) is a usage error, not
    the current directory."""
    if not value.strip():
        msg = "must not be empty (an unset variable, most likely); pass '.' for this directory"
        raise argparse.ArgumentTypeError(msg)
    return Path(value)


def _version() -> str:
    try:
        return importlib.metadata.version("eventbus-debug")
    except importlib.metadata.PackageNotFoundError:  # running from a source tree
        from . import __version__

        return __version__


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Debug PyTorch training without slowing it down: run the demo, rebuild "
        "reports from event logs, follow and summarize them.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    demo = sub.add_parser(
        "demo",
        help="train a small model with injected faults, then write the report",
        description="Run the demo training loop (faults injected at known steps), log every "
        "event to LOG_DIR and write report.json / report.html there.",
    )
    demo.add_argument(
        "--log-dir",
        type=_path,
        default=Path("eventbus-debug-demo"),
        help="where the log and the report go (default: %(default)s)",
    )
    demo.add_argument(
        "--steps", type=int, default=None, help="training steps (default: the demo's own)"
    )
    demo.add_argument("--quiet", action="store_true", help="no live progress on the console")

    report = sub.add_parser(
        "report",
        help="rebuild report.json and report.html from a log directory",
        description="Rebuild report.json and report.html from the JSON-lines log in LOGDIR "
        "(every rank, rotated files included): the same report the live ReportWriter writes.",
    )
    report.add_argument("logdir", type=_path, help="the log directory")
    report.add_argument("--out", type=_path, default=None, help="where to write (default: LOGDIR)")
    report.add_argument("--no-html", action="store_true", help="write report.json only")
    report.add_argument("--title", default="eventbus-debug report", help="the page title")
    _add_read_options(report)
    _add_run_option(report, "report")

    tail = sub.add_parser(
        "tail",
        help="print the last events of a log, and follow it as it grows",
        description="Pretty-print the last events of the log in LOGDIR; with --follow, keep "
        "printing new events as they are written (across file rotation) until interrupted.",
    )
    tail.add_argument("logdir", type=_path, help="the log directory")
    how_many = tail.add_mutually_exclusive_group()
    how_many.add_argument(
        "-n",
        "--lines",
        type=int,
        default=DEFAULT_TAIL_LINES,
        metavar="N",
        help="how many past events to show first (default: %(default)s)",
    )
    how_many.add_argument("--all", action="store_true", help="show every past event")
    tail.add_argument(
        "-f",
        "--follow",
        action="store_true",
        help="keep printing new events (waits for LOGDIR and its log to appear)",
    )
    tail.add_argument(
        "--json", action="store_true", help="print each event as its JSON line, as in the log"
    )
    tail.add_argument(
        "--color",
        choices=("auto", "always", "never"),
        default="auto",
        help="colour the lines (default: on a terminal, unless NO_COLOR is set)",
    )
    tail.add_argument(
        "--kind",
        action="append",
        default=[],
        metavar="K",
        help="show only events of this kind (repeatable; an unknown kind is an error)",
    )
    tail.add_argument(
        "--min-severity",
        choices=_SEVERITIES,
        default="debug",
        help="hide events below this severity",
    )
    tail.add_argument(
        "--poll-interval",
        type=float,
        default=DEFAULT_POLL_INTERVAL,
        metavar="S",
        help="seconds between checks for new lines when following (default: %(default)s)",
    )
    tail.add_argument(
        "--timeout", type=float, default=None, metavar="S", help="stop following after S seconds"
    )
    tail.add_argument(
        "--exit-on-end", action="store_true", help="stop following after a session_ended event"
    )
    _add_read_options(tail)

    summary = sub.add_parser(
        "summary",
        help="print the run summary of a log directory",
        description="Aggregate the log in LOGDIR and print the run summary as a table (or JSON).",
    )
    summary.add_argument("logdir", type=_path, help="the log directory")
    summary.add_argument("--json", action="store_true", help="print the full summary as JSON")
    summary.add_argument(
        "--color",
        choices=("auto", "always", "never"),
        default="auto",
        help="colour the table (default: on a terminal, unless NO_COLOR is set)",
    )
    _add_read_options(summary)
    _add_run_option(summary, "summary")
    return parser


def _add_read_options(parser: argparse.ArgumentParser) -> None:
    """The options of every command that reads a log: bad lines, and your own event types."""
    parser.add_argument(
        "--skip-bad-lines",
        action="store_true",
        help="skip undecodable lines (each one logged on standard error) instead of failing",
    )
    parser.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE first, so that the @event_type classes it defines decode (your own "
        "event types; repeatable; the current directory is on the import path)",
    )


def _import_modules(names: Sequence[str]) -> None:
    """Import each of *names* (``--import``), the current directory first on the import path
    as for ``python -m``: the modules that register a log's own event types.

    Raises:
        UsageError: if a module cannot be imported (the message names it and says why).
    """
    if not names:
        return
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:  # an ImportError, or the module's own code failing
            msg = f"--import {name}: {type(exc).__name__}: {exc}"
            raise UsageError(msg) from None


def _add_run_option(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--run",
        default="latest",
        metavar="RUN",
        help=f"which run of a log that several runs appended to the {what} shows: 'latest' "
        "(default), a run id, or 'all' to fold every run together",
    )


# -- helpers ------------------------------------------------------------------------------------


def _check_logdir(path: Path) -> None:
    if not path.exists():
        msg = f"log directory {str(path)!r} does not exist"
        raise CommandError(msg)
    if not path.is_dir():
        msg = f"{str(path)!r} is not a directory; pass the directory holding events*.jsonl"
        raise CommandError(msg)
    if not log_files(path):
        msg = f"no event log (events*.jsonl) in {str(path)!r}"
        raise CommandError(msg)


def _check_run(run: str) -> None:
    if not run.strip():
        msg = "--run must be 'latest', 'all' or a run id, got an empty string"
        raise UsageError(msg)


@contextlib.contextmanager
def _run_choice(run: str) -> Iterator[None]:
    """Turn the run selection's "no such run" ``ValueError`` into a usage error (exit 2).

    The selection is the report's own (:func:`~eventbus_debug.sinks.report.summarize_runs`);
    its message names the runs the log holds.
    """
    try:
        yield
    except ValueError as exc:
        if run not in ("latest", "all") and "is not in this log" in str(exc):
            msg = f"--run: {exc}"
            raise UsageError(msg) from None
        raise


def _summarize(logdir: Path, *, strict: bool, run: str = "latest") -> RunSummary:
    """The summary of *run* in *logdir*: the same run selection as ``report``."""
    from .sinks.report import summarize_runs

    _check_run(run)
    _check_logdir(logdir)
    with _run_choice(run):
        return summarize_runs(read_events(logdir, strict=strict), run=run)


def _runs_lines(summary: RunSummary) -> list[tuple[str, str]]:
    """Which run a summary shows, and the log's other runs (nothing for a one-run log)."""
    if len(summary.runs) <= 1:
        return [("run", summary.run_id)] if summary.run_id else []

    def label(run_id: str) -> str:
        return run_id or "(events before any session)"

    if summary.mixed_runs:
        ids = ", ".join(label(r.run_id) for r in summary.runs)
        return [("runs", f"{len(summary.runs)} folded together (--run all): {ids}")]
    shown = next((r for r in summary.runs if r.shown), None)
    latest = " (the latest)" if shown is not None and shown is summary.runs[-1] else ""
    others = ", ".join(
        f"{label(r.run_id)} ({r.events} events)" for r in summary.runs if not r.shown
    )
    return [
        ("run", f"{label(shown.run_id) if shown else '-'}{latest}, 1 of {len(summary.runs)}"),
        ("other runs", f"{others}; pick one with --run ID, fold all with --run all"),
    ]


def format_event(event: Event, /, *, colors: bool = False) -> str:
    """One human-readable line for *event*: what ``tail`` prints, the console sink's line.

    Logs are untrusted input: a control character in the event's text is shown escaped
    (``\\x1b``), and such a line is left uncoloured.
    """
    return terminal_line(event, colors=colors)


_NON_ASCII: Final = re.compile(r"[^\x00-\x7f]")


def _json_escape(match: re.Match[str]) -> str:
    code = ord(match[0])
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    code -= 0x10000  # a surrogate pair, as JSON writes characters beyond the BMP
    return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"


def _utf8(out: IO[str]) -> bool:
    """Whether *out* writes UTF-8 (any character); a stream without an encoding counts as one."""
    encoding = getattr(out, "encoding", None)
    if not isinstance(encoding, str):
        return True
    try:
        return codecs.lookup(encoding).name == "utf-8"
    except LookupError:
        return False


def _json_text(text: str, out: IO[str]) -> str:
    """JSON *text* for *out*: as it is on UTF-8 output, else with every non-ASCII character
    escaped (``\\u00e9``), the same JSON that any encoding can write."""
    return text if _utf8(out) else _NON_ASCII.sub(_json_escape, text)


def _colors(choice: str, out: IO[str]) -> bool:
    if choice == "auto":
        from .sinks.lines import use_colors

        return use_colors(out)
    return choice == "always"


def _known_kinds(kinds: Sequence[str]) -> frozenset[str]:
    """*kinds* checked against the registered event kinds."""
    from . import sinks  # noqa: F401  (registers the sinks' own event kinds)

    known = set(event_types())
    unknown = sorted(set(kinds) - known)
    if unknown:
        msg = (
            f"unknown --kind {', '.join(unknown)} (your own event types: --import the module "
            f"that defines them); valid kinds: {', '.join(sorted(known))}"
        )
        raise UsageError(msg)
    return frozenset(kinds)


# -- commands -----------------------------------------------------------------------------------


def _cmd_demo(args: argparse.Namespace, out: IO[str]) -> int:
    try:
        demo = importlib.import_module(f"{__package__}.demo")
    except ImportError as exc:
        msg = f"the demo is not available in this installation ({exc})"
        raise CommandError(msg) from None
    import anyio

    from .sinks.report import build_report

    options: dict[str, Any] = {"console": not args.quiet}
    if args.steps is not None:
        if args.steps < 1:
            msg = f"--steps must be >= 1, got {args.steps}"
            raise UsageError(msg)
        options["steps"] = args.steps
    log_dir: Path = args.log_dir

    async def run() -> Any:
        return await demo.run_demo(log_dir, **options)

    result = anyio.run(run)
    result_dir = Path(getattr(result, "log_dir", log_dir))
    html = getattr(result, "report_html", None)
    if html is None or not Path(html).exists():
        _, paths = build_report(result_dir)
        html = paths.html
    out.write(f"log:    {result_dir}\nreport: {html}\n")
    return 0


def _cmd_report(args: argparse.Namespace, out: IO[str]) -> int:
    from .sinks.report import write_report

    # What build_report does, in two steps: a failure to write names the --out directory.
    summary = _summarize(args.logdir, strict=not args.skip_bad_lines, run=args.run)
    target: Path = args.logdir if args.out is None else args.out
    try:
        paths = write_report(summary, target, html=not args.no_html, title=args.title)
    except OSError as exc:
        msg = f"cannot write the report in {str(target)!r}: {exc.strerror or exc}"
        raise CommandError(msg) from None
    out.write(f"{paths.json}\n")
    if paths.html is not None:
        out.write(f"{paths.html}\n")
    out.write(
        f"{summary.events} events, {summary.steps} steps, {summary.anomalies} anomalies, "
        f"{summary.incidents_total} incidents\n"
    )
    if len(summary.runs) > 1:
        for key, value in _runs_lines(summary):
            out.write(_printable(f"{key}: {value}") + "\n")
    return 0


def _wait_for_log(logdir: Path, poll: float, deadline: float | None) -> bool:
    """Wait until *logdir* holds a log (a run not started yet); False when *deadline* passed."""
    while True:
        if logdir.is_dir() and log_files(logdir):
            return True
        if logdir.exists() and not logdir.is_dir():
            _check_logdir(logdir)  # raises: not a directory
        if deadline is not None and time.monotonic() >= deadline:
            return False
        time.sleep(poll)


def _cmd_tail(args: argparse.Namespace, out: IO[str]) -> int:
    if args.lines < 0:
        msg = f"-n/--lines must be >= 0, got {args.lines}"
        raise UsageError(msg)
    if not (math.isfinite(args.poll_interval) and args.poll_interval > 0):
        msg = f"--poll-interval must be a finite number of seconds > 0, got {args.poll_interval}"
        raise UsageError(msg)
    if args.timeout is not None and not (math.isfinite(args.timeout) and args.timeout >= 0):
        msg = f"--timeout must be a finite number of seconds >= 0, got {args.timeout}"
        raise UsageError(msg)
    kinds = _known_kinds(args.kind)
    floor = Severity(args.min_severity)
    colors = _colors(args.color, out)
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    if args.follow:
        try:
            if not _wait_for_log(args.logdir, args.poll_interval, deadline):
                return 0
        except KeyboardInterrupt:
            return 0
    else:
        _check_logdir(args.logdir)

    def wanted(event: Event) -> bool:
        return event.severity >= floor and (not kinds or event.kind in kinds)

    def show(event: Event) -> str:
        if args.json:
            return _json_text(encode_event(event).decode().rstrip("\n"), out)
        return format_event(event, colors=colors)

    with LogFollower(args.logdir, from_end=False, strict=not args.skip_bad_lines) as follower:
        past = follower.poll()
        shown = [e for e in past if wanted(e)]
        if not args.all:
            shown = list(deque(shown, maxlen=args.lines)) if args.lines else []
        for event in shown:
            out.write(show(event) + "\n")
        out.flush()
        if not args.follow:
            return 0
        if args.exit_on_end and _ended(past):
            return 0
        try:
            while deadline is None or time.monotonic() < deadline:
                time.sleep(args.poll_interval)
                new = follower.poll()
                for event in new:
                    if wanted(event):
                        out.write(show(event) + "\n")
                out.flush()
                if args.exit_on_end and _ended(new):
                    break
        except KeyboardInterrupt:
            pass
        return 0


def _ended(events: Sequence[Event]) -> bool:
    """Whether the last session start or end among *events* is an end: a log that a rerun
    appended to holds the previous run's ``session_ended`` before the live run's start."""
    for event in reversed(events):
        if isinstance(event, SessionEnded | SessionStarted):
            return isinstance(event, SessionEnded)
    return False


def _fmt_opt(value: float | None, spec: str = ".4g") -> str:
    return "-" if value is None else format(value, spec)


def _cmd_summary(args: argparse.Namespace, out: IO[str]) -> int:
    from .sinks.report import summary_to_dict

    summary = _summarize(args.logdir, strict=not args.skip_bad_lines, run=args.run)
    if args.json:
        text = orjson.dumps(summary_to_dict(summary), option=orjson.OPT_INDENT_2).decode()
        out.write(_json_text(text, out) + "\n")
        return 0
    s = summary
    rows: list[tuple[str, str]] = [
        *_runs_lines(s),
        ("events", f"{s.events}"),
        ("ranks", ", ".join(map(str, s.ranks)) or "-"),
        ("steps", _steps_line(s)),
        ("ended", _ended_line(s)),
        ("run time", f"{s.duration_s:.1f} s"),
        ("steps/s", _fmt_opt(s.steps_per_s, ".3g")),
        ("anomalies", f"{s.anomalies} on {s.anomaly_steps} steps (rate {s.anomaly_rate:.2%})"),
        (
            "first/last anomaly step",
            f"{_fmt_opt(s.first_anomaly_step, 'd')} / {_fmt_opt(s.last_anomaly_step, 'd')}",
        ),
        ("non-finite", f"{s.non_finite}"),
        ("loss anomalies", f"{s.loss_anomalies} (rate {s.loss_anomaly_rate:.2%})"),
        ("gradient explosions", f"{s.gradient_explosions} (rate {s.gradient_explosion_rate:.2%})"),
        ("vanishing gradients", f"{s.gradient_vanishings} (rate {s.gradient_vanishing_rate:.2%})"),
        ("recovery decisions", _pairs(s.recovery_decisions)),
        ("recovery outcomes", _pairs(s.recovery_outcomes)),
        ("steps skipped", f"{s.steps_skipped}"),
        ("errors by category", _pairs(s.errors_by_category)),
        ("peak RSS", _mib(s.memory.peak_rss_bytes)),
        (
            "RSS trend",
            "-"
            if s.memory.rss_trend_bytes_per_step is None
            else f"{s.memory.rss_trend_bytes_per_step / 1024:.1f} KiB/step",
        ),
        ("CPU % mean/min/max", _stat(s.system.cpu_percent)),
        ("memory % mean/min/max", _stat(s.system.memory_percent)),
        ("telemetry shed", _pairs(s.sinks.dropped)),
        ("incidents", f"{s.incidents_total}"),
    ]
    width = max(len(k) for k, _ in rows)
    colors = _colors(args.color, out)
    alarming = {"anomalies", "non-finite", "incidents", "steps skipped"}
    for key, value in rows:
        value = _printable(value)  # run ids, end reasons, sink names: from the log
        label = f"{key:<{width}}"
        if colors:
            label = f"\x1b[1m{label}\x1b[0m"
            if (key in alarming and not value.startswith(("0", "-"))) or (
                key == "ended" and value not in ("completed", "-")
            ):
                value = f"\x1b[31m{value}\x1b[0m"
        out.write(f"{label}  {value}\n")
    return 0


def _steps_line(s: RunSummary) -> str:
    """``100 (0..99)``: the steps completed; a step begun but never completed is named."""
    last = s.last_completed_step if s.last_completed_step is not None else s.last_step
    line = f"{s.steps} ({_fmt_opt(s.first_step, 'd')}..{_fmt_opt(last, 'd')})"
    if last is not None and s.last_step is not None and s.last_step > last:
        line += f", step {s.last_step} begun, not completed"
    return line


def _ended_line(s: RunSummary) -> str:
    """How the sessions ended: one reason, or each rank's when they differ."""
    reasons = set(s.ended.values())
    if len(reasons) == 1 and len(s.ended) == len(s.ranks):
        return next(iter(reasons))
    return "; ".join(f"rank {rank}: {reason}" for rank, reason in s.ended.items()) or "-"


def _pairs(mapping: Any) -> str:
    return ", ".join(f"{k}={v}" for k, v in mapping.items()) or "-"


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / (1024 * 1024):.1f} MiB"


def _stat(stat: Any) -> str:
    if not stat.samples:
        return "-"
    return f"{stat.mean:.1f} / {stat.min:.1f} / {stat.max:.1f} ({stat.samples} samples)"


_COMMANDS: Final[dict[str, Callable[[argparse.Namespace, IO[str]], int]]] = {
    "demo": _cmd_demo,
    "report": _cmd_report,
    "tail": _cmd_tail,
    "summary": _cmd_summary,
}


@contextlib.contextmanager
def _diagnostics_to(stream: TextIO) -> Iterator[None]:
    """Show the library's warnings and errors on *stream* while a command runs.

    The command line is an application, so it may configure logging: one handler on the
    ``eventbus_debug`` logger (never on stdout, where command output goes), removed afterwards.
    Only warnings and errors are shown: the command's own output (and, for ``demo``, the
    console view) already tells what happened.
    """
    logger = logging.getLogger(LOGGER_NAME)
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    handler.setLevel(logging.WARNING)
    previous = logger.level
    logger.addHandler(handler)
    if logger.level == logging.NOTSET or logger.level > logging.WARNING:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)


@contextlib.contextmanager
def _lenient(stream: TextIO) -> Iterator[None]:
    """On a stream that cannot write every character (``PYTHONIOENCODING=ascii``, a Windows
    code page), write those it lacks escaped (``\\xe9``) while a command runs, rather than fail
    half-way; JSON output escapes them itself (:func:`_json_text`) and stays valid JSON."""
    reconfigure = getattr(stream, "reconfigure", None)
    errors = getattr(stream, "errors", None)
    if _utf8(stream) or reconfigure is None or errors != "strict":
        yield
        return
    reconfigure(errors="backslashreplace")
    try:
        yield
    finally:
        with contextlib.suppress(OSError, ValueError):
            reconfigure(errors=errors)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``eventbus-debug`` command line; returns the exit status.

    Args:
        argv: the arguments (without the program name); ``sys.argv[1:]`` when ``None``.
    """
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2)
        return int(exc.code or 0) if not isinstance(exc.code, str) else 2
    command = _COMMANDS[args.command]
    try:
        with _diagnostics_to(sys.stderr), _lenient(sys.stdout):
            _import_modules(getattr(args, "imports", ()))
            return command(args, sys.stdout)
    except UsageError as exc:
        _error(args.command, str(exc), limit=None)
        return 2
    except BrokenPipeError:  # `eventbus-debug tail ... | head`: the reader is gone
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as exc:
        where = f"{str(exc.filename)!r}: " if exc.filename else ""
        _error(args.command, f"{where}{exc.strerror or exc}")
        return 1
    except UnknownEventKindError as exc:
        # Your own event types: the module that defines them was not imported.
        _error(args.command, f"{exc} — pass --import MODULE (the module that defines it)")
        return 1
    except (CommandError, LogReadError, EventDecodeError) as exc:
        _error(args.command, str(exc))
        return 1
    except (ValueError, TypeError, KeyError) as exc:  # a crafted log the readers let through
        _error(args.command, f"cannot read the log: {type(exc).__name__}: {exc}")
        return 1
    except KeyboardInterrupt:
        return 130


def _error(command: str, message: str, *, limit: int | None = 500) -> None:
    """One line on standard error, whatever the message holds (cut to *limit* characters)."""
    line = _printable(" ".join(message.split()))
    if limit is not None and len(line) > limit:
        line = line[: limit - 1] + "…"
    print(f"{PROG} {command}: error: {line}", file=sys.stderr)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
