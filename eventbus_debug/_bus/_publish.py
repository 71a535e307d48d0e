"""The publish paths: what publishers call, on the event loop or from other threads.

``publish_nowait`` is the hot path (one flag, one list, one ``isinstance``); ``publish`` adds
flow control; ``publish_threadsafe`` goes through a thread-safe queue; ``has_undispatched``
looks at what is still buffered. A publish the bus cannot take is refused here; in a child
process forked from the bus's (a ``DataLoader`` worker) it is counted instead. The layer of
:class:`~.bus.EventBus` above :mod:`._dispatch` (see :mod:`.bus`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable, Sized
from typing import Final

import anyio

from ..diagnostics import get_logger
from ..events import Delivery, Event, has_incident
from ..exceptions import BusClosedError
from ._dispatch import HOLD_MAX, BusDispatcher, _State
from ._queue import FLOW_STALL_TIMEOUT, IN_SINK

__all__ = ("BusPublishing",)

# The bus's records keep the logger name they always had (docs/logging.md).
_log = get_logger("eventbus_debug._bus.bus")

_INCIDENT: Final = Delivery.INCIDENT
_get_ident: Final = threading.get_ident


class BusPublishing(BusDispatcher):
    """The publishers' part of :class:`~.bus.EventBus`: the ``publish*`` methods."""

    # Set by EventBus.__init__ (see there).
    _accepting: bool
    _incident_only: dict[tuple[type[Event], ...], bool]
    _forked_from: int | None  # in a forked child: the pid of the bus's process
    _checkpoint: Callable[[], Awaitable[None]]  # publish's yield (see _waiters.checkpointer)
    lost_in_fork: int
    _warned_thread: bool  # publish_nowait_from_thread was logged
    _not_running_hint: str = "publish inside `async with EventBus() as bus:`"
    """How to start the bus, in the refusal of a publish before it runs; a
    :class:`~.sync.SyncEventBus` names its own ``with`` block (read on the error path only)."""

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
        #
        # The burst's appends do not check the thread (get_ident() costs ~25 ns, a third of
        # this path): another thread's publish_nowait that finds a burst pending appends here
        # too. That is safe under the GIL: the check of _wake_pending and the append run with
        # no switch of thread between them, as do the dispatcher's swap of _buffer and its
        # last look at it before it sleeps (it clears _wake_pending with the buffer empty), so
        # such an event is dispatched with the burst. _publish_from_thread appends to the same
        # list, so that thread's events keep their order whichever branch they take, and
        # _end_hold hands itself to the loop when called from another thread.
        if self._accepting and isinstance(event, Event):
            if self._wake_pending:
                self._buffer.append(event)
                if self._holding and (event.delivery is _INCIDENT or len(self._buffer) >= HOLD_MAX):
                    self._end_hold()
                return
            # Once per burst (the wake): only the loop's thread may wake the dispatcher; from
            # another thread a waiter's trigger raises (trio) or races the loop (asyncio).
            if _get_ident() != self._loop_ident:
                self._publish_from_thread(event)
                return
            self._buffer.append(event)
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
            if self._from_sink_while_closing(event):
                if _get_ident() == self._loop_ident:
                    self._publish_internal(event)
                else:  # a worker thread of the sink's: the close's drain pulls it
                    self.publish_threadsafe(event)
                return
            self._refuse(1)
            return
        raise TypeError(_not_event_message(event))

    def _publish_from_thread(self, event: Event) -> None:
        """``publish_nowait`` called from a thread other than the event loop's (an autograd
        hook, a data loader's thread, a worker of ``anyio.to_thread``) when no burst is
        pending: the event joins the buffer (the list a burst's publishes append to, so the
        thread's events keep their order) and the dispatcher is woken the thread-safe way
        (:meth:`wake_threadsafe`, once per burst of them); the first such call is logged."""
        if not self._warned_thread:
            self._warned_thread = True
            _log.warning(
                "publish_nowait_from_thread",
                thread=threading.current_thread().name,
                detail=(
                    "publish_nowait was called outside the event loop's thread; the event was "
                    "handed over thread-safely. Call bus.publish_threadsafe(event) from threads"
                ),
            )
        self._buffer.append(event)  # atomic under the GIL, as the dispatcher's swap of it
        if self._state is not _State.RUNNING:  # the close began after the check of _accepting
            self._handed_over_while_closing()
        elif not self._thread_wake_pending:
            self.wake_threadsafe()

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
        if _get_ident() != self._loop_ident:  # from another thread: the thread-safe way
            for event in batch:
                self._publish_from_thread(event)
            return
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
        await self._checkpoint()

    async def _wait_for_room(self) -> None:
        """Wait while a flow-controlled sink is over its high-water mark and making progress."""
        while self._pressing and self._state is _State.RUNNING:
            now = time.monotonic()
            deadlines = [d for s in self._subs if (d := s._flow_deadline(now)) is not None]
            if not self._pressing or not deadlines:
                return
            with anyio.move_on_after(min(deadlines) - now):
                await self._await_progress()

    def _flow_room(self) -> int | None:
        """Events a flow-controlled sink (the canonical log) takes in one dispatch without
        shedding when it is under its high-water mark, for the one with the least room;
        ``None`` when no flow-controlled sink holds publishers back now."""
        rooms = [
            s.capacity - s._high_water for s in self._subs if s.backpressure and not s._stalled
        ]
        return min(rooms) if rooms else None

    def _undispatched(self) -> int:
        """Events published (on the loop or from threads) and not dispatched yet."""
        return len(self._buffer) + len(self._thread_queue)

    async def _wait_for_dispatch(self) -> None:
        """Wait until the events handed over so far were dispatched, then while a
        flow-controlled sink is over its high-water mark (``SyncEventBus.flush``'s wait when
        the training thread publishes faster than the bus's thread dispatches).

        Bounded: a dispatcher that makes no progress for ``FLOW_STALL_TIMEOUT`` stops the wait.
        """
        with anyio.move_on_after(FLOW_STALL_TIMEOUT):
            while self._undispatched() and self._state is _State.RUNNING:
                self._pull_thread_events()
                await self._await_progress()  # wakes the dispatcher (ending a telemetry hold)
        if self._pressing:
            await self._wait_for_room()

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
            if self._from_sink_while_closing(event):
                self._thread_queue.append(event)  # the close's drain pulls it (any thread)
                self._handed_over_while_closing()
                return
            self._refuse(1)
            return
        if not isinstance(event, Event):
            raise TypeError(_not_event_message(event))
        self._thread_queue.append(event)
        if self._state is not _State.RUNNING:  # the close began after the check above
            self._handed_over_while_closing()
        elif wake and not self._thread_wake_pending:
            self.wake_threadsafe()

    def _handed_over_while_closing(self) -> None:
        """An event was handed over (by this thread, any thread) while the bus closes: found
        running, then the close began (or a sink's own, see :meth:`_from_sink_while_closing`).
        It is never refused now (it may be delivered already): the close's drain delivers it,
        and once the bus is closed :meth:`_settle_after_close` counts it (undelivered) if the
        close no longer could. Either way it is accounted for, whoever wins the race."""
        if self._state is _State.CLOSING:
            with contextlib.suppress(BusClosedError):  # the loop is gone: settled below
                self.wake_threadsafe()
        if self._state is _State.CLOSED:
            self._settle_after_close()

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

    # -- what the bus cannot take --------------------------------------------------------------

    def _mark_forked(self, parent: int) -> None:
        """This is a copy of the bus in a forked child process: no event loop delivers its
        events here. The publishers' paths check nothing more: they see a closed bus, and
        :meth:`_refuse` counts what they publish and says so once (never raises: a data
        loader worker that reports something must not stop the training)."""
        self._forked_from = parent
        self._accepting = False
        self._state = _State.CLOSED
        self._call_soon_threadsafe = None

    def _from_sink_while_closing(self, event: object) -> bool:
        """Whether *event* is a sink's, published while the bus closes (from the sink's task or
        a worker thread it started): taken like the bus's own reports, for the sinks not
        closed yet (an alert handler that failed on the last events reaches the log)."""
        return self._state is _State.CLOSING and isinstance(event, Event) and IN_SINK.get()

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
            return f"the bus is not running yet; {self._not_running_hint}"
        return "the bus is closed; events can no longer be published to it"


_RUNNING_BUSES: weakref.WeakSet[BusPublishing] = weakref.WeakSet()
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
