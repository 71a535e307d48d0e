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

from .._modules import named_root
from ..probes.finite import stored_values
from ..probes.levels import Cadence, Thresholds
from ..probes.step import StepProbe, StepVerdict

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


def _threshold(value: object, argument: str, *, allow_inf: bool = True) -> float:
    """*value* as a positive float, or a clear error naming *argument*."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        msg = f"{argument} must be a positive number, got {value!r}"
        raise TypeError(msg)
    f = float(value)
    if math.isnan(f) or f <= 0 or (math.isinf(f) and not allow_inf):
        msg = f"{argument} must be a positive number, got {value!r}"
        raise ValueError(msg)
    return f


def _named(model: nn.Module, *, grads: bool) -> list[tuple[str, torch.Tensor]]:
    """*model*'s floating-point parameters (or their gradients, when they have one), by name.

    A model on the meta device is refused whether or not its parameters have gradients: a
    meta model has none, and an empty report would read as "nothing wrong". A
    ``torch.compile``\\ d model's tensors are named as the model's own (``0.weight``, not
    ``_orig_mod.0.weight``), like everything the session reports.

    Raises:
        TypeError: if *model* is not an ``nn.Module``.
        ValueError: if a parameter or a gradient is on the meta device (it has no values).
    """
    named: list[tuple[str, torch.Tensor]] = []
    for n, p in named_root(_check_model(model)).named_parameters():
        if not (p.is_floating_point() or p.is_complex()):
            continue
        t = p.grad if grads else p.detach()
        if p.is_meta or (t is not None and t.is_meta):
            what = "parameter" if p.is_meta else "gradient of parameter"
            msg = (
                f"the {what} {n!r} is on the meta device: it has a shape but no values to "
                "check; materialize the model first (model.to_empty(device=...) and load its "
                "weights)"
            )
            raise ValueError(msg)
        if t is not None:
            named.append((n, t))
    return named


def _reductions(t: torch.Tensor) -> torch.Tensor:
    """[2-norm, sum of |x|, non-finite flag] of one tensor, in float64, without overflow.

    Non-finiteness comes from ``isfinite``, not from the norm: a finite gradient of 1e20 has a
    float32 sum of squares of inf, and is still finite. The norm is taken of the values divided
    by their largest magnitude, so it overflows only when the true norm exceeds float64's range.
    """
    v = stored_values(t)
    if v.is_complex():
        v = v.to(torch.complex128).abs()
    v = v.to(torch.float64)
    if v.numel() == 0:
        return torch.zeros(3, dtype=torch.float64, device=v.device)
    finite = torch.isfinite(v).all()
    scale = v.abs().amax()
    safe = torch.where(finite & (scale > 0), scale, torch.ones_like(scale))
    norm = torch.linalg.vector_norm(v / safe) * safe
    return torch.stack([norm, v.abs().sum(), (~finite).to(torch.float64)])


def _stats(model: nn.Module, *, grads: bool) -> tuple[tuple[ParameterStats, ...], tuple[str, ...]]:
    """Per-parameter statistics and the names of the non-finite ones (one transfer per device)."""
    named = _named(model, grads=grads)
    if not named:
        return (), ()
    with torch.no_grad():
        rows = [_reductions(t) for _, t in named]
        home = rows[0].device
        values = torch.stack([r.to(home) for r in rows]).tolist()  # the one transfer
    stats = []
    bad = []
    for (name, t), (norm, l1, non_finite) in zip(named, values, strict=True):
        size = t.numel()
        stats.append(
            ParameterStats(name=name, norm=norm, mean_abs=l1 / size if size else 0.0, numel=size)
        )
        if non_finite:
            bad.append(name)
    return tuple(stats), tuple(bad)


def _report(
    stats: tuple[ParameterStats, ...], bad: tuple[str, ...], high: float, low: float
) -> GradientReport:
    return GradientReport(
        total_norm=math.sqrt(math.fsum(s.norm * s.norm for s in stats)),
        non_finite=bad,
        above=tuple(s.name for s in stats if s.norm > high),
        below=tuple(s.name for s in stats if s.mean_abs < low),
        stats=stats,
    )


def analyze_gradients(model: nn.Module) -> tuple[ParameterStats, ...]:
    """Per-parameter gradient norm and mean ``|grad|`` (parameters without a gradient left out).

    Raises:
        TypeError: if *model* is not an ``nn.Module``.
        ValueError: if a parameter is on the meta device (it holds no values).
    """
    return _stats(model, grads=True)[0]


def analyze_model_parameters(model: nn.Module) -> tuple[ParameterStats, ...]:
    """Per-parameter norm and mean ``|w|`` (tied weights once).

    Raises:
        TypeError: if *model* is not an ``nn.Module``.
        ValueError: if a parameter is on the meta device (it holds no values).
    """
    return _stats(model, grads=False)[0]


def check_gradients(
    model: nn.Module, gradient_threshold: float = 1.0, vanishing_threshold: float = 1e-7
) -> GradientReport:
    """Gradients' total norm, the non-finite ones, those above / below the thresholds.

    A gradient is non-finite when it holds NaN or Inf; a huge finite gradient (1e20) is finite
    and is reported in ``above``.

    Raises:
        TypeError: if *model* is not an ``nn.Module`` or a threshold is not a number.
        ValueError: if a threshold is zero, negative or NaN, or a parameter is on the meta device.
    """
    high = _threshold(gradient_threshold, "gradient_threshold")
    low = _threshold(vanishing_threshold, "vanishing_threshold", allow_inf=False)
    return _report(*_stats(model, grads=True), high, low)


def check_model_parameters(model: nn.Module) -> GradientReport:
    """Parameters' total norm and the non-finite ones (``above``/``below`` stay empty).

    Raises:
        TypeError: if *model* is not an ``nn.Module``.
        ValueError: if a parameter is on the meta device (it holds no values).
    """
    return _report(*_stats(model, grads=False), math.inf, 0.0)


def check_gradient_explosion(model: nn.Module, threshold: float = 10.0) -> tuple[str, ...]:
    """Names of the parameters whose gradient 2-norm exceeds *threshold* (or is non-finite).

    Raises:
        TypeError: if *model* is not an ``nn.Module`` or *threshold* not a number.
        ValueError: if *threshold* is zero, negative or NaN, or a parameter is on the meta device.
    """
    limit = _threshold(threshold, "threshold")
    stats, bad = _stats(model, grads=True)
    return tuple(s.name for s in stats if s.name in bad or not s.norm <= limit)


def check_gradient_vanishing(model: nn.Module, threshold: float = 1e-7) -> tuple[str, ...]:
    """Names of the parameters whose mean ``|grad|`` is below *threshold*.

    Raises:
        TypeError: if *model* is not an ``nn.Module`` or *threshold* not a number.
        ValueError: if *threshold* is zero, negative, NaN or infinite, or a parameter is on the
            meta device.
    """
    limit = _threshold(threshold, "threshold", allow_inf=False)
    return tuple(s.name for s in _stats(model, grads=True)[0] if s.mean_abs < limit)


def monitor_training_step(
    model: nn.Module, loss: torch.Tensor | float | None, step: int
) -> StepVerdict:
    """One stateless step check (no history: no warm-up explosion rule, no loss spikes).

    Non-finite losses, gradients and parameters are reported; with nothing to compare with, a
    gradient explosion is only a total norm above the absolute cap ``Thresholds().explosion``
    (``1e6``).

    Raises:
        TypeError: if *model* is not a module, *step* not an int or *loss* not a tensor/number.
        ValueError: if *loss* has more than one element, *step* is negative, or a parameter of
            *model* is on the meta device.
    """
    _named(model, grads=False)  # a meta model: a clear error before the probe reads values
    probe = StepProbe(
        _check_model(model), None, cadence=Cadence(param_every=1), thresholds=Thresholds()
    )
    return probe.check_step_sync(step, loss=loss)
