"""``apply_common_fixes``: one explicit pass over a model and optimizer, with a typed report.

The seeds' ``ErrorRecoveryManager.apply_common_fixes(model, optimizer)``, done safely:
non-finite parameters are restored from the last good state (never zeroed: zeros hide the fault
and break symmetry), non-finite gradients are dropped, exploding gradients are clipped (and the
LR lowered if asked), all-zero gradients are reported by name, and stale gradients are cleared
on request. Everything done is returned and, with a bus, published as
:class:`~eventbus_debug.recovery.RecoveryApplied`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import torch
from torch import nn

from eventbus_debug.diagnostics import get_logger

from .._modules import float_parameters
from .._validate import fraction, positive_number
from ..events import RecoveryAction, RecoveryApplied
from ..typing import Publisher
from .lr import scale_learning_rate
from .safepoint import NoGoodStateError, StateSnapshots

__all__ = ("CommonFixes", "apply_common_fixes")

_log = get_logger(__name__)

SOURCE: Final = "recovery.common_fixes"

NAN_PARAMETER_FIX: Final = "nan_parameter_fix"
NONFINITE_GRADIENT_FIX: Final = "nonfinite_gradient_fix"
EXPLODING_GRADIENT_FIX: Final = "exploding_gradient_fix"
ZERO_GRADIENT_REPORT: Final = "zero_gradient_report"
STALE_GRADIENT_FIX: Final = "stale_gradient_fix"


@dataclass(frozen=True, slots=True, kw_only=True)
class CommonFixes:
    """What :func:`apply_common_fixes` found and did.

    ``"nan_parameter_fix" in fixes`` works as in the seeds.

    Attributes:
        fixes: the fixes applied or reports made, in order: ``"nan_parameter_fix"``,
            ``"nonfinite_gradient_fix"``, ``"exploding_gradient_fix"``,
            ``"zero_gradient_report"``, ``"stale_gradient_fix"``.
        nonfinite_parameters: parameters that held NaN/Inf.
        restored_step: the step of the good state restored, when one was.
        unrepaired_parameters: non-finite parameters left as they are (no good state to
            restore; they are reported, never zeroed). Empty when the model is healthy.
        nonfinite_gradients: parameters whose gradient held NaN/Inf (all gradients dropped).
        zero_gradients: parameters whose gradient is exactly zero (dead layers).
        grad_norm: the total gradient 2-norm before clipping (``None`` without gradients).
        clipped_to: the norm the gradients were clipped to, when they were.
        lr_factor: what the learning rates were multiplied by.
        details: what each fix changed, in words.
    """

    fixes: tuple[str, ...] = ()
    nonfinite_parameters: tuple[str, ...] = ()
    restored_step: int | None = None
    unrepaired_parameters: tuple[str, ...] = ()
    nonfinite_gradients: tuple[str, ...] = ()
    zero_gradients: tuple[str, ...] = ()
    grad_norm: float | None = None
    clipped_to: float | None = None
    lr_factor: float = 1.0
    details: tuple[str, ...] = ()

    def __contains__(self, fix: object) -> bool:
        return fix in self.fixes

    @property
    def healthy(self) -> bool:
        """True when every parameter is finite after the fixes."""
        return not self.unrepaired_parameters


def _names(named: Sequence[tuple[str, torch.Tensor]], flags: list[bool]) -> tuple[str, ...]:
    return tuple(n for (n, _), f in zip(named, flags, strict=True) if f)


def apply_common_fixes(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    snapshots: StateSnapshots | None = None,
    max_grad_norm: float | None = 1.0,
    lr_factor_on_explosion: float | None = None,
    schedulers: Sequence[Any] = (),
    zero_grads: bool = False,
    bus: Publisher | None = None,
    step: int | None = None,
) -> CommonFixes:
    """Check *model* (and its gradients) and apply the safe common fixes; report what was done.

    In order:

    1. parameters holding NaN/Inf: restore the last good state from *snapshots* (model and
       optimizer; the gradients, which belong to the discarded state, are dropped). Without a
       good state (or with one that no longer fits the model: its structure changed since) they
       are reported in ``unrepaired_parameters`` and left alone — never zeroed;
    2. gradients holding NaN/Inf: all gradients are dropped (``grad = None``), so an
       ``optimizer.step()`` now does nothing;
    3. a total gradient norm above *max_grad_norm*: clipped to it (and the LR multiplied by
       *lr_factor_on_explosion*, when given, base LRs of *schedulers* included);
    4. gradients exactly zero: reported by name (a dead layer needs a look, not a silent
       re-initialization);
    5. ``zero_grads=True`` (the gradients are stale, e.g. between epochs): dropped.

    It costs a few reductions per parameter and reads them back; call it between steps or
    epochs, not on every step instead of a :class:`~eventbus_debug.recovery.SafePoint`.

    Args:
        model: the model.
        optimizer: its optimizer (restored with the model; its LR lowered on explosion).
        snapshots: where the last good state is kept.
        max_grad_norm: the clipping threshold; ``None`` does not clip.
        lr_factor_on_explosion: multiply the LR by this (0 < f < 1) when gradients exploded.
        schedulers: LR schedulers whose base LRs are scaled with the LR.
        zero_grads: drop the gradients at the end (they are stale).
        bus: publish a :class:`RecoveryApplied` for each fix (``source="recovery.common_fixes"``).
        step: the step stamped on those events.

    Raises:
        TypeError: if *model* is not an ``nn.Module``.
        ValueError: if *max_grad_norm* is not a finite number > 0, *lr_factor_on_explosion* is
            not in (0, 1), or *lr_factor_on_explosion* is given without an *optimizer*.
    """
    if not isinstance(model, nn.Module):
        msg = f"model must be a torch.nn.Module, got {type(model).__name__}"
        raise TypeError(msg)
    if max_grad_norm is not None:
        positive_number("max_grad_norm", max_grad_norm)
    if lr_factor_on_explosion is not None:
        fraction("lr_factor_on_explosion", lr_factor_on_explosion, inclusive=False)
        if optimizer is None:
            msg = "lr_factor_on_explosion needs the optimizer: pass optimizer="
            raise ValueError(msg)

    fixes: list[str] = []
    details: list[str] = []

    def record(fix: str, action: RecoveryAction, detail: str, outcome: str = "applied") -> None:
        fixes.append(fix)
        details.append(detail)
        _log.warning("common_fix", fix=fix, detail=detail, outcome=outcome)
        if bus is not None:
            bus.publish_nowait(
                RecoveryApplied(
                    source=SOURCE, step=step, action=action, detail=detail, outcome=outcome
                )
            )

    def drop_grads() -> None:
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)

    # 1. parameters
    params = float_parameters(model)
    bad_flags: list[bool] = (
        torch.stack([(~torch.isfinite(p.detach()).all()).cpu() for _, p in params]).tolist()
        if params
        else []
    )
    bad_params = _names(params, bad_flags)
    restored_step: int | None = None
    unrepaired: tuple[str, ...] = ()
    grads_dropped = False
    if bad_params:
        shown = ", ".join(bad_params[:10])
        refused: NoGoodStateError | None = None
        restored = False
        if snapshots is not None and snapshots.available:
            try:
                restored_step = snapshots.restore(model, optimizer)
                restored = True
            except NoGoodStateError as exc:  # it no longer fits the model: nothing was changed
                refused = exc
        if restored:
            drop_grads()
            grads_dropped = True
            record(
                NAN_PARAMETER_FIX,
                RecoveryAction.RESTORE_STATE,
                f"non-finite parameters ({shown}): restored the state of step {restored_step}",
            )
        else:
            unrepaired = bad_params
            why = (
                f"the good state held could not be restored ({refused})"
                if refused is not None
                else "no good state to restore"
            )
            record(
                NAN_PARAMETER_FIX,
                RecoveryAction.RESTORE_STATE,
                f"non-finite parameters ({shown}) and {why}: left as they are (not zeroed); "
                "pass snapshots= or load a checkpoint",
                outcome="failed",
            )

    # 2-4. gradients
    bad_grads: tuple[str, ...] = ()
    zero: tuple[str, ...] = ()
    grad_norm: float | None = None
    clipped_to: float | None = None
    lr_factor = 1.0
    with_grad = [(n, p) for n, p in params if p.grad is not None]
    if with_grad and not grads_dropped:
        norms = torch.stack(
            [torch.linalg.vector_norm(p.grad.detach()).float().cpu() for _, p in with_grad]  # type: ignore[union-attr]
        )
        values: list[float] = norms.tolist()
        bad_grads = tuple(
            n for (n, _), v in zip(with_grad, values, strict=True) if not math.isfinite(v)
        )
        if bad_grads:
            drop_grads()
            grads_dropped = True
            record(
                NONFINITE_GRADIENT_FIX,
                RecoveryAction.SKIP_STEP,
                f"non-finite gradients ({', '.join(bad_grads[:10])}): all gradients dropped",
            )
        else:
            grad_norm = math.sqrt(sum(v * v for v in values))
            zero = tuple(n for (n, _), v in zip(with_grad, values, strict=True) if v == 0.0)
            if max_grad_norm is not None and grad_norm > max_grad_norm:
                torch.nn.utils.clip_grads_with_norm_(
                    [p for _, p in with_grad], max_grad_norm, torch.tensor(grad_norm)
                )
                clipped_to = float(max_grad_norm)
                record(
                    EXPLODING_GRADIENT_FIX,
                    RecoveryAction.CLIP_GRADIENTS,
                    f"gradients clipped from norm {grad_norm:.4g} to {max_grad_norm:.4g}",
                )
                if lr_factor_on_explosion is not None and optimizer is not None:
                    lr_factor = float(lr_factor_on_explosion)
                    detail = scale_learning_rate(optimizer, lr_factor, schedulers)
                    record(EXPLODING_GRADIENT_FIX, RecoveryAction.SCALE_LR, detail)
            if zero:
                record(
                    ZERO_GRADIENT_REPORT,
                    RecoveryAction.CONTINUE,
                    f"gradients exactly zero in {len(zero)} parameter(s): "
                    f"{', '.join(zero[:10])} (dead layers? check the init and the activations)",
                )

    # 5. stale gradients
    if zero_grads and with_grad and not grads_dropped:
        drop_grads()
        record(
            STALE_GRADIENT_FIX,
            RecoveryAction.CONTINUE,
            f"stale gradients of {len(with_grad)} parameter(s) dropped",
        )

    return CommonFixes(
        fixes=tuple(dict.fromkeys(fixes)),
        nonfinite_parameters=bad_params,
        restored_step=restored_step,
        unrepaired_parameters=unrepaired,
        nonfinite_gradients=bad_grads,
        zero_gradients=zero,
        grad_norm=grad_norm,
        clipped_to=clipped_to,
        lr_factor=lr_factor,
        details=tuple(details),
    )
