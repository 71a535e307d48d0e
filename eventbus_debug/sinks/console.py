"""A sink that shows events to humans, one line each, the same line ``eventbus-debug tail`` prints.

Lines look like (see :mod:`sinks.lines`)::

    12:00:01.234 INFO     session_started          name=demo run=8f3c…
    12:00:01.240 ERROR    non_finite_detected      step=121 non-finite gradient: fc.weight (3 NaN)

By default only incidents are shown (anomalies, errors, recovery decisions, sink failures, the
session's start and end): a console is for what needs a human's eyes, the log holds the rest.
Ask for per-step telemetry with ``telemetry=True`` (``step_every`` samples its step lines).

Lines go through an active tqdm or rich progress bar when there is one (see
:mod:`sinks._terminal`). Rendering and writing run in a worker thread, once per batch the bus
hands over: a console can be slow (a terminal being scrolled, a pipe nobody reads), and the
event loop must not wait for it. The sink never touches :mod:`logging` or structlog's
configuration.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Final, TextIO

import anyio

from eventbus_debug.events import Event, Severity
from eventbus_debug.exceptions import ArgumentTypeError
from eventbus_debug.threads import run_in_daemon_thread

from ._checks import count
from ._terminal import resolve_stream, write_text
from .lines import format_event, use_colors

_FLUSH_TIMEOUT: Final = 2.0
"""Seconds the close waits for a flush of the stream (a full pipe may never drain)."""

__all__ = ("ConsoleSink",)


class ConsoleSink:
    """Render events as one human-readable line each on a text stream.

    Args:
        stream: where lines go; ``None`` (the default) writes to whatever ``sys.stderr`` is at
            the time of writing (so a rich progress bar's redirection is honoured).
        min_severity: events below this severity are not shown.
        telemetry: also show telemetry (steps, per-step checks, memory and system samples);
            by default only incidents are shown.
        event_types: show only events of these classes (and subclasses); empty shows all
            (telemetry among them only with *telemetry*).
        exclude: never show events of these classes.
        step_every: show ``StepCompleted`` only for steps that are a multiple of this.
        colors: ANSI colours; ``None`` uses them when the stream is a terminal and ``NO_COLOR``
            is not set.
        name: the subscription name the bus uses.

    Raises:
        ArgumentTypeError: if *step_every* is not an int or *min_severity* is not a
            :class:`~eventbus_debug.Severity` (a ``TypeError``, and the ``ValueError`` earlier
            releases raised).
        ValueError: if *step_every* is below 1.
        TypeError: if an entry of *event_types* or *exclude* is not an Event subclass, or
            *telemetry* is not a bool.
        ArgumentTypeError: if *stream* has no ``write`` method or *colors* is not a bool or
            None (a ``TypeError``).
    """

    def __init__(
        self,
        stream: TextIO | None = None,
        *,
        min_severity: Severity = Severity.DEBUG,
        telemetry: bool = False,
        event_types: Iterable[type[Event]] = (),
        exclude: Iterable[type[Event]] = (),
        step_every: int = 1,
        colors: bool | None = None,
        name: str = "console",
    ) -> None:
        if not isinstance(min_severity, Severity):
            msg = f"min_severity must be a Severity (e.g. Severity.WARNING), got {min_severity!r}"
            raise ArgumentTypeError(msg)
        count("step_every", step_every, rule="a positive integer")
        if not isinstance(telemetry, bool):
            msg = f"telemetry must be a bool, got {telemetry!r}"
            raise TypeError(msg)
        if stream is not None and not callable(getattr(stream, "write", None)):
            msg = (
                f"stream must be a text stream (an object with a write(str) method) or None "
                f"(sys.stderr), got {type(stream).__name__} {stream!r:.60}"
            )
            raise ArgumentTypeError(msg)
        if colors is not None and not isinstance(colors, bool):
            msg = f"colors must be True, False or None (auto), got {colors!r:.60}"
            raise ArgumentTypeError(msg)
        self._types = _check_types("event_types", event_types)
        self._exclude = _check_types("exclude", exclude)
        self._stream = stream
        self._colors = colors
        self.name = name
        self._min = min_severity
        self._telemetry = telemetry
        self._step_every = step_every
        self._closed = False
        self.shown = 0
        """Events written to the stream so far."""

    def __repr__(self) -> str:
        return f"<ConsoleSink min_severity={self._min.value} telemetry={self._telemetry}>"

    def wants(self, event: Event, /) -> bool:
        """Whether *event* passes this sink's filters (severity, telemetry, types, sampling)."""
        if event.severity < self._min:
            return False
        if not self._telemetry and not event.is_incident:
            return False
        if self._types and not isinstance(event, self._types):
            return False
        if self._exclude and isinstance(event, self._exclude):
            return False
        if self._step_every > 1 and not event.is_incident and event.kind == "step_completed":
            return event.step is None or event.step % self._step_every == 0
        return True

    def render(self, event: Event, /, *, colors: bool = False) -> str:
        """The line that shows *event* (no I/O, no trailing newline)."""
        return format_event(event, colors=colors)

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
            # A daemon thread the bus can abandon: a write blocked on a full pipe never hangs
            # the bus's close nor the process's exit.
            await run_in_daemon_thread(self._write, shown, name="eventbus-console")

    async def aclose(self) -> None:
        """Flush the stream (it is not closed: the sink does not own it). Idempotent."""
        if self._closed:
            return
        self._closed = True
        stream = resolve_stream(self._stream)
        flush = getattr(stream, "flush", None)
        if callable(flush):
            with anyio.CancelScope(shield=True), anyio.move_on_after(_FLUSH_TIMEOUT):
                try:
                    await run_in_daemon_thread(flush, name="eventbus-console")
                except (OSError, ValueError):  # a closed pipe: nothing left to flush
                    pass

    def _write(self, events: list[Event]) -> None:
        stream = resolve_stream(self._stream)
        colors = use_colors(stream) if self._colors is None else self._colors
        text = "".join(self.render(e, colors=colors) + "\n" for e in events)
        write_text(stream, text)
        self.shown += len(events)


def _check_types(arg: str, types: Iterable[type[Event]]) -> tuple[type[Event], ...]:
    result = tuple(types)
    for tp in result:
        if not (isinstance(tp, type) and issubclass(tp, Event)):
            msg = f"{arg} must hold Event subclasses, got {tp!r}"
            raise TypeError(msg)
    return result
