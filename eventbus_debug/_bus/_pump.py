"""One subscriber's pump: the task that feeds the sink, and the sink's failures and stalls.

The pump waits for queued events and hands them to the sink (``handle_batch``, else
``handle`` one at a time), counting what was delivered; a sink that raises is counted, reported
(``SinkFailed``) and disabled after *max_failures* failures in a row; a sink that holds the
event loop is reported (``LoopStalled``). The layer of :class:`~.subscription.Subscription`
above :mod:`._queue` (see :mod:`.subscription`).
"""

from __future__ import annotations

import asyncio
import traceback
from collections.abc import Awaitable, Callable
from typing import Any, Final

import anyio
import anyio.lowlevel
from anyio.abc import TaskGroup

from ..diagnostics import get_logger
from ..events import Event, SinkDisabled, SinkFailed
from ..threads import running_loop
from ._adapter import SinkAdapter
from ._cancel import abandon, foreign_cancellation, retrieved
from ._queue import IN_SINK, SubscriptionQueue
from ._stalls import StallMeter, Timed
from ._waiters import Waiter

__all__ = ("HANDLE_ROUND", "MAX_BATCH", "TASK_PREFIX", "SubscriptionPump")

# A subscription's records keep the logger name they always had (docs/logging.md).
_log = get_logger("eventbus_debug._bus.subscription")

MAX_BATCH: Final = 4096
"""A ``handle_batch`` sink receives at most this many events per call."""
HANDLE_ROUND: Final = 64
"""A ``handle(event)`` sink yields to the event loop at least once per this many events."""
TASK_PREFIX: Final = "eventbus-sink-"
"""The name of a sink's task is this prefix and the subscription's name."""


class SubscriptionPump(SubscriptionQueue):
    """The pump's part of :class:`~.subscription.Subscription`: its task, failures, stalls."""

    # Set by Subscription.__init__ (see there).
    __slots__ = (
        "_adapter",
        "_cancel_scope",
        "_consecutive",
        "_done",
        "_inflight_min_seq",
        "_inflight_n",
        "_input_closed",
        "_max_failures",
        "_stalls",
        "_stopped",
        "_task",
        "_task_id",
        "delivered",
        "disabled",
        "discarded",
        "failed",
    )

    _adapter: SinkAdapter
    _max_failures: int
    _stalls: StallMeter | None
    _input_closed: bool
    _inflight_min_seq: int
    _inflight_n: int
    _consecutive: int
    _cancel_scope: anyio.CancelScope | None
    _task: asyncio.Task[None] | None  # the pump, on asyncio (see _start)
    _task_id: int | None
    _stopped: bool  # the bus gave up on the pump (see Subscription.__init__)
    _done: anyio.Event | None
    delivered: int
    failed: int
    discarded: int
    disabled: bool

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
        IN_SINK.set(True)  # this task's own context (a task runs in a copy)
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

    # -- what the sink has handled ---------------------------------------------------------

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

    # -- stopping --------------------------------------------------------------------------

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
