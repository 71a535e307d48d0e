"""The robust windows the loss-spike and explosion detectors judge one number per step with.

Both are judged on the host from values the step probe already transferred, so they cost a few
list operations per step. Both are robust by construction, because a detector that fires on a
healthy run is a bug:

* the baseline is a running **median** (not a mean a single outlier drags along), and the
  noise scale is the median absolute deviation (MAD) of the same window;
* a value at or below the baseline is never a spike (a drop is an improvement), and zero,
  negative and converged losses are handled with an absolute tolerance scaled to the run;
* what fired stays out of the baseline, so a spike cannot teach the detector that spikes are
  normal, and :meth:`reset` restarts the window after a restore; a level that *holds* (a
  sustained loss spike, or gradient norms that stay at one level within an order of magnitude
  of the run's healthy scale for a few checks) is reported at its onset, then the window
  restarts at it, so a shift is not reported at every step until the median catches up;
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

import math
from bisect import bisect_left, bisect_right, insort
from collections import deque
from typing import Any, Final

from ..._saved import StateReader

__all__ = ("LR_RISE", "LrRange", "RecentMax", "RunningMedian", "Outliers", "SCALE_VALUES")

SCALE_VALUES: Final = 5
"""Values in a window before its median counts as a baseline the run has had (the largest such
baseline of the last *memory* observations is the run's range, see :class:`LossSpikeDetector`
and :class:`ExplosionDetector`): one value, a first loss or a first norm, is a sample, not a
level."""

LR_RISE: Final = 2.0
"""The learning rate *rose* when it is at least this many times its lowest value of the last
*memory* observations (a warm restart, a cyclic schedule's upswing, a warm-up): see
:class:`LrRange`."""

_RECENT_BLOCKS: Final = 20
"""How many blocks the run's range (:class:`RecentMax`) splits *memory* observations into."""


class RunningMedian:
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

    def state(self) -> list[float]:
        """The window's values, oldest first (plain floats: see :mod:`eventbus_debug._saved`)."""
        return list(self._order)

    def load(self, values: list[float]) -> None:
        """Refill the window with *values*, oldest first (the last *size* are kept)."""
        self.clear()
        for value in values:
            self.add(value)

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


class Outliers:
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

    def state(self) -> list[list[float]]:
        """``[observation, value]`` pairs, oldest first."""
        return [[at, value] for at, value in self.order]

    def load(self, pairs: list[tuple[int, float]]) -> None:
        """Remember *pairs* (``(observation, value)``, oldest first) instead."""
        self.order = deque(sorted(pairs, key=lambda p: p[0]))
        self.ordered = sorted(value for _, value in self.order)

    def count(self, low: float, high: float) -> int:
        """How many remembered values lie in ``[low, high]``."""
        return bisect_right(self.ordered, high) - bisect_left(self.ordered, low)

    def clear(self) -> None:
        self.order.clear()
        self.ordered.clear()


class RecentMax:
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

    def state(self) -> dict[str, Any]:
        """The kept blocks' maxima, the current block's, and where the next block starts."""
        return {"blocks": list(self._blocks), "current": self.current, "end": self.end}

    def load(self, state: StateReader) -> None:
        """Take a :meth:`state` back (blocks beyond what this one keeps are dropped, oldest
        first)."""
        self._blocks = deque(state.numbers("blocks"), maxlen=self._count)
        self.current = state.number("current")
        self.end = state.count("end")
        self.largest = max([*self._blocks, self.current, self.empty])

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


class LrRange:
    """The run's healthy baselines by learning rate: its range where the LR just rose.

    An LR that rises (SGDR's warm restart, a cyclic schedule's upswing, a warm-up) kicks the
    model out of the basin the low LR let it settle in: the loss and the gradient norm climb
    back, for a while, to levels the run showed when it last trained at that LR, however long
    ago that was (a restart every 250 steps after 13,000 steps climbed 6x its converged
    median, to a level it had only shown in its first cycle). The detectors' range (their
    largest healthy baseline) is recent, so that a converged run spiking back to its first
    losses is reported; this class widens it exactly where the optimizer says the rise is
    expected: while the LR is at least :data:`LR_RISE` times its lowest value of the last
    *memory* observations, the largest baseline the run ever had at an LR of the same order
    (the same octave, or the ones next to it: within a factor of 2 to 4) is in the range too.
    With a constant or decaying LR nothing changes. The LR is read from the optimizer's
    ``param_groups`` (the largest group's); without an optimizer there is none (``None``).

    Costs one ``log2``, two comparisons and a dict update per observation.

    Attributes:
        raised: the LR of the current observation rose (see above).
    """

    __slots__ = ("_lows", "_octave", "_octaves", "raised")

    def __init__(self, memory: int) -> None:
        self._lows = RecentMax(memory, -math.inf)  # negated LRs: the lowest recent LR
        self._octaves: dict[int, float] = {}  # floor(log2(lr)) -> largest baseline there
        self._octave: int | None = None  # the current observation's (None: no LR known)
        self.raised = False

    def state(self) -> dict[str, Any]:
        """The recent lows, the largest baseline per octave, and the current observation's."""
        return {
            "lows": self._lows.state(),
            "octaves": [[octave, v] for octave, v in sorted(self._octaves.items())],
            "octave": self._octave,
            "raised": self.raised,
        }

    def load(self, state: StateReader) -> None:
        """Take a :meth:`state` back."""
        self._lows.load(state.child("lows"))
        self._octaves = dict(state.counted_numbers("octaves", signed=True))
        self._octave = state.optional_integer("octave")
        self.raised = state.flag("raised")

    def step(self, now: int, lr: float | None) -> None:
        """Observation *now* runs at *lr* (``None``: unknown); call it once per observation,
        before :meth:`feed` and :meth:`largest`."""
        if lr is None or not 0.0 < lr < math.inf:
            self._octave = None
            self.raised = False
            return
        lows = self._lows
        if now >= lows.end:
            lows.roll(now)
        lows.feed(-lr)
        self._octave = math.floor(math.log2(lr))
        self.raised = lr >= -LR_RISE * lows.largest

    def feed(self, baseline: float) -> None:
        """A healthy baseline of the current observation."""
        octave = self._octave
        if octave is not None and baseline > self._octaves.get(octave, -math.inf):
            self._octaves[octave] = baseline

    def largest(self) -> float:
        """The largest baseline the run had at an LR of the current one's order, while the
        LR rose; ``-inf`` otherwise."""
        octave = self._octave
        if not self.raised or octave is None:
            return -math.inf
        get = self._octaves.get
        return max(get(octave - 1, -math.inf), get(octave, -math.inf), get(octave + 1, -math.inf))
