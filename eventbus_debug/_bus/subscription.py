"""One subscriber: :class:`Subscription`, its constructor, its public face, and its leaving.

The bus (the subscription's *owner*) stages events for it, starts its pump, and asks it to
stop; everything about one sink's delivery (flow control, stalls of the event loop, failures,
disabling, the close of the sink) lives in the subscription.

``Subscription`` is one class built in layers, one module each, each importing only the one
below: :mod:`._queue` (``SubscriptionQueue``: the bounded queue, shedding, flow control),
:mod:`._pump` (``SubscriptionPump``: the sink's task, its failures and stalls) and this module
(the constructor, which sets the state every layer declares, ``cancel``, ``statistics``, and
leaving the bus: unsubscribed, abandoned at the close deadline, the close of the sink).
"""

from __future__ import annotations

import collections
import inspect
import time
from collections.abc import Callable
from typing import Any, Final, final

import anyio
from typing_extensions import Self

from .._validate import positive_seconds
from ..diagnostics import get_logger
from ..events import (
    Event,
    EventsUndelivered,
    SinkCloseFailed,
    SinkUnresponsive,
)
from ..threads import run_in_daemon_thread
from ._adapter import SinkAdapter, is_async_callable
from ._cancel import foreign_cancellation, run_abandonable
from ._pump import SubscriptionPump
from ._queue import IN_SINK, _Owner
from ._stalls import StallMeter
from .statistics import SubscriptionStatistics

__all__ = ("Subscription",)

_log = get_logger(__name__)

CLOSE_GRACE: Final = 1.0
"""Seconds granted, once the close deadline passed, to each sink to take the last reports and
stop, then again to close it; and to the bus's dispatcher to stop."""


def _current_task_id() -> int | None:
    """The running task's id; None outside an event loop (a thread, after the loop ended)."""
    try:
        return anyio.get_current_task().id
    except RuntimeError:  # anyio's NoEventLoopError: no event loop runs in this thread
        return None


@final
class Subscription(SubscriptionPump):
    """One sink's connection to a bus: its filter, bounded queue, task and counters.

    Returned by :meth:`EventBus.subscribe`. Cancel it with :meth:`cancel` (or use it as a
    context manager) to stop delivery; events already queued are dropped and counted.

    The queue is two FIFOs, incidents and telemetry, merged by sequence number when the sink
    reads them: shedding the oldest telemetry is one ``popleft`` whatever the queue holds, so
    a burst of any size is queued in linear time.
    """

    __slots__ = (
        "__weakref__",
        "_close_timeout",
        "_sink_closed",
        "event_types",
        "sink",
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
        self._bus = bus
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
        self._incidents = collections.deque()
        self._telemetry = collections.deque()
        # Filled by the dispatcher during one dispatch round, then moved into the queues at once.
        self._staged_incidents = []
        self._staged_telemetry = []
        self._waiter = None
        self._input_closed = False
        self._inflight_min_seq = -1
        self._inflight_n = 0
        self._consecutive = 0
        self._cancel_scope = None
        self._task = None  # the pump, on asyncio (see _start)
        self._task_id = None
        # The bus gave up on the pump (close deadline, unsubscribed): what it held is counted,
        # and the pump counts nothing more, whenever (if ever) the sink's call returns.
        self._stopped = False
        self._done = None
        self._sink_closed = False
        self._pressing = False  # holding back `await publish` (flow control)
        self._stalled = False  # made no progress while pressing: released until it does
        self._last_progress = 0.0
        self.delivered = 0
        self.failed = 0
        self.shed = 0
        self.shed_unreported = 0
        self.shed_by_kind = {}
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

    # -- leaving the bus -------------------------------------------------------------------

    def _detach(self) -> None:
        """Unsubscribed: discard the queue and the event in the sink's hands, stop the pump,
        forget the bus. From inside the sink's own call, that call completes and counts."""
        lost = self._clear()
        own_call = self._task_id is not None and _current_task_id() == self._task_id
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
            token = IN_SINK.set(True)  # reset after: on trio this runs in the closing task
            try:
                if is_async_callable(close):
                    result = close()
                else:  # a synchronous close() may block: a daemon thread, abandoned if it hangs
                    result = await run_in_daemon_thread(close, name=name)
                if inspect.isawaitable(result):
                    await result
            finally:
                IN_SINK.reset(token)

        try:
            await run_abandonable(run, name)
        except anyio.get_cancelled_exc_class() as exc:
            if not foreign_cancellation():
                raise
            msg = f"the close raised {type(exc).__name__} (it awaited something cancelled)"
            raise RuntimeError(msg) from exc
