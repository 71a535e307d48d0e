"""The bus's and the sinks' own incidents: failures, shedding, stalls, log outages."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import field
from typing import ClassVar, Final

from ._base import Event, Severity, event_type

__all__ = (
    "SELF_EXCLUDING",
    "EventsDropped",
    "EventsUndelivered",
    "LogWriteResumed",
    "LoopStalled",
    "SinkCloseFailed",
    "SinkDisabled",
    "SinkFailed",
    "SinkUnresponsive",
)


@event_type
class SinkFailed(Event):
    """A subscriber raised while handling an event (or starting); it keeps receiving."""

    kind: ClassVar[str] = "sink_failed"
    severity: Severity = Severity.ERROR
    sink: str
    error_type: str
    message: str
    traceback: str = ""
    event_kind: str = ""
    event_seq: int = -1
    consecutive_failures: int = 1


@event_type
class SinkDisabled(Event):
    """A subscriber failed too many times in a row and receives nothing more."""

    kind: ClassVar[str] = "sink_disabled"
    severity: Severity = Severity.CRITICAL
    sink: str
    reason: str
    consecutive_failures: int
    discarded: int = 0


@event_type
class EventsDropped(Event):
    """Telemetry was shed from a subscriber's full queue (coalesced: one report per interval)."""

    kind: ClassVar[str] = "events_dropped"
    severity: Severity = Severity.WARNING
    sink: str
    dropped: int
    total_dropped: int
    by_kind: Mapping[str, int] = field(default_factory=dict)


@event_type
class EventsUndelivered(Event):
    """At close, a subscriber did not finish within the timeout; its queued events were lost."""

    kind: ClassVar[str] = "events_undelivered"
    severity: Severity = Severity.ERROR
    sink: str
    undelivered: int
    timeout_s: float
    phase: str = "drain"


@event_type
class SinkCloseFailed(Event):
    """A subscriber's ``aclose`` raised while the bus was closing (what it held may be lost)."""

    kind: ClassVar[str] = "sink_close_failed"
    severity: Severity = Severity.ERROR
    sink: str
    error_type: str
    message: str


@event_type
class SinkUnresponsive(Event):
    """A subscriber did not finish within its bound at close and was abandoned.

    ``phase`` is ``"drain"`` (still handling events when the close timeout fired; the events
    it lost are in an :class:`EventsUndelivered`) or ``"close"`` (its ``aclose`` did not
    return). ``thread_abandoned`` is true when a worker thread of the sink was still inside a
    call (a hung write): the thread is left behind as a daemon, it never blocks the exit.
    """

    kind: ClassVar[str] = "sink_unresponsive"
    severity: Severity = Severity.ERROR
    sink: str
    phase: str
    waited_s: float
    thread_abandoned: bool = False


@event_type
class LoopStalled(Event):
    """A subscriber held the event loop (synchronous work inside an async handler).

    Reported at most once per window per sink: ``stall_s`` is its longest single hold of the
    loop, ``blocked_s`` the total over ``window_s`` seconds, ``threshold_s`` the bus's
    ``stall_threshold``. While the loop is held, training (and every other sink) waits.
    """

    kind: ClassVar[str] = "loop_stalled"
    severity: Severity = Severity.WARNING
    sink: str
    stall_s: float
    blocked_s: float
    window_s: float
    threshold_s: float


@event_type
class LogWriteResumed(Event):
    """The file sink could write again after an outage (disk full, directory gone).

    Written by the sink itself into the log, where the gap is: ``outage_s`` seconds without a
    successful write, ``write_errors`` failed attempts (retried with backoff), ``lines_lost``
    lines given up meanwhile (its pending buffer is bounded).
    """

    kind: ClassVar[str] = "log_write_resumed"
    severity: Severity = Severity.WARNING
    path: str
    outage_s: float
    write_errors: int
    lines_lost: int
    error: str = ""


SELF_EXCLUDING: Final[tuple[type[Event], ...]] = (
    SinkFailed,
    SinkDisabled,
    SinkCloseFailed,
    SinkUnresponsive,
    LoopStalled,
)
"""Events about a sink that are never delivered to that sink itself (it could fail on them)."""
