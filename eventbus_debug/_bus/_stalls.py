"""How long a sink holds the event loop: each synchronous slice of its calls, timed.

A slice of an async sink's call between two awaits holds the loop: nothing else (training
included) runs meanwhile. :class:`Timed` measures the slices of one call; :class:`StallMeter`
sums them per window and says when a :class:`~eventbus_debug.events.LoopStalled` is due.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Awaitable, Callable, Generator
from typing import Any, Final, final

from ..events import LoopStalled

__all__ = ("StallMeter", "Timed")

STALL_WINDOW: Final = 1.0
"""Loop holds by one sink are summed over windows of this many seconds (see LoopStalled)."""
STALL_SHARE: Final = 0.2
"""A sink holding the loop this share of a window is reported even without one long hold."""


def _clock() -> float:
    return time.monotonic()


@final
class StallMeter:
    """One sink's loop holds over the current window, against a threshold in seconds."""

    __slots__ = ("_blocked", "_longest", "_window_start", "threshold")

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold
        self._window_start = _clock()
        self._blocked = 0.0
        self._longest = 0.0

    def restart(self) -> None:
        """Start a new window now (the sink's pump starts)."""
        self._window_start = _clock()
        self._blocked = 0.0
        self._longest = 0.0

    def note(self, sink: str, longest: float, total: float) -> LoopStalled | None:
        """Add one call's holds; the report to publish when one hold reached the threshold or
        the holds took ``STALL_SHARE`` of a window of at least ``STALL_WINDOW`` (then a new
        window starts), else None."""
        now = _clock()
        self._blocked += total
        if longest > self._longest:
            self._longest = longest
        window = now - self._window_start
        threshold = self.threshold
        report = None
        if longest >= threshold or (
            window >= STALL_WINDOW and self._blocked >= STALL_SHARE * window
        ):
            report = LoopStalled(
                source="eventbus",
                sink=sink,
                stall_s=self._longest,
                blocked_s=self._blocked,
                window_s=max(window, longest),
                threshold_s=threshold,
            )
        elif window < STALL_WINDOW:
            return None
        self._window_start = now
        self._blocked = 0.0
        self._longest = 0.0
        return report


@final
class Timed:
    """Awaits a sink's coroutine, timing each synchronous slice of it (between two awaits).

    A slice is time the event loop was held by the sink: nothing else (training included) ran.
    The longest slice and their total go to *note* when the call ends.
    """

    __slots__ = ("_coro", "_note")

    def __init__(self, coro: Awaitable[Any], note: Callable[[float, float], None]) -> None:
        self._coro = coro
        self._note = note

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
            self._note(longest, total)
