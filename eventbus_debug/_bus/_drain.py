"""Draining and closing: waiting until what was published is handled, and the bounded close.

``drain`` waits for every subscriber (or the ones named); ``aclose`` stops accepting events,
drains within *close_timeout*, abandons the sinks still busy, closes the sinks in reverse
order of subscription and stops the dispatcher. The layer of :class:`~.bus.EventBus` above
:mod:`._publish` (see :mod:`.bus`).
"""

from __future__ import annotations

import time

import anyio
import anyio.lowlevel

from .._validate import non_negative
from ..diagnostics import get_logger
from ..exceptions import BusClosedError
from . import subscription as _subscription
from ._dispatch import _State
from ._publish import _RUNNING_BUSES, BusPublishing
from .subscription import Subscription

__all__ = ("BusDraining", "check_subscriptions")

# The bus's records keep the logger name they always had (docs/logging.md).
_log = get_logger("eventbus_debug._bus.bus")


class BusDraining(BusPublishing):
    """The waiting part of :class:`~.bus.EventBus`: ``drain`` and ``aclose``."""

    # Set by EventBus.__init__ (see there).
    _close_timeout: float

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

    # -- closing -------------------------------------------------------------------------------

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
            interrupt: BaseException | None = None
            for sub in reversed(list(self._subs)):
                try:
                    await self._close_one(sub, deadline)
                except anyio.get_cancelled_exc_class():
                    raise
                except BaseException as exc:  # KeyboardInterrupt, SystemExit
                    # A sink's close raised what is not an Exception: the other sinks are
                    # closed all the same (the log last), then it goes on (below).
                    _log.error("sink_close_interrupted", sink=sub.name, error=repr(exc))
                    interrupt = interrupt or exc
            self._stop_dispatcher = True
            self._wake_dispatcher()
            if self._dispatcher_done is not None:
                with anyio.move_on_after(_subscription.CLOSE_GRACE):
                    await self._dispatcher_done.wait()
                if not self._dispatcher_done.is_set() and self._dispatcher_scope is not None:
                    self._dispatcher_scope.cancel()
        self._state = _State.CLOSED
        # From here a publish_nowait from another thread takes the slow path, which sees the
        # close; what a publisher on another thread handed over after the last dispatch (it
        # found the bus running, then lost the race) is counted now (or by that publisher).
        self._wake_pending = False
        _RUNNING_BUSES.discard(self)
        self._settle_after_close()
        elapsed = time.monotonic() - started
        if elapsed > 1.0:
            _log.info("bus_close_slow", seconds=round(elapsed, 3))
        if interrupt is not None:
            raise interrupt

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
