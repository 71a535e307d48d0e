"""The seed documents' one-shot checks, as thin functions over the step probe's reductions.

Each call computes fused per-parameter norms and moves them to the host once. For a training
loop use :class:`~eventbus_debug.probes.StepProbe`, which keeps history (warm-up, loss window)
and publishes events; these functions are for one-off inspection.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ._reduce import NormPlan
from .levels import Cadence, Thresholds
from .step import StepProbe, StepVerdict

__all__ = (
    "GradientReport",
    "ParameterStats",
    "analyze_gradients",
    "analyze_model_parameters",
    "check_gradient_explosion",
    "check_gradient_vanishing",
    "check_gradients",
    "check_model_parameters",
    "monitor_training_step",
)


@dataclass(frozen=True, slots=True, kw_only=True)
class ParameterStats:
    """The 2-norm and mean absolute value of one parameter (or its gradient)."""

    name: str
    norm: float
    mean_abs: float
    numel: int

    @property
    def finite(self) -> bool:
        """False when the tensor holds NaN or Inf."""
        return math.isfinite(self.norm) and math.isfinite(self.mean_abs)


@dataclass(frozen=True, slots=True, kw_only=True)
class GradientReport:
    """The result of :func:`check_gradients` / :func:`check_model_parameters`."""

    total_norm: float
    non_finite: tuple[str, ...]
    above: tuple[str, ...]
    below: tuple[str, ...]
    stats: tuple[ParameterStats, ...]

    @property
    def finite(self) -> bool:
        """True when every tensor was finite."""
        return not self.non_finite


def _check_model(model: object) -> nn.Module:
    if not isinstance(model, nn.Module):
        msg = f"model must be a torch.nn.Module, got {type(model).__qualname__}"
        raise TypeError(msg)
    return model


def _stats(model: nn.Module, *, grads: bool) -> tuple[ParameterStats, ...]:
    named: list[tuple[str, torch.Tensor]] = []
    for n, p in _check_model(model).named_parameters():
        t = p.grad if grads else p.detach()
        if t is not None and (p.is_floating_point() or p.is_complex()):
            named.append((n, t))
    if not named:
        return ()
    tensors = [t for _, t in named]
    plan = NormPlan(tensors)
    l2, l1 = plan.reduce(tensors, l1=True)
    assert l1 is not None
    values = torch.cat([l2, l1]).tolist()  # the one transfer
    k = plan.size
    out: list[ParameterStats | None] = [None] * k
    for j, (i, size) in enumerate(zip(plan.order, plan.numels, strict=True)):
        out[i] = ParameterStats(
            name=named[i][0],
            norm=values[j],
            mean_abs=values[k + j] / size if size else 0.0,
            numel=size,
        )
    return tuple(s for s in out if s is not None)


def _report(stats: tuple[ParameterStats, ...], high: float, low: float) -> GradientReport:
    return GradientReport(
        total_norm=math.sqrt(math.fsum(s.norm * s.norm for s in stats)),
        non_finite=tuple(s.name for s in stats if not s.finite),
        above=tuple(s.name for s in stats if s.norm > high),
        below=tuple(s.name for s in stats if s.mean_abs < low),
        stats=stats,
    )


def analyze_gradients(model: nn.Module) -> tuple[ParameterStats, ...]:
    """Per-parameter gradient norm and mean ``|grad|`` (parameters without a gradient left out).

    Raises:
        TypeError: if *model* is not an ``nn.Module``.
    """
    return _stats(model, grads=True)


def analyze_model_parameters(model: nn.Module) -> tuple[ParameterStats, ...]:
    """Per-parameter norm and mean ``|w|`` (tied weights once).

    Raises:
        TypeError: if *model* is not an ``nn.Module``.
    """
    return _stats(model, grads=False)


def check_gradients(
    model: nn.Module, gradient_threshold: float = 1.0, vanishing_threshold: float = 1e-7
) -> GradientReport:
    """Gradients' total norm, the non-finite ones, those above / below the thresholds.

    Raises:
        TypeError: if *model* is not an ``nn.Module``.
    """
    return _report(_stats(model, grads=True), gradient_threshold, vanishing_threshold)


def check_model_parameters(model: nn.Module) -> GradientReport:
    """Parameters' total norm and the non-finite ones (``above``/``below`` stay empty).

    Raises:
        TypeError: if *model* is not an ``nn.Module``.
    """
    return _report(_stats(model, grads=False), math.inf, 0.0)


def check_gradient_explosion(model: nn.Module, threshold: float = 10.0) -> tuple[str, ...]:
    """Names of the parameters whose gradient 2-norm exceeds *threshold* (or is non-finite).

    Raises:
        TypeError: if *model* is not an ``nn.Module``.
    """
    stats = _stats(model, grads=True)
    return tuple(s.name for s in stats if not s.norm <= threshold)


def check_gradient_vanishing(model: nn.Module, threshold: float = 1e-7) -> tuple[str, ...]:
    """Names of the parameters whose mean ``|grad|`` is below *threshold*.

    Raises:
        TypeError: if *model* is not an ``nn.Module``.
    """
    return tuple(s.name for s in _stats(model, grads=True) if s.mean_abs < threshold)


def monitor_training_step(
    model: nn.Module, loss: torch.Tensor | float | None, step: int
) -> StepVerdict:
    """One stateless step check (no history: no warm-up explosion rule, no loss spikes).

    Raises:
        TypeError: if *model* is not a module, *step* not an int or *loss* not a tensor/number.
        ValueError: if *loss* has more than one element or *step* is negative.
    """
    probe = StepProbe(
        _check_model(model), None, cadence=Cadence(param_every=1), thresholds=Thresholds()
    )
    return probe.check_step_nowait(step, loss=loss)
