"""Routing and dispatch: the publishers' buffer fanned out into the subscriptions' queues.

The dispatcher task empties the buffer that publishing fills, stamps sequence numbers, resolves
once per event class where its events go, and stages each event for every matching
subscription. It also holds telemetry back for a ``telemetry_latency``, wakes whoever waits for
progress, publishes the bus's own reports (drops, failures), and is what the subscriptions call
back (``_queue._Owner``). The lowest layer of :class:`~.bus.EventBus` (see :mod:`.bus`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Final

import anyio
import anyio.lowlevel
from anyio.abc import TaskGroup

from ..diagnostics import get_logger
from ..events import SELF_EXCLUDING, Anomaly, Delivery, Event, has_incident
from ._waiters import AnyioWaiter, Waiter
from .subscription import Subscription

__all__ = ("DISPATCH_ROUND", "HOLD_MAX", "BusDispatcher")

# The bus's records keep the logger name they always had (docs/logging.md).
_log = get_logger("eventbus_debug._bus.bus")

DISPATCH_ROUND: Final = 4096
"""The dispatcher yields to the event loop after fanning out at most this many events."""
HOLD_MAX: Final = 512
"""With a ``telemetry_latency``, this many waiting events are dispatched without waiting more."""
_INCIDENT: Final = Delivery.INCIDENT
_get_ident: Final = threading.get_ident


class _State(Enum):
    NEW = "new"
    RUNNING = "running"
    CLOSING = "closing"
    CLOSED = "closed"


def _set_seq_by_name(event: Event, seq: int) -> None:
    object.__setattr__(event, "seq", seq)  # the event's own class's slot (see _SET_SEQ)


_SET_SEQ: Final[Callable[[Event, int], None]] = (
    Event.__dict__["seq"].__set__ if "seq" not in Anomaly.__dict__ else _set_seq_by_name
)
"""Writes the (frozen) ``seq`` slot directly: the bus stamps it once, at dispatch.

Queues hold the events themselves (stamped with ``seq``): no allocation per subscriber. An
object allocated per event and subscriber would also drive the garbage collector, whose full
passes were the longest loop stalls in a burst of 50,000 incidents.

On Python 3.10, ``dataclass(slots=True)`` gives every event class its own copy of every
inherited slot (3.11 stopped re-declaring the base's), so ``Event``'s descriptor would write a
slot that the concrete class's ``seq`` shadows (every event delivered with ``seq == -1``):
where a subclass has a ``seq`` of its own, the name goes through the event's class
(``object.__setattr__``, 50 ns more per event)."""


@dataclass(frozen=True, slots=True)
class _Route:
    """Where events of one class go, resolved on first dispatch of that class."""

    subs: tuple[Subscription, ...]
    appends: tuple[Callable[[Event], None], ...]  # each sub's staged list's append
    incident: bool
    self_excluding: bool


class BusDispatcher:
    """The dispatcher's part of :class:`~.bus.EventBus`: buffer, routes, fan-out, wake-ups."""

    # Set by EventBus.__init__ (see there).
    _state: _State
    _linger: float
    _drop_interval: float
    _pressing: int  # flow-controlled subscriptions above their high-water mark
    _buffer: list[Event]
    _classified: int
    _buffered_incidents: int
    _wake_pending: bool
    _holding: bool
    _last_dispatch: float
    _seq: int
    _wake: Callable[[], object] | None  # a waiter's trigger, see Waiter
    _new_waiter: Callable[[], Waiter]
    _thread_queue: collections.deque[Event]
    _thread_wake_pending: bool
    _subs: list[Subscription]
    _routes: dict[type[Event], _Route]
    _tg: TaskGroup | None
    _progress: Waiter | None
    _last_drop_report: float
    _dispatcher_done: anyio.Event | None
    _stop_dispatcher: bool
    _dispatcher_scope: anyio.CancelScope | None
    _loop_ident: int  # the thread of the bus's event loop (set on entering)
    _call_soon_threadsafe: Callable[[Callable[[], object]], object] | None
    _after_close_lock: threading.Lock  # serializes _settle_after_close (any thread)
    _after_close_logged: bool

    # -- the dispatcher ------------------------------------------------------------------------

    def _wake_dispatcher(self) -> None:
        if not self._wake_pending:
            self._wake_pending = True
            self._trigger()
        elif self._holding:
            self._end_hold()

    def _end_hold(self) -> None:
        """Stop the dispatcher's wait for more telemetry: dispatch now.

        On the loop's thread only (a waiter's trigger raises on trio and races the loop on
        asyncio elsewhere): from another thread (a ``publish_nowait`` there that found a burst
        pending) it is handed to the loop. Rare: an incident or a full buffer during a hold.
        """
        if _get_ident() != self._loop_ident:
            schedule = self._call_soon_threadsafe
            if schedule is not None:
                with contextlib.suppress(RuntimeError):  # the loop is gone: the bus closed
                    schedule(self._end_hold)
            return
        self._holding = False
        self._trigger()

    def _trigger(self) -> None:
        """Wake the dispatcher's current wait, if it waits (the waiter is used once)."""
        wake = self._wake
        if wake is not None:
            self._wake = None
            try:
                wake()
            except asyncio.InvalidStateError:  # the dispatcher's wait was just cancelled
                pass

    def _wake_for_threads(self) -> None:
        """Events published from threads arrived; telemetry may keep waiting during a hold."""
        if not self._holding:
            self._wake_dispatcher()
            return
        self._thread_wake_pending = False  # the next wake from a thread is scheduled again
        queued = tuple(self._thread_queue)
        if (
            len(queued) + len(self._buffer) >= HOLD_MAX
            or has_incident(queued)
            or self._buffered_incident_count()  # publish_nowait from a thread: in the buffer
        ):
            self._end_hold()

    def _signal_progress(self) -> None:
        progress = self._progress
        if progress is not None:
            self._progress = None
            progress.set()

    def _pull_thread_events(self) -> None:
        self._thread_wake_pending = False
        tq = self._thread_queue
        if tq:
            n = len(tq)
            buf = self._buffer
            for _ in range(n):
                buf.append(tq.popleft())

    def _settle_after_close(self) -> None:
        """Account for what was handed over after the close's last dispatch: events that a
        publisher on another thread handed over as the bus closed (it found the bus running,
        then lost the race). Any thread, once the bus is CLOSED: the close calls it last, and
        a publisher that finds the bus closed after handing its event over calls it too.

        They are routed as the dispatcher routes, to sinks all closed by now: each sink they
        were for counts them in its ``undelivered``, the close's one way of counting what a sink
        did not get (as ``_commit_staged`` does for what reaches a sink after its close), and
        they are stamped, so that ``statistics()`` counts them published and dispatched. Also
        what a dispatcher that crashed left. Logged too (``events_after_close``, once).
        """
        with self._after_close_lock:  # the close and late publishers may settle at once
            if self._state is not _State.CLOSED:
                return
            self._pull_thread_events()
            late = self._buffer
            if not late:
                return
            self._buffer = []
            self._classified = self._buffered_incidents = 0
            seq = self._seq
            for event in late:
                seq += 1
                _SET_SEQ(event, seq)
                route = self._routes.get(event.__class__) or self._resolve(event.__class__)
                excluded = event.sink if route.self_excluding else None  # type: ignore[attr-defined]
                for sub in route.subs:
                    if sub.name != excluded:
                        sub.undelivered += 1
            self._seq = seq
            if self._after_close_logged:
                return
            self._after_close_logged = True
        _log.warning(
            "events_after_close",
            events=len(late),
            detail=(
                "events handed over from another thread as the bus closed arrived after its last "
                "delivery; counted as undelivered in the statistics of the sinks they were for"
            ),
        )

    async def _await_progress(self) -> None:
        progress = self._progress
        if progress is None:
            progress = self._progress = AnyioWaiter()  # shared by many waiters
        self._wake_dispatcher()
        await progress.wait()

    def _publish_internal(self, event: Event) -> None:
        """Publish from inside the bus (failures, drop reports), also while closing."""
        if self._state is _State.CLOSED:
            return
        self._buffer.append(event)
        self._wake_dispatcher()  # also ends a hold: the bus's own reports never wait

    async def _dispatch_loop(self) -> None:
        scope = self._dispatcher_scope
        assert scope is not None
        try:
            with scope:  # shielded: only aclose stops the dispatcher
                await self._dispatch_forever()
        finally:
            if self._dispatcher_done is not None:
                self._dispatcher_done.set()
            self._signal_progress()  # a close waiting for the dispatcher stops waiting

    async def _dispatch_forever(self) -> None:
        while True:
            self._pull_thread_events()
            if self._buffer:
                if self._linger and self._may_hold():
                    await self._hold()
                    continue
                self._last_dispatch = time.monotonic()
                self._dispatch()
                self._signal_progress()
                # Yield, then look again before waiting: on a loop that publishes at every turn
                # (a training loop), resuming from a checkpoint costs less than a fresh waiter
                # and its wake-up (benchmarks/bench_step_loop.py, issue #13).
                await anyio.lowlevel.checkpoint()
                continue
            if self._stop_dispatcher:
                break
            unreported = self._report_drops(force=False)
            if self._buffer:
                continue
            self._wake_pending = False
            wake = self._new_waiter()
            self._wake = wake.trigger
            if unreported:
                with anyio.move_on_after(self._drop_interval):
                    await wake.wait()
            else:
                await wake.wait()
            self._wake = None

    def _may_hold(self) -> bool:
        """Whether the buffered events may wait for more (telemetry only, recent dispatch)."""
        if (
            self._state is not _State.RUNNING
            or self._progress is not None  # someone drains (or waits for room): dispatch now
            or self._stop_dispatcher
            or len(self._buffer) >= HOLD_MAX
            or time.monotonic() - self._last_dispatch >= self._linger
        ):
            return False
        return not self._buffered_incident_count()

    async def _hold(self) -> None:
        """Wait until the latency since the last dispatch ran out, or an urgent publish.

        ``_wake_pending`` stays set, so telemetry published meanwhile costs its append only;
        an incident, a full buffer, :meth:`drain` or close end the wait (``_end_hold``).
        """
        remaining = self._last_dispatch + self._linger - time.monotonic()
        wake = self._new_waiter()
        self._wake = wake.trigger
        self._holding = True
        try:
            with anyio.move_on_after(remaining):
                await wake.wait()
        finally:
            self._holding = False
            self._wake = None

    def _dispatch(self) -> None:
        """Stamp sequence numbers on the buffered events and fan them out.

        Each event is stamped, then appended to the staged list of every matching subscription
        (its incident list or its telemetry list: one C-level append per subscriber); routing is
        resolved once per event class. Staged events move into the queues once per round, which
        also wakes each pump once per round. A round is at most ``DISPATCH_ROUND`` events.
        """
        batch = self._buffer
        if len(batch) > DISPATCH_ROUND:  # a huge burst: fan out in rounds, yielding between
            self._buffer = batch[DISPATCH_ROUND:]
            batch = batch[:DISPATCH_ROUND]
        else:
            self._buffer = []
        self._classified = self._buffered_incidents = 0
        routes = self._routes
        seq = self._seq
        set_seq = _SET_SEQ
        for event in batch:
            seq += 1
            set_seq(event, seq)
            route = routes.get(event.__class__)
            if route is None:
                route = self._resolve(event.__class__)
            if route.self_excluding:
                sink_name = event.sink  # type: ignore[attr-defined]
                for append, sub in zip(route.appends, route.subs, strict=True):
                    if sub.name != sink_name:
                        append(event)
            else:
                for append in route.appends:
                    append(event)
        self._seq = seq
        shed = 0
        for sub in self._subs:
            shed += sub._commit_staged()
        if shed:
            self._report_drops(force=False)

    def _resolve(self, cls: type[Event]) -> _Route:
        subs = tuple(s for s in self._subs if not s.disabled and not s._stopped and s.accepts(cls))
        incident = cls.delivery is Delivery.INCIDENT
        route = _Route(
            subs=subs,
            appends=tuple(s._stager(incident) for s in subs),
            incident=incident,
            self_excluding=issubclass(cls, SELF_EXCLUDING),
        )
        self._routes[cls] = route
        return route

    def _report_drops(self, *, force: bool) -> bool:
        """Publish coalesced EventsDropped reports; returns True if some are still due."""
        pending = [s for s in self._subs if s.shed_unreported]
        if not pending:
            return False
        now = time.monotonic()
        if not force and now - self._last_drop_report < self._drop_interval:
            return True
        self._last_drop_report = now
        for sub in pending:
            self._publish_drop_report(sub)
        return False

    def _publish_drop_report(self, sub: Subscription) -> None:
        self._publish_internal(sub._drop_report())

    def _buffered_incident_count(self) -> int:
        """How many incidents the buffer holds: a tally that looks at each event once (reset at
        each dispatch), so that asking at every step costs a few hundred ns."""
        buffer = self._buffer
        classified = self._classified
        if classified < len(buffer):
            incidents = self._buffered_incidents
            for i in range(classified, len(buffer)):
                if buffer[i].delivery is _INCIDENT:
                    incidents += 1
            self._buffered_incidents = incidents
            self._classified = len(buffer)
        return self._buffered_incidents

    # -- the subscriptions' side (see _queue._Owner) -------------------------------------------

    def _forget_routes(self) -> None:
        """A subscription was disabled: resolve the routes again without it."""
        self._routes.clear()

    def _task_failed(self, exc: BaseException) -> None:
        """A sink's task (outside the task group, see ``Subscription._start``) ended with a
        ``BaseException`` that is not an ``Exception``: raise it in the task group, as if the
        task had been there (the block is cancelled; leaving the bus raises the group)."""
        tg = self._tg
        if tg is None:
            _log.error("bus_task_failed", error=repr(exc), exc_info=exc)
            return
        tg.start_soon(_reraise, exc, name="eventbus-sink-failure")

    def _flow_changed(self, pressing: bool) -> None:
        """A flow-controlled subscription went over its high-water mark, or back under."""
        if pressing:
            self._pressing += 1
        else:
            self._pressing -= 1
            self._signal_progress()


async def _reraise(exc: BaseException) -> None:
    raise exc
