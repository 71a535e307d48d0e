"""One subscriber: its bounded queue and shedding policy, its pump task and its failure count.

The bus (the subscription's *owner*) stages events for it, starts its pump, and asks it to
stop; everything about one sink's delivery (flow control, stalls of the event loop, failures,
disabling, the close of the sink) lives here.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import Any, Final, Protocol, final

import anyio
import anyio.lowlevel
from anyio.abc import TaskGroup
from typing_extensions import Self

from .._validate import positive_seconds
from ..diagnostics import get_logger
from ..events import (
    Event,
    EventsDropped,
    EventsUndelivered,
    SinkCloseFailed,
    SinkDisabled,
    SinkFailed,
    SinkUnresponsive,
)
from ..threads import run_in_daemon_thread, running_loop
from ._adapter import SinkAdapter, is_async_callable
from ._cancel import abandon, foreign_cancellation, retrieved, run_abandonable
from ._stalls import StallMeter, Timed
from ._waiters import Waiter
from .statistics import SubscriptionStatistics

__all__ = ("Subscription",)

_log = get_logger(__name__)

MAX_BATCH: Final = 4096
"""A ``handle_batch`` sink receives at most this many events per call."""
HANDLE_ROUND: Final = 64
"""A ``handle(event)`` sink yields to the event loop at least once per this many events."""
FLOW_STALL_TIMEOUT: Final = 1.0
"""A flow-controlled sink that completes no batch for this long stops holding publishers back."""
TASK_PREFIX: Final = "eventbus-sink-"
"""The name of a sink's task is this prefix and the subscription's name."""
CLOSE_GRACE: Final = 1.0
"""Seconds granted, once the close deadline passed, to each sink to take the last reports and
stop, then again to close it; and to the bus's dispatcher to stop."""


class _Owner(Protocol):
    """The bus, as seen by its subscriptions: where their reports go and whom they wake."""

    def _publish_internal(self, event: Event) -> None: ...

    def _signal_progress(self) -> None: ...

    def _unsubscribe(self, sub: Subscription) -> None: ...

    def _forget_routes(self) -> None: ...

    def _flow_changed(self, pressing: bool) -> None: ...

    def _task_failed(self, exc: BaseException) -> None: ...


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
        "_close_timeout",
        "_consecutive",
        "_done",
        "_high_water",
        "_incidents",
        "_inflight_min_seq",
        "_inflight_n",
        "_input_closed",
        "_last_progress",
        "_low_water",
        "_max_failures",
        "_pressing",
        "_sink_closed",
        "_staged_incidents",
        "_staged_telemetry",
        "_stalled",
        "_stalls",
        "_stopped",
        "_task",
        "_task_id",
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
        bus: _Owner,
        sink: object,
        adapter: SinkAdapter,
        event_types: tuple[type[Event], ...],
        name: str,
        capacity: int,
        backpressure: bool = False,
        *,
        max_failures: int,
        close_timeout: float,
        stall_threshold: float | None,
    ) -> None:
        self._bus: _Owner | None = bus
        self.sink = sink
        self._adapter = adapter
        self.event_types = event_types
        self.name = name
        self.capacity = capacity
        self.backpressure = backpressure
        self._max_failures = max_failures
        self._close_timeout = close_timeout
        self._stalls = None if stall_threshold is None else StallMeter(stall_threshold)
        self._high_water = max(1, capacity // 2)
        self._low_water = capacity // 4
        self._incidents: collections.deque[Event] = collections.deque()
        self._telemetry: collections.deque[Event] = collections.deque()
        # Filled by the dispatcher during one dispatch round, then moved into the queues at once.
        self._staged_incidents: list[Event] = []
        self._staged_telemetry: list[Event] = []
        self._waiter: Waiter | None = None
        self._input_closed = False
        self._inflight_min_seq = -1
        self._inflight_n = 0
        self._consecutive = 0
        self._cancel_scope: anyio.CancelScope | None = None
        self._task: asyncio.Task[None] | None = None  # the pump, on asyncio (see _start)
        self._task_id: int | None = None
        # The bus gave up on the pump (close deadline, unsubscribed): what it held is counted,
        # and the pump counts nothing more, whenever (if ever) the sink's call returns.
        self._stopped = False
        self._done: anyio.Event | None = None
        self._sink_closed = False
        self._pressing = False  # holding back `await publish` (flow control)
        self._stalled = False  # made no progress while pressing: released until it does
        self._last_progress = 0.0
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

    @property
    def pending(self) -> int:
        """Events queued for the sink or in its hands now (0: it has caught up). O(1).

        Events published but not dispatched yet are not counted: see
        :meth:`EventBus.has_undispatched`.
        """
        return len(self._incidents) + len(self._telemetry) + self._inflight_n

    def statistics(self) -> SubscriptionStatistics:
        """A snapshot of this subscription's counters."""
        return SubscriptionStatistics(
            name=self.name,
            capacity=self.capacity,
            queued=self.pending,
            delivered=self.delivered,
            failed=self.failed,
            shed=self.shed,
            discarded=self.discarded,
            undelivered=self.undelivered,
            disabled=self.disabled,
        )

    def cancel(self) -> None:
        """Stop delivering to this sink; queued events are discarded (and counted). Idempotent.

        An event in the sink's hands is counted as discarded too, and the sink's call is
        cancelled (never waited for), unless the sink cancels its own subscription: then its
        current call completes and counts. The sink's ``aclose`` is not called: the caller
        owns a sink it unsubscribed (see :meth:`close_sink`).
        """
        bus = self._bus
        if bus is not None:
            bus._unsubscribe(self)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.cancel()

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
        """
        staged_inc = self._staged_incidents
        staged_tel = self._staged_telemetry
        if not staged_inc and not staged_tel:
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

    def _idle_up_to(self, target: int) -> bool:
        """Whether every event numbered up to *target* was handled (or will never be)."""
        if self.disabled or self._stopped:
            return True
        if self._inflight_n and self._inflight_min_seq <= target:
            return False
        incidents = self._incidents
        telemetry = self._telemetry
        if incidents and incidents[0].seq <= target:
            return False
        return not telemetry or telemetry[0].seq > target

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

    # -- the pump --------------------------------------------------------------------------

    def _start(self, tg: TaskGroup, new_waiter: Callable[[], Waiter]) -> None:
        """Start the pump task that feeds the sink.

        On asyncio the pump is a task of its own, outside the bus's task group: the bus waits
        for it only as long as its close allows, and never has to join it (a sink that ignores
        cancellation cannot hold the close). Elsewhere it runs in *tg*.
        """
        self._done = anyio.Event()
        if self._stalls is not None:
            self._stalls.restart()
        name = f"{TASK_PREFIX}{self.name}"
        loop = running_loop()
        if loop is not None:
            self._task = loop.create_task(self._run(new_waiter), name=name)
            self._task.add_done_callback(retrieved)
        else:
            tg.start_soon(self._run, new_waiter, name=name)

    def _call(self, coro: Awaitable[Any]) -> Awaitable[Any]:
        return coro if self._stalls is None else Timed(coro, self._note_holds)

    async def _run(self, new_waiter: Callable[[], Waiter]) -> None:
        """The pump, and what its end means: a sink's ``BaseException`` that is neither an
        ``Exception`` nor a cancellation goes to the bus's task group, which raises it when
        the bus is left (see :meth:`EventBus.__aexit__`)."""
        self._task_id = anyio.get_current_task().id
        try:
            await self._pump(new_waiter)
        except anyio.get_cancelled_exc_class():
            raise  # ends the task (see _pump); a task group takes it as the cancellation it is
        except (KeyboardInterrupt, SystemExit):
            raise  # asyncio re-raises them from the event loop itself
        except BaseException as exc:
            bus = self._bus
            if self._task is None:
                raise  # in the bus's task group already
            if bus is not None:
                bus._task_failed(exc)
            else:
                _log.error("sink_task_failed", sink=self.name, error=repr(exc), exc_info=exc)

    async def _pump(self, new_waiter: Callable[[], Waiter]) -> None:
        adapter = self._adapter
        call = self._call
        try:
            # Shielded: cancelling the scope around the bus must not kill delivery; only the
            # bus cancels a pump (a sink still busy at the close deadline, an unsubscribe).
            with anyio.CancelScope(shield=True) as scope:
                self._cancel_scope = scope
                if adapter.start is not None:
                    try:
                        await call(adapter.start())
                    except Exception as exc:
                        if not self._stopped:
                            self._fail(exc, None)
                    except anyio.get_cancelled_exc_class() as exc:
                        if self._stopped or not foreign_cancellation():
                            raise
                        self._fail(exc, None)
                while not self._stopped:
                    if self.disabled or not (self._incidents or self._telemetry):
                        if self.disabled:
                            self.discarded += self._clear()
                            self._release()
                        self._signal_owner()
                        if self._input_closed:
                            break
                        waiter = self._waiter = new_waiter()
                        await waiter.wait()
                        continue
                    if adapter.handle_batch is not None:
                        await self._deliver_batch(adapter.handle_batch)
                    else:
                        handle = adapter.handle
                        assert handle is not None
                        await self._deliver_each(handle)
                    # A sink that never awaits must still let the loop breathe. Also when the
                    # queue is empty: on a loop that publishes at every turn (a training loop),
                    # resuming from a checkpoint costs less than a fresh waiter and its wake-up
                    # (benchmarks/bench_step_loop.py, issue #13).
                    await anyio.lowlevel.checkpoint()
        except anyio.get_cancelled_exc_class():
            if not self._stopped:
                self._task_lost()
            raise
        finally:
            self._inflight_n = 0
            self._release()
            if self._done is not None:
                self._done.set()
            self._signal_owner()

    async def _deliver_batch(self, handle_batch: Callable[[list[Event]], Awaitable[Any]]) -> None:
        events = self._take_batch(MAX_BATCH)
        n = len(events)
        self._inflight_min_seq = events[0].seq
        self._inflight_n = n
        try:
            await self._call(handle_batch(events))
        except Exception as exc:
            if self._stopped:
                return
            self.failed += n
            self._fail(exc, events[0])
        except anyio.get_cancelled_exc_class() as exc:
            if self._stopped or not foreign_cancellation():
                raise
            self.failed += n
            self._fail(exc, events[0])
        else:
            if self._stopped:
                return
            self.delivered += n
            self._consecutive = 0
        self._inflight_n = 0
        self._after_batch()

    async def _deliver_each(self, handle: Callable[[Event], Awaitable[Any]]) -> None:
        """One event at a time, up to a round of ``HANDLE_ROUND`` before yielding."""
        for _ in range(min(self._queued(), HANDLE_ROUND)):
            if self.disabled or not (self._incidents or self._telemetry):
                break
            event = self._pop()
            self._inflight_min_seq = event.seq
            self._inflight_n = 1
            try:
                await self._call(handle(event))
            except Exception as exc:
                if self._stopped:
                    return
                self.failed += 1
                self._fail(exc, event)
            except anyio.get_cancelled_exc_class() as exc:
                if self._stopped or not foreign_cancellation():
                    raise
                self.failed += 1
                self._fail(exc, event)
            else:
                if self._stopped:
                    return
                self.delivered += 1
                self._consecutive = 0
            self._inflight_n = 0
            self._signal_owner()
        self._after_batch()

    def _signal_owner(self) -> None:
        bus = self._bus
        if bus is not None:
            bus._signal_progress()

    def _report(self, event: Event) -> None:
        bus = self._bus
        if bus is not None:
            bus._publish_internal(event)

    # -- failures and stalls ---------------------------------------------------------------

    def _fail(self, exc: BaseException, event: Event | None) -> None:
        """Count a failure of the sink (*event* None: its ``start``); disable it if due.

        *exc* is an ``Exception``, or the cancellation exception the sink raised although its
        task was not cancelled (see :func:`._cancel.foreign_cancellation`).
        """
        self._consecutive += 1
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        if self._consecutive == 1:
            _log.warning(
                "sink_failed",
                sink=self.name,
                error=f"{type(exc).__name__}: {exc}",
                event_kind=event.kind if event is not None else "start",
            )
        self._report(
            SinkFailed(
                source="eventbus",
                step=event.step if event is not None else None,
                sink=self.name,
                error_type=type(exc).__qualname__,
                message=str(exc),
                traceback=tb,
                event_kind=event.kind if event is not None else "",
                event_seq=event.seq if event is not None else -1,
                consecutive_failures=self._consecutive,
            )
        )
        if self._consecutive >= self._max_failures and not self.disabled:
            self._disable(
                f"{self._consecutive} consecutive failures, last: {type(exc).__name__}: {exc}"
            )

    def _disable(self, reason: str) -> None:
        """Deliver nothing more to the sink: discard its queue, report why."""
        self.disabled = True
        discarded = self._clear()
        self.discarded += discarded
        self._release()
        bus = self._bus
        if bus is not None:
            bus._forget_routes()
        _log.error("sink_disabled", sink=self.name, reason=reason)
        self._report(
            SinkDisabled(
                source="eventbus",
                sink=self.name,
                reason=reason,
                consecutive_failures=self._consecutive,
                discarded=discarded,
            )
        )

    def _task_lost(self) -> None:
        """The pump was cancelled by something other than the bus (a sink raising the
        cancellation exception on Python 3.10, code cancelling every task): the event in the
        sink's hands counts as failed, and the sink is disabled (nothing feeds it any more)."""
        if self._inflight_n:
            self.failed += self._inflight_n
            self._inflight_n = 0
        if not self.disabled:
            self._disable("its task was cancelled (by the sink, or by code other than the bus)")

    def _note_holds(self, longest: float, total: float) -> None:
        """Account for how long one call of the sink held the loop; report a stall if due."""
        stalls = self._stalls
        if stalls is None:
            return
        report = stalls.note(self.name, longest, total)
        if report is not None:
            _log.warning(
                "sink_stalled_loop",
                sink=self.name,
                stall_s=round(report.stall_s, 4),
                blocked_s=round(report.blocked_s, 4),
            )
            self._report(report)

    # -- leaving the bus -------------------------------------------------------------------

    def _stop_task(self) -> None:
        """Stop the pump: an idle one leaves its loop when woken (``_input_closed``); one busy
        in the sink's code is cancelled, once, and on asyncio abandoned (see :meth:`_start`)."""
        if self._waiter is not None:
            self._wake()
            return
        task = self._task
        if task is not None:
            abandon(task)
        elif self._cancel_scope is not None:
            self._cancel_scope.cancel()

    def _detach(self) -> None:
        """Unsubscribed: discard the queue and the event in the sink's hands, stop the pump,
        forget the bus. From inside the sink's own call, that call completes and counts."""
        lost = self._clear()
        own_call = self._task_id is not None and anyio.get_current_task().id == self._task_id
        if not own_call:
            lost += self._inflight_n
            self._inflight_n = 0
            self._stopped = True
        self.discarded += lost
        self._release()
        self._bus = None
        self._input_closed = True
        if not own_call:
            self._stop_task()
        self._wake()

    def _abandon(self, waited: float) -> None:
        """Still busy after *waited* seconds of the close: stop the pump (cancelled once,
        never waited for), count what it held as undelivered (once) and report it."""
        if self._stopped:
            return
        lost = self._clear() + self._inflight_n
        self._inflight_n = 0
        self._stopped = True
        self.undelivered += lost
        self._release()
        self._input_closed = True
        bus = self._bus
        if bus is not None:
            bus._forget_routes()  # nothing more is routed to it, the bus's reports included
        self._stop_task()
        abandoned = self._thread_busy()
        _log.error(
            "close_timed_out",
            sink=self.name,
            undelivered=lost,
            timeout_s=round(waited, 3),
            thread_abandoned=abandoned,
        )
        self._report(
            EventsUndelivered(source="eventbus", sink=self.name, undelivered=lost, timeout_s=waited)
        )
        self._report(
            SinkUnresponsive(
                source="eventbus",
                sink=self.name,
                phase="drain",
                waited_s=waited,
                thread_abandoned=abandoned,
            )
        )

    def _thread_busy(self) -> bool:
        return bool(getattr(self.sink, "thread_busy", False))

    async def _shutdown(self, stop_by: float, deadline: float) -> None:
        """Let the pump finish what it has by *stop_by* (else abandon it), then close the sink
        within what is left until *deadline*, but at least ``CLOSE_GRACE``."""
        self._input_closed = True
        self._wake()
        done = self._done
        if done is not None and not done.is_set() and not self._stopped:
            started = time.monotonic()
            with anyio.move_on_after(stop_by - started):
                await done.wait()
            if not done.is_set():
                self._abandon(time.monotonic() - started)
        await self.close_sink(max(deadline - time.monotonic(), CLOSE_GRACE))

    async def close_sink(self, timeout: float) -> None:
        """Close the sink (its ``aclose``, else its ``close``) within *timeout* seconds, once.

        Whoever removes a subscription owns its sink: the bus calls this for every
        subscription when it closes, and a caller that cancelled a subscription may call it
        to close the sink it gave. A plain function (or bound method) subscribed as a handler
        has nothing to close; a second call does nothing. An async close runs in a task of its
        own (on asyncio) and a synchronous ``close()`` in a daemon thread, so that one that
        hangs, shields itself or ignores cancellation is abandoned after *timeout* whatever it
        does. A close that raises is logged (``sink_close_failed``) and one that outlasts
        *timeout* is abandoned and logged (``sink_close_timed_out``); while the subscription
        is still on its bus, each is also published there
        (:class:`~eventbus_debug.events.SinkCloseFailed`,
        :class:`~eventbus_debug.events.SinkUnresponsive` with ``phase="close"``). Never raises
        what the sink raised.

        Args:
            timeout: seconds the sink's close may take.

        Raises:
            ValueError: if *timeout* is not a finite number of seconds > 0.
        """
        budget = positive_seconds("timeout", timeout)
        aclose = self._adapter.aclose
        if aclose is None or self._sink_closed:
            return
        self._sink_closed = True
        with anyio.move_on_after(budget) as scope:
            try:
                await self._run_close(aclose)
            except Exception as exc:
                _log.warning(
                    "sink_close_failed",
                    sink=self.name,
                    error=f"{type(exc).__name__}: {exc}",
                    exc_info=True,
                )
                self._report(
                    SinkCloseFailed(
                        source="eventbus",
                        sink=self.name,
                        error_type=type(exc).__qualname__,
                        message=str(exc),
                    )
                )
        if scope.cancelled_caught:
            abandoned = self._thread_busy()
            _log.error(
                "sink_close_timed_out",
                sink=self.name,
                timeout_s=round(budget, 3),
                thread_abandoned=abandoned,
            )
            self._report(
                SinkUnresponsive(
                    source="eventbus",
                    sink=self.name,
                    phase="close",
                    waited_s=budget,
                    thread_abandoned=abandoned,
                )
            )

    async def _run_close(self, close: Callable[[], Any]) -> None:
        """Run the sink's close where its caller can stop waiting for it at any time.

        Raises:
            Exception: what the close raised; the cancellation exception raised by the close
                itself (not a cancellation of the caller) comes as a ``RuntimeError``.
        """
        name = f"eventbus-close-{self.name}"

        async def run() -> None:
            if is_async_callable(close):
                result = close()
            else:  # a synchronous close() may block: a daemon thread, abandoned if it hangs
                result = await run_in_daemon_thread(close, name=name)
            if inspect.isawaitable(result):
                await result

        try:
            await run_abandonable(run, name)
        except anyio.get_cancelled_exc_class() as exc:
            if not foreign_cancellation():
                raise
            msg = f"the close raised {type(exc).__name__} (it awaited something cancelled)"
            raise RuntimeError(msg) from exc
