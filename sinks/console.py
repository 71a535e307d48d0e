"""A sink that shows events to humans, one compact line each, rendered by structlog.

:class:`ConsoleSink` builds its own private logger with :func:`structlog.wrap_logger` over a
:class:`structlog.PrintLogger` on the stream it is given; it never calls ``structlog.configure()``
and never touches :mod:`logging`, so the application's logging setup is left exactly as it is.

Lines look like::

    12:00:01.234 [debug    ] step 120          loss=0.4321 lr=0.001
    12:00:01.240 [error    ] non_finite_detected names=('fc.weight',) role=gradient step=121

Rendering and writing run in a worker thread, once per batch the bus hands over: a console
can be slow (a terminal being scrolled, a pipe nobody reads), and the event loop must not wait
for it.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final, TextIO

import anyio
import anyio.to_thread
import structlog

from eventbus_debug.events import Event, Severity

__all__ = ("ConsoleSink",)

_HEADER: Final = frozenset({"seq", "time_ns", "step", "rank", "source", "severity"})
_MAX_TEXT: Final = 160
_MAX_ITEMS: Final = 4

# The fields worth a glance for the common events, by kind (other kinds show every field).
_COMPACT: Final[Mapping[str, tuple[tuple[str, str], ...]]] = {
    "step_completed": (
        ("loss", "loss"),
        ("learning_rate", "lr"),
        ("samples_per_s", "samples/s"),
    ),
    "step_checked": (("loss", "loss"), ("grad_norm", "grad_norm"), ("finite", "finite")),
    "sink_failed": (("sink", "sink"), ("error_type", "error"), ("message", "message")),
    "sink_disabled": (("sink", "sink"), ("reason", "reason")),
    "events_dropped": (("sink", "sink"), ("dropped", "dropped"), ("total_dropped", "total")),
    "events_undelivered": (("sink", "sink"), ("undelivered", "undelivered")),
    "error_raised": (
        ("error_type", "error"),
        ("message", "message"),
        ("category", "category"),
        ("attempt", "attempt"),
    ),
}

_METHOD: Final[Mapping[Severity, str]] = {
    Severity.DEBUG: "debug",
    Severity.INFO: "info",
    Severity.WARNING: "warning",
    Severity.ERROR: "error",
    Severity.CRITICAL: "critical",
}


class ConsoleSink:
    """Render events as compact, human-readable lines on a text stream.

    Args:
        stream: where lines go (default :data:`sys.stderr`, looked up when the sink is built).
        min_severity: events below this severity are not shown.
        event_types: show only events of these classes (and subclasses); empty shows all.
        exclude: never show events of these classes.
        step_every: show ``StepCompleted`` only for steps that are a multiple of this
            (incidents always show).
        colors: ANSI colours; ``None`` uses them when *stream* is a terminal.
        name: the subscription name the bus uses.

    Raises:
        ValueError: if *step_every* is not a positive integer or *min_severity* is not a
            :class:`~eventbus_debug.Severity`.
        TypeError: if an entry of *event_types* or *exclude* is not an Event subclass.
    """

    def __init__(
        self,
        stream: TextIO | None = None,
        *,
        min_severity: Severity = Severity.DEBUG,
        event_types: Iterable[type[Event]] = (),
        exclude: Iterable[type[Event]] = (),
        step_every: int = 1,
        colors: bool | None = None,
        name: str = "console",
    ) -> None:
        if not isinstance(min_severity, Severity):
            msg = f"min_severity must be a Severity, got {min_severity!r}"
            raise ValueError(msg)
        if isinstance(step_every, bool) or not isinstance(step_every, int) or step_every < 1:
            msg = f"step_every must be a positive integer, got {step_every!r}"
            raise ValueError(msg)
        self._types = _check_types("event_types", event_types)
        self._exclude = _check_types("exclude", exclude)
        self._stream: TextIO = stream if stream is not None else sys.stderr
        if colors is None:
            isatty = getattr(self._stream, "isatty", None)
            colors = bool(isatty()) if callable(isatty) else False
        self.name = name
        self._min = min_severity
        self._step_every = step_every
        self._closed = False
        self.shown = 0
        """Events written to the stream so far."""
        self._logger: Any = structlog.wrap_logger(
            structlog.PrintLogger(self._stream),
            processors=[
                structlog.dev.ConsoleRenderer(colors=colors, pad_event_to=16, sort_keys=False)
            ],
            # Explicit, so an application's structlog.configure() changes nothing here.
            wrapper_class=structlog.make_filtering_bound_logger(logging.NOTSET),
            context_class=dict,
            cache_logger_on_first_use=False,
        )

    def __repr__(self) -> str:
        return f"<ConsoleSink min_severity={self._min.value}>"

    def wants(self, event: Event, /) -> bool:
        """Whether *event* passes this sink's filters (severity, types, step sampling)."""
        if event.severity < self._min:
            return False
        if self._types and not isinstance(event, self._types):
            return False
        if self._exclude and isinstance(event, self._exclude):
            return False
        if self._step_every > 1 and not event.is_incident and event.kind == "step_completed":
            return event.step is None or event.step % self._step_every == 0
        return True

    def render(self, event: Event, /) -> tuple[str, dict[str, Any]]:
        """The structlog method name and event dict that show *event* (no I/O)."""
        kind = event.kind
        fields: dict[str, Any] = {}
        if kind == "step_completed" and event.step is not None:
            message = f"step {event.step}"
        else:
            message = kind
            if event.step is not None:
                fields["step"] = event.step
        compact = _COMPACT.get(kind)
        if compact is not None:
            for attr, key in compact:
                value = getattr(event, attr, None)
                if value is not None:
                    fields[key] = _short(value)
        else:
            for f in dataclasses.fields(event):
                if f.name in _HEADER:
                    continue
                value = getattr(event, f.name)
                if value is None or (isinstance(value, (tuple, list, Mapping)) and not value):
                    continue
                fields[f.name] = _short(value)
        if event.rank:
            fields["rank"] = event.rank
        fields["timestamp"] = _clock(event.time_ns)
        fields["level"] = event.severity.value
        return _METHOD[event.severity], {"event": message, **fields}

    async def handle(self, event: Event, /) -> None:
        """Show one event (the bus prefers :meth:`handle_batch`)."""
        await self.handle_batch((event,))

    async def handle_batch(self, events: Sequence[Event], /) -> None:
        """Filter *events* here, then render and write the shown ones in a worker thread.

        Raises:
            OSError: if the stream cannot be written (the bus reports it as ``SinkFailed``).
            RuntimeError: if the sink is closed.
        """
        if self._closed:
            msg = f"{self!r} is closed"
            raise RuntimeError(msg)
        shown = [e for e in events if self.wants(e)]
        if shown:
            await anyio.to_thread.run_sync(self._write, shown)

    async def aclose(self) -> None:
        """Flush the stream (it is not closed: the sink does not own it). Idempotent."""
        if self._closed:
            return
        self._closed = True
        flush = getattr(self._stream, "flush", None)
        if callable(flush):
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(flush)

    def _write(self, events: list[Event]) -> None:
        logger = self._logger
        for event in events:
            method, event_dict = self.render(event)
            message = event_dict.pop("event")
            getattr(logger, method)(message, **event_dict)
            self.shown += 1


def _check_types(arg: str, types: Iterable[type[Event]]) -> tuple[type[Event], ...]:
    result = tuple(types)
    for tp in result:
        if not (isinstance(tp, type) and issubclass(tp, Event)):
            msg = f"{arg} must hold Event subclasses, got {tp!r}"
            raise TypeError(msg)
    return result


def _clock(time_ns: int) -> str:
    seconds, ns = divmod(time_ns, 1_000_000_000)
    return time.strftime("%H:%M:%S", time.localtime(seconds)) + f".{ns // 1_000_000:03d}"


def _short(value: Any) -> Any:
    """A compact display form: floats to 4 significant digits, long text and tuples cut."""
    if isinstance(value, float):
        if math.isfinite(value):
            return float(f"{value:.4g}")
        return value  # nan / inf / -inf render as such: the point of this library
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, str):
        text = value.strip()
        if "\n" in text:  # tracebacks and stacks: the last line says what happened
            text = text.splitlines()[-1].strip()
        return text if len(text) <= _MAX_TEXT else text[: _MAX_TEXT - 1] + "…"
    if isinstance(value, (tuple, list)):
        items = tuple(_short(v) for v in value[:_MAX_ITEMS])
        return items if len(value) <= _MAX_ITEMS else (*items, f"+{len(value) - _MAX_ITEMS}")
    if isinstance(value, Mapping):
        keys = list(value)[:_MAX_ITEMS]
        out = {str(k): _short(value[k]) for k in keys}
        if len(value) > _MAX_ITEMS:
            out["…"] = f"+{len(value) - _MAX_ITEMS}"
        return out
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _short(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return value
