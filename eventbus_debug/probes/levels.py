"""Which checks run at which debug level, how often, and with which thresholds."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .events import DebugLevel

__all__ = ("Cadence", "Checks", "Thresholds", "checks_due")


def _positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        msg = f"{name} must be an int >= 1, got {value!r}"
        raise ValueError(msg)


def _positive_float(name: str, value: object, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or not math.isfinite(value)
        or value <= 0
    ):
        msg = f"{name} must be a finite number > 0, got {value!r}"
        raise ValueError(msg)


@dataclass(frozen=True, slots=True, kw_only=True)
class Thresholds:
    """When the step probe's checks fire. Defaults come from widely used tools.

    Args:
        vanishing: mean ``|grad|`` below which gradients vanished (SageMaker Debugger: 1e-7).
        vanishing_per_layer: also fire when a single parameter's mean ``|grad|`` is below
            *vanishing* (a dead layer), not only the whole model's.
        explosion: a fixed cap on the total gradient norm; ``None`` for none.
        explosion_factor: after the warm-up, the total norm may not exceed this many times the
            largest norm seen during the warm-up (Megatron-LM: 10).
        explosion_warmup: how many gradient checks the warm-up lasts (Megatron-LM: 100).
        spike_window: how many recent losses the running mean covers (Lightning: 10).
        spike_deviation: the ``"deviation"`` rule fires when
            ``|loss - running mean| >= spike_deviation * running mean`` (Lightning: 2).
        spike_ratio: the ``"sustained"`` rule counts steps with
            ``loss >= spike_ratio * running mean`` (llm-foundry: 2) ...
        spike_patience: ... and fires when more than this many are consecutive (llm-foundry: 4).
        update_ratio_low: weight-update ratios ``‖Δw‖/‖w‖`` below this are reported as stalled
            (SageMaker: 1e-8).
        update_ratio_high: ratios above this are reported as too large (SageMaker: 10).
        top_k: how many of the largest per-parameter norms an explosion incident lists.

    Raises:
        ValueError: if a threshold is not a finite positive number, or a count not an int >= 1.
    """

    vanishing: float = 1e-7
    vanishing_per_layer: bool = True
    explosion: float | None = None
    explosion_factor: float = 10.0
    explosion_warmup: int = 100
    spike_window: int = 10
    spike_deviation: float = 2.0
    spike_ratio: float = 2.0
    spike_patience: int = 4
    update_ratio_low: float = 1e-8
    update_ratio_high: float = 10.0
    top_k: int = 5

    def __post_init__(self) -> None:
        for name in ("vanishing", "explosion_factor", "spike_deviation", "spike_ratio"):
            _positive_float(name, getattr(self, name))
        for name in ("update_ratio_low", "update_ratio_high"):
            _positive_float(name, getattr(self, name))
        _positive_float("explosion", self.explosion, allow_none=True)
        for name in ("explosion_warmup", "spike_window", "spike_patience", "top_k"):
            _positive_int(name, getattr(self, name))


@dataclass(frozen=True, slots=True, kw_only=True)
class Cadence:
    """How often each check runs, in steps (a check runs when ``step % every == 0``).

    Parameters need checking less often than gradients: finite gradients and a finite
    optimizer update keep parameters finite. At :attr:`DebugLevel.EXTREME` every check runs
    on every step regardless of these values.

    Args:
        loss_every: the loss check (non-finite, spikes).
        grad_every: the gradient check (norms, non-finite, explosion, vanishing).
        param_every: the parameter check (norms, non-finite).
        update_every: the weight-update ratio (ADVANCED and above); measured between the
            chosen step and the next one.
        activation_every: activation statistics (EXTREME only).
        vanishing_every: the mean ``|grad|`` pass of the vanishing check, on gradient-check
            steps. It costs about as much as the 2-norms themselves on CPU, and vanishing is a
            trend over many steps; all-zero gradients are still caught at every gradient
            check, from the 2-norms.

    Raises:
        ValueError: if a value is not an int >= 1.
    """

    loss_every: int = 1
    grad_every: int = 1
    param_every: int = 10
    update_every: int = 10
    activation_every: int = 1
    vanishing_every: int = 10

    def __post_init__(self) -> None:
        for name in (
            "loss_every",
            "grad_every",
            "param_every",
            "update_every",
            "activation_every",
            "vanishing_every",
        ):
            _positive_int(name, getattr(self, name))


@dataclass(frozen=True, slots=True)
class Checks:
    """The checks due at one step (all False means the probe does nothing at that step)."""

    loss: bool = False
    grads: bool = False
    params: bool = False
    layers: bool = False
    updates: bool = False
    activations: bool = False
    vanishing: bool = False

    @property
    def any(self) -> bool:
        """True when at least one check is due."""
        return self.loss or self.grads or self.params or self.updates or self.activations


_NONE = Checks()


def checks_due(level: DebugLevel, cadence: Cadence, step: int) -> Checks:
    """The checks *level* runs at *step* under *cadence*."""
    if level is DebugLevel.OFF:
        return _NONE
    if level is DebugLevel.EXTREME:
        return Checks(
            True, True, True, True, True, step % cadence.activation_every == 0, vanishing=True
        )
    advanced = level is DebugLevel.ADVANCED
    grads = step % cadence.grad_every == 0
    return Checks(
        loss=step % cadence.loss_every == 0,
        grads=grads,
        params=step % cadence.param_every == 0,
        layers=advanced and grads,
        updates=advanced and step % cadence.update_every == 0,
        activations=False,
        vanishing=grads and step % cadence.vanishing_every == 0,
    )
