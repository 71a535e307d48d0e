"""Partial batches: whether a step's gradients average far fewer samples than the run's.

An epoch's last batch under ``drop_last=False`` (PyTorch's and Hugging Face ``Trainer``'s
default) may hold a sample or two; one hard sample's loss and gradient are then the whole
batch's. The detectors judge such a step with bars that many times wider and learn nothing from
it (:meth:`LossSpikeDetector.observe_partial <._spikes.LossSpikeDetector.observe_partial>`,
:meth:`ExplosionDetector.observe_partial <._explosions.ExplosionDetector.observe_partial>`).
"""

from __future__ import annotations

from typing import Final

from ._windows import RunningMedian

__all__ = ("PartialBatches",)

PARTIAL: Final = 0.5
"""A step of at most this fraction of the run's usual samples is a *partial* batch."""

USUAL: Final = 50
"""How many recent steps' sample counts make the run's usual one: a median, so that neither an
epoch's short last batch nor a window that summed two batches moves it."""


class PartialBatches:
    """How much more leniently each step is judged, from the samples it was told.

    Attributes:
        widen: the judged step's widening: ``usual / samples`` for a partial batch, else 1.0
            (a full one, or samples unknown).
        step: the step :attr:`widen` is for (-1 before the first).

    The counts are not part of a probe's saved state: a resumed run learns its usual count
    again at its first steps.
    """

    __slots__ = ("_counts", "step", "widen")

    def __init__(self) -> None:
        self._counts = RunningMedian(USUAL)
        self.widen = 1.0
        self.step = -1

    def judge(self, step: int, samples: int | None) -> float:
        """*step* had *samples* samples (``None``: unknown): its widening, which the count
        then joins the run's."""
        self.step = step
        if samples is None:
            self.widen = 1.0
            return 1.0
        counts = self._counts
        usual = counts.median() if len(counts) else 0.0
        counts.add(float(samples))
        self.widen = usual / samples if 0 < samples <= PARTIAL * usual else 1.0
        return self.widen

    def widen_at(self, step: int) -> float:
        """The widening of *step* when it is the step judged last, else 1.0."""
        return self.widen if step == self.step else 1.0
