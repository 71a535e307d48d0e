"""The loss-spike detector: a loss far above its recent median, unless the run keeps reaching
that level (the principles both detectors share: :mod:`._windows`)."""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from enum import Enum
from typing import Any, Final

from typing_extensions import Self

from ..._saved import StateReader
from ..._validate import positive_int, positive_number
from ..levels import Thresholds
from ._windows import SCALE_VALUES, LrRange, Outliers, RecentMax, RunningMedian

__all__ = ("LossSpikeDetector", "SpikeRule", "SpikeVerdict")

_MAD_TO_SIGMA: Final = 1.4826
"""MAD x 1.4826 estimates the standard deviation of normally distributed values."""

_MIN_NOISE: Final = 5
"""Losses in the window before its spread (MAD) is trusted. With fewer, nothing is known of the
noise, so the relative tolerance is widened by ``_MIN_NOISE / n`` (10x the baseline above it
with one loss seen, the plain ``rtol`` from five on). Below five, the spread of the few losses
seen (largest minus smallest) stands in for ``|median|`` when it is larger: a loss hovering
around zero (a policy-gradient loss whose sign flips) has a tiny median but not a tiny noise."""

_LEVEL_BELOW: Final = 0.5
_LEVEL_ABOVE: Final = 10.0
"""An earlier outlier is at the *level* of a loss ``median + excess`` when it lies between
``median + 0.5 x excess`` and ``median + 10 x excess``: of the same order above today's
baseline. Losses usually fall, so an outlier from a few hundred steps ago at a higher level
still counts; one a hundred times higher (an explosion) vouches for nothing smaller."""


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
        "_lr_range",
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
        self._window = RunningMedian(window)
        self.warmup = warmup
        self.rtol = rtol
        self.atol = atol
        self.mad_factor = mad_factor
        self.scale_tol = scale_tol
        self.patience = patience
        self.sustained_rtol = sustained_rtol
        self.sustained_mad = sustained_mad
        self._scale = 0.0
        self._peaks = RecentMax(self.memory, -math.inf)
        """The largest healthy baseline (running median, signed) of the last *memory*
        observations: the run's range."""
        self._lr_range = LrRange(self.memory)
        """The baselines the run had by LR: in the range while the LR rose (a warm restart)."""
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
        self._outliers = Outliers()
        """Every recent outlier or elevated loss, flagged or not."""
        self._runs = Outliers()
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

    def state(self) -> dict[str, Any]:
        """What the detector learned, as plain values (see :meth:`load`)."""
        return {
            "window": self._window.state(),
            "scale": self._scale,
            "peaks": self._peaks.state(),
            "lr_range": self._lr_range.state(),
            "peak_held": self._peak_held,
            "streak": self._streak,
            "streak_losses": list(self._streak_losses),
            "tail": self._tail,
            "judged": self._judged,
            "outliers": self._outliers.state(),
            "runs": self._runs.state(),
            "run": list(self._run),
            "run_length": self._run_length,
        }

    def load(self, state: StateReader) -> None:
        """Continue from a :meth:`state` (the thresholds stay this detector's own).

        Raises:
            ValueError: if a field is missing or malformed (the message names it).
        """
        window = state.numbers("window")
        scale = state.number("scale")
        peaks, lr_range = state.child("peaks"), state.child("lr_range")
        peak_held, streak = state.count("peak_held"), state.count("streak")
        streak_losses, tail = state.numbers("streak_losses"), state.number("tail")
        judged = state.count("judged")
        outliers, runs = state.counted_numbers("outliers"), state.counted_numbers("runs")
        run, run_length = state.numbers("run"), state.count("run_length")
        self._window.load(window)
        self._scale = scale
        self._peaks.load(peaks)
        self._lr_range.load(lr_range)
        self._peak_held = peak_held
        self._streak = streak
        self._streak_losses = streak_losses
        self._tail = tail
        self._judged = judged
        self._outliers.load(outliers)
        self._runs.load(runs)
        if len(run) > self.patience:  # a detector with a smaller patience: keep the largest
            run = heapq.nlargest(self.patience, run)
        heapq.heapify(run)
        self._run = run
        self._run_length = run_length

    def observe(self, loss: float, lr: float | None = None) -> SpikeVerdict | None:
        """Judge one finite loss; returns the verdict when it is a spike, else ``None``.

        *lr* is the learning rate the loss was computed under (the optimizer's, ``None``:
        unknown): while it is at least twice its lowest value of the last *memory*
        observations (a warm restart), the range also holds the largest baseline the run had
        at an LR of that order, however long ago (:class:`~._windows.LrRange`).
        """
        judged = self._judged = self._judged + 1
        lr_range = self._lr_range
        lr_range.step(judged, lr)
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
        if held and (judged - held > self.memory or median <= self._range()):
            held = self._peak_held = 0  # back within the range, or the run's level by now
        if not held and len(window) >= SCALE_VALUES:
            peaks.feed(median)
            lr_range.feed(median)
        excess = loss - median
        if excess <= 0.0:
            if self._run_length:
                self._calm()
            window.add(loss)
            return None
        n = len(window)
        relative, sigma, floor = self._noise(median)
        if relative == 0.0 and sigma == 0.0 and floor == 0.0:
            # No scale yet: every loss so far was exactly zero (a loss weight ramped up from 0,
            # a first batch that is all padding). Any positive loss is "infinitely" far above
            # that; it is the run's first measure of its scale, not a spike.
            if self._run_length:
                self._calm()
            window.add(loss)
            return None
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
        if spike and not (known or earlier >= self.recurrence) and loss > self._range():
            return SpikeVerdict(SpikeRule.SPIKE, median, tolerance, self._streak)  # kept out
        if not spike:
            self._tail = max(self._tail, z)
        window.add(loss)  # an elevated or recurring loss is the data
        return None

    def observe_partial(self, loss: float, widen: float) -> SpikeVerdict | None:
        """Judge the loss of a partial batch without learning from it: a spike only beyond
        *widen* times the tolerance, never a streak.

        A batch of a fraction ``1 / widen`` of the run's usual samples (an epoch's last,
        ``drop_last=False``) has the noise of that fraction: one hard sample's loss is the whole
        batch's. Its loss joins no window and no memory, so the run's own noise is not widened
        by it either.
        """
        window = self._window
        if len(window) < max(self.warmup, 1):
            return None
        median = window.median()
        excess = loss - median
        if excess <= 0.0:
            return None
        relative, sigma, floor = self._noise(median)
        if relative == 0.0 and sigma == 0.0 and floor == 0.0:
            return None  # no scale yet (see observe)
        tolerance = widen * max(relative, self.mad_factor * sigma, floor)
        if (
            excess > tolerance
            and excess > widen * self.rtol * self._tail * sigma
            and loss > self._range()
        ):
            return SpikeVerdict(SpikeRule.SPIKE, median, tolerance, 1)
        return None

    def _noise(self, median: float) -> tuple[float, float, float]:
        """How far above *median* the window's losses may go: its relative tolerance, its
        noise sigma (0 with fewer than five losses) and the absolute floor."""
        window = self._window
        n = len(window)
        if n >= _MIN_NOISE:
            sigma = _MAD_TO_SIGMA * window.mad(median)
            relative = self.rtol * abs(median)
        else:
            sigma = 0.0
            relative = self.rtol * max(abs(median), window.spread()) * _MIN_NOISE / n
        return relative, sigma, max(self.atol, self.scale_tol * self._scale)

    def _range(self) -> float:
        """The run's range: its largest healthy baseline of the last *memory* observations,
        or, while the LR rose, of any time at an LR of the current one's order."""
        largest = self._peaks.largest
        if self._lr_range.raised:
            return max(largest, self._lr_range.largest())
        return largest

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
        if loss <= self._range():
            return None  # a shift back within the run's range: the data moved, not reported
        self._peak_held = self._judged  # a reported level is not a healthy baseline of the run
        return SpikeVerdict(SpikeRule.SUSTAINED, median, tolerance, streak)
