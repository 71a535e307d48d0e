"""The event bus: one cheap buffer on the publisher's side, fan-out in a dispatcher task.

Publishing appends to one list and wakes the dispatcher at most once per burst; the dispatcher
stamps sequence numbers and offers each event to the bounded queue of every matching
subscription (see :mod:`.subscription`); one task per subscription drains its queue into the
sink. A slow, raising or hanging sink therefore only ever affects its own queue.
"""

from __future__ import annotations

import asyncio
import collections
import math
import os
import sys
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Sized
from dataclasses import dataclass
from enum import Enum
from types import TracebackType
from typing import Final, final

import anyio
import anyio.lowlevel
from anyio.abc import TaskGroup
from typing_extensions import Self

from .._validate import non_negative, positive_int, positive_seconds
from ..diagnostics import get_logger
from ..events import SELF_EXCLUDING, Anomaly, Delivery, Event, has_incident, refresh_rank
from ..exceptions import BusClosedError, SubscriptionError
from ..threads import threadsafe_scheduler
from . import subscription as _subscription
from ._adapter import SinkAdapter, default_name
from ._waiters import AnyioWaiter, Waiter, waiter_factory
from .statistics import BusStatistics
from .subscription import Subscription

if sys.version_info < (3, 11):  # pragma: no cover - anyio depends on the backport there
    from exceptiongroup import BaseExceptionGroup

__all__ = ("EventBus", "check_subscriptions")

_log = get_logger(__name__)

DEFAULT_CAPACITY: Final = 1024
DEFAULT_CLOSE_TIMEOUT: Final = 30.0
DEFAULT_MAX_CONSECUTIVE_FAILURES: Final = 5
DEFAULT_DROP_REPORT_INTERVAL: Final = 1.0
DEFAULT_STALL_THRESHOLD: Final = 0.25
DISPATCH_ROUND: Final = 4096
"""The dispatcher yields to the event loop after fanning out at most this many events."""
OWN_TASKS_FAILED: Final = (
    "the EventBus's own tasks failed (its dispatcher, or a sink's task: a sink raising a "
    "BaseException that is not an Exception); the block's exception, if any, comes first"
)
"""The message of the group raised on leaving the bus when its own tasks failed."""
HOLD_MAX: Final = 512
"""With a ``telemetry_latency``, this many waiting events are dispatched without waiting more."""
_INCIDENT: Final = Delivery.INCIDENT


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


@final
class EventBus:
    """Routes published events to subscribers; one bounded queue and task per subscriber.

    Use it as ``async with EventBus() as bus:``. Leaving the block stops accepting events,
    drains every queue, then closes sinks in reverse subscription order; the whole close is
    bounded (see :meth:`aclose`), also when the caller's scope is cancelled.

    Exceptions: whatever the block raises leaves it as itself, never wrapped in an
    ``ExceptionGroup`` (the bus's task group stays inside): ``except ValueError`` around the
    block catches a ``ValueError`` from it, the bus's own errors (``SubscriptionError``,
    ``TypeError``, ``TimeoutError`` from :meth:`drain`) included; ``KeyboardInterrupt`` and
    ``SystemExit`` keep their meaning (``sys.exit(3)`` exits with 3), and a cancellation goes on
    propagating after the close. A group comes out only if the bus's own tasks failed (its
    dispatcher, or a sink raising a ``BaseException`` that is not an ``Exception``): an
    ``ExceptionGroup`` (a ``BaseExceptionGroup`` if one of them is not an ``Exception``;
    message ``OWN_TASKS_FAILED``) holding the block's exception first, if it raised one, then
    those failures, which are also logged (``bus_task_failed``). A ``KeyboardInterrupt`` or
    ``SystemExit``, from the block or a sink, is never wrapped.

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
        telemetry_latency: the longest, in seconds, a telemetry event may wait so that a
            steady stream of them is fanned out in batches (one dispatch and one turn of each
            sink's task per batch instead of per event). ``0`` (the default): every event is
            dispatched at the publisher's next ``await``. Incidents never wait; neither does
            anything once :meth:`drain` is called or the bus closes, nor an event published
            after a quiet spell longer than the latency; at most ``HOLD_MAX`` (512) events
            wait. A :class:`~eventbus_debug.Session` builds its bus with 0.1 s.

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
        telemetry_latency: float = 0.0,
    ) -> None:
        self._capacity = positive_int("capacity", capacity)
        self._linger = non_negative("telemetry_latency", telemetry_latency)
        self._max_failures = positive_int("max_consecutive_failures", max_consecutive_failures)
        self._close_timeout = positive_seconds("close_timeout", close_timeout)
        self._drop_interval = positive_seconds("drop_report_interval", drop_report_interval)
        self._stall_threshold = (
            None
            if stall_threshold is None
            else positive_seconds("stall_threshold", stall_threshold)
        )
        self._pressing = 0  # flow-controlled subscriptions above their high-water mark

        self._state = _State.NEW
        # The publisher's path touches only these three attributes (see publish_nowait).
        self._accepting = False
        self._buffer: list[Event] = []
        # has_undispatched's tally: the incidents among the first _classified events of _buffer
        # (counted lazily there, so that publishing stays one append; reset at each dispatch).
        self._classified = 0
        self._buffered_incidents = 0
        self._incident_only: dict[tuple[type[Event], ...], bool] = {}
        self._wake_pending = False
        # With a telemetry latency: the dispatcher waits for more telemetry (see _hold).
        self._holding = False
        self._last_dispatch = -math.inf
        self._seq = 0
        self._wake: Callable[[], object] | None = None  # a waiter's trigger, see Waiter
        self._new_waiter: Callable[[], Waiter] = AnyioWaiter
        self._thread_queue: collections.deque[Event] = collections.deque()
        self._thread_wake_pending = False
        self._call_soon_threadsafe: Callable[[Callable[[], object]], object] | None = None
        self._subs: list[Subscription] = []
        self._routes: dict[type[Event], _Route] = {}
        self._tg: TaskGroup | None = None
        self._progress: Waiter | None = None
        self._last_drop_report = 0.0
        self._dispatcher_done: anyio.Event | None = None
        self._names: set[str] = set()
        self._stop_dispatcher = False
        self._dispatcher_scope: anyio.CancelScope | None = None
        self._forked_from: int | None = None  # in a forked child: the pid of the bus's process
        self.lost_in_fork = 0
        """Events published in a child process forked from this bus's (a ``DataLoader``
        worker), where nothing delivers them: counted here, in that child, and logged once."""

    # -- lifecycle -----------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        if self._state is not _State.NEW:
            msg = "an EventBus can be entered once; create a new one"
            raise RuntimeError(msg)
        refresh_rank()
        self._call_soon_threadsafe = threadsafe_scheduler()
        self._new_waiter = waiter_factory()
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        self._state = _State.RUNNING
        self._accepting = True
        _RUNNING_BUSES.add(self)
        self._dispatcher_done = anyio.Event()
        self._dispatcher_scope = anyio.CancelScope(shield=True)
        tg.start_soon(self._dispatch_loop, name="eventbus-dispatcher")
        for sub in self._subs:
            sub._start(tg, self._new_waiter)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        await self.aclose()
        tg = self._tg
        if tg is None:
            return None
        self._tg = None
        try:
            return await tg.__aexit__(exc_type, exc, tb)
        except BaseExceptionGroup as group:
            # anyio wraps whatever reaches its task group: the block's own exception and the
            # failures of the bus's tasks (the dispatcher, the sinks' pumps).
            failures = [e for e in group.exceptions if e is not exc]
        for failure in failures:
            _log.error("bus_task_failed", error=repr(failure), exc_info=failure)
        # A KeyboardInterrupt or SystemExit in a task of the bus (a sink calling sys.exit())
        # already left the event loop by itself (asyncio re-raises them there), and one raised
        # in the block wins over the bus's failures, as in asyncio.TaskGroup: never wrapped.
        failures = [e for e in failures if not isinstance(e, KeyboardInterrupt | SystemExit)]
        if not failures or isinstance(exc, KeyboardInterrupt | SystemExit):
            return False  # the block's exception (if any) propagates as itself, unwrapped
        body = [] if exc is None or isinstance(exc, anyio.get_cancelled_exc_class()) else [exc]
        raise BaseExceptionGroup(OWN_TASKS_FAILED, [*body, *failures]) from None

    async def aclose(self) -> None:
        """Stop accepting events, deliver everything queued, close the sinks. Idempotent.

        Bounded: every queue gets *close_timeout* seconds in total to drain. A sink still busy
        then is abandoned: its task is cancelled once and never waited for (a sink that
        shields itself, swallows the cancellation or waits on a thread that hangs finishes in
        the background, or never), and what it had left is counted once and reported by
        :class:`EventsUndelivered` and :class:`SinkUnresponsive` incidents, in
        ``statistics()`` and in the library's log. The sinks are then closed one by one in
        reverse order of subscription; the sinks not closed yet still receive the reports
        about the others (so the log, subscribed first, records them). Each sink gets what is
        left of the timeout, but at least ``CLOSE_GRACE`` (1 s), to take those reports, and
        again to close (an async close runs in a task of its own, a synchronous ``close()``
        in a daemon thread: both are abandoned when late). Worst case, whatever the sinks do:
        *close_timeout* plus two ``CLOSE_GRACE`` per sink and one for the bus's dispatcher; a
        sink that hangs in a call or in its close costs one. On trio (where the sinks' tasks
        run in the bus's task group) a sink that ignores cancellation still holds the close.

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
            for sub in await self._drain_for_close():
                sub._abandon(self._close_timeout)
            self._report_drops(force=True)  # the final reports, if the drain ran out of time
            for sub in reversed(list(self._subs)):
                await self._close_one(sub, deadline)
            self._stop_dispatcher = True
            self._wake_dispatcher()
            if self._dispatcher_done is not None:
                with anyio.move_on_after(_subscription.CLOSE_GRACE):
                    await self._dispatcher_done.wait()
                if not self._dispatcher_done.is_set() and self._dispatcher_scope is not None:
                    self._dispatcher_scope.cancel()
        self._state = _State.CLOSED
        _RUNNING_BUSES.discard(self)
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
            name = default_name(sink)
            base, n = name, 2
            while name in self._names:
                name, n = f"{base}-{n}", n + 1
        elif not isinstance(name, str) or not name:
            msg = f"name must be a non-empty string, got {name!r}"
            raise SubscriptionError(msg)
        elif name in self._names:
            msg = f"a subscription named {name!r} already exists; pass another name"
            raise SubscriptionError(msg)
        adapter = SinkAdapter(sink, name)
        types = tuple(t for t in event_types if t is not Event)
        if len(types) < len(event_types):
            types = ()
        sub = Subscription(
            self,
            sink,
            adapter,
            types,
            name,
            capacity,
            backpressure,
            max_failures=self._max_failures,
            close_timeout=self._close_timeout,
            stall_threshold=self._stall_threshold,
        )
        self._subs.append(sub)
        self._names.add(name)
        self._routes.clear()
        if self._state is _State.RUNNING:
            assert self._tg is not None
            sub._start(self._tg, self._new_waiter)
        return sub

    def _unsubscribe(self, sub: Subscription) -> None:
        if sub not in self._subs:
            return
        if sub.shed_unreported and self._state is not _State.CLOSED:
            self._publish_drop_report(sub)  # the last words about this subscription
        self._subs.remove(sub)
        self._names.discard(sub.name)
        self._routes.clear()
        sub._detach()

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
            elif self._holding and (event.delivery is _INCIDENT or len(self._buffer) >= HOLD_MAX):
                self._end_hold()
            return
        if not self._accepting:
            self._refuse(1)
            return
        raise TypeError(_not_event_message(event))

    def publish_many_nowait(self, events: Iterable[Event], /) -> None:
        """Accept a batch of events, in order, with one wake-up of the dispatcher.

        Raises:
            BusClosedError: if the bus is not running.
            TypeError: if an item is not an :class:`Event` (nothing of the batch is accepted).
        """
        if self._state is not _State.RUNNING:
            self._refuse(len(events) if isinstance(events, Sized) else 1)
            return
        batch = list(events)
        for event in batch:
            if not isinstance(event, Event):
                raise TypeError(_not_event_message(event))
        self._buffer.extend(batch)
        if not self._holding:
            self._wake_dispatcher()
        elif len(self._buffer) >= HOLD_MAX or has_incident(batch):
            self._end_hold()

    async def publish(self, event: Event, /) -> None:
        """Like :meth:`publish_nowait`, plus a checkpoint so that subscribers get to run.

        If a flow-controlled sink (the canonical log) is behind, waits until it caught up:
        the publisher is slowed to the sink's pace rather than the log losing events (see
        :meth:`subscribe`); a sink that stops making progress never holds it for long.

        Raises:
            BusClosedError: if the bus is not running (not entered yet, closing or closed).
            TypeError: if *event* is not an :class:`Event`.
        """
        self.publish_nowait(event)
        if self._pressing:
            await self._wait_for_room()
        await anyio.lowlevel.checkpoint()

    async def _wait_for_room(self) -> None:
        """Wait while a flow-controlled sink is over its high-water mark and making progress."""
        while self._pressing and self._state is _State.RUNNING:
            now = time.monotonic()
            deadlines = [d for s in self._subs if (d := s._flow_deadline(now)) is not None]
            if not self._pressing or not deadlines:
                return
            with anyio.move_on_after(min(deadlines) - now):
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
            self._refuse(1)
            return
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
            schedule(self._wake_for_threads)
        except RuntimeError:  # the event loop is gone: the bus is closing or closed
            self._thread_wake_pending = False
            raise BusClosedError(self._closed_message()) from None

    # -- waiting -------------------------------------------------------------------------------

    async def drain(self, *subscriptions: Subscription, timeout: float | None = None) -> None:
        """Return once every event published before the call was handled by every subscriber.

        "Handled" means the sink returned or raised (a failure counts as handled), or the event
        was shed. Disabled sinks are skipped. Pass subscriptions to wait for those only (a
        recovery safe point waits for its engine, not for a slow report writer).

        *timeout* is ``None`` (wait as long as it takes) or a finite number of seconds >= 0
        (``0``: only check that everything is handled already).

        Raises:
            TimeoutError: if *timeout* seconds pass first.
            TypeError: if a positional argument is not a :class:`Subscription`.
            ValueError: if *timeout* is not None nor a finite number >= 0 (NaN, negative,
                infinite; a bool or a string is an ArgumentTypeError, both a ValueError and a
                TypeError), or a subscription is another bus's.
            BusClosedError: if the bus was never started.
        """
        if timeout is not None:
            timeout = non_negative("timeout", timeout)
        check_subscriptions(subscriptions, self)
        if self._state is _State.NEW:
            msg = "drain() needs a running bus; use `async with EventBus() as bus:`"
            raise BusClosedError(msg)
        self._pull_thread_events()
        target = self._seq + len(self._buffer)
        subs = subscriptions or None
        with anyio.move_on_after(timeout) as scope:
            while not self._drained_up_to(target, subs):
                if self._state is _State.CLOSED:
                    return
                await self._await_progress()
        if scope.cancelled_caught:
            raise TimeoutError(self._drain_timed_out(timeout, target, subs))
        await anyio.lowlevel.checkpoint()

    def _drain_timed_out(
        self, timeout: float | None, target: int, subs: tuple[Subscription, ...] | None
    ) -> str:
        """What a drain that timed out still waited for, in words."""
        busy = [
            f"sink {s.name!r} ({s.pending} pending)"
            for s in (subs if subs is not None else self._subs)
            if not s._idle_up_to(target)
        ]
        if self._seq < target:
            busy.append(f"{target - self._seq} events not dispatched yet")
        return f"drain() timed out after {timeout:g} s, waiting for: {', '.join(busy)}"

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

        When every type asked for is an incident class (``delivery`` is
        ``Delivery.INCIDENT``, for the class and its subclasses, as for ``Anomaly``) and no
        incident is in flight, the answer comes from a tally of the buffer's incidents, which
        looks at each published event once (a few hundred ns per call at one call and a few
        events per training step). Otherwise it scans the buffer.
        """
        if self._thread_queue:
            if not event_types:
                return True
            if any(isinstance(e, event_types) for e in tuple(self._thread_queue)):
                return True
        buffer = self._buffer
        if not buffer:
            return False
        if not event_types:
            return True
        if not self._buffered_incident_count():
            incident_only = self._incident_only.get(event_types)
            if incident_only is None:
                incident_only = self._incident_only[event_types] = _all_incidents(event_types)
            if incident_only:
                return False
        return any(isinstance(e, event_types) for e in buffer)

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
            self._trigger()
        elif self._holding:
            self._end_hold()

    def _end_hold(self) -> None:
        """Stop the dispatcher's wait for more telemetry: dispatch now."""
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
        if len(queued) + len(self._buffer) >= HOLD_MAX or has_incident(queued):
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

    # -- the subscriptions' side (see subscription._Owner) -----------------------------------

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

    # -- closing -------------------------------------------------------------------------------

    async def _drain_for_close(self) -> list[Subscription]:
        """Deliver everything; return the subscriptions still busy when the timeout fired.

        Telemetry shed meanwhile is reported as while running (at most one
        :class:`EventsDropped` per sink per *drop_report_interval*), plus a final report once
        everything else was delivered.
        """
        self._pull_thread_events()
        with anyio.move_on_after(self._close_timeout):
            while True:
                self._pull_thread_events()
                target = self._close_target()
                if self._drained_up_to(target, None) and self._seq == target:
                    if self._thread_queue:
                        continue
                    if not any(s.shed_unreported for s in self._subs):
                        return []
                    self._report_drops(force=True)
                    continue
                await self._await_progress()
        target = self._close_target()
        return [s for s in self._subs if not s._idle_up_to(target)]

    def _close_target(self) -> int:
        """The seq a close waits for: every event published, or, once the dispatcher is gone
        before its time (it crashed: leaving the bus raises the crash), what it dispatched."""
        done = self._dispatcher_done
        if done is not None and done.is_set() and not self._stop_dispatcher:
            return self._seq
        return self._seq + len(self._buffer)

    async def _await_progress(self) -> None:
        progress = self._progress
        if progress is None:
            progress = self._progress = AnyioWaiter()  # shared by many waiters
        self._wake_dispatcher()
        await progress.wait()

    async def _close_one(self, sub: Subscription, deadline: float) -> None:
        """Deliver what is left to *sub* (the reports about the sinks closed before it) and
        stop its task, then close it; each step within what is left until *deadline*, but at
        least ``CLOSE_GRACE`` (a sink still busy then is abandoned)."""
        stop_by = max(deadline, time.monotonic() + _subscription.CLOSE_GRACE)
        if not sub._stopped and not sub.disabled:
            with anyio.move_on_after(stop_by - time.monotonic()):
                while True:
                    self._pull_thread_events()
                    target = self._close_target()
                    if self._drained_up_to(target, (sub,)):
                        break
                    await self._await_progress()
        await sub._shutdown(stop_by, deadline)

    def _mark_forked(self, parent: int) -> None:
        """This is a copy of the bus in a forked child process: no event loop delivers its
        events here. The publishers' paths check nothing more: they see a closed bus, and
        :meth:`_refuse` counts what they publish and says so once (never raises: a data
        loader worker that reports something must not stop the training)."""
        self._forked_from = parent
        self._accepting = False
        self._state = _State.CLOSED
        self._call_soon_threadsafe = None

    def _refuse(self, count: int) -> None:
        """A publish the bus cannot take: a :class:`BusClosedError`, except in a forked child.

        In a child process forked from the bus's (a ``DataLoader`` worker) the events cannot
        reach the bus: they are counted in :attr:`lost_in_fork` and the first is logged once
        (a warning of the library's logger naming the cause and the way out) instead of
        raising inside the user's dataset, which would stop the training.
        """
        if self._forked_from is None:
            raise BusClosedError(self._closed_message())
        self.lost_in_fork += count
        if self.lost_in_fork == count:
            _log.warning("events_lost_in_forked_child", detail=self._closed_message())

    def _closed_message(self) -> str:
        if self._forked_from is not None:
            return (
                f"this EventBus runs in process {self._forked_from}; this is a child process "
                f"({os.getpid()}) forked from it (a DataLoader worker?), where nothing delivers "
                "its events: they are lost (counted in lost_in_fork). Publish from the training "
                "process (return "
                "what the worker found with its sample, as "
                "eventbus_debug.recovery.SkipCorruptSamples does), or use num_workers=0"
            )
        if self._state is _State.NEW:
            return "the bus is not running yet; publish inside `async with EventBus() as bus:`"
        return "the bus is closed; events can no longer be published to it"


async def _reraise(exc: BaseException) -> None:
    raise exc


_RUNNING_BUSES: weakref.WeakSet[EventBus] = weakref.WeakSet()
"""The buses running in this process (entered, not closed): the ones a fork copies alive."""


def _after_fork_in_child() -> None:
    parent = os.getppid()
    for bus in list(_RUNNING_BUSES):
        bus._mark_forked(parent)
    _RUNNING_BUSES.clear()


if hasattr(os, "register_at_fork"):  # not on Windows, which cannot fork
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _not_event_message(obj: object) -> str:
    return (
        f"only Event instances can be published, got {type(obj).__name__}; "
        "build a typed event (e.g. StepCompleted(step=..., loss=...))"
    )


def _all_incidents(event_types: tuple[type[Event], ...]) -> bool:
    """Whether every event of *event_types* is an incident: each class and its subclasses."""
    stack = list(event_types)
    while stack:
        cls = stack.pop()
        if cls.delivery is not _INCIDENT:
            return False
        stack.extend(cls.__subclasses__())
    return True


def check_subscriptions(subscriptions: tuple[object, ...], bus: object) -> None:
    """Refuse what ``drain(*subscriptions)`` cannot wait for, naming it.

    Raises:
        TypeError: if an item is not a :class:`Subscription` (a sink, a name...).
        ValueError: if an item is a subscription of another bus.
    """
    for i, sub in enumerate(subscriptions):
        if not isinstance(sub, Subscription):
            msg = (
                f"drain()'s subscriptions must be Subscriptions that subscribe() returned, got "
                f"{type(sub).__qualname__} {sub!r} (argument {i + 1})"
            )
            raise TypeError(msg)
        if sub._bus is not None and sub._bus is not bus:
            msg = (
                f"drain()'s subscriptions must be this bus's, got subscription {sub.name!r} of "
                f"another bus (argument {i + 1})"
            )
            raise ValueError(msg)
