"""The bus for plain synchronous training loops: the event loop runs on a background thread."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any, TypeVar, final

from anyio.from_thread import BlockingPortal, start_blocking_portal
from typing_extensions import Self

from .._validate import non_negative, positive_int
from ..events import Delivery, Event
from ..exceptions import BusClosedError
from .bus import EventBus, check_subscriptions
from .statistics import BusStatistics
from .subscription import Subscription

__all__ = ("SyncEventBus",)

T = TypeVar("T")


@final
class SyncEventBus:
    """An :class:`EventBus` for a plain ``for`` loop: sinks run on a background event loop.

    Publishing is a list append on the training thread (about 0.1 µs); events cross to the
    bus's thread in batches, with one cross-thread wake-up per :meth:`flush` (call it once per
    step) instead of one per event. Incidents flush at once. The guarantees are those of the
    async bus: isolation, shedding of telemetry only, drain, and a lossless close.

    Example::

        with SyncEventBus() as bus:
            bus.subscribe(RotatingFileSink("debug_logs"))
            for step in range(100):
                loss = train_step()
                bus.publish(StepCompleted(step=step, loss=loss))
                bus.flush()

    Args:
        max_pending: events buffered on the training thread before an automatic flush.
        **bus_options: passed to :class:`EventBus` (``capacity``, ``close_timeout``, ...).
    """

    def __init__(self, *, max_pending: int = 1024, **bus_options: Any) -> None:
        self._max_pending = positive_int("max_pending", max_pending)
        self._bus = EventBus(**bus_options)
        self._pending = 0
        self._stack: contextlib.ExitStack | None = None
        self._portal: BlockingPortal | None = None

    @property
    def bus(self) -> EventBus:
        """The underlying async bus (use it only from the bus's thread, via :attr:`portal`)."""
        return self._bus

    @property
    def portal(self) -> BlockingPortal:
        """The portal into the bus's event loop, to run async code there from the loop thread.

        Raises:
            BusClosedError: if the bus is not running.
        """
        if self._portal is None:
            msg = "the SyncEventBus is not running; use `with SyncEventBus() as bus:`"
            raise BusClosedError(msg)
        return self._portal

    def __enter__(self) -> Self:
        stack = contextlib.ExitStack()
        try:
            portal = stack.enter_context(start_blocking_portal("asyncio"))
            stack.enter_context(portal.wrap_async_context_manager(self._bus))
        except BaseException:
            stack.close()
            raise
        self._portal = portal
        self._stack = stack
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Flush, drain every queue, close the sinks and stop the thread. Idempotent."""
        stack, self._stack = self._stack, None
        if stack is None:
            return
        with contextlib.suppress(BusClosedError):
            self.flush()
        try:
            stack.close()
        finally:
            self._portal = None

    def subscribe(self, sink: object, /, *event_types: type[Event], **options: Any) -> Subscription:
        """Same as :meth:`EventBus.subscribe`; the sink runs on the bus's thread."""
        return self._call(lambda: self._bus.subscribe(sink, *event_types, **options))

    def publish(self, event: Event, /) -> None:
        """Buffer *event* for the bus; incidents, and every ``max_pending``-th event, flush.

        Flushing may wait for a flow-controlled sink that is behind (see :meth:`flush`); use
        :meth:`publish_nowait` where nothing may wait.

        Raises:
            BusClosedError: if the bus is not running.
            TypeError: if *event* is not an :class:`Event`.
        """
        self._bus.publish_threadsafe(event, wake=False)
        self._pending += 1
        if type(event).delivery is Delivery.INCIDENT or self._pending >= self._max_pending:
            self.flush()

    def publish_many(self, events: Iterable[Event], /) -> None:
        """Buffer several events, then flush once."""
        for event in events:
            self._bus.publish_threadsafe(event, wake=False)
        self.flush()

    def publish_nowait(self, event: Event, /) -> None:
        """Buffer *event* for the bus and never wait (the :class:`~eventbus_debug.Publisher`
        method): incidents wake the bus's thread at once, telemetry rides the next flush.

        Raises:
            BusClosedError: if the bus is not running.
            TypeError: if *event* is not an :class:`Event`.
        """
        incident = type(event).delivery is Delivery.INCIDENT
        self._bus.publish_threadsafe(event, wake=incident)
        self._pending += 1
        if not incident and self._pending >= self._max_pending:
            self._pending = 0
            self._bus.wake_threadsafe()

    def publish_many_nowait(self, events: Iterable[Event], /) -> None:
        """Buffer several events and wake the bus's thread once; never waits."""
        for event in events:
            self._bus.publish_threadsafe(event, wake=False)
        self._pending = 0
        self._bus.wake_threadsafe()

    def flush(self) -> None:
        """Hand everything published so far to the bus's thread: one cross-thread wake-up.

        If a flow-controlled sink (the canonical log) is behind, also waits until it caught
        up, as ``await bus.publish(...)`` does (see :meth:`EventBus.subscribe`).
        """
        self._pending = 0
        if self._portal is None:
            msg = "the SyncEventBus is not running; use `with SyncEventBus() as bus:`"
            raise BusClosedError(msg)
        self._bus.wake_threadsafe()
        if self._bus._pressing:
            self._call_async(self._bus._wait_for_room)

    def drain(self, *subscriptions: Subscription, timeout: float | None = None) -> None:
        """Block until everything published so far was handled (see :meth:`EventBus.drain`).

        Raises:
            TimeoutError: if *timeout* seconds pass first.
            TypeError: if a positional argument is not a :class:`Subscription`.
            ValueError: if *timeout* is not None nor a finite number >= 0, or a subscription
                is another bus's.
            BusClosedError: if the bus is not running.
        """
        if timeout is not None:
            timeout = non_negative("timeout", timeout)
        check_subscriptions(subscriptions, self._bus)
        self.flush()
        self._call_async(lambda: self._bus.drain(*subscriptions, timeout=timeout))

    def statistics(self) -> BusStatistics:
        """A snapshot of the bus's counters."""
        return self._bus.statistics()

    def _call(self, fn: Callable[[], T]) -> T:
        return self.portal.call(fn)

    def _call_async(self, fn: Callable[[], Any]) -> Any:
        async def run() -> Any:
            return await fn()

        return self.portal.call(run)
