"""What a session concludes at a step: the :class:`Verdict`, and a checked step's result."""

from __future__ import annotations

from dataclasses import dataclass

from .._records import fast_init
from ..probes.step import StepVerdict
from ..recovery.safepoint import StepDecision

__all__ = ("TrainingStepResult", "Verdict")


@fast_init
@dataclass(frozen=True, slots=True, kw_only=True)
class Verdict:
    """What the session concluded at a step's safe point (after backward, before the step).

    Attributes:
        step: the step.
        probe: the step probe's verdict (its numbers and the incidents it fired).
        should_step: False when the optimizer step must be skipped (non-finite values, or a
            recovery decision).
        actions: the recovery actions applied at this safe point, by name.
        decision: the recovery safe point's decision (None without recovery).
    """

    step: int
    probe: StepVerdict
    should_step: bool
    actions: tuple[str, ...] = ()
    decision: StepDecision | None = None

    @property
    def loss(self) -> float | None:
        """The checked loss (None when the loss was not checked this step)."""
        return self.probe.loss

    @property
    def grad_norm(self) -> float | None:
        """The total gradient norm (None when gradients were not checked this step)."""
        return self.probe.grad_norm

    @property
    def finite(self) -> bool:
        """False when the loss, a gradient or a parameter was NaN or infinite."""
        return self.probe.finite


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingStepResult:
    """What :meth:`Session.training_step` / :meth:`SyncSession.training_step` did.

    Attributes:
        step: the step.
        loss: the loss value (NaN when it was not finite).
        stepped: whether the optimizer stepped.
        verdict: the safe point's verdict.
        duration_s: the step's wall time.
    """

    step: int
    loss: float
    stepped: bool
    verdict: Verdict
    duration_s: float
