"""The session's own cost per step, measured, and kept within an overhead budget.

:class:`OverheadMeter` adds up the wall time spent inside the session's step calls (the
checks at the safe point and the record of a finished step, event-loop turns included: on an
async loop the sinks run in them) and the time between finished steps. Its :attr:`overhead`
is the session's time over the rest of the step: ``0.02`` means the session made the step 2 %
longer than it would have been without it.

With a budget, every window of steps it compares the window's overhead with the budget and
stretches (or, well under budget, relaxes) the cadence of the costly checks through the
probe's public :attr:`~eventbus_debug.StepProbe.cadence`: parameter norms, update ratios, the
vanishing pass and activation statistics. The loss and gradient checks, which catch
non-finite values, keep their cadence: a NaN is caught at the step it appears, whatever the
budget. A budget still exceeded with the costly checks at their longest periods is one the
every-step checks alone exceed (small steps): the meter says so once, in a warning that names
the measured overhead, and keeps the checks as they are.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Final, final

from ..diagnostics import get_logger
from ..probes import Cadence, StepProbe

__all__ = ("MAX_STRETCH", "WINDOW", "OverheadMeter")

_log = get_logger(__name__)

WINDOW: Final = 100
"""Steps per budget decision (at least two periods of the slowest stretched check)."""
MAX_STRETCH: Final = 64
"""The most the costly checks' periods are multiplied by."""
_RELAX: Final = 0.25
"""Under this share of the budget, the stretch is halved again."""


@final
class OverheadMeter:
    """Measures the session's own time per step; with *budget*, keeps it within the budget.

    Args:
        probe: the step probe whose costly checks' cadence the budget stretches.
        budget: the share of the step time the session may cost (``None``: measure only).
        window: steps per budget decision.
        clock: the time source, in seconds (``time.perf_counter``).
    """

    def __init__(
        self,
        probe: StepProbe,
        budget: float | None = None,
        *,
        window: int = WINDOW,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.probe = probe
        self.budget = budget
        self.window = window
        self.clock = clock
        self.base: Cadence = probe.cadence
        """The cadence the probe had when the meter started (the user's)."""
        self.stretch = 1
        """What the costly checks' periods are multiplied by now."""
        self.own_s = 0.0
        """Seconds spent inside the session's step calls, over the run."""
        self.step_s = 0.0
        """Seconds from the first finished step to the last, over the run."""
        self._last_end: float | None = None
        self._window_own = 0.0
        self._window_step = 0.0
        self._window_steps = 0
        self._own_since_last = 0.0
        self.unreachable = False
        """True once the budget was exceeded with the costly checks at their longest periods."""

    @property
    def overhead(self) -> float | None:
        """The session's time over the rest of the steps' time, over the run (None before
        two steps finished)."""
        return _share(self.own_s, self.step_s)

    def add(self, seconds: float) -> None:
        """Count *seconds* spent inside a session call."""
        self._own_since_last += seconds

    def step_finished(self, now: float, own: float = 0.0) -> None:
        """Close a step at *now* (the end of its ``step_completed``, which took *own* seconds
        of the session's time: counted as :meth:`add` would); decide with a budget."""
        own += self._own_since_last
        self._own_since_last = 0.0
        last, self._last_end = self._last_end, now
        if last is None:
            return  # the first step has no start: its time is unknown
        step = now - last
        self.own_s += own
        self.step_s += step
        if self.budget is None:
            return
        self._window_own += own
        self._window_step += step
        self._window_steps += 1
        if self._window_steps >= max(self.window, 2 * self._longest_period()):
            share = _share(self._window_own, self._window_step)
            self._window_own = self._window_step = 0.0
            self._window_steps = 0
            if share is not None:
                self._decide(share)

    def _longest_period(self) -> int:
        cadence = self.probe.cadence
        return max(cadence.param_every, cadence.update_every, cadence.vanishing_every)

    def _decide(self, share: float) -> None:
        budget = self.budget
        if budget is None:
            return
        stretch = self.stretch
        if share > budget and stretch >= MAX_STRETCH:
            if not self.unreachable:
                self.unreachable = True
                _log.warning(
                    "overhead_budget_unreachable",
                    overhead=round(share, 4),
                    budget=budget,
                    stretch=stretch,
                    detail="the every-step checks (loss, gradients, non-finite) alone cost more "
                    "than the budget on this step size; they keep their cadence",
                )
            return
        if share > budget:
            stretch *= 2
        elif share < budget * _RELAX and stretch > 1:
            stretch //= 2
        else:
            return
        self.stretch = stretch
        base = self.base
        self.probe.cadence = replace(
            base,
            param_every=base.param_every * stretch,
            update_every=base.update_every * stretch,
            vanishing_every=base.vanishing_every * stretch,
            activation_every=base.activation_every * stretch,
        )
        _log.info(
            "overhead_budget_cadence", overhead=round(share, 4), budget=budget, stretch=stretch
        )


def _share(own: float, total: float) -> float | None:
    rest = total - own
    if total <= 0.0:
        return None
    return own / rest if rest > 0.0 else float("inf")
