"""One line of text per event, the same everywhere a human reads events.

The console sink, the alert handlers that write text and ``eventbus-debug tail`` all show an
event with :func:`format_event`, so an incident reads the same wherever it appears: one
timestamp format (local ``HH:MM:SS.mmm``), one name (the event's ``kind``, as in the log),
readable values (``4.2e+03``, ``fc.weight,fc.bias``, never a Python repr)::

    12:00:01.234 INFO     step_completed           step=120 loss=0.4321 lr=0.001 samples/s=5400
    12:00:01.240 ERROR    non_finite_detected      step=121 non-finite gradient: fc.weight (3 NaN)

Incidents are described by :func:`sinks.report.describe_incident` (the report's wording);
other events show their compact fields.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import enum
import math
import os
from collections.abc import Mapping
from typing import Any, Final

from eventbus_debug.events import Event, Severity

__all__ = ("describe", "format_clock", "format_event", "format_value", "use_colors")

_MAX_TEXT: Final = 160
_MAX_ITEMS: Final = 4
_HEADER: Final = frozenset(
    {"seq", "time_ns", "step", "rank", "source", "severity", "kind", "delivery"}
)

# The fields worth a glance for the frequent events, by kind, with their display names.
_COMPACT: Final[Mapping[str, tuple[tuple[str, str], ...]]] = {
    "step_completed": (
        ("loss", "loss"),
        ("learning_rate", "lr"),
        ("samples_per_s", "samples/s"),
    ),
    "step_checked": (("loss", "loss"), ("grad_norm", "grad_norm"), ("finite", "finite")),
    "memory_sampled": (("rss_bytes", "rss"), ("cuda_allocated", "cuda_allocated")),
    "system_sampled": (
        ("cpu_percent", "cpu%"),
        ("memory_percent", "mem%"),
        ("disk_percent", "disk%"),
    ),
    "session_started": (("name", "name"), ("run_id", "run")),
    "session_ended": (
        ("name", "name"),
        ("reason", "reason"),
        ("steps", "steps"),
        ("duration_s", "s"),
    ),
}

_COLORS: Final[Mapping[Severity, str]] = {
    Severity.DEBUG: "\x1b[2m",
    Severity.INFO: "\x1b[32m",
    Severity.WARNING: "\x1b[33m",
    Severity.ERROR: "\x1b[31m",
    Severity.CRITICAL: "\x1b[1;31m",
}
_BOLD: Final = "\x1b[1m"
_RESET: Final = "\x1b[0m"


def use_colors(stream: object) -> bool:
    """Whether to colour lines for *stream*: a terminal, unless ``NO_COLOR`` is set."""
    if os.environ.get("NO_COLOR"):
        return False
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except (OSError, ValueError):  # a closed stream
        return False


def format_clock(time_ns: int) -> str:
    """The local wall time of *time_ns* as ``HH:MM:SS.mmm``."""
    return _dt.datetime.fromtimestamp(time_ns / 1e9).strftime("%H:%M:%S.%f")[:-3]


def format_value(value: Any) -> str:
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


def describe(event: Event, /) -> str:
    """The body of *event*'s line: its description (incidents) or its compact fields."""
    compact = _COMPACT.get(event.kind)
    if compact is not None:
        return " ".join(
            f"{label}={format_value(getattr(event, attr))}"
            for attr, label in compact
            if getattr(event, attr, None) not in (None, (), "", {})
        )
    if event.is_incident:
        from .report import describe_incident

        text = describe_incident(event)
        if text != event.kind:  # the report knows this kind; otherwise show its fields
            return text
    return " ".join(
        f"{f.name}={format_value(getattr(event, f.name))}"
        for f in dataclasses.fields(event)
        if f.name not in _HEADER and getattr(event, f.name) not in (None, (), "", {})
    )


def format_event(event: Event, /, *, colors: bool = False) -> str:
    """One line for *event*: time, severity, kind, step and rank, then :func:`describe`."""
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
