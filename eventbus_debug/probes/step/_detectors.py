"""Small stateful windows that judge one number per step: loss spikes, gradient explosions.

Both are judged on the host from values the step probe already transferred, so they cost a few
list operations per step. Both are robust by construction, because a detector that fires on a
healthy run is a bug:

* the baseline is a running **median** (not a mean a single outlier drags along), and the
  noise scale is the median absolute deviation (MAD) of the same window;
* a value at or below the baseline is never a spike (a drop is an improvement), and zero,
  negative and converged losses are handled with an absolute tolerance scaled to the run;
* what fired stays out of the baseline, so a spike cannot teach the detector that spikes are
  normal, and :meth:`reset` restarts the window after a restore.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import deque
from dataclasses import dataclass
from enum import Enum
from typing import Final

from typing_extensions import Self

from ..levels import Thresholds

__all__ = (
    "ExplosionDetector",
    "ExplosionVerdict",
    "LossSpikeDetector",
    "SpikeRule",
    "SpikeVerdict",
)

_MAD_TO_SIGMA: Final = 1.4826
"""MAD x 1.4826 estimates the standard deviation of normally distributed values."""

_MIN_NOISE: Final = 5
"""Losses in the window before its spread (MAD) is trusted. With fewer, nothing is known of the
noise, so the relative tolerance is widened by ``_MIN_NOISE / n`` (10x the baseline above it
with one loss seen, the plain ``rtol`` from five on)."""


class _RunningMedian:
    """The median and MAD of the last *size* values, kept sorted incrementally (bisect)."""

    __slots__ = ("_order", "_sorted")

    def __init__(self, size: int) -> None:
        self._order: deque[float] = deque(maxlen=size)
        self._sorted: list[float] = []

    def __len__(self) -> int:
        return len(self._order)

    def add(self, value: float) -> None:
        order = self._order
        if len(order) == order.maxlen:
            old = order[0]
            del self._sorted[bisect_left(self._sorted, old)]
        order.append(value)
        insort(self._sorted, value)

    def clear(self) -> None:
        self._order.clear()
        self._sorted.clear()

    def median(self) -> float:
        ordered = self._sorted
        n = len(ordered)
        mid = n // 2
        return ordered[mid] if n % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])

    def mad(self, median: float) -> float:
        """The median absolute deviation from *median* (the window's median), in O(log size).

        The deviations below and above *median* are two already sorted runs, walking out from
        the median in the sorted window: ``a(i) = median - ordered[hi - 1 - i]`` and
        ``b(j) = ordered[hi + j] - median``. Their median is found by bisecting how many of the
        ``n // 2 + 1`` smallest deviations come from ``a`` (the classic k-th smallest of two
        sorted arrays), without building either run. It runs on every loss above the median.
        """
        ordered = self._sorted
        n = len(ordered)
        hi = bisect_left(ordered, median)  # the first value at or above the median
        nb = n - hi
        count = n // 2 + 1  # the middle deviation is the count-th smallest
        inf = math.inf
        lo_i, up_i = max(0, count - nb), min(count, hi)
        while True:  # i deviations come from a, j = count - i from b
            i = (lo_i + up_i) // 2
            j = count - i
            a_last = median - ordered[hi - i] if i > 0 else -inf  # a(i - 1)
            b_next = ordered[hi + j] - median if j < nb else inf  # b(j)
            if a_last > b_next:
                up_i = i - 1
                continue
            b_last = ordered[hi + j - 1] - median if j > 0 else -inf  # b(j - 1)
            a_next = median - ordered[hi - 1 - i] if i < hi else inf  # a(i)
            if b_last > a_next:
                lo_i = i + 1
                continue
            break
        # the count-th smallest is the larger of the two last taken; for an even n the median
        # averages it with the one before (the second largest taken)
        if a_last >= b_last:
            if n % 2:
                return a_last
            a_prev = median - ordered[hi - i + 1] if i > 1 else -inf  # a(i - 2)
            return 0.5 * (max(a_prev, b_last) + a_last)
        if n % 2:
            return b_last
        b_prev = ordered[hi + j - 2] - median if j > 1 else -inf  # b(j - 2)
        return 0.5 * (max(a_last, b_prev) + b_last)


class SpikeRule(Enum):
    """Which loss-spike rule fired."""

    SPIKE = "spike"
    """One loss far above the baseline (Lightning's ``SpikeDetection`` flags these)."""
    SUSTAINED = "sustained"
    """The loss stayed far above the baseline for ``patience`` steps in a row."""


@dataclass(frozen=True, slots=True)
class SpikeVerdict:
    """A loss the detector judged a spike.

    Attributes:
        rule: which rule fired.
        baseline: the running median it was compared with.
        tolerance: how far above the baseline a loss may go before it is a spike.
        streak: how many spiking steps in a row, this one included.
    """

    rule: SpikeRule
    baseline: float
    tolerance: float
    streak: int


class LossSpikeDetector:
    """Flags losses far above their recent median; a drop is never a spike.

    A loss is a spike when, after *warmup* finite losses (Lightning: 1),
    ``loss - median > max(rtol * |median|, mad_factor * sigma, atol, scale_tol * scale)`` where
    ``sigma`` is the MAD-based noise of the window and ``scale`` the largest ``|median|`` the
    run has had (so a loss converging to 1e-17 may wobble by 1e-15 without alarm). Spikes stay
    out of the window. An envelope keeps heavy-tailed minibatch noise (an overfitting
    classifier's rare batch at 25x the median) quiet: the excess must also exceed *rtol* times
    the largest robust z-score the run has had (decaying by *tail_decay* per step: a half-life
    of about 7,000 steps). *patience* spiking or elevated losses in a row are reported as
    :attr:`SpikeRule.SUSTAINED` and the window restarts at the new level (the loss moved; the
    detector does not go blind).

    Args:
        window: how many recent losses the median covers.
        warmup: how many finite losses before the first check.
        rtol: relative tolerance (Lightning: 2.0, i.e. three times the baseline).
        atol: absolute tolerance.
        mad_factor: how many noise sigmas above the median a loss may go.
        scale_tol: tolerance as a fraction of the largest baseline the run has had.
        patience: spiking or elevated steps in a row before :attr:`SpikeRule.SUSTAINED`.
        sustained_rtol: a loss more than this x ``|median|`` above the median ...
        sustained_mad: ... and this many noise sigmas above it is *elevated*; *patience*
            elevated or spiking losses in a row are a sustained spike.
        tail_decay: per-step decay of the run's largest z-score.
    """

    __slots__ = (
        "_scale",
        "_streak",
        "_tail",
        "_window",
        "atol",
        "mad_factor",
        "patience",
        "rtol",
        "scale_tol",
        "sustained_mad",
        "sustained_rtol",
        "tail_decay",
        "warmup",
    )

    def __init__(
        self,
        *,
        window: int,
        warmup: int,
        rtol: float,
        atol: float,
        mad_factor: float,
        scale_tol: float,
        patience: int,
        sustained_rtol: float = 0.5,
        sustained_mad: float = 4.0,
        tail_decay: float = 0.9999,
    ) -> None:
        self._window = _RunningMedian(window)
        self.warmup = warmup
        self.rtol = rtol
        self.atol = atol
        self.mad_factor = mad_factor
        self.scale_tol = scale_tol
        self.patience = patience
        self.sustained_rtol = sustained_rtol
        self.sustained_mad = sustained_mad
        self._scale = 0.0
        self._streak = 0
        self._tail = 0.0
        self.tail_decay = tail_decay

    @classmethod
    def from_thresholds(cls, th: Thresholds) -> Self:
        """The detector the ``spike_*`` fields of *th* describe."""
        return cls(
            window=th.spike_window,
            warmup=th.spike_warmup,
            rtol=th.spike_rtol,
            atol=th.spike_atol,
            mad_factor=th.spike_mad,
            scale_tol=th.spike_scale_tol,
            patience=th.spike_patience,
        )

    def reset(self) -> None:
        """Forget the window and the streak (after a restore: the loss level is the snapshot's)."""
        self._window.clear()
        self._streak = 0

    def observe(self, loss: float) -> SpikeVerdict | None:
        """Judge one finite loss; returns the verdict when it is a spike, else ``None``."""
        window = self._window
        if len(window) < self.warmup:
            window.add(loss)
            return None
        median = window.median()
        self._scale = max(self._scale, abs(median))
        excess = loss - median
        if excess <= 0.0:
            self._streak = 0
            window.add(loss)
            return None
        n = len(window)
        sigma = _MAD_TO_SIGMA * window.mad(median) if n >= _MIN_NOISE else 0.0
        floor = max(self.atol, self.scale_tol * self._scale)
        tolerance = max(
            self.rtol * abs(median) * max(1.0, _MIN_NOISE / n), self.mad_factor * sigma, floor
        )
        # ... and beyond the run's own noise: its robust z-score must exceed the largest the run
        # has had (decaying), so heavy-tailed minibatch noise (an overfitting classifier's rare
        # batch at 25x the median) widens the bar instead of firing.
        z = excess / sigma if sigma > 0 else 0.0
        self._tail *= self.tail_decay
        tail = self.rtol * self._tail * sigma
        if excess > tolerance and excess > tail:
            self._streak += 1
            if self._streak >= self.patience:
                return self._sustained(loss, median, tolerance)
            return SpikeVerdict(SpikeRule.SPIKE, median, tolerance, self._streak)  # kept out
        # Not a spike. An *elevated* loss (well above the noise, not far enough for a spike)
        # joins the window but keeps the streak going: a level shift that persists for
        # `patience` steps is sustained even when no single loss is a spike.
        elevated = n >= _MIN_NOISE and excess > max(
            self.sustained_rtol * abs(median), self.sustained_mad * sigma, floor
        )
        self._streak = self._streak + 1 if elevated else 0
        if self._streak >= self.patience:
            return self._sustained(loss, median, tolerance)
        self._tail = max(self._tail, z)  # the run's own noise: its largest robust z-score
        window.add(loss)
        return None

    def _sustained(self, loss: float, median: float, tolerance: float) -> SpikeVerdict:
        streak = self._streak
        self.reset()
        self._window.add(loss)  # the new level is the baseline from here on
        return SpikeVerdict(SpikeRule.SUSTAINED, median, tolerance, streak)


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
    accepted norms, and above the largest norm the run has accepted, is an explosion; an
    absolute *cap* applies from the first check. Zero, non-finite and exploded norms never enter
    the window (an explosion cannot raise its own bar).

    Args:
        window: how many accepted norms the median covers.
        factor: the growth factor over the median.
        cap: the absolute cap (``None``: none).
        floor: a norm below this fraction of the largest the run accepted is never an
            explosion (a converged BERT-like model's median norm falls 100x while hard batches
            keep early-training norms: 207 false incidents over 20k steps with 0.1).
    """

    __slots__ = ("_largest", "_window", "cap", "factor", "floor")

    def __init__(
        self, *, window: int, factor: float, cap: float | None, floor: float = 1.0
    ) -> None:
        self._window = _RunningMedian(window)
        self.factor = factor
        self.cap = cap
        self.floor = floor
        self._largest = 0.0

    @classmethod
    def from_thresholds(cls, th: Thresholds) -> Self:
        """The detector the ``explosion*`` fields of *th* describe."""
        return cls(window=th.explosion_window, factor=th.explosion_factor, cap=th.explosion)

    @property
    def largest(self) -> float:
        """The largest accepted norm so far."""
        return self._largest

    def reset(self) -> None:
        """Restart the window (after a restore); the largest norm seen is kept."""
        self._window.clear()

    def observe(self, norm: float) -> ExplosionVerdict | None:
        """Judge one finite total norm; returns the verdict when it exploded, else ``None``."""
        if norm == 0.0:
            return None  # a zero gradient (a converged or satisfied loss) says nothing of scale
        window = self._window
        count = len(window)
        baseline = window.median() if count else math.nan
        # A converged model's norms shrink by orders of magnitude while a hard batch still has
        # the norms of early training: 10x that tiny median is noise, not an explosion, as long
        # as it stays within what the run has already seen (and accepted).
        growth = max(self.factor * baseline, self.floor * self._largest) if count else math.inf
        cap = self.cap if self.cap is not None else math.inf
        threshold = min(cap, growth)
        if norm > threshold:
            rule = "cap" if cap <= growth else "growth"
            return ExplosionVerdict(threshold, baseline, self._largest, rule)
        window.add(norm)
        self._largest = max(self._largest, norm)
        return None
