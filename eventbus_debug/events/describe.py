"""One line of text per event, the same everywhere a human reads events.

The console sink, the alert handlers that write text, ``eventbus-debug tail`` and the run
report's incident table all describe an event with :func:`describe`, so an incident reads the
same wherever it appears. :func:`describe_line` adds the header: one timestamp format (local
``HH:MM:SS.mmm``), one name (the event's ``kind``, as in the log), the step and rank::

    12:00:01.234 INFO     step_completed           step=120 loss=0.4321 lr=0.001 samples/s=5400
    12:00:01.240 ERROR    non_finite_detected      step=121 non-finite gradient: fc.weight (3 NaN)

Values are readable (``4.2e+03``, ``fc.weight,fc.bias``, never a Python repr). The known kinds
are matched by class (a renamed field is a type error, not a silently empty line); any other
kind shows its message, its reason or its fields. Standard library only.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import enum
import math
import re
from collections.abc import Mapping
from typing import Any, Final

from ._base import Event, Severity
from .bus import EventsDropped, EventsUndelivered, SinkDisabled, SinkFailed
from .recovery import ErrorRaised, RecoveryApplied, RecoveryDecided, StepSkipped
from .resources import MemoryLeakSuspected, MemorySampled, ResourceThresholdExceeded, SystemSampled
from .session import SessionEnded, SessionStarted, StepCompleted
from .training import (
    AnomalyLocalized,
    AutogradAnomalyDetected,
    GradientExploded,
    GradientVanished,
    LossSpiked,
    NonFiniteDetected,
    StepChecked,
)

__all__ = (
    "describe",
    "describe_line",
    "format_clock",
    "format_value",
    "printable",
    "terminal_line",
)

_MAX_TEXT: Final = 160
_MAX_ITEMS: Final = 4
_HEADER: Final = frozenset(
    {"seq", "time_ns", "step", "rank", "source", "severity", "kind", "delivery"}
)
_COLORS: Final[Mapping[Severity, str]] = {
    Severity.DEBUG: "\x1b[2m",
    Severity.INFO: "\x1b[32m",
    Severity.WARNING: "\x1b[33m",
    Severity.ERROR: "\x1b[31m",
    Severity.CRITICAL: "\x1b[1;31m",
}
_BOLD: Final = "\x1b[1m"
_RESET: Final = "\x1b[0m"


def format_clock(time_ns: int, /) -> str:
    """The local wall time of *time_ns* as ``HH:MM:SS.mmm``."""
    return _dt.datetime.fromtimestamp(time_ns / 1e9).strftime("%H:%M:%S.%f")[:-3]


def format_value(value: Any, /) -> str:
    """A short, readable text for one field value (no Python reprs).

    Floats get 4 significant digits (``nan``, ``inf`` as such), enums their value, sequences
    are joined by commas (at most 4 items, then ``+N``), long or multi-line text is cut to its
    last line and 160 characters.
    """
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    if isinstance(value, enum.Enum):
        return format_value(value.value)
    if isinstance(value, str):
        text = value.strip()
        if "\n" in text:  # tracebacks and stacks: the last line says what happened
            text = text.splitlines()[-1].strip()
        return text if len(text) <= _MAX_TEXT else text[: _MAX_TEXT - 1] + "…"
    if isinstance(value, (tuple, list)):
        items = [format_value(v) for v in value[:_MAX_ITEMS]]
        if len(value) > _MAX_ITEMS:
            items.append(f"+{len(value) - _MAX_ITEMS}")
        return ",".join(items)
    if isinstance(value, Mapping):
        keys = list(value)[:_MAX_ITEMS]
        items = [f"{k}:{format_value(value[k])}" for k in keys]
        if len(value) > _MAX_ITEMS:
            items.append(f"+{len(value) - _MAX_ITEMS}")
        return ",".join(items)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return ",".join(
            f"{f.name}:{format_value(getattr(value, f.name))}" for f in dataclasses.fields(value)
        )
    return format_value(str(value))


def _pairs(*pairs: tuple[str, object]) -> str:
    """``label=value`` for each pair whose value is set."""
    return " ".join(
        f"{label}={format_value(value)}" for label, value in pairs if value not in (None, "")
    )


def _telemetry(event: Event) -> str | None:
    """The few fields worth a glance for the frequent events, or ``None`` for other kinds."""
    match event:
        case StepCompleted():
            return _pairs(
                ("loss", event.loss),
                ("lr", event.learning_rate),
                ("samples/s", event.samples_per_s),
            )
        case StepChecked():
            return _pairs(
                ("loss", event.loss), ("grad_norm", event.grad_norm), ("finite", event.finite)
            )
        case MemorySampled():
            return _pairs(("rss", event.rss_bytes), ("cuda_allocated", event.cuda_allocated))
        case SystemSampled():
            return _pairs(
                ("cpu%", event.cpu_percent),
                ("mem%", event.memory_percent),
                ("disk%", event.disk_percent),
            )
        case SessionStarted():
            return _pairs(("name", event.name), ("run", event.run_id))
        case SessionEnded():
            return _pairs(
                ("name", event.name),
                ("reason", event.reason),
                ("detail", event.detail),
                ("steps", event.steps),
                ("s", event.duration_s),
            )
    return None


def _names(names: tuple[str, ...], limit: int = 3) -> str:
    return ", ".join(names[:limit]) + ("..." if len(names) > limit else "")


def _incident(event: Event) -> str | None:
    """The wording of the known incidents, or ``None`` for other kinds."""
    f = format_value
    match event:
        case NonFiniteDetected():
            counts = []
            if event.nan_count:
                counts.append(f"{event.nan_count} NaN")
            if event.inf_count:
                counts.append(f"{event.inf_count} Inf")
            extra = f" ({', '.join(counts)})" if counts else ""
            return f"non-finite {event.role.value}: {_names(event.names) or '?'}{extra}"
        case GradientExploded():
            top = f"; largest {event.top[0][0]}={f(event.top[0][1])}" if event.top else ""
            return f"gradient norm {f(event.total_norm)} > {f(event.threshold)}{top}"
        case GradientVanished():
            layers = f" in {len(event.layers)} layer(s)" if event.layers else ""
            zero = " (all zero)" if event.all_zero else ""
            if event.mean_abs is None:  # dead layers only: the threshold is relative
                return (
                    f"{len(event.layers)} layer(s) lost their gradient (RMS < "
                    f"{f(event.threshold)}x the model's): {_names(event.layers)}"
                )
            return f"mean |grad| {f(event.mean_abs)} < {f(event.threshold)}{layers}{zero}"
        case LossSpiked():
            return (
                f"loss {f(event.loss)} = {f(event.ratio)}x running mean "
                f"{f(event.running_mean)} ({event.rule})"
            )
        case AnomalyLocalized():
            return (
                f"first non-finite {event.role.value} in {event.module or '<root>'} ({event.phase})"
            )
        case AutogradAnomalyDetected():
            return f"autograd anomaly in {event.backward_fn}: {event.message[:120]}"
        case MemoryLeakSuspected():
            return f"{event.resource} grows {f(event.slope)}/sample over {event.window}: {event.retained}"
        case ResourceThresholdExceeded():
            return f"{event.metric} {f(event.value)} > {f(event.threshold)}"
        case ErrorRaised():
            return (
                f"{event.category.value} error {event.error_type} (attempt {event.attempt}): "
                f"{event.message[:160]}"
            )
        case RecoveryDecided():
            return f"decided {event.action.value} for {event.trigger_kind}: {event.reason[:160]}"
        case RecoveryApplied():
            return f"{event.action.value} {event.outcome}: {event.detail[:160]}"
        case StepSkipped():
            return f"step skipped: {event.reason[:160]}"
        case SinkFailed():
            return f"sink {event.sink} failed on {event.event_kind}: {event.error_type}: {event.message[:120]}"
        case SinkDisabled():
            return f"sink {event.sink} disabled: {event.reason[:160]}"
        case EventsDropped():
            return f"sink {event.sink} shed {event.dropped} telemetry event(s) ({event.total_dropped} total)"
        case EventsUndelivered():
            return f"sink {event.sink} lost {event.undelivered} event(s) at {event.phase}"
    return None


def describe(event: Event, /) -> str:
    """The one-line description of *event* (no timestamp, no newline; never empty).

    Known incidents read as a sentence (``gradient norm 1e+04 > 100; largest fc.weight=9e+03``),
    frequent telemetry as its few telling fields (``loss=0.43 lr=0.001``); any other incident
    as its ``message`` or ``reason``, any other event as its fields, and an event without
    fields as its kind.
    """
    text = _telemetry(event)
    if text is None:
        text = _incident(event)
    if text is None and event.is_incident:
        for name in ("message", "reason"):
            value = getattr(event, name, None)
            if isinstance(value, str) and value.strip():
                text = format_value(value)
                break
    if text is None:
        text = " ".join(
            f"{f.name}={format_value(getattr(event, f.name))}"
            for f in dataclasses.fields(event)
            if f.name not in _HEADER and getattr(event, f.name) not in (None, (), "", {})
        )
    return text.replace("\n", " ") or event.kind


def describe_line(event: Event, /, *, colors: bool = False) -> str:
    """One line for *event*: time, severity, kind, step and rank, then :func:`describe`.

    *colors* adds ANSI colours (severity coloured, incident kinds in bold).
    """
    severity = event.severity.value.upper()
    kind = event.kind
    if colors:
        severity = f"{_COLORS[event.severity]}{severity:<8}{_RESET}"
        kind = f"{_BOLD}{kind:<24}{_RESET}" if event.is_incident else f"{kind:<24}"
    else:
        severity = f"{severity:<8}"
        kind = f"{kind:<24}"
    where = []
    if event.step is not None:
        where.append(f"step={event.step}")
    if event.rank:
        where.append(f"rank={event.rank}")
    parts = [format_clock(event.time_ns), severity, kind, " ".join(where), describe(event)]
    return " ".join(p for p in parts if p).rstrip()


_CONTROL: Final = re.compile(r"[\x00-\x1f\x7f-\x9f]")
"""Control characters (C0, DEL, C1): never written to a terminal from an event, where a crafted
string (an exception's message, a run id read from a log) could move the cursor, clear the
screen or set the window title."""


def printable(text: str) -> str:
    """*text* with its control characters shown escaped (``\\x1b``), never sent raw."""
    if _CONTROL.search(text) is None:
        return text
    return _CONTROL.sub(lambda m: f"\\x{ord(m[0]):02x}", text)


def terminal_line(event: Event, /, *, colors: bool = False) -> str:
    """:func:`describe_line` for a terminal: the console sink's line, what ``eventbus-debug tail``
    prints. Events carry untrusted text (exception messages, logs read back): a control
    character in it is shown escaped (``\\x1b``), and such a line is left uncoloured."""
    line = describe_line(event)
    if _CONTROL.search(line) is not None:
        return printable(line)
    return describe_line(event, colors=True) if colors else line
