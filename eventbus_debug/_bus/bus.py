"""The event bus: one cheap buffer on the publisher's side, fan-out in a dispatcher task.

Publishing appends to one list and wakes the dispatcher at most once per burst; the dispatcher
stamps sequence numbers and offers each event to the bounded queue of every matching
subscription; one task per subscription drains its queue into the sink. A slow, raising or
hanging sink therefore only ever affects its own queue.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import inspect
import math
import time
import traceback
import warnings
from collections.abc import Awaitable, Callable, Generator, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from types import TracebackType
from typing import Any, Final, Protocol, final

import anyio
import anyio.lowlevel
from anyio.abc import TaskGroup
from typing_extensions import Self

from eventbus_debug.diagnostics import get_logger

from ..events import (
    SELF_EXCLUDING,
    Delivery,
    Event,
    EventsDropped,
    EventsUndelivered,
    LoopStalled,
    SinkCloseFailed,
    SinkDisabled,
    SinkFailed,
    SinkUnresponsive,
    refresh_rank,
)
from ..exceptions import BusClosedError, SubscriptionError

__all__ = ("BusStatistics", "EventBus", "Subscription", "SubscriptionStatistics")

_log = get_logger(__name__)

DEFAULT_CAPACITY: Final = 1024
DEFAULT_CLOSE_TIMEOUT: Final = 30.0
DEFAULT_MAX_CONSECUTIVE_FAILURES: Final = 5
DEFAULT_DROP_REPORT_INTERVAL: Final = 1.0
DEFAULT_STALL_THRESHOLD: Final = 0.25
MAX_BATCH: Final = 4096
HANDLE_ROUND: Final = 64
"""A ``handle(event)`` sink yields to the event loop at least once per this many events."""
DISPATCH_ROUND: Final = 4096
"""The dispatcher yields to the event loop after fanning out at most this many events."""
FLOW_STALL_TIMEOUT: Final = 1.0
"""A flow-controlled sink that completes no batch for this long stops holding publishers back."""
CLOSE_GRACE: Final = 1.0
"""Seconds granted to each sink's close (and to the last reports) once the deadline passed."""
STALL_WINDOW: Final = 1.0
"""Loop holds by one sink are summed over windows of this many seconds (see LoopStalled)."""
STALL_SHARE: Final = 0.2
"""A sink holding the loop this share of a window is reported even without one long hold."""


class _State(Enum):
    NEW = "new"
    RUNNING = "running"
    CLOSING = "closing"
    CLOSED = "closed"


@dataclass(frozen=True, slots=True)
class SubscriptionStatistics:
    """A snapshot of one subscription's counters.

    Attributes:
        name: the subscription's name.
        capacity: its queue bound (incidents may exceed it; they are never shed).
        queued: events waiting in its queue now.
        delivered: events its sink handled without raising.
        failed: events whose handling raised.
        shed: telemetry events dropped from its full queue.
        discarded: events not delivered because the sink was disabled.
        undelivered: events lost because the sink did not finish within the close timeout.
        disabled: whether the sink was disabled after repeated failures.
    """

    name: str
    capacity: int
    queued: int
    delivered: int
    failed: int
    shed: int
    discarded: int
    undelivered: int
    disabled: bool


@dataclass(frozen=True, slots=True)
class BusStatistics:
    """A snapshot of the bus: ``published`` counts every accepted event."""

    published: int
    dispatched: int
    pending: int
    closed: bool
    subscriptions: tuple[SubscriptionStatistics, ...]

    @property
    def shed(self) -> int:
        """Total telemetry shed over all subscriptions."""
        return sum(s.shed for s in self.subscriptions)


_QueueItem = Event
"""Queues hold the events themselves (stamped with ``seq``): no allocation per subscriber.

An object allocated per event and subscriber would also drive the garbage collector, whose
full passes were the longest loop stalls in a burst of 50,000 incidents."""

_SET_SEQ: Final[Callable[[Event, int], None]] = Event.__dict__["seq"].__set__
"""Writes the (frozen) ``seq`` slot directly: the bus stamps it once, at dispatch."""


@dataclass(frozen=True, slots=True)
class _Route:
    """Where events of one class go, resolved on first dispatch of that class."""

    subs: tuple[Subscription, ...]
    appends: tuple[Callable[[_QueueItem], None], ...]  # each sub's staged list's append
    incident: bool
    self_excluding: bool


class _Adapter:
    """How the bus talks to one sink, resolved once at subscribe time."""

    __slots__ = ("aclose", "handle", "handle_batch", "start")

    def __init__(self, sink: object, name: str) -> None:
        self.handle: Callable[[Event], Awaitable[Any]] | None = None
        self.handle_batch: Callable[[Sequence[Event]], Awaitable[Any]] | None = None
        self.start: Callable[[], Awaitable[Any]] | None = None
        self.aclose: Callable[[], Any] | None = None
        if inspect.isclass(sink):
            msg = f"sink {name!r} is a class ({sink.__qualname__}); pass an instance of it"
            raise SubscriptionError(msg)
        batch = getattr(sink, "handle_batch", None)
        single = getattr(sink, "handle", None)
        if batch is not None or single is not None:
            for attr, fn in (("handle_batch", batch), ("handle", single)):
                if fn is not None and not _is_async_callable(fn):
                    msg = (
                        f"sink {name!r}: {attr} must be an `async def` method, got {fn!r}; "
                        "blocking work belongs in a worker thread (anyio.to_thread.run_sync)"
                    )
                    raise SubscriptionError(msg)
            self.handle_batch = batch
            self.handle = single
            start = getattr(sink, "start", None)
            if start is not None:
                if not _is_async_callable(start):
                    msg = f"sink {name!r}: start must be an `async def` method, got {start!r}"
                    raise SubscriptionError(msg)
                self.start = start
            self.aclose = getattr(sink, "aclose", None) or getattr(sink, "close", None)
            return
        if callable(sink):
            if not _is_async_callable(sink):
                msg = (
                    f"{sink!r} is not an async function; pass an `async def handler(event)` or "
                    "an object with an async handle(event) / handle_batch(events) method"
                )
                raise SubscriptionError(msg)
            self.handle = sink  # type: ignore[assignment]
            return
        msg = (
            f"{sink!r} is not a sink: pass an `async def handler(event)` or an object with an "
            "async handle(event) / handle_batch(events) method"
        )
        raise SubscriptionError(msg)


def _is_async_callable(fn: object) -> bool:
    if inspect.iscoroutinefunction(fn):
        return True
    call = getattr(fn, "__call__", None)  # noqa: B004 - instances with an async __call__
    return call is not None and inspect.iscoroutinefunction(call)


@final
class Subscription:
    """One sink's connection to a bus: its filter, bounded queue, task and counters.

    Returned by :meth:`EventBus.subscribe`. Cancel it with :meth:`cancel` (or use it as a
    context manager) to stop delivery; events already queued are dropped and counted.

    The queue is two FIFOs, incidents and telemetry, merged by sequence number when the sink
    reads them: shedding the oldest telemetry is one ``popleft`` whatever the queue holds, so
    a burst of any size is queued in linear time.
    """

    __slots__ = (
        "__weakref__",
        "_adapter",
        "_bus",
        "_cancel_scope",
        "_consecutive",
        "_done",
        "_high_water",
        "_incidents",
        "_inflight_min_seq",
        "_inflight_n",
        "_input_closed",
        "_last_progress",
        "_low_water",
        "_pressing",
        "_sink_closed",
        "_staged_incidents",
        "_staged_telemetry",
        "_stall_blocked",
        "_stall_longest",
        "_stall_window_start",
        "_stalled",
        "_telemetry",
        "_waiter",
        "backpressure",
        "capacity",
        "delivered",
        "disabled",
        "discarded",
        "event_types",
        "failed",
        "name",
        "shed",
        "shed_by_kind",
        "shed_unreported",
        "sink",
        "undelivered",
    )

    def __init__(
        self,
        bus: EventBus,
        sink: object,
        adapter: _Adapter,
        event_types: tuple[type[Event], ...],
        name: str,
        capacity: int,
        backpressure: bool = False,
    ) -> None:
        self._bus: EventBus | None = bus
        self.sink = sink
        self._adapter = adapter
        self.event_types = event_types
        self.name = name
        self.capacity = capacity
        self.backpressure = backpressure
        self._high_water = max(1, capacity // 2)
        self._low_water = capacity // 4
        self._incidents: collections.deque[_QueueItem] = collections.deque()
        self._telemetry: collections.deque[_QueueItem] = collections.deque()
        # Filled by the dispatcher during one dispatch round, then moved into the queues at once.
        self._staged_incidents: list[_QueueItem] = []
        self._staged_telemetry: list[_QueueItem] = []
        self._waiter: _Waiter | None = None
        self._input_closed = False
        self._inflight_min_seq = -1
        self._inflight_n = 0
        self._consecutive = 0
        self._cancel_scope: anyio.CancelScope | None = None
        self._done: anyio.Event | None = None
        self._sink_closed = False
        self._pressing = False  # holding back `await publish` (flow control)
        self._stalled = False  # made no progress while pressing: released until it does
        self._last_progress = 0.0
        self._stall_window_start = 0.0
        self._stall_blocked = 0.0
        self._stall_longest = 0.0
        self.delivered = 0
        self.failed = 0
        self.shed = 0
        self.shed_unreported = 0
        self.shed_by_kind: dict[str, int] = {}
        self.discarded = 0
        self.undelivered = 0
        self.disabled = False

    def __repr__(self) -> str:
        return f"<Subscription {self.name!r} types={[t.__name__ for t in self.event_types]}>"

    def accepts(self, cls: type[Event]) -> bool:
        """Whether events of class *cls* are routed to this subscription."""
        return not self.event_types or issubclass(cls, self.event_types)

    def statistics(self) -> SubscriptionStatistics:
        """A snapshot of this subscription's counters."""
        return SubscriptionStatistics(
            name=self.name,
            capacity=self.capacity,
            queued=self._queued() + self._inflight_n,
            delivered=self.delivered,
            failed=self.failed,
            shed=self.shed,
            discarded=self.discarded,
            undelivered=self.undelivered,
            disabled=self.disabled,
        )

    def cancel(self) -> None:
        """Stop delivering to this sink; queued events are discarded (and counted). Idempotent.

        The sink's ``aclose`` is not called: the caller owns a sink it unsubscribed.
        """
        bus = self._bus
        if bus is not None:
            bus._unsubscribe(self)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.cancel()

    # -- internals used by the bus ----------------------------------------------------------

    def _queued(self) -> int:
        return len(self._incidents) + len(self._telemetry)

    def _clear(self) -> int:
        """Empty the queues; returns how many events they held."""
        n = self._queued()
        self._incidents.clear()
        self._telemetry.clear()
        return n

    def _take_staged(self) -> int:
        """Move the events staged by the dispatcher into the queues; returns how many were shed.

        Incidents are always queued. Telemetry beyond the room the incidents leave is shed,
        oldest first: queued telemetry before staged, one ``popleft`` per shed event.
        """
        staged_inc = self._staged_incidents
        staged_tel = self._staged_telemetry
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
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            waiter.set()
        return shed

    def _press(self) -> None:
        bus = self._bus
        if bus is not None:
            self._pressing = True
            self._last_progress = time.monotonic()
            bus._pressing += 1

    def _release(self) -> None:
        if self._pressing:
            self._pressing = False
            bus = self._bus
            if bus is not None:
                bus._pressing -= 1
                bus._signal_progress()

    def _pop(self) -> _QueueItem:
        """The queued item with the lowest sequence number (the queues must not be empty)."""
        incidents = self._incidents
        telemetry = self._telemetry
        if incidents and (not telemetry or incidents[0].seq < telemetry[0].seq):
            return incidents.popleft()
        return telemetry.popleft()

    def _take_batch(self, n: int) -> list[_QueueItem]:
        """Up to *n* queued items in sequence order (a merge of the two queues)."""
        incidents = self._incidents
        telemetry = self._telemetry
        if not incidents:
            pop = telemetry.popleft
            return [pop() for _ in range(min(n, len(telemetry)))]
        if not telemetry:
            pop = incidents.popleft
            return [pop() for _ in range(min(n, len(incidents)))]
        out: list[_QueueItem] = []
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

    def _count_shed(self, event: Event) -> None:
        self.shed += 1
        self.shed_unreported += 1
        kind = event.kind
        self.shed_by_kind[kind] = self.shed_by_kind.get(kind, 0) + 1

    def _idle_up_to(self, target: int) -> bool:
        if self.disabled:
            return True
        if self._inflight_n and self._inflight_min_seq <= target:
            return False
        incidents = self._incidents
        telemetry = self._telemetry
        if incidents and incidents[0].seq <= target:
            return False
        return not telemetry or telemetry[0].seq > target


@final
class EventBus:
    """Routes published events to subscribers; one bounded queue and task per subscriber.

    Use it as ``async with EventBus() as bus:``. Leaving the block stops accepting events,
    drains every queue, then closes sinks in reverse subscription order; the whole close is
    bounded (see :meth:`aclose`), also when the caller's scope is cancelled.

    Example::

        async with EventBus() as bus:
            async def show(event: StepCompleted) -> None:
                print(event.step, event.loss)

            bus.subscribe(show, StepCompleted)
            bus.publish_nowait(StepCompleted(step=1, loss=0.5))
            await bus.drain()

    Args:
        capacity: default queue bound per subscription (overridable in :meth:`subscribe`; a
            sink may ask for its own with a ``queue_capacity`` attribute).
        close_timeout: seconds granted to drain all queues and close the sinks at close.
        max_consecutive_failures: a sink raising this many times in a row is disabled.
        drop_report_interval: at most one :class:`EventsDropped` per sink per this many seconds.
        stall_threshold: a sink holding the event loop this long in one go (synchronous work
            in an async handler) is reported by a :class:`LoopStalled` incident; ``None``
            turns the measurement off.

    Raises:
        ValueError: if an argument is out of range (the message names it).
    """

    def __init__(
        self,
        *,
        capacity: int = DEFAULT_CAPACITY,
        close_timeout: float = DEFAULT_CLOSE_TIMEOUT,
        max_consecutive_failures: int = DEFAULT_MAX_CONSECUTIVE_FAILURES,
        drop_report_interval: float = DEFAULT_DROP_REPORT_INTERVAL,
        stall_threshold: float | None = DEFAULT_STALL_THRESHOLD,
    ) -> None:
        _check_positive_int("capacity", capacity)
        _check_positive_int("max_consecutive_failures", max_consecutive_failures)
        _check_positive_float("close_timeout", close_timeout)
        _check_positive_float("drop_report_interval", drop_report_interval)
        if stall_threshold is not None:
            _check_positive_float("stall_threshold", stall_threshold)
        self._stall_threshold = None if stall_threshold is None else float(stall_threshold)
        self._pressing = 0  # flow-controlled subscriptions above their high-water mark
        self._capacity = capacity
        self._close_timeout = float(close_timeout)
        self._max_failures = max_consecutive_failures
        self._drop_interval = float(drop_report_interval)

        self._state = _State.NEW
        # The publisher's path touches only these three attributes (see publish_nowait).
        self._accepting = False
        self._buffer: list[Event] = []
        self._wake_pending = False
        self._seq = 0
        self._wake: Callable[[], object] | None = None  # a waiter's trigger, see _Waiter
        self._new_waiter: Callable[[], _Waiter] = _AnyioWaiter
        self._thread_queue: collections.deque[Event] = collections.deque()
        self._thread_wake_pending = False
        self._call_soon_threadsafe: Callable[[Callable[[], object]], object] | None = None
        self._subs: list[Subscription] = []
        self._routes: dict[type[Event], _Route] = {}
        self._tg: TaskGroup | None = None
        self._progress: _Waiter | None = None
        self._last_drop_report = 0.0
        self._dispatcher_done: anyio.Event | None = None
        self._names: set[str] = set()
        self._stop_dispatcher = False
        self._dispatcher_scope: anyio.CancelScope | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        if self._state is not _State.NEW:
            msg = "an EventBus can be entered once; create a new one"
            raise RuntimeError(msg)
        refresh_rank()
        self._call_soon_threadsafe = _threadsafe_scheduler()
        self._new_waiter = _waiter_factory()
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        self._state = _State.RUNNING
        self._accepting = True
        self._dispatcher_done = anyio.Event()
        self._dispatcher_scope = anyio.CancelScope(shield=True)
        tg.start_soon(self._dispatch_loop, name="eventbus-dispatcher")
        for sub in self._subs:
            self._start_pump(sub)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        await self.aclose()
        tg = self._tg
        if tg is not None:
            self._tg = None
            return await tg.__aexit__(exc_type, exc, tb)
        return None

    async def aclose(self) -> None:
        """Stop accepting events, deliver everything queued, close the sinks. Idempotent.

        Bounded: every queue gets *close_timeout* seconds in total to drain. A sink still busy
        then is abandoned (its task cancelled; a worker thread stuck in a call is left behind
        as a daemon) and what it had left is reported by :class:`EventsUndelivered` and
        :class:`SinkUnresponsive` incidents, in ``statistics()`` and in the library's log.
        The sinks are then closed one by one in reverse order of subscription, each within
        what is left of the timeout but at least ``CLOSE_GRACE`` (1 s); the sinks not closed
        yet still receive the reports about the others (so the log, subscribed first, records
        them). Worst case: *close_timeout* plus one second per sink and one for the reports.

        Runs shielded from cancellation, and the sinks' tasks are shielded too: cancelling the
        caller's scope (``move_on_after``, a cancelled training task) loses no queued event.
        """
        if self._state in (_State.CLOSING, _State.CLOSED):
            return
        self._accepting = False
        if self._state is _State.NEW:
            self._state = _State.CLOSED
            return
        self._state = _State.CLOSING
        started = time.monotonic()
        deadline = started + self._close_timeout
        with anyio.CancelScope(shield=True):
            hung = await self._drain_for_close()
            if hung:
                self._report_undelivered(hung)
            for sub in reversed(list(self._subs)):
                await self._close_one(sub, deadline, sub in hung)
            self._stop_dispatcher = True
            self._wake_dispatcher()
            if self._dispatcher_done is not None:
                with anyio.move_on_after(CLOSE_GRACE):
                    await self._dispatcher_done.wait()
                if not self._dispatcher_done.is_set() and self._dispatcher_scope is not None:
                    self._dispatcher_scope.cancel()
        self._state = _State.CLOSED
        elapsed = time.monotonic() - started
        if elapsed > 1.0:
            _log.info("bus_close_slow", seconds=round(elapsed, 3))

    def __del__(self) -> None:
        if getattr(self, "_state", None) in (_State.RUNNING, _State.CLOSING):
            warnings.warn(
                f"{self!r} was garbage-collected without being closed; queued events may be lost",
                ResourceWarning,
                stacklevel=2,
            )

    def __repr__(self) -> str:
        return f"<EventBus {self._state.value} subscriptions={len(self._subs)}>"

    @property
    def closed(self) -> bool:
        """True once :meth:`aclose` began; publishing then raises :class:`BusClosedError`."""
        return self._state in (_State.CLOSING, _State.CLOSED)

    @property
    def running(self) -> bool:
        """True between entering the bus and the start of its close."""
        return self._state is _State.RUNNING

    # -- subscribing ---------------------------------------------------------------------------

    def subscribe(
        self,
        sink: object,
        /,
        *event_types: type[Event],
        name: str | None = None,
        capacity: int | None = None,
        backpressure: bool | None = None,
    ) -> Subscription:
        """Deliver events of *event_types* (all events when none are given) to *sink*.

        *sink* is an ``async def handler(event)`` or an object with an async ``handle(event)``
        and/or ``handle_batch(events)``, and optionally async ``start()`` and ``aclose()``.
        Types match by subclass, so ``subscribe(sink, Event)`` receives everything.

        *capacity* bounds the sink's queue (default: the sink's ``queue_capacity`` attribute,
        else the bus's). With *backpressure* (default: the sink's ``backpressure`` attribute,
        else off) the sink is flow-controlled: while its queue is over half full, ``await
        bus.publish(...)`` waits until it is down to a quarter, so a publisher faster than
        the sink is slowed to the sink's pace instead of shedding. ``publish_nowait`` never
        waits; a full queue then sheds telemetry as for any sink. A flow-controlled sink that
        completes no batch for a second stops holding publishers back until it does.

        Raises:
            SubscriptionError: if *sink* is not usable, a type is not an :class:`Event`
                subclass, *capacity* is not a positive int, or *name* is already used.
            BusClosedError: if the bus is closing or closed.
        """
        if self.closed:
            msg = "cannot subscribe: the bus is closed"
            raise BusClosedError(msg)
        for tp in event_types:
            if not (isinstance(tp, type) and issubclass(tp, Event)):
                msg = (
                    f"event_types must be Event subclasses, got {tp!r}; "
                    "pass classes such as StepCompleted (or Event for everything)"
                )
                raise SubscriptionError(msg)
        if capacity is None:
            hint = getattr(sink, "queue_capacity", None)
            capacity = hint if isinstance(hint, int) and not isinstance(hint, bool) else None
            if capacity is None or capacity < 1:
                capacity = self._capacity
        if backpressure is None:
            backpressure = getattr(sink, "backpressure", False) is True
        elif not isinstance(backpressure, bool):
            msg = f"backpressure must be True, False or None, got {backpressure!r}"
            raise SubscriptionError(msg)
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            msg = f"capacity must be a positive integer, got {capacity!r}"
            raise SubscriptionError(msg)
        if name is None:
            name = _default_name(sink)
            base, n = name, 2
            while name in self._names:
                name, n = f"{base}-{n}", n + 1
        elif not isinstance(name, str) or not name:
            msg = f"name must be a non-empty string, got {name!r}"
            raise SubscriptionError(msg)
        elif name in self._names:
            msg = f"a subscription named {name!r} already exists; pass another name"
            raise SubscriptionError(msg)
        adapter = _Adapter(sink, name)
        types = tuple(t for t in event_types if t is not Event)
        if len(types) < len(event_types):
            types = ()
        sub = Subscription(self, sink, adapter, types, name, capacity, backpressure)
        self._subs.append(sub)
        self._names.add(name)
        self._routes.clear()
        if self._state is _State.RUNNING:
            self._start_pump(sub)
        return sub

    def _unsubscribe(self, sub: Subscription) -> None:
        if sub not in self._subs:
            return
        if sub.shed_unreported and self._state is not _State.CLOSED:
            self._publish_drop_report(sub)  # the last words about this subscription
        self._subs.remove(sub)
        self._names.discard(sub.name)
        self._routes.clear()
        sub.discarded += sub._clear()
        sub._release()
        sub._bus = None
        sub._input_closed = True
        if sub._cancel_scope is not None:
            sub._cancel_scope.cancel()
        self._wake_sub(sub)

    @property
    def subscriptions(self) -> tuple[Subscription, ...]:
        """The live subscriptions, in subscription order."""
        return tuple(self._subs)

    # -- publishing ----------------------------------------------------------------------------

    def publish_nowait(self, event: Event, /) -> None:
        """Accept *event* for delivery; never blocks, never awaits, O(1) whatever the fan-out.

        Delivery happens when the event loop next runs the dispatcher (at your next ``await``).

        Raises:
            BusClosedError: if the bus is not running (not entered yet, closing or closed).
            TypeError: if *event* is not an :class:`Event`.
        """
        # The hot path: two attribute reads, one isinstance, one append. The dispatcher is
        # woken once per burst (the first publish after it went idle). The wake is
        # _wake_dispatcher inlined: the call costs ~50 ns of an isolated publish's 1 µs budget
        # (benchmarks/bench_publish.py).
        if self._accepting and isinstance(event, Event):
            self._buffer.append(event)
            if not self._wake_pending:
                self._wake_pending = True
                wake = self._wake
                if wake is not None:
                    self._wake = None
                    try:
                        wake()
                    except asyncio.InvalidStateError:  # the dispatcher's wait was cancelled
                        pass
            return
        if not self._accepting:
            raise BusClosedError(self._closed_message())
        raise TypeError(_not_event_message(event))

    def publish_many_nowait(self, events: Iterable[Event], /) -> None:
        """Accept a batch of events, in order, with one wake-up of the dispatcher.

        Raises:
            BusClosedError: if the bus is not running.
            TypeError: if an item is not an :class:`Event` (nothing of the batch is accepted).
        """
        if self._state is not _State.RUNNING:
            raise BusClosedError(self._closed_message())
        batch = list(events)
        for event in batch:
            if not isinstance(event, Event):
                raise TypeError(_not_event_message(event))
        self._buffer.extend(batch)
        self._wake_dispatcher()

    async def publish(self, event: Event, /) -> None:
        """Like :meth:`publish_nowait`, plus a checkpoint so that subscribers get to run.

        If a flow-controlled sink (the canonical log) is behind, waits until it caught up:
        the publisher is slowed to the sink's pace rather than the log losing events (see
        :meth:`subscribe`); a sink that stops making progress never holds it for long.
        """
        self.publish_nowait(event)
        if self._pressing:
            await self._wait_for_room()
        await anyio.lowlevel.checkpoint()

    async def _wait_for_room(self) -> None:
        """Wait while a flow-controlled sink is over its high-water mark and making progress."""
        while self._pressing and self._state is _State.RUNNING:
            now = time.monotonic()
            oldest = now
            for sub in self._subs:
                if sub._pressing:
                    if now - sub._last_progress >= FLOW_STALL_TIMEOUT:
                        sub._release()
                        sub._stalled = True  # until it completes a batch
                        _log.warning("flow_control_released", sink=sub.name)
                    else:
                        oldest = min(oldest, sub._last_progress)
            if not self._pressing:
                return
            with anyio.move_on_after(oldest + FLOW_STALL_TIMEOUT - now):
                await self._await_progress()

    def publish_threadsafe(self, event: Event, /, *, wake: bool = True) -> None:
        """Accept *event* from any thread (autograd engine threads, a sync training loop).

        Never blocks and never waits for the event loop: the event goes into a thread-safe
        queue that the dispatcher empties in batches; a burst of publishes costs one
        cross-thread wake-up. With ``wake=False`` the event waits for the next wake-up (the next
        publish with ``wake=True``, :meth:`wake_threadsafe`, or any dispatch).

        Raises:
            BusClosedError: if the bus is not running.
            TypeError: if *event* is not an :class:`Event`.
        """
        if self._state is not _State.RUNNING:
            raise BusClosedError(self._closed_message())
        if not isinstance(event, Event):
            raise TypeError(_not_event_message(event))
        self._thread_queue.append(event)
        if wake and not self._thread_wake_pending:
            self.wake_threadsafe()

    def wake_threadsafe(self) -> None:
        """From any thread: have the dispatcher pick up the events published from threads."""
        self._thread_wake_pending = True
        schedule = self._call_soon_threadsafe
        if schedule is None:
            return
        try:
            schedule(self._wake_dispatcher)
        except RuntimeError:  # the event loop is gone: the bus is closing or closed
            self._thread_wake_pending = False
            raise BusClosedError(self._closed_message()) from None

    # -- waiting -------------------------------------------------------------------------------

    async def drain(self, *subscriptions: Subscription, timeout: float | None = None) -> None:
        """Return once every event published before the call was handled by every subscriber.

        "Handled" means the sink returned or raised (a failure counts as handled), or the event
        was shed. Disabled sinks are skipped. Pass subscriptions to wait for those only (a
        recovery safe point waits for its engine, not for a slow report writer).

        Raises:
            TimeoutError: if *timeout* seconds pass first.
            BusClosedError: if the bus was never started.
        """
        if self._state is _State.NEW:
            msg = "drain() needs a running bus; use `async with EventBus() as bus:`"
            raise BusClosedError(msg)
        self._pull_thread_events()
        target = self._seq + len(self._buffer)
        subs = subscriptions or None
        with anyio.fail_after(timeout):
            while not self._drained_up_to(target, subs):
                if self._state is _State.CLOSED:
                    return
                progress = self._progress
                if progress is None:
                    progress = self._progress = _AnyioWaiter()  # shared by many waiters
                self._wake_dispatcher()
                await progress.wait()
        await anyio.lowlevel.checkpoint()

    def _drained_up_to(self, target: int, subs: tuple[Subscription, ...] | None) -> bool:
        if self._seq < target:
            return False
        for sub in subs if subs is not None else self._subs:
            if not sub._idle_up_to(target):
                return False
        return True

    def has_undispatched(self, *event_types: type[Event]) -> bool:
        """Whether an event of *event_types* (any, when none) was published but not dispatched.

        Cheap (no await): it looks at the publisher-side buffers only. Events published from
        other threads count as undispatched until the dispatcher picks them up. A safe point
        uses it to skip a drain when nothing it cares about is in flight.
        """
        if self._thread_queue:
            if not event_types:
                return True
            if any(isinstance(e, event_types) for e in tuple(self._thread_queue)):
                return True
        if not event_types:
            return bool(self._buffer)
        return any(isinstance(e, event_types) for e in self._buffer)

    def statistics(self) -> BusStatistics:
        """A snapshot of the bus's counters and of every subscription's."""
        return BusStatistics(
            published=self._seq + len(self._buffer) + len(self._thread_queue),
            dispatched=self._seq,
            pending=len(self._buffer) + len(self._thread_queue),
            closed=self.closed,
            subscriptions=tuple(s.statistics() for s in self._subs),
        )

    # -- the dispatcher ------------------------------------------------------------------------

    def _wake_dispatcher(self) -> None:
        if not self._wake_pending:
            self._wake_pending = True
            wake = self._wake
            if wake is not None:
                self._wake = None
                try:
                    wake()
                except asyncio.InvalidStateError:  # the dispatcher's wait was just cancelled
                    pass

    def _wake_sub(self, sub: Subscription) -> None:
        waiter = sub._waiter
        if waiter is not None:
            sub._waiter = None
            waiter.set()

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

    def _publish_internal(self, event: Event) -> None:
        """Publish from inside the bus (failures, drop reports), also while closing."""
        if self._state is _State.CLOSED:
            return
        self._buffer.append(event)
        self._wake_dispatcher()

    async def _dispatch_loop(self) -> None:
        scope = self._dispatcher_scope
        assert scope is not None
        try:
            with scope:  # shielded: only aclose stops the dispatcher
                await self._dispatch_forever()
        finally:
            if self._dispatcher_done is not None:
                self._dispatcher_done.set()

    async def _dispatch_forever(self) -> None:
        while True:
            self._pull_thread_events()
            if self._buffer:
                self._dispatch()
                self._signal_progress()
                await anyio.lowlevel.checkpoint()
                continue
            if self._stop_dispatcher:
                break
            unreported = self._report_drops(force=self._state is not _State.RUNNING)
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
            if sub._staged_incidents or sub._staged_telemetry:
                shed += sub._take_staged()
        if shed:
            self._report_drops(force=False)

    def _resolve(self, cls: type[Event]) -> _Route:
        subs = tuple(s for s in self._subs if not s.disabled and s.accepts(cls))
        incident = cls.delivery is Delivery.INCIDENT
        route = _Route(
            subs=subs,
            appends=tuple(
                (s._staged_incidents if incident else s._staged_telemetry).append for s in subs
            ),
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
        if sub.shed == sub.shed_unreported:
            _log.warning("events_shed", sink=sub.name, capacity=sub.capacity)
        self._publish_internal(
            EventsDropped(
                source="eventbus",
                sink=sub.name,
                dropped=sub.shed_unreported,
                total_dropped=sub.shed,
                by_kind=dict(sub.shed_by_kind),
            )
        )
        sub.shed_unreported = 0
        sub.shed_by_kind.clear()

    # -- the pumps -----------------------------------------------------------------------------

    def _start_pump(self, sub: Subscription) -> None:
        assert self._tg is not None
        sub._done = anyio.Event()
        sub._stall_window_start = time.monotonic()
        self._tg.start_soon(self._pump, sub, name=f"eventbus-sink-{sub.name}")

    async def _pump(self, sub: Subscription) -> None:
        adapter = sub._adapter
        timed = self._stall_threshold is not None
        try:
            # Shielded: cancelling the scope around the bus must not kill delivery; only the
            # bus cancels a pump (a sink still busy at the close deadline, an unsubscribe).
            with anyio.CancelScope(shield=True) as scope:
                sub._cancel_scope = scope
                if adapter.start is not None:
                    try:
                        if timed:
                            await _Timed(adapter.start(), self, sub)
                        else:
                            await adapter.start()
                    except Exception as exc:
                        self._record_failure(sub, exc, None)
                while True:
                    if sub.disabled or not (sub._incidents or sub._telemetry):
                        if sub.disabled:
                            sub.discarded += sub._clear()
                            sub._release()
                        self._signal_progress()
                        if sub._input_closed:
                            break
                        waiter = sub._waiter = self._new_waiter()
                        await waiter.wait()
                        continue
                    if adapter.handle_batch is not None:
                        items = sub._take_batch(MAX_BATCH)
                        n = len(items)
                        sub._inflight_min_seq = items[0].seq
                        sub._inflight_n = n
                        events = items
                        try:
                            if timed:
                                await _Timed(adapter.handle_batch(events), self, sub)
                            else:
                                await adapter.handle_batch(events)
                        except Exception as exc:
                            sub.failed += n
                            self._record_failure(sub, exc, events[0])
                        else:
                            sub.delivered += n
                            sub._consecutive = 0
                        sub._inflight_n = 0
                        self._after_batch(sub)
                    else:
                        handle = adapter.handle
                        assert handle is not None
                        # One event at a time, up to a round of HANDLE_ROUND before yielding.
                        for _ in range(min(sub._queued(), HANDLE_ROUND)):
                            if sub.disabled or not (sub._incidents or sub._telemetry):
                                break
                            event = sub._pop()
                            sub._inflight_min_seq = event.seq
                            sub._inflight_n = 1
                            try:
                                if timed:
                                    await _Timed(handle(event), self, sub)
                                else:
                                    await handle(event)
                            except Exception as exc:
                                sub.failed += 1
                                self._record_failure(sub, exc, event)
                            else:
                                sub.delivered += 1
                                sub._consecutive = 0
                            sub._inflight_n = 0
                            if self._progress is not None:
                                self._signal_progress()
                        self._after_batch(sub)
                    # A sink that never awaits must still let the loop breathe.
                    await anyio.lowlevel.checkpoint()
        finally:
            sub._inflight_n = 0
            sub._release()
            if sub._done is not None:
                sub._done.set()
            self._signal_progress()

    def _after_batch(self, sub: Subscription) -> None:
        """Flow control bookkeeping after a batch; wakes drains and held-back publishers."""
        sub._stalled = False
        if sub._pressing:
            sub._last_progress = time.monotonic()
            if sub._queued() <= sub._low_water:
                sub._release()
        if self._progress is not None:
            self._signal_progress()

    def _note_holds(self, sub: Subscription, longest: float, total: float) -> None:
        """Account for how long one call of *sub* held the loop; report a stall if due."""
        threshold = self._stall_threshold
        if threshold is None:
            return
        now = time.monotonic()
        sub._stall_blocked += total
        if longest > sub._stall_longest:
            sub._stall_longest = longest
        window = now - sub._stall_window_start
        if longest >= threshold or (
            window >= STALL_WINDOW and sub._stall_blocked >= STALL_SHARE * window
        ):
            _log.warning(
                "sink_stalled_loop",
                sink=sub.name,
                stall_s=round(sub._stall_longest, 4),
                blocked_s=round(sub._stall_blocked, 4),
            )
            self._publish_internal(
                LoopStalled(
                    source="eventbus",
                    sink=sub.name,
                    stall_s=sub._stall_longest,
                    blocked_s=sub._stall_blocked,
                    window_s=max(window, longest),
                    threshold_s=threshold,
                )
            )
        elif window < STALL_WINDOW:
            return
        sub._stall_window_start = now
        sub._stall_blocked = 0.0
        sub._stall_longest = 0.0

    def _record_failure(self, sub: Subscription, exc: Exception, event: Event | None) -> None:
        sub._consecutive += 1
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        if sub._consecutive == 1:
            _log.warning(
                "sink_failed",
                sink=sub.name,
                error=f"{type(exc).__name__}: {exc}",
                event_kind=event.kind if event is not None else "start",
            )
        self._publish_internal(
            SinkFailed(
                source="eventbus",
                step=event.step if event is not None else None,
                sink=sub.name,
                error_type=type(exc).__qualname__,
                message=str(exc),
                traceback=tb,
                event_kind=event.kind if event is not None else "",
                event_seq=event.seq if event is not None else -1,
                consecutive_failures=sub._consecutive,
            )
        )
        if sub._consecutive >= self._max_failures and not sub.disabled:
            sub.disabled = True
            discarded = sub._clear()
            sub.discarded += discarded
            sub._release()
            self._routes.clear()
            reason = f"{sub._consecutive} consecutive failures, last: {type(exc).__name__}: {exc}"
            _log.error("sink_disabled", sink=sub.name, reason=reason)
            self._publish_internal(
                SinkDisabled(
                    source="eventbus",
                    sink=sub.name,
                    reason=reason,
                    consecutive_failures=sub._consecutive,
                    discarded=discarded,
                )
            )

    # -- closing -------------------------------------------------------------------------------

    async def _drain_for_close(self) -> list[Subscription]:
        """Deliver everything; return the subscriptions still busy when the timeout fired."""
        self._pull_thread_events()
        with anyio.move_on_after(self._close_timeout):
            while True:
                self._pull_thread_events()
                self._report_drops(force=True)
                target = self._seq + len(self._buffer)
                if self._drained_up_to(target, None) and not self._buffer:
                    if not self._thread_queue and not any(s.shed_unreported for s in self._subs):
                        return []
                await self._await_progress()
        target = self._seq + len(self._buffer)
        return [s for s in self._subs if not s._idle_up_to(target)]

    async def _await_progress(self) -> None:
        progress = self._progress
        if progress is None:
            progress = self._progress = _AnyioWaiter()  # shared by many waiters
        self._wake_dispatcher()
        await progress.wait()

    def _report_undelivered(self, hung: list[Subscription]) -> None:
        """Abandon the sinks still busy at the deadline and report what they lost."""
        for sub in hung:
            lost = sub._clear() + sub._inflight_n
            sub.undelivered += lost
            sub._release()
            sub._input_closed = True
            if sub._cancel_scope is not None:
                sub._cancel_scope.cancel()
            abandoned = bool(getattr(sub.sink, "thread_busy", False))
            _log.error(
                "close_timed_out",
                sink=sub.name,
                undelivered=lost,
                timeout_s=self._close_timeout,
                thread_abandoned=abandoned,
            )
            self._publish_internal(
                EventsUndelivered(
                    source="eventbus",
                    sink=sub.name,
                    undelivered=lost,
                    timeout_s=self._close_timeout,
                )
            )
            self._publish_internal(
                SinkUnresponsive(
                    source="eventbus",
                    sink=sub.name,
                    phase="drain",
                    waited_s=self._close_timeout,
                    thread_abandoned=abandoned,
                )
            )

    async def _close_one(self, sub: Subscription, deadline: float, hung: bool) -> None:
        """Deliver what is left to *sub* (the reports about the sinks closed before it), stop
        its task and close it, each step bounded by the deadline (at least CLOSE_GRACE)."""
        if not hung and not sub.disabled:
            with anyio.move_on_after(max(deadline - time.monotonic(), CLOSE_GRACE)):
                while True:
                    self._pull_thread_events()
                    target = self._seq + len(self._buffer)
                    if self._drained_up_to(target, (sub,)):
                        break
                    await self._await_progress()
        sub._input_closed = True
        self._wake_sub(sub)
        done = sub._done
        if done is not None and not done.is_set():
            with anyio.move_on_after(CLOSE_GRACE):
                await done.wait()
            if not done.is_set() and sub._cancel_scope is not None:
                lost = sub._clear() + sub._inflight_n
                if lost:
                    sub.undelivered += lost
                    self._publish_internal(
                        EventsUndelivered(
                            source="eventbus",
                            sink=sub.name,
                            undelivered=lost,
                            timeout_s=self._close_timeout,
                        )
                    )
                sub._cancel_scope.cancel()
                with anyio.move_on_after(CLOSE_GRACE):
                    await done.wait()
        aclose = sub._adapter.aclose
        if aclose is None or sub._sink_closed:
            return
        sub._sink_closed = True
        budget = max(deadline - time.monotonic(), CLOSE_GRACE)
        with anyio.move_on_after(budget) as scope:
            try:
                result = aclose()
                if inspect.isawaitable(result):
                    await result
            except Exception as exc:
                _log.warning(
                    "sink_close_failed",
                    sink=sub.name,
                    error=f"{type(exc).__name__}: {exc}",
                    exc_info=True,
                )
                self._publish_internal(
                    SinkCloseFailed(
                        source="eventbus",
                        sink=sub.name,
                        error_type=type(exc).__qualname__,
                        message=str(exc),
                    )
                )
        if scope.cancelled_caught:
            abandoned = bool(getattr(sub.sink, "thread_busy", False))
            _log.error(
                "sink_close_timed_out",
                sink=sub.name,
                timeout_s=round(budget, 3),
                thread_abandoned=abandoned,
            )
            self._publish_internal(
                SinkUnresponsive(
                    source="eventbus",
                    sink=sub.name,
                    phase="close",
                    waited_s=budget,
                    thread_abandoned=abandoned,
                )
            )

    def _closed_message(self) -> str:
        if self._state is _State.NEW:
            return "the bus is not running yet; publish inside `async with EventBus() as bus:`"
        return "the bus is closed; events can no longer be published to it"


class _Timed:
    """Awaits a sink's coroutine, timing each synchronous slice of it (between two awaits).

    A slice is time the event loop was held by the sink: nothing else (training included) ran.
    The longest slice and their total go to :meth:`EventBus._note_holds` when the call ends.
    """

    __slots__ = ("_bus", "_coro", "_sub")

    def __init__(self, coro: Awaitable[Any], bus: EventBus, sub: Subscription) -> None:
        self._coro = coro
        self._bus = bus
        self._sub = sub

    def __await__(self) -> Generator[Any, Any, Any]:
        coro = self._coro
        if not inspect.iscoroutine(coro):  # an awaitable object: not timed
            return (yield from coro.__await__())
        send = coro.send
        clock = time.perf_counter
        longest = 0.0
        total = 0.0
        value: Any = None
        error: BaseException | None = None
        try:
            while True:
                t0 = clock()
                try:
                    if error is None:
                        yielded = send(value)
                    else:
                        err, error = error, None
                        yielded = coro.throw(err)
                except StopIteration as stop:
                    dt = clock() - t0
                    total += dt
                    longest = max(longest, dt)
                    return stop.value
                dt = clock() - t0
                total += dt
                if dt > longest:
                    longest = dt
                try:
                    value = yield yielded
                except GeneratorExit:
                    coro.close()
                    raise
                except BaseException as exc:  # a cancellation: hand it to the sink
                    error = exc
                    value = None
        finally:
            self._bus._note_holds(self._sub, longest, total)


class _Waiter(Protocol):
    """A one-shot wake-up: ``set()`` from the loop's thread, ``await wait()`` in one task.

    ``trigger`` is ``set`` without its safety check: the cheapest call that wakes the waiter,
    which may raise :class:`asyncio.InvalidStateError` if the wait was cancelled.
    """

    @property
    def trigger(self) -> Callable[[], object]: ...

    def set(self) -> None: ...

    def wait(self) -> Awaitable[Any]: ...


class _AnyioWaiter:
    """The portable waiter (any anyio backend)."""

    __slots__ = ("_event", "trigger")

    def __init__(self) -> None:
        self._event = anyio.Event()
        self.trigger = self._event.set

    def set(self) -> None:
        self._event.set()

    def wait(self) -> Awaitable[Any]:
        return self._event.wait()


class _FutureWaiter:
    """The asyncio waiter: a bare future, about 20x cheaper to create than ``anyio.Event``.

    Awaiting a future inside an anyio task keeps cancel-scope semantics (a cancelled task
    cancels the future it awaits). Only for a waiter awaited by ONE task (the dispatcher, a
    pump) and never reused after a wait: a cancelled waiter of a shared future would wake
    every other waiter with the cancellation.
    """

    __slots__ = ("_future", "trigger")

    def __init__(self, future: asyncio.Future[None]) -> None:
        self._future = future
        self.trigger = functools.partial(future.set_result, None)

    def set(self) -> None:
        future = self._future
        if not future.done():
            future.set_result(None)

    def wait(self) -> Awaitable[Any]:
        return self._future


def _waiter_factory() -> Callable[[], _Waiter]:
    """The cheapest waiter for the running backend."""
    token = anyio.lowlevel.current_token().native_token
    if isinstance(token, asyncio.AbstractEventLoop):
        create_future = token.create_future
        return lambda: _FutureWaiter(create_future())
    return _AnyioWaiter


def _threadsafe_scheduler() -> Callable[[Callable[[], object]], object] | None:
    """A non-blocking "run this on the bus's event loop soon" for the running backend."""
    token = anyio.lowlevel.current_token().native_token
    call_soon = getattr(token, "call_soon_threadsafe", None)  # asyncio loop
    if call_soon is not None:
        return call_soon  # type: ignore[no-any-return]
    run_soon = getattr(token, "run_sync_soon", None)  # trio token
    return run_soon  # type: ignore[no-any-return]


def _default_name(sink: object) -> str:
    name = getattr(sink, "name", None)
    if isinstance(name, str) and name:
        return name
    qualname = getattr(sink, "__qualname__", None)
    if isinstance(qualname, str):
        return qualname
    return type(sink).__name__


def _not_event_message(obj: object) -> str:
    return (
        f"only Event instances can be published, got {type(obj).__name__}; "
        "build a typed event (e.g. StepCompleted(step=..., loss=...))"
    )


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        msg = f"{name} must be a positive integer, got {value!r}"
        raise ValueError(msg)


def _check_positive_float(name: str, value: object) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        msg = f"{name} must be a positive number of seconds, got {value!r}"
        raise ValueError(msg)
