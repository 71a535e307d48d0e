"""The event bus: :class:`EventBus`, its constructor, entering and leaving it, and subscribing.

Publishing appends to one list and wakes the dispatcher at most once per burst; the dispatcher
stamps sequence numbers and offers each event to the bounded queue of every matching
subscription (see :mod:`.subscription`); one task per subscription drains its queue into the
sink. A slow, raising or hanging sink therefore only ever affects its own queue.

``EventBus`` is one class built in layers, one module each, each importing only the one below:
:mod:`._dispatch` (``BusDispatcher``: routing and the dispatcher task), :mod:`._publish`
(``BusPublishing``: the ``publish*`` methods), :mod:`._drain` (``BusDraining``: ``drain`` and the
bounded ``aclose``) and this module (the constructor, which sets the state every layer declares,
``async with``, ``subscribe`` and ``statistics``).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import math
import sys
import threading
import warnings
from collections.abc import Callable
from types import TracebackType
from typing import Final, final

import anyio
from typing_extensions import Self

from .._validate import non_negative, positive_int, positive_seconds
from ..diagnostics import get_logger
from ..events import Event, refresh_rank
from ..exceptions import BusClosedError, SubscriptionError
from ..threads import threadsafe_scheduler
from ._adapter import SinkAdapter, default_name
from ._dispatch import _State
from ._drain import BusDraining
from ._publish import _RUNNING_BUSES
from ._waiters import AnyioWaiter, checkpointer, waiter_factory
from .statistics import BusStatistics
from .subscription import Subscription

if sys.version_info < (3, 11):  # pragma: no cover - anyio depends on the backport there
    from exceptiongroup import BaseExceptionGroup

__all__ = ("EventBus",)

_log = get_logger(__name__)

DEFAULT_CAPACITY: Final = 1024
DEFAULT_CLOSE_TIMEOUT: Final = 30.0
DEFAULT_MAX_CONSECUTIVE_FAILURES: Final = 5
DEFAULT_DROP_REPORT_INTERVAL: Final = 1.0
DEFAULT_STALL_THRESHOLD: Final = 0.25
CROSS_THREAD_WAIT: Final = 1.0
"""Seconds a thread other than the bus's waits for the bus's loop to run a call it handed over
(:meth:`Subscription.cancel` from a ``SyncEventBus``'s training thread)."""
OWN_TASKS_FAILED: Final = (
    "the EventBus's own tasks failed (its dispatcher, or a sink's task: a sink raising a "
    "BaseException that is not an Exception); the block's exception, if any, comes first"
)
"""The message of the group raised on leaving the bus when its own tasks failed."""


def _sink_capacity(sink: object, name: str | None, hint: object) -> int:
    """A sink's own ``queue_capacity`` attribute, checked as the ``capacity`` argument is.

    Raises:
        ArgumentTypeError: if it is not an int (a bool, a float, a string...).
        ValueError: if it is below 1.
    """
    label = f"sink {name if isinstance(name, str) and name else default_name(sink)!r}"
    try:
        return positive_int(f"{label}: its queue_capacity attribute", hint)
    except ValueError as exc:  # ArgumentTypeError is a ValueError too
        msg = f"{exc} (None, or no such attribute, gives the bus's capacity)"
        raise type(exc)(msg) from None


@final
class EventBus(BusDraining):
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
        self._buffer = []
        # has_undispatched's tally: the incidents among the first _classified events of _buffer
        # (counted lazily there, so that publishing stays one append; reset at each dispatch).
        self._classified = 0
        self._buffered_incidents = 0
        self._incident_only = {}
        self._wake_pending = False
        # With a telemetry latency: the dispatcher waits for more telemetry (see _hold).
        self._holding = False
        self._last_dispatch = -math.inf
        self._seq = 0
        self._wake = None  # a waiter's trigger, see Waiter
        self._new_waiter = AnyioWaiter
        self._checkpoint = anyio.lowlevel.checkpoint
        self._thread_queue = collections.deque()
        self._thread_wake_pending = False
        self._call_soon_threadsafe = None
        self._after_close_lock = threading.Lock()
        self._after_close_logged = False
        self._subs = []
        self._routes = {}
        self._tg = None
        self._progress = None
        self._last_drop_report = 0.0
        self._dispatcher_done = None
        self._names: set[str] = set()
        self._stop_dispatcher = False
        self._dispatcher_scope = None
        self._forked_from = None  # in a forked child: the pid of the bus's process
        self._loop_ident = -1  # the event loop's thread, once entered (see publish_nowait)
        self._warned_thread = False
        self.lost_in_fork = 0
        """Events published in a child process forked from this bus's (a ``DataLoader``
        worker), where nothing delivers them: counted here, in that child, and logged once."""

    # -- lifecycle -----------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        if self._state is not _State.NEW:
            msg = "an EventBus can be entered once; create a new one"
            raise RuntimeError(msg)
        refresh_rank()
        self._loop_ident = threading.get_ident()
        self._call_soon_threadsafe = threadsafe_scheduler()
        self._new_waiter = waiter_factory()
        self._checkpoint = checkpointer()
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
        try:
            await self.aclose()
        except BaseException:
            # A sink's close raised KeyboardInterrupt or SystemExit (every sink was closed
            # anyway, see aclose): the task group is still left, its tasks being done (a task
            # group never left corrupts trio's run), and the interrupt goes on as itself.
            with contextlib.suppress(BaseException):
                await self._leave_task_group(exc_type, exc, tb)
            raise
        return await self._leave_task_group(exc_type, exc, tb)

    async def _leave_task_group(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
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
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            return False  # the block's own interrupt wins, unwrapped
        interrupts = [e for e in failures if isinstance(e, KeyboardInterrupt | SystemExit)]
        if interrupts:
            # A sink's task in the task group (trio) ended with it: it goes on as itself, as
            # on asyncio (where it leaves the event loop) and in asyncio.TaskGroup; never lost
            # behind the cancellation the task group delivered to the block.
            raise interrupts[0] from None
        if not failures:
            return False  # the block's exception (if any) propagates as itself, unwrapped
        body = [] if exc is None or isinstance(exc, anyio.get_cancelled_exc_class()) else [exc]
        raise BaseExceptionGroup(OWN_TASKS_FAILED, [*body, *failures]) from None

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
        an int >= 1, else the bus's when it is ``None`` or absent). With *backpressure* (default: the sink's ``backpressure`` attribute,
        else off) the sink is flow-controlled: while its queue is over half full, ``await
        bus.publish(...)`` waits until it is down to a quarter, so a publisher faster than
        the sink is slowed to the sink's pace instead of shedding. ``publish_nowait`` never
        waits; a full queue then sheds telemetry as for any sink. A flow-controlled sink that
        completes no batch for a second stops holding publishers back until it does.

        Raises:
            SubscriptionError: if *sink* is not usable, a type is not an :class:`Event`
                subclass, *capacity* is not a positive int, or *name* is already used.
            ArgumentTypeError: if the sink's ``queue_capacity`` attribute (used without
                *capacity*) is not an int nor ``None`` (a bool, a float, a string).
            ValueError: if that attribute is an int below 1 (the messages name the sink).
            BusClosedError: if the bus is closing or closed.
        """
        if self.closed:
            msg = "cannot subscribe: the bus is closed"
            raise BusClosedError(msg)
        if self._state is _State.RUNNING and threading.get_ident() != self._loop_ident:
            msg = (
                f"subscribe() was called from thread {threading.current_thread().name!r}, not "
                "the bus's event loop thread, where the sink's task starts; call it there "
                "(from a thread: anyio.from_thread.run_sync(bus.subscribe, sink)), or use "
                "SyncEventBus.subscribe"
            )
            raise RuntimeError(msg)
        for tp in event_types:
            if not (isinstance(tp, type) and issubclass(tp, Event)):
                msg = (
                    f"event_types must be Event subclasses, got {tp!r}; "
                    "pass classes such as StepCompleted (or Event for everything)"
                )
                raise SubscriptionError(msg)
        if capacity is None:
            hint = getattr(sink, "queue_capacity", None)
            capacity = self._capacity if hint is None else _sink_capacity(sink, name, hint)
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
        if self._state is not _State.NEW and threading.get_ident() != self._loop_ident:
            # Another thread (a SyncEventBus's training thread): the pump is stopped on the
            # bus's loop, whose tasks, waiters and cancel scopes are not thread-safe.
            if self._run_on_loop(functools.partial(self._unsubscribe, sub)):
                return
        if sub.shed_unreported and self._state is not _State.CLOSED:
            self._publish_drop_report(sub)  # the last words about this subscription
        self._subs.remove(sub)
        self._names.discard(sub.name)
        self._routes.clear()
        sub._detach()

    def _run_on_loop(self, fn: Callable[[], object]) -> bool:
        """From another thread: run *fn* on the bus's event loop and wait for it, at most
        ``CROSS_THREAD_WAIT`` (a loop held by a sink runs it when it turns again). False when
        the loop is gone (then *fn* is the caller's to run, nothing else runs on the loop)."""
        schedule = self._call_soon_threadsafe
        if schedule is None:
            return False
        done = threading.Event()

        def run() -> None:
            try:
                fn()
            except Exception as exc:  # a callback of the loop's: raising there crashes trio
                _log.error("bus_cross_thread_call_failed", error=repr(exc), exc_info=exc)
            finally:
                done.set()

        try:
            schedule(run)
        except RuntimeError:  # the event loop is gone
            return False
        if not done.wait(CROSS_THREAD_WAIT):
            _log.warning(
                "bus_loop_unresponsive",
                waited_s=CROSS_THREAD_WAIT,
                detail="the call runs on the bus's event loop when it next turns",
            )
        return True

    @property
    def subscriptions(self) -> tuple[Subscription, ...]:
        """The live subscriptions, in subscription order."""
        return tuple(self._subs)

    def statistics(self) -> BusStatistics:
        """A snapshot of the bus's counters and of every subscription's."""
        pending = self._undispatched()
        return BusStatistics(
            published=self._seq + pending,
            dispatched=self._seq,
            pending=pending,
            closed=self.closed,
            subscriptions=tuple(s.statistics() for s in self._subs),
        )
