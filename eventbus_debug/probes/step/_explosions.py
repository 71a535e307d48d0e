"""The explosion detector: a total gradient norm far above the run's running median, from the
first step (the principles both detectors share: :mod:`._windows`)."""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass
from typing import Any

from typing_extensions import Self

from ..._saved import StateReader
from ..._validate import positive_int, positive_number
from ..levels import Thresholds
from ._windows import SCALE_VALUES, LrRange, Outliers, RecentMax, RunningMedian

__all__ = ("ExplosionDetector", "ExplosionVerdict")


@dataclass(frozen=True, slots=True)
class ExplosionVerdict:
    """A gradient norm the detector judged an explosion.

    Attributes:
        threshold: the norm it exceeded.
        baseline: the running median of accepted norms (``nan`` before the first one).
        largest: the largest norm accepted so far (``0.0`` before the first one).
        rule: ``"growth"`` (against the median) or ``"cap"`` (the absolute cap).
    """

    threshold: float
    baseline: float
    largest: float
    rule: str


class ExplosionDetector:
    """Flags a total gradient norm far above the run's running median, from the first step.

    From the second gradient check a norm above ``factor x median`` of the last *window*
    accepted norms, above the largest norm the run has accepted, and above *reach* (2) times
    the largest median (of at least five norms) of the last *memory* checks, is an explosion.
    Zero, non-finite and exploded norms never enter the window (an explosion cannot raise its
    own bar), except the norms of a level that held (see below).

    The last two are the scale the run has already shown while healthy: a converged model that
    meets harder or noisier data sees its norm climb 30x over its converged median, back to
    early-training norms and a little beyond the largest of them (1.2x on a classifier given
    10 % label noise 500 steps in, 1.2x its first median too), and that is the data, not an
    explosion. The scale is a baseline the run had (a median of *window* norms), not one norm:
    a single hard batch does not widen it (the heavy tail below is learned from recurrence).
    It is the recent scale, not the whole run's: a norm 150x a median the run has held for
    more than *memory* checks is an explosion however large its first norms were, as long as
    it is above the largest norm accepted. The trade: within *memory* checks of a baseline of
    100, a late norm of 30 on a converged median of 1 is not reported; one that goes on is, at
    the first norm beyond that scale, and the loss-spike detector judges the same step on its
    own.

    The absolute *cap* judges only what has nothing to be compared with: a norm while the
    window is empty (the first checks, and the first after a :meth:`reset`). Once the run has
    accepted norms, its own scale is the reference: a regression on raw, unnormalized targets
    (prices around 1e5) has healthy norms of 1e6 to 1e8 from the first step, and a cap judged
    against them fired on every step. With the window empty, a norm above the cap is reported
    once; a later one within *factor* of the smallest norm so reported is the run's scale and
    starts the window (two norms of the same order, step after step, are the data, not an
    explosion), while one more than *factor* times larger is reported as well.

    A heavy tail is learned like the loss-spike detector's recurring levels: an accepted norm
    above half the growth bar (``factor / 2 x median``) is a *tail* norm, remembered for
    *memory* checks. A norm above the growth bar is quiet (and accepted) when at least
    *recurrence* remembered tail norms lie within a factor of 2 below it, outside the current
    streak of tail norms: a seq2seq model whose rare hard batches reach 7x, 8x, then 13x the
    median as its learning rate decays is its data, while a norm climbing step after step
    (one streak) never vouches for itself, and an exploded norm is never remembered (one
    explosion vouches for nothing, and a norm 1000x the median has no tail within 2x of it).

    A norm that moved to a new *level* and stays there is a shift, reported at its onset and
    then learned, like the loss-spike detector's sustained spike: when the current streak has
    lasted *settle* checks, its last *settle* norms (this one included) lie within a factor of
    2 of each other (a level, not a climb) and within *factor* times the scale the run has
    shown (the largest norm it accepted, or *reach* times its largest recent median), the
    window restarts at the streak's norms instead of reporting. Without it a converged
    classifier given noisier data 2,000 steps in (norms back to 2x its early-training ones,
    its early baseline past *memory*) had each of its next 125 norms above the old largest
    reported, until enough lower ones had refilled the median. A norm climbing 1.2x a step
    or faster is no level (every later norm above the bar is reported), nor is one beyond
    *factor* times the run's scale (an LR 1000x too high: reported at every check).

    Args:
        window: how many accepted norms the median covers.
        factor: the growth factor over the median.
        cap: the absolute cap on a norm with no accepted history (``None``: none).
        floor: a norm below this fraction of the largest the run accepted is never an
            explosion (a converged BERT-like model's median norm falls 100x while hard batches
            keep early-training norms: 207 false incidents over 20k steps with 0.1).
        reach: a norm up to this multiple of the largest median of the last *memory* checks
            is never an explosion (a converged classifier meeting 10 % label noise reaches 1.2x both its
            largest early norm and its first median: 7 false incidents with none).
        memory: how many checks a tail norm is remembered, and how far back the run's scale
            (its largest median) reaches.
        recurrence: how many earlier tail norms within 2x below a norm make it the data.
        settle: how many checks a streak must hold one level (within 2x) before the window
            restarts at it.

    Raises:
        ValueError: if *memory*, *recurrence* or *settle* is not an int >= 1, or *reach* is
            not a finite positive number.
    """

    __slots__ = (
        "_above_cap",
        "_checks",
        "_largest",
        "_lr_range",
        "_peaks",
        "_streak",
        "_streak_norms",
        "_tail",
        "_window",
        "cap",
        "factor",
        "floor",
        "memory",
        "reach",
        "recurrence",
        "settle",
    )

    def __init__(
        self,
        *,
        window: int,
        factor: float,
        cap: float | None,
        floor: float = 1.0,
        reach: float = 2.0,
        memory: int = 1000,
        recurrence: int = 2,
        settle: int = 5,
    ) -> None:
        self.memory = positive_int("memory", memory)
        self.recurrence = positive_int("recurrence", recurrence)
        self.settle = positive_int("settle", settle)
        self.reach = positive_number("reach", reach)
        self._peaks = RecentMax(self.memory, 0.0)
        """The largest median of accepted norms of the last *memory* checks (the run's
        healthy scale)."""
        self._lr_range = LrRange(self.memory)
        """The medians the run had by LR: in its scale while the LR rose (a warm restart)."""
        self._checks = 0
        self._tail = Outliers()
        """Recent accepted norms above half the growth bar (the run's heavy tail)."""
        self._streak = 0
        """The check that started the current streak of tail or exploded norms (0: none);
        the norms of one streak never vouch for each other."""
        self._streak_norms: deque[float] = deque(maxlen=window)
        """The norms of the current streak, exploded ones included (a level it held restarts
        the window)."""
        self._window = RunningMedian(window)
        self.factor = factor
        self.cap = cap
        self.floor = floor
        self._largest = 0.0
        self._above_cap = math.inf
        """The smallest norm reported above the cap while the window was empty."""

    @classmethod
    def from_thresholds(cls, th: Thresholds) -> Self:
        """The detector the ``explosion*`` fields of *th* describe."""
        return cls(window=th.explosion_window, factor=th.explosion_factor, cap=th.explosion)

    @property
    def largest(self) -> float:
        """The largest accepted norm so far."""
        return self._largest

    def reset(self) -> None:
        """Restart the window (after a restore); the largest norm seen and the medians of the
        last *memory* checks are kept (they still expire with them), what was reported above
        the cap is forgotten (the undone steps vouch for nothing)."""
        self._window.clear()
        self._above_cap = math.inf
        self._tail.clear()
        self._streak = 0
        self._streak_norms.clear()

    def state(self) -> dict[str, Any]:
        """What the detector learned, as plain values (see :meth:`load`)."""
        return {
            "window": self._window.state(),
            "peaks": self._peaks.state(),
            "lr_range": self._lr_range.state(),
            "checks": self._checks,
            "tail": self._tail.state(),
            "streak": self._streak,
            "streak_norms": list(self._streak_norms),
            "largest": self._largest,
            "above_cap": self._above_cap,
        }

    def load(self, state: StateReader) -> None:
        """Continue from a :meth:`state` (the thresholds stay this detector's own).

        Raises:
            ValueError: if a field is missing or malformed (the message names it).
        """
        window = state.numbers("window")
        peaks, lr_range = state.child("peaks"), state.child("lr_range")
        checks, tail = state.count("checks"), state.counted_numbers("tail")
        streak, streak_norms = state.count("streak"), state.numbers("streak_norms")
        largest, above_cap = state.number("largest"), state.number("above_cap")
        self._window.load(window)
        self._peaks.load(peaks)
        self._lr_range.load(lr_range)
        self._checks = checks
        self._tail.load(tail)
        self._streak = streak
        self._streak_norms.clear()
        self._streak_norms.extend(streak_norms)
        self._largest = largest
        self._above_cap = above_cap

    def observe(self, norm: float, lr: float | None = None) -> ExplosionVerdict | None:
        """Judge one finite total norm; returns the verdict when it exploded, else ``None``.

        *lr* is the learning rate of the step (the optimizer's, ``None``: unknown): while it
        is at least twice its lowest value of the last *memory* checks (a warm restart), the
        run's scale also holds the largest median it had at an LR of that order, however long
        ago (:class:`~._windows.LrRange`).
        """
        if norm == 0.0:
            return None  # a zero gradient (a converged or satisfied loss) says nothing of scale
        checks = self._checks = self._checks + 1
        lr_range = self._lr_range
        lr_range.step(checks, lr)
        horizon = checks - self.memory
        tail, peaks = self._tail, self._peaks
        if tail.order and tail.order[0][0] < horizon:
            tail.expire(horizon)
        if checks >= peaks.end:
            peaks.roll(checks)
        window = self._window
        if window:
            baseline = window.median()
            if len(window) >= SCALE_VALUES:
                peaks.feed(baseline)
                lr_range.feed(baseline)
            # A converged model's norms shrink by orders of magnitude while a hard batch, or
            # harder data, still has the norms of early training: 10x that tiny median is the
            # data, not an explosion, as long as it stays within what the run has already
            # accepted, or within reach of a baseline the run has had recently.
            threshold = self._bar(baseline)
            if norm > threshold and lr_range.raised:
                # the LR rose: the scale the run had at this LR, however long ago, is its own
                threshold = max(threshold, self._scale())
            if norm > 0.5 * self.factor * baseline:
                if not self._streak:
                    self._streak = checks  # the first check of this streak
                    self._streak_norms.clear()
                self._streak_norms.append(norm)
                if norm > threshold and self._earlier_tail(norm) < self.recurrence:
                    if not self._settled():
                        return ExplosionVerdict(threshold, baseline, self._largest, "growth")
                    self._restart()  # a shift that held: the streak's level is the baseline
                    return None
                tail.add(checks, norm)
            else:
                self._streak = 0
        elif self.cap is not None and norm > self.cap:
            # Nothing accepted to compare with: the cap judges. A norm of the order of one
            # already reported is the run's scale; the first of its order is reported.
            if norm > self.factor * self._above_cap or self._above_cap == math.inf:
                self._above_cap = min(self._above_cap, norm)
                return ExplosionVerdict(self.cap, math.nan, self._largest, "cap")
        window.add(norm)
        self._largest = max(self._largest, norm)
        return None

    def observe_partial(self, norm: float, widen: float) -> ExplosionVerdict | None:
        """Judge the total norm of a partial batch without learning from it: an explosion
        only beyond *widen* times the bar (the cap, before any norm was accepted).

        A batch of a fraction ``1 / widen`` of the run's usual samples (an epoch's last) has a
        gradient that averages fewer samples: one hard sample's gradient is the whole batch's,
        far above a full batch's mean. Its norm joins no window, tail or largest norm, so the
        bars of the full batches are not raised by it. The verdict's threshold is the full
        batches' bar, not the widened one: what a clip brings an exploded gradient back to.
        """
        if norm == 0.0:
            return None
        window = self._window
        if not window:
            if self.cap is not None and norm > widen * self.cap:
                return ExplosionVerdict(self.cap, math.nan, self._largest, "cap")
            return None
        baseline = window.median()
        bar = self._bar(baseline)
        if norm > widen * bar and self._lr_range.raised:
            bar = max(bar, self._scale())
        if norm > widen * bar:
            return ExplosionVerdict(bar, baseline, self._largest, "growth")
        return None

    def _bar(self, baseline: float) -> float:
        """The growth bar over a window whose median is *baseline*: *factor* times it, above
        the largest norm accepted (*floor* times it), and *reach* times the largest recent
        median (before an LR rise widens it, see :meth:`_scale`)."""
        return max(
            self.factor * baseline, self.floor * self._largest, self.reach * self._peaks.largest
        )

    def _settled(self) -> bool:
        """Whether the current streak has held one level (within 2x) for its last *settle*
        checks, within *factor* times the scale the run has shown while healthy."""
        norms = self._streak_norms
        settle = self.settle
        if len(norms) < settle:
            return False
        last = list(itertools.islice(norms, len(norms) - settle, None))
        high = max(last)
        return high <= 2.0 * min(last) and high <= self.factor * self._scale()

    def _scale(self) -> float:
        """The scale the run has shown while healthy: *floor* times the largest norm it
        accepted, or *reach* times its largest recent median, or, while the LR rose, its
        largest median at an LR of the current one's order (:class:`~._windows.LrRange`)."""
        return max(
            self.floor * self._largest,
            self.reach * max(self._peaks.largest, self._lr_range.largest()),
        )

    def _restart(self) -> None:
        """Restart the window at the streak's level (a shift that held); the streak ends."""
        window = self._window
        window.clear()
        for value in self._streak_norms:
            window.add(value)
        self._largest = max(self._largest, max(self._streak_norms))
        self._streak = 0
        self._streak_norms.clear()

    def _earlier_tail(self, norm: float) -> int:
        """How many remembered tail norms lie in ``[norm / 2, norm]``, outside this streak."""
        low = 0.5 * norm
        tail = self._tail
        count = tail.count(low, norm)
        for at, value in reversed(tail.order):
            if at < self._streak:
                break
            if low <= value <= norm:
                count -= 1
        return count
