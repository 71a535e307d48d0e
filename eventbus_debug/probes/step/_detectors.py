"""Small stateful windows that judge one number per step: loss spikes, gradient explosions.

Both are judged on the host from values the step probe already transferred, so they cost a few
list operations per step. Both are robust by construction, because a detector that fires on a
healthy run is a bug:

* the baseline is a running **median** (not a mean a single outlier drags along), and the
  noise scale is the median absolute deviation (MAD) of the same window;
* a value at or below the baseline is never a spike (a drop is an improvement), and zero,
  negative and converged losses are handled with an absolute tolerance scaled to the run;
* what fired stays out of the baseline, so a spike cannot teach the detector that spikes are
  normal, and :meth:`reset` restarts the window after a restore;
* a high loss at a level the run's recent outliers keep reaching (a second task's batches, a
  long-sequence bucket, a heavy tail) is the data's distribution, not a spike: the loss-spike
  detector remembers its outliers for a while and judges each new one against them; the
  explosion detector does the same for a gradient norm's heavy tail, and learns a run's own
  scale when its very first norms are above the absolute cap (a regression on raw prices);
* a value the run has shown *recently* while healthy is not a spike or an explosion relative to
  a converged baseline: a converged model that meets harder or noisier data (a curriculum step,
  a data-mix change) sees its loss and gradient norm climb back toward early-training levels,
  which is a distribution shift. A loss at or below the largest baseline (running median) the
  run has had over the last *memory* observations, and a norm within twice the largest
  baseline of the last *memory* checks, are the data; what goes beyond that range is judged
  as before. The range is recent, not the whole run's: a model converged for longer than
  *memory* steps that climbs back to its first losses or norms is reported (a late spike on a
  multi-day run is what the detectors are for).
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, bisect_right, insort
from collections import deque
from dataclasses import dataclass
from enum import Enum
from typing import Final

from typing_extensions import Self

from ..._validate import positive_int, positive_number
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
with one loss seen, the plain ``rtol`` from five on). Below five, the spread of the few losses
seen (largest minus smallest) stands in for ``|median|`` when it is larger: a loss hovering
around zero (a policy-gradient loss whose sign flips) has a tiny median but not a tiny noise."""

_SCALE_VALUES: Final = 5
"""Values in a window before its median counts as a baseline the run has had (the largest such
baseline of the last *memory* observations is the run's range, see :class:`LossSpikeDetector`
and :class:`ExplosionDetector`): one value, a first loss or a first norm, is a sample, not a
level."""

_RECENT_BLOCKS: Final = 20
"""How many blocks the run's range (:class:`_RecentMax`) splits *memory* observations into."""

_LEVEL_BELOW: Final = 0.5
_LEVEL_ABOVE: Final = 10.0
"""An earlier outlier is at the *level* of a loss ``median + excess`` when it lies between
``median + 0.5 x excess`` and ``median + 10 x excess``: of the same order above today's
baseline. Losses usually fall, so an outlier from a few hundred steps ago at a higher level
still counts; one a hundred times higher (an explosion) vouches for nothing smaller."""


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

    def spread(self) -> float:
        """The largest value minus the smallest (0.0 when empty)."""
        ordered = self._sorted
        return ordered[-1] - ordered[0] if ordered else 0.0

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


class _Outliers:
    """Values remembered for a bounded number of observations, sorted (bisect) for counting.

    Attributes:
        order: ``(observation, value)`` in arrival order (the oldest first, to expire).
        ordered: the same values, sorted.
    """

    __slots__ = ("order", "ordered")

    def __init__(self) -> None:
        self.order: deque[tuple[int, float]] = deque()
        self.ordered: list[float] = []

    def expire(self, before: int) -> None:
        """Forget what was added at an observation number below *before*."""
        order, ordered = self.order, self.ordered
        while order and order[0][0] < before:
            del ordered[bisect_left(ordered, order.popleft()[1])]

    def add(self, at: int, value: float) -> None:
        self.order.append((at, value))
        insort(self.ordered, value)

    def count(self, low: float, high: float) -> int:
        """How many remembered values lie in ``[low, high]``."""
        return bisect_right(self.ordered, high) - bisect_left(self.ordered, low)

    def clear(self) -> None:
        self.order.clear()
        self.ordered.clear()


class _RecentMax:
    """The largest value fed over about the last *memory* observations (the run's range).

    The observations are grouped into blocks of ``memory // 20`` (at least one); the largest
    value of each of the last ``ceil(memory / block)`` complete blocks is kept, and the current
    block's. A value is so remembered for at least *memory* observations and for less than
    *memory* plus two blocks (1,000 to 1,049 observations with the default 1,000), in O(1)
    amortized: :meth:`feed` is two comparisons, and :meth:`roll` runs once a block, over at
    most forty numbers.

    Attributes:
        largest: the largest value remembered (*empty* when none is).
        current: the largest value fed in the current block (*empty* when none was).
        end: the observation that starts the next block (:meth:`roll` is due).
    """

    __slots__ = ("_blocks", "_count", "_size", "current", "empty", "end", "largest")

    def __init__(self, memory: int, empty: float) -> None:
        size = max(1, memory // _RECENT_BLOCKS)
        self._size = size
        self._count = -(-memory // size)  # complete blocks kept: at least *memory* observations
        self._blocks: deque[float] = deque(maxlen=self._count)
        self.empty = empty
        self.current = self.largest = empty
        self.end = 1 + size  # observations are numbered from 1

    def feed(self, value: float) -> None:
        """Remember *value* in the current block (call :meth:`roll` first when it is due)."""
        if value > self.current:
            self.current = value
            if value > self.largest:
                self.largest = value

    def roll(self, now: int) -> None:
        """Close the blocks that ended before observation *now* (``now >= end``)."""
        blocks, size, empty = self._blocks, self._size, self.empty
        blocks.append(self.current)
        passed = (now - self.end) // size  # whole blocks since, with nothing fed (a gap)
        if passed:
            blocks.extend([empty] * min(passed, self._count))
        self.end += (passed + 1) * size
        self.current = empty
        self.largest = max(blocks)


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
    """Flags losses far above their recent median, unless the run keeps reaching that level.

    A loss is an *outlier* when, after *warmup* finite losses (Lightning: 1),
    ``loss - median > max(rtol * |median|, mad_factor * sigma, atol, scale_tol * scale)`` where
    ``sigma`` is the MAD-based noise of the window and ``scale`` the largest ``|median|`` the
    run has had (so a loss converging to 1e-17 may wobble by 1e-15 without alarm). An envelope
    keeps heavy-tailed minibatch noise (an overfitting classifier's rare batch at 25x the
    median) quiet: the excess must also exceed *rtol* times the largest robust z-score the run
    has had (decaying by *tail_decay* per step: a half-life of about 7,000 steps). A loss more
    than *sustained_rtol* x ``|median|`` and *sustained_mad* sigmas above the median is
    *elevated*.

    A loss at or below the largest baseline the run has had over the last *memory* observations
    (a running median of at least five losses) is within the range the run has recently shown
    while healthy, and is never reported: a converged classifier meeting 10 % label noise goes
    from 0.012 back to 1.2 (its first baseline, 500 steps earlier, was 2.3), a WGAN generator's
    loss drifts back to where it started; the data moved, the training did not break. Such a
    loss is judged and remembered like any other (a level it shows is learned, a streak of them
    restarts the window at the new level) but it joins the window instead of being kept out.
    The range is the recent one, not the whole run's: a language model converged from 10.8 to
    2.5 for more than *memory* steps that spikes back to 8 is reported (within *memory* steps
    of a baseline above 8 it is not: the trade). A loss beyond the range is judged as before,
    and a streak that crosses it is still one streak. The level a reported
    :attr:`SpikeRule.SUSTAINED` restart moved the baseline to is not a healthy one, so it does
    not join the range until the baseline is back within it, or has held that level for
    *memory* observations (then it is the run's level).

    Outliers and elevated losses are remembered for *memory* observations, flagged or not, so
    the detector learns a high loss that recurs (a second task's batches, a long-sequence
    bucket, a heavy tail) instead of firing on it forever. An earlier outlier is *at the level*
    of a loss ``median + excess`` when it lies between ``median + 0.5 x excess`` and
    ``median + 10 x excess``; earlier means outside the current streak, so the losses of one
    shift never vouch for each other. Then:

    * the level is **frequent** when at least one earlier outlier is at it and they make up at
      least *frequent* of the losses judged (of the last *memory*);
    * the level is **known** when an earlier *run* of at least *patience* outliers in a row
      held it (length-bucketed batches, a recurring curriculum phase);
    * an outlier is reported as :attr:`SpikeRule.SPIKE` unless its level is frequent, known,
      or reached by at least *recurrence* earlier outliers; a spike stays out of the window,
      a recurring outlier joins it (it is the data);
    * *patience* outliers or elevated losses in a row whose level is neither frequent nor
      known are reported as :attr:`SpikeRule.SUSTAINED` and the window restarts at the new
      level (the loss moved; the detector does not go blind).

    So the first appearance of a level is always reported, a single spike never vouches for the
    next one (two are needed, and one explosion vouches for nothing ten times smaller), a shift
    that stays is sustained even inside a multimodal stream, and what is learned is forgotten
    after *memory* observations or a :meth:`reset`. An outlier costs a few bisections and one
    sorted insert into a list of at most *memory* floats (a microsecond or two); any other loss
    two more comparisons than before.

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
        memory: how many observations an outlier (and a run of them) is remembered, and how
            far back the run's range (its largest baseline) reaches.
        recurrence: how many earlier outliers at a loss's level make it recurring.
        frequent: the share of the judged losses that earlier outliers at a level must make
            up for the level to be frequent (a streak at a frequent level is chance, not a
            shift: a 30 % task has five batches in a row every few hundred steps).

    Raises:
        ValueError: if *memory* or *recurrence* is not an int >= 1, or *frequent* is not a
            number in ``(0, 1]``.
    """

    __slots__ = (
        "_judged",
        "_outliers",
        "_peak_held",
        "_peaks",
        "_run",
        "_run_length",
        "_runs",
        "_scale",
        "_streak",
        "_streak_losses",
        "_tail",
        "_window",
        "atol",
        "frequent",
        "mad_factor",
        "memory",
        "patience",
        "recurrence",
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
        memory: int = 1000,
        recurrence: int = 2,
        frequent: float = 0.1,
    ) -> None:
        self.memory = positive_int("memory", memory)
        self.recurrence = positive_int("recurrence", recurrence)
        if positive_number("frequent", frequent) > 1.0:
            msg = f"frequent must be a number in (0, 1], got {frequent!r}"
            raise ValueError(msg)
        self.frequent = float(frequent)
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
        self._peaks = _RecentMax(self.memory, -math.inf)
        """The largest healthy baseline (running median, signed) of the last *memory*
        observations: the run's range."""
        self._peak_held = 0
        """The observation of a sustained restart (0: none), until the baseline is back at or
        below the peak or has held for *memory* observations: until then the reported level
        is not a healthy baseline."""
        self._streak = 0
        self._streak_losses: list[float] = []
        """The outliers of the current streak (they never vouch for each other)."""
        self._tail = 0.0
        self.tail_decay = tail_decay
        self._judged = 0
        """Observations so far: the clock of the memories."""
        self._outliers = _Outliers()
        """Every recent outlier or elevated loss, flagged or not."""
        self._runs = _Outliers()
        """The level each recent run of *patience* or more outliers in a row held."""
        self._run: list[float] = []
        """The current run of outliers: a min-heap of its *patience* largest losses."""
        self._run_length = 0

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
        """Forget the window, the streak and the outliers (after a restore: the loss level is
        the snapshot's, and what the undone steps showed vouches for nothing); the baselines
        of the last *memory* observations are kept (the run has shown that range), and still
        expire with them."""
        self._window.clear()
        self._streak = 0
        self._streak_losses.clear()
        self._outliers.clear()
        self._runs.clear()
        self._run.clear()
        self._run_length = 0

    def observe(self, loss: float) -> SpikeVerdict | None:
        """Judge one finite loss; returns the verdict when it is a spike, else ``None``."""
        judged = self._judged = self._judged + 1
        outliers, runs = self._outliers, self._runs
        horizon = judged - self.memory
        oldest = outliers.order
        if oldest and oldest[0][0] < horizon:
            outliers.expire(horizon)
        oldest = runs.order
        if oldest and oldest[0][0] < horizon:
            runs.expire(horizon)
        peaks = self._peaks
        if judged >= peaks.end:
            peaks.roll(judged)
        window = self._window
        if len(window) < self.warmup:
            window.add(loss)
            return None
        median = window.median()
        self._scale = max(self._scale, abs(median))
        held = self._peak_held
        if held and (judged - held > self.memory or median <= peaks.largest):
            held = self._peak_held = 0  # back within the range, or the run's level by now
        if not held and len(window) >= _SCALE_VALUES:
            peaks.feed(median)
        excess = loss - median
        if excess <= 0.0:
            if self._run_length:
                self._calm()
            window.add(loss)
            return None
        n = len(window)
        if n >= _MIN_NOISE:
            sigma = _MAD_TO_SIGMA * window.mad(median)
            relative = self.rtol * abs(median)
        else:
            sigma = 0.0
            relative = self.rtol * max(abs(median), window.spread()) * _MIN_NOISE / n
        floor = max(self.atol, self.scale_tol * self._scale)
        tolerance = max(relative, self.mad_factor * sigma, floor)
        # ... and beyond the run's own noise: its robust z-score must exceed the largest the run
        # has had (decaying), so heavy-tailed minibatch noise (an overfitting classifier's rare
        # batch at 25x the median) widens the bar instead of firing.
        z = excess / sigma if sigma > 0 else 0.0
        self._tail *= self.tail_decay
        spike = excess > tolerance and excess > self.rtol * self._tail * sigma
        # An *elevated* loss (well above the noise, maybe not far enough for a spike) keeps a
        # streak going: a level shift that persists for `patience` steps is sustained even
        # when no single loss is a spike.
        elevated = n >= _MIN_NOISE and excess > max(
            self.sustained_rtol * abs(median), self.sustained_mad * sigma, floor
        )
        if not (spike or elevated):
            if self._run_length:
                self._calm()
            if n < _MIN_NOISE and excess > max(self.sustained_rtol * abs(median), floor):
                # no noise estimate yet: not judged elevated, but remembered (a second task's
                # batch among the first five losses is an outlier the run will show again)
                outliers.add(judged, loss)
            self._tail = max(self._tail, z)  # the run's own noise: its largest robust z-score
            window.add(loss)
            return None
        # An outlier: is its level one the run keeps reaching?
        low, high = median + _LEVEL_BELOW * excess, median + _LEVEL_ABOVE * excess
        earlier = outliers.count(low, high) - sum(
            1 for v in self._streak_losses if low <= v <= high
        )
        common = earlier > 0 and earlier >= self.frequent * min(judged - 1, self.memory)
        known = common or runs.count(low, high) > 0
        outliers.add(judged, loss)
        self._extend_run(loss)
        if known:
            self._streak = 0  # the data's own level: no shift
            self._streak_losses.clear()
        else:
            self._streak += 1
            self._streak_losses.append(loss)
            if self._streak >= self.patience:
                return self._sustained(loss, median, tolerance)
        # A loss within the run's range (at or below its largest healthy baseline) is never
        # reported: it joins the window (a converged model meeting harder data climbs back
        # toward its early losses; that is the data), but it is remembered as an outlier like
        # any other, so a level it shows is learned and the losses of one streak still never
        # vouch for each other.
        if spike and not (known or earlier >= self.recurrence) and loss > peaks.largest:
            return SpikeVerdict(SpikeRule.SPIKE, median, tolerance, self._streak)  # kept out
        if not spike:
            self._tail = max(self._tail, z)
        window.add(loss)  # an elevated or recurring loss is the data
        return None

    def _extend_run(self, loss: float) -> None:
        """Add *loss* to the current run of outliers (its *patience* largest are kept)."""
        run = self._run
        if len(run) < self.patience:
            heapq.heappush(run, loss)
        elif loss > run[0]:
            heapq.heapreplace(run, loss)
        self._run_length += 1

    def _calm(self) -> None:
        """A loss that is no outlier: the streak and the run end (a long run is remembered)."""
        self._streak = 0
        self._streak_losses.clear()
        self._end_run()

    def _end_run(self) -> None:
        if self._run_length >= self.patience:
            # the level the run held for `patience` losses: its patience-th largest
            self._runs.add(self._judged, self._run[0])
        self._run.clear()
        self._run_length = 0

    def _sustained(self, loss: float, median: float, tolerance: float) -> SpikeVerdict | None:
        streak = self._streak
        self._streak = 0
        self._streak_losses.clear()
        self._end_run()  # remembered: the same shift again is a known level
        self._window.clear()
        self._window.add(loss)  # the new level is the baseline from here on
        if loss <= self._peaks.largest:
            return None  # a shift back within the run's range: the data moved, not reported
        self._peak_held = self._judged  # a reported level is not a healthy baseline of the run
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
    accepted norms, above the largest norm the run has accepted, and above *reach* (2) times
    the largest median (of at least five norms) of the last *memory* checks, is an explosion.
    Zero, non-finite and exploded norms never enter the window (an explosion cannot raise its
    own bar).

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

    Raises:
        ValueError: if *memory* or *recurrence* is not an int >= 1, or *reach* is not a
            finite positive number.
    """

    __slots__ = (
        "_above_cap",
        "_checks",
        "_largest",
        "_peaks",
        "_streak",
        "_tail",
        "_window",
        "cap",
        "factor",
        "floor",
        "memory",
        "reach",
        "recurrence",
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
    ) -> None:
        self.memory = positive_int("memory", memory)
        self.recurrence = positive_int("recurrence", recurrence)
        self.reach = positive_number("reach", reach)
        self._peaks = _RecentMax(self.memory, 0.0)
        """The largest median of accepted norms of the last *memory* checks (the run's
        healthy scale)."""
        self._checks = 0
        self._tail = _Outliers()
        """Recent accepted norms above half the growth bar (the run's heavy tail)."""
        self._streak = 0
        """The check that started the current streak of tail or exploded norms (0: none);
        the norms of one streak never vouch for each other."""
        self._window = _RunningMedian(window)
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

    def observe(self, norm: float) -> ExplosionVerdict | None:
        """Judge one finite total norm; returns the verdict when it exploded, else ``None``."""
        if norm == 0.0:
            return None  # a zero gradient (a converged or satisfied loss) says nothing of scale
        checks = self._checks = self._checks + 1
        horizon = checks - self.memory
        tail, peaks = self._tail, self._peaks
        if tail.order and tail.order[0][0] < horizon:
            tail.expire(horizon)
        if checks >= peaks.end:
            peaks.roll(checks)
        window = self._window
        if window:
            baseline = window.median()
            if len(window) >= _SCALE_VALUES:
                peaks.feed(baseline)
            # A converged model's norms shrink by orders of magnitude while a hard batch, or
            # harder data, still has the norms of early training: 10x that tiny median is the
            # data, not an explosion, as long as it stays within what the run has already
            # accepted, or within reach of a baseline the run has had recently.
            threshold = max(
                self.factor * baseline,
                self.floor * self._largest,
                self.reach * peaks.largest,
            )
            if norm > 0.5 * self.factor * baseline:
                if not self._streak:
                    self._streak = checks  # the first check of this streak
                if norm > threshold and self._earlier_tail(norm) < self.recurrence:
                    return ExplosionVerdict(threshold, baseline, self._largest, "growth")
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
