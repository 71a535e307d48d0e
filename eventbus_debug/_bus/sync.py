"""The bus for plain synchronous training loops: the event loop runs on a background thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import threading
from collections.abc import Callable, Coroutine, Iterable
from types import TracebackType
from typing import Any, Final, TypeVar, final

import anyio
from anyio.from_thread import BlockingPortal
from typing_extensions import Self

from .._validate import non_negative, positive_int
from ..diagnostics import get_logger
from ..events import Delivery, Event
from ..exceptions import BusClosedError
from . import _pump, _queue, subscription as _subscription
from ._drain import check_subscriptions
from ._queue import IN_SINK
from .bus import EventBus
from .statistics import BusStatistics
from .subscription import Subscription

__all__ = ("SyncEventBus",)

T = TypeVar("T")

_log = get_logger(__name__)

THREAD_GRACE: Final = 1.0
"""Seconds the training thread waits for the bus's thread beyond the bound of what it asked
(a drain's timeout, the close's bound) before it stops waiting: the bus's event loop is then
held by a sink (a blocking call in an async handler)."""

_NOT_RUNNING_HINT: Final = "publish inside `with SyncEventBus() as bus:`"
"""What a publish before ``with`` is told (the inner bus would name ``async with EventBus()``)."""


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
        self._bus._not_running_hint = _NOT_RUNNING_HINT  # its refusals name this bus's block
        self._pending = 0
        self._host: _LoopThread | None = None
        self._portal: BlockingPortal | None = None
        self._room: concurrent.futures.Future[Any] | None = None  # flush's wait for room
        self._closed = False  # close() began: publishing is refused from then on

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
        if self._host is not None:
            msg = "the SyncEventBus is already running; create a new one"
            raise RuntimeError(msg)
        host = _LoopThread(self._bus)
        host.thread.start()
        try:
            portal = host.ready.result()
        except BaseException:
            host.thread.join()
            raise
        self._portal = portal
        self._host = host
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Flush, drain every queue, close the sinks and stop the thread. Idempotent.

        Bounded as :meth:`EventBus.aclose` is, whatever the sinks do, plus ``THREAD_GRACE``
        (1 s): if a sink holds the bus's event loop longer (a blocking call in an async
        handler), the training thread stops waiting, logs ``sync_bus_close_timed_out`` naming
        what holds the loop, and leaves the bus's (daemon) thread behind.

        Raises:
            BaseExceptionGroup: as leaving an :class:`EventBus` (its own tasks failed).
        """
        host, self._host = self._host, None
        if host is None:
            return
        with contextlib.suppress(BusClosedError):
            self.flush()
        # From here on publishing is refused here, also when the close below gives up (a sink
        # holding the bus's loop keeps the bus itself from ever learning it closes).
        self._closed = True
        self._portal = None
        bound = _close_bound(self._bus) + THREAD_GRACE
        host.stop()
        try:
            host.closed.result(bound)
        except concurrent.futures.TimeoutError:
            if not host.closed.done():
                _log.error(
                    "sync_bus_close_timed_out",
                    waited_s=round(bound, 3),
                    held_by=_holder(host.loop),
                    detail="the bus's thread is left behind (a daemon)",
                )
                return
            raise
        finally:
            if host.closed.done():
                host.thread.join(THREAD_GRACE)

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
        if self._closed:
            self._refuse_closed()
        self._bus.publish_threadsafe(event, wake=False)
        self._pending += 1
        if type(event).delivery is Delivery.INCIDENT or self._pending >= self._max_pending:
            self.flush()

    def publish_many(self, events: Iterable[Event], /) -> None:
        """Buffer several events, then flush once."""
        if self._closed:
            self._refuse_closed()
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
        if self._closed:
            self._refuse_closed()
        incident = type(event).delivery is Delivery.INCIDENT
        self._bus.publish_threadsafe(event, wake=incident)
        self._pending += 1
        if not incident and self._pending >= self._max_pending:
            self._pending = 0
            self._bus.wake_threadsafe()

    def publish_many_nowait(self, events: Iterable[Event], /) -> None:
        """Buffer several events and wake the bus's thread once; never waits."""
        if self._closed:
            self._refuse_closed()
        for event in events:
            self._bus.publish_threadsafe(event, wake=False)
        self._pending = 0
        self._bus.wake_threadsafe()

    def flush(self) -> None:
        """Hand everything published so far to the bus's thread: one cross-thread wake-up.

        If a flow-controlled sink (the canonical log) is behind, also waits until it caught
        up, as ``await bus.publish(...)`` does (see :meth:`EventBus.subscribe`); and when the
        events handed over but not dispatched yet would overfill it (this thread publishes
        faster than the bus's thread dispatches), waits until they were dispatched first.
        """
        self._pending = 0
        if self._portal is None:
            msg = "the SyncEventBus is not running; use `with SyncEventBus() as bus:`"
            raise BusClosedError(msg)
        bus = self._bus
        bus.wake_threadsafe()
        if self._room is not None and not self._room.done():
            return  # a wait that outlived its bound: the bus's thread is held, not waited for again
        if bus._pressing:
            wait = bus._wait_for_room()
        else:
            room = bus._flow_room()
            # Half the room: the events published between two flushes (up to max_pending)
            # still fit when the dispatcher takes them in one round.
            if room is None or bus._undispatched() < max(1, room // 2):
                return
            wait = bus._wait_for_dispatch()
        # Bounded: a flow-controlled sink that makes no progress stops holding the publisher
        # after FLOW_STALL_TIMEOUT; a bus thread held by a sink is not waited for beyond it
        # (nor again, until that wait ended).
        if self._on_bus_thread():
            wait.close()  # from the bus's own thread (a sink): it would wait for itself
            return
        self._room = self._submit(wait)
        with contextlib.suppress(concurrent.futures.TimeoutError):
            self._room.result(_queue.FLOW_STALL_TIMEOUT + THREAD_GRACE)

    def drain(self, *subscriptions: Subscription, timeout: float | None = None) -> None:
        """Block until everything published so far was handled (see :meth:`EventBus.drain`).

        With a *timeout*, the training thread waits at most *timeout* plus ``THREAD_GRACE``
        (1 s), also when a sink holds the bus's event loop (a blocking call in an async
        handler), which would keep the drain's own timeout from firing; the error then names
        what holds the loop.

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
        if self._on_bus_thread():
            msg = (
                "drain() was called on the SyncEventBus's own thread (from a sink?): it would "
                "wait for the event loop it holds; drain from the training thread, or "
                "`await bus.bus.drain()` in async code on the bus's loop"
            )
            raise RuntimeError(msg)
        self.flush()
        future = self._submit(self._bus.drain(*subscriptions, timeout=timeout))
        wait = None if timeout is None else timeout + THREAD_GRACE
        try:
            future.result(wait)
        except concurrent.futures.TimeoutError:
            if future.done():
                raise  # the drain's own TimeoutError
            future.cancel()
            assert self._host is not None
            held_by = _holder(self._host.loop)
            _log.error("sync_bus_unresponsive", waited_s=wait, held_by=held_by)
            msg = (
                f"drain() timed out: the bus's thread did not answer within {wait:g} s, "
                f"{held_by} (a blocking call in an async handler? run it in a worker thread)"
            )
            raise TimeoutError(msg) from None

    def _on_bus_thread(self) -> bool:
        """Whether the caller runs on the bus's own thread (a sink), which cannot wait for it."""
        host = self._host
        return host is not None and host.thread.ident == threading.get_ident()

    def _refuse_closed(self) -> None:
        """A publish after :meth:`close` began: refused (in a forked child: counted, see
        EventBus), except a sink's own during the close, which the bus takes (see
        :meth:`EventBus.aclose`)."""
        if IN_SINK.get():
            return
        if self._bus._forked_from is None:
            msg = "the bus is closed; events can no longer be published to this SyncEventBus"
            raise BusClosedError(msg)
        self._bus._refuse(1)

    def statistics(self) -> BusStatistics:
        """A snapshot of the bus's counters."""
        return self._bus.statistics()

    def cancel_soon(self, task: concurrent.futures.Future[Any]) -> None:
        """Cancel *task* (a future of :attr:`portal`'s ``start_task_soon``) without waiting.

        The cancellation runs on the bus's loop when it next turns: cancelling a portal's
        future from this thread makes anyio before 4.16 wait for the loop, which a sink that
        holds it (a blocking call in an async handler) would turn into a hang of the caller.
        """
        host = self._host
        loop = host.loop if host is not None else None
        if loop is not None:
            try:
                loop.call_soon_threadsafe(task.cancel)
                return
            except RuntimeError:  # the loop is closed: nothing waits on it any more
                pass
        task.cancel()

    def _call(self, fn: Callable[[], T]) -> T:
        return self.portal.call(fn)

    def _submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run *coro* on the bus's event loop; the training thread waits on the future (never
        blocks to submit it, even while the loop is held)."""
        host = self._host
        loop = host.loop if host is not None else None
        if host is None or loop is None or self._portal is None:
            coro.close()
            msg = "the SyncEventBus is not running; use `with SyncEventBus() as bus:`"
            raise BusClosedError(msg)
        # In a copy of the loop thread's own context: run_coroutine_threadsafe would copy this
        # thread's, and a caller inside a trio program would hand the bus's task trio's marker
        # (sniffio's context variable), so anyio in that task would take asyncio for trio.
        return host.context.copy().run(asyncio.run_coroutine_threadsafe, coro, loop)


@final
class _LoopThread:
    """The bus's event loop, in a daemon thread: the bus's block and a portal run there.

    ``ready`` gives the portal once the bus was entered; ``closed`` the outcome of leaving the
    bus (set by :meth:`stop`). The thread is a daemon so that a sink holding the loop forever
    never keeps the process alive; the training thread waits for it with bounds only.
    """

    __slots__ = ("_bus", "_stop", "closed", "context", "loop", "ready", "thread")

    def __init__(self, bus: EventBus) -> None:
        self._bus = bus
        self._stop: anyio.Event | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.context = contextvars.Context()  # the loop's own, once it runs (see _submit)
        self.ready: concurrent.futures.Future[BlockingPortal] = concurrent.futures.Future()
        self.closed: concurrent.futures.Future[None] = concurrent.futures.Future()
        self.thread = threading.Thread(target=self._main, name="eventbus-sync-bus", daemon=True)

    def stop(self) -> None:
        """Have the loop leave the bus's block (from the training thread; never blocks)."""
        loop, stop = self.loop, self._stop
        if loop is None or stop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop is already gone
            loop.call_soon_threadsafe(stop.set)

    def _main(self) -> None:
        try:
            anyio.run(self._serve, backend="asyncio")
        except BaseException as exc:  # handed to the training thread
            for future in (self.ready, self.closed):
                if not future.done():
                    future.set_exception(exc)

    async def _serve(self) -> None:
        async with BlockingPortal() as portal:
            self.loop = asyncio.get_running_loop()
            self.context = contextvars.copy_context()
            self._stop = stop = anyio.Event()
            try:
                async with self._bus:
                    self.ready.set_result(portal)
                    await stop.wait()
            except BaseException as exc:
                (self.closed if self.ready.done() else self.ready).set_exception(exc)
                if not isinstance(exc, Exception):
                    raise
            else:
                self.closed.set_result(None)


def _close_bound(bus: EventBus) -> float:
    """The longest an :class:`EventBus`'s close takes, whatever its sinks do."""
    grace = _subscription.CLOSE_GRACE
    return bus._close_timeout + grace * (2 * len(bus.subscriptions) + 1)


def _holder(loop: asyncio.AbstractEventLoop | None) -> str:
    """What holds *loop* now, in words (the task it runs, read from another thread)."""
    task = asyncio.current_task(loop) if loop is not None else None
    if task is None:
        return "no task of the bus holds it (its thread is busy elsewhere)"
    name = task.get_name()
    prefix = _pump.TASK_PREFIX
    if name.startswith(prefix):
        return f"sink {name[len(prefix) :]!r} holds its event loop"
    return f"task {name!r} holds its event loop"
