"""What one step check found: the value a training loop acts on."""

from __future__ import annotations

from dataclasses import dataclass

from ..._records import fast_init

__all__ = ("StepVerdict",)


@fast_init
@dataclass(frozen=True, slots=True, kw_only=True)
class StepVerdict:
    """What one step check found; what the training loop acts on.

    Attributes:
        step: the step the values belong to (in deferred mode, an earlier step than the call's).
        checked: False when no check ran (level OFF, nothing due, or the first deferred call).
        finite: False when the loss, a gradient or a parameter held NaN or Inf.
        loss: the loss value, when given and checked.
        grad_norm: the total gradient 2-norm (tied weights once), when gradients were checked.
        param_norm: the total parameter 2-norm, when parameters were checked.
        fired: the ``kind`` of every incident published for this step.
        deferred: True when the values were read one step late, without waiting.
        overflow: True when the gradients overflowed under an AMP ``GradScaler`` (its routine
            business: ``scaler.step`` skips the update and lowers the scale; not an incident).
    """

    step: int
    checked: bool = True
    finite: bool = True
    loss: float | None = None
    grad_norm: float | None = None
    param_norm: float | None = None
    fired: tuple[str, ...] = ()
    deferred: bool = False
    overflow: bool = False

    @property
    def ok(self) -> bool:
        """True when the values are finite and no incident fired."""
        return self.finite and not self.fired
