"""One subscriber's bounded queue: its two FIFOs, the shedding policy, and flow control.

The dispatcher stages events for the subscription and commits them once per round: incidents
are always queued, telemetry beyond the capacity is shed oldest first (counted per kind, for
the ``EventsDropped`` reports); the pump takes them back in sequence order. A flow-controlled
subscription above its high-water mark holds ``await publish`` back until it is down to its
low-water mark, or makes no progress for ``FLOW_STALL_TIMEOUT``. The lowest layer of
:class:`~.subscription.Subscription` (see :mod:`.subscription`).
"""

from __future__ import annotations

import collections
import contextvars
import time
from collections.abc import Callable
from typing import Any, Final, Protocol

from ..diagnostics import get_logger
from ..events import Event, EventsDropped
from ._waiters import Waiter

__all__ = ("FLOW_STALL_TIMEOUT", "SubscriptionQueue")

# A subscription's records keep the logger name they always had (docs/logging.md).
_log = get_logger("eventbus_debug._bus.subscription")

FLOW_STALL_TIMEOUT: Final = 1.0
"""A flow-controlled sink that completes no batch for this long stops holding publishers back."""

IN_SINK: Final = contextvars.ContextVar("eventbus_debug_in_sink", default=False)
"""True in a sink's own tasks (its pump, its close) and the worker threads they start: what a
sink publishes while the bus closes (an alert handler that failed on the last events) is
delivered to the sinks not closed yet, as the bus's own reports are, instead of refused."""


class _Owner(Protocol):
    """The bus, as seen by its subscriptions: where their reports go and whom they wake."""

    def _publish_internal(self, event: Event) -> None: ...

    def _signal_progress(self) -> None: ...

    def _unsubscribe(self, sub: Any) -> None: ...  # a Subscription (a layer above this one)

    def _forget_routes(self) -> None: ...

    def _flow_changed(self, pressing: bool) -> None: ...

    def _task_failed(self, exc: BaseException) -> None: ...


class SubscriptionQueue:
    """The queue's part of :class:`~.subscription.Subscription`: queue, shedding, flow control.

    Two FIFOs, incidents and telemetry, merged by sequence number when the sink reads them.
    """

    # Set by Subscription.__init__ (see there).
    __slots__ = (
        "_bus",
        "_high_water",
        "_incidents",
        "_last_progress",
        "_low_water",
        "_pressing",
        "_staged_incidents",
        "_staged_telemetry",
        "_stalled",
        "_telemetry",
        "_waiter",
        "backpressure",
        "capacity",
        "name",
        "shed",
        "shed_by_kind",
        "shed_unreported",
        "undelivered",
    )

    _bus: _Owner | None
    name: str
    capacity: int
    backpressure: bool
    _high_water: int
    _low_water: int
    _incidents: collections.deque[Event]
    _telemetry: collections.deque[Event]
    _staged_incidents: list[Event]  # filled by the dispatcher during one round (see there)
    _staged_telemetry: list[Event]
    _waiter: Waiter | None  # the pump's, while it waits for events
    _pressing: bool  # holding back `await publish` (flow control)
    _stalled: bool  # made no progress while pressing: released until it does
    _last_progress: float
    shed: int
    shed_unreported: int
    shed_by_kind: dict[str, int]
    undelivered: int  # events lost to the sink at close (see _commit_staged, _abandon)
    _input_closed: bool  # (the pump's slot) its close began: nothing more is queued

    # -- the queue -------------------------------------------------------------------------

    def _queued(self) -> int:
        return len(self._incidents) + len(self._telemetry)

    def _clear(self) -> int:
        """Empty the queues; returns how many events they held."""
        n = self._queued()
        self._incidents.clear()
        self._telemetry.clear()
        return n

    def _stager(self, incident: bool) -> Callable[[Event], None]:
        """The append the dispatcher uses to stage an event for this subscription."""
        return (self._staged_incidents if incident else self._staged_telemetry).append

    def _commit_staged(self) -> int:
        """Move the events staged by the dispatcher into the queues; returns how many were shed.

        Incidents are always queued. Telemetry beyond the room the incidents leave is shed,
        oldest first: queued telemetry before staged, one ``popleft`` per shed event. Wakes the
        pump if it waits (once per dispatch round).

        Once the sink's input is closed (the bus closed it), what still reaches it (the reports
        about the sinks closed after it, an event from a thread that raced the close) can no
        longer be delivered: it is counted as undelivered, never left in a queue nobody reads.
        """
        staged_inc = self._staged_incidents
        staged_tel = self._staged_telemetry
        if not staged_inc and not staged_tel:
            return 0
        if self._input_closed:
            self.undelivered += len(staged_inc) + len(staged_tel)
            staged_inc.clear()
            staged_tel.clear()
            return 0
        incidents = self._incidents
        telemetry = self._telemetry
        if staged_inc:
            incidents.extend(staged_inc)
            staged_inc.clear()
        shed = 0
        excess = len(incidents) + len(telemetry) + len(staged_tel) - self.capacity
        if excess <= 0:
            if staged_tel:
                telemetry.extend(staged_tel)
                staged_tel.clear()
        else:
            while excess and telemetry:
                self._count_shed(telemetry.popleft())
                excess -= 1
                shed += 1
            if staged_tel:
                cut = min(excess, len(staged_tel))
                for event in staged_tel[:cut]:
                    self._count_shed(event)
                shed += cut
                telemetry.extend(staged_tel[cut:] if cut else staged_tel)
                staged_tel.clear()
        if self.backpressure and not self._pressing and not self._stalled:
            if len(incidents) + len(telemetry) >= self._high_water:
                self._press()
        self._wake()
        return shed

    def _count_shed(self, event: Event) -> None:
        self.shed += 1
        self.shed_unreported += 1
        kind = event.kind
        self.shed_by_kind[kind] = self.shed_by_kind.get(kind, 0) + 1

    def _drop_report(self) -> EventsDropped:
        """The report of the telemetry shed since the last one; resets the unreported count."""
        if self.shed == self.shed_unreported:
            _log.warning("events_shed", sink=self.name, capacity=self.capacity)
        report = EventsDropped(
            source="eventbus",
            sink=self.name,
            dropped=self.shed_unreported,
            total_dropped=self.shed,
            by_kind=dict(self.shed_by_kind),
        )
        self.shed_unreported = 0
        self.shed_by_kind.clear()
        return report

    def _pop(self) -> Event:
        """The queued item with the lowest sequence number (the queues must not be empty)."""
        incidents = self._incidents
        telemetry = self._telemetry
        if incidents and (not telemetry or incidents[0].seq < telemetry[0].seq):
            return incidents.popleft()
        return telemetry.popleft()

    def _take_batch(self, n: int) -> list[Event]:
        """Up to *n* queued items in sequence order (a merge of the two queues)."""
        incidents = self._incidents
        telemetry = self._telemetry
        if not incidents:
            pop = telemetry.popleft
            return [pop() for _ in range(min(n, len(telemetry)))]
        if not telemetry:
            pop = incidents.popleft
            return [pop() for _ in range(min(n, len(incidents)))]
        out: list[Event] = []
        append = out.append
        while incidents and telemetry and len(out) < n:
            if incidents[0].seq < telemetry[0].seq:
                append(incidents.popleft())
            else:
                append(telemetry.popleft())
        rest = incidents or telemetry
        for _ in range(min(n - len(out), len(rest))):
            append(rest.popleft())
        return out

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            waiter.set()

    # -- flow control ----------------------------------------------------------------------

    def _press(self) -> None:
        bus = self._bus
        if bus is not None:
            self._pressing = True
            self._last_progress = time.monotonic()
            bus._flow_changed(True)

    def _release(self) -> None:
        if self._pressing:
            self._pressing = False
            bus = self._bus
            if bus is not None:
                bus._flow_changed(False)

    def _flow_deadline(self, now: float) -> float | None:
        """When this sink stops holding publishers back (None: it does not hold them now).

        A sink that completed no batch for ``FLOW_STALL_TIMEOUT`` is released at once, until
        it completes one.
        """
        if not self._pressing:
            return None
        if now - self._last_progress >= FLOW_STALL_TIMEOUT:
            self._release()
            self._stalled = True
            _log.warning("flow_control_released", sink=self.name)
            return None
        return self._last_progress + FLOW_STALL_TIMEOUT

    def _after_batch(self) -> None:
        """Flow control bookkeeping after a batch; wakes drains and held-back publishers."""
        self._stalled = False
        if self._pressing:
            self._last_progress = time.monotonic()
            if self._queued() <= self._low_water:
                self._release()
        bus = self._bus
        if bus is not None:
            bus._signal_progress()
