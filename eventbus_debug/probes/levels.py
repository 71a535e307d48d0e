"""The debug levels, and which checks run at which level, how often, and with which thresholds."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Final

from .._validate import non_negative, positive_int, positive_number
from ..exceptions import ArgumentTypeError

__all__ = ("Cadence", "Checks", "DebugLevel", "Thresholds", "checks_due", "level_of")


class DebugLevel(Enum):
    """How much the probes check, from nothing to everything.

    Attributes:
        OFF: no check runs; a probe call costs one comparison.
        BASIC: loss, gradient norms, non-finite, explosion and vanishing checks, and the
            parameter and buffer norms every ``param_every`` steps (one device transfer per
            step).
        ADVANCED: BASIC plus per-layer gradient norms and weight-update ratios.
        EXTREME: ADVANCED on every step, plus activation statistics (dead/saturated units).
    """

    OFF = "off"
    BASIC = "basic"
    ADVANCED = "advanced"
    EXTREME = "extreme"

    @property
    def rank(self) -> int:
        """The order of the level: OFF=0 < BASIC=1 < ADVANCED=2 < EXTREME=3."""
        return _LEVEL_RANKS[self]

    def includes(self, other: DebugLevel) -> bool:
        """True when this level runs everything *other* runs (``EXTREME.includes(BASIC)``)."""
        return _LEVEL_RANKS[self] >= _LEVEL_RANKS[other]


_LEVEL_RANKS: dict[DebugLevel, int] = {
    DebugLevel.OFF: 0,
    DebugLevel.BASIC: 1,
    DebugLevel.ADVANCED: 2,
    DebugLevel.EXTREME: 3,
}


def level_of(value: DebugLevel | str, name: str = "level") -> DebugLevel:
    """*value* as a :class:`DebugLevel`: a level, or its name in any case (``"advanced"``).

    Args:
        value: the level or its name.
        name: the argument's name in the error messages.

    Raises:
        ArgumentTypeError: if *value* is neither a :class:`DebugLevel` nor a str.
        ValueError: if *value* is not a level name (the valid ones are listed).
    """
    if isinstance(value, DebugLevel):
        return value
    valid = ", ".join(repr(v.value) for v in DebugLevel)
    if not isinstance(value, str):
        msg = f"{name} must be a DebugLevel or one of {valid}, got {value!r}"
        raise ArgumentTypeError(msg)
    try:
        return DebugLevel(value.strip().lower())
    except ValueError:
        msg = f"{name} must be one of {valid} (or a DebugLevel), got {value!r}"
        raise ValueError(msg) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class Thresholds:
    """When the step probe's checks fire. The defaults are tuned for zero false alarms on long,
    noisy, healthy runs (``benchmarks/bench_decisions.py`` measures them).

    Args:
        vanishing: mean ``|grad|`` of the whole model below which gradients vanished
            (SageMaker Debugger: 1e-7); never fires while the loss has converged.
        vanishing_relative: a dead layer's gradient RMS is below this fraction of the model's
            RMS *and* a thousandfold below its own usual share (quiet parameters are judged
            against their own history); a parameter whose share never exceeded 1e-6 (zero by
            construction: attention key biases, tied or unused parameters) and a frozen one
            (``requires_grad=False``) are never dead.
        vanishing_patience: vanishing checks in a row before an incident.
        vanishing_per_layer: look for dead layers at all (not only the whole model).
        explosion: an absolute cap on a total gradient norm with nothing accepted to compare
            with (the first checks, and the first after a restore); a later norm within
            *explosion_factor* of one reported above it is the run's scale and starts the
            baseline; ``None`` for none.
        explosion_factor: the total norm may not exceed this many times the running median of
            the last *explosion_window* accepted norms (checked from the second step), unless it
            stays within the scale the run has shown while healthy: the largest norm it
            accepted, or twice the largest median of its last 1,000 gradient checks (a converged
            model meeting harder data climbs back to early-training norms; that is not an
            explosion).
        explosion_window: how many accepted norms the running median covers.
        spike_window: how many recent losses the loss baseline (a running median) covers.
        spike_warmup: finite losses seen before the first spike check (Lightning: 1).
        spike_rtol: a loss more than ``spike_rtol x |baseline|`` above the baseline may be a
            spike (Lightning: 2) ...
        spike_mad: ... and more than this many noise sigmas (from the window's median absolute
            deviation) above it ...
        spike_atol: ... and more than this absolute amount ...
        spike_scale_tol: ... and more than this fraction of the largest baseline the run had
            (converged losses near zero wobble by tiny amounts; that is not a spike). A loss at
            or below the largest baseline of the run's last 1,000 losses is never reported (a
            converged model meeting harder data climbs back toward its early losses; that is the
            data).
        spike_patience: spikes (or *elevated* losses: more than 0.5 x ``|baseline|`` and 4
            noise sigmas above it) in a row reported as a *sustained* spike (the strong,
            persistent evidence a rollback needs); the baseline then restarts at the new level.
        update_ratio_low: weight-update ratios ``‖Δw‖/‖w‖`` below this are reported as stalled
            (SageMaker: 1e-8); frozen and gradient-less parameters are never included.
        update_ratio_high: ratios above this are reported as too large (SageMaker: 10).
        top_k: how many of the largest per-parameter norms an explosion incident lists.

    Raises:
        ValueError: if a threshold is not a finite positive number, or a count not an int >= 1.
    """

    vanishing: float = 1e-7
    vanishing_relative: float = 1e-4
    vanishing_patience: int = 10
    vanishing_per_layer: bool = True
    explosion: float | None = 1e6
    explosion_factor: float = 10.0
    explosion_window: int = 50
    spike_window: int = 50
    spike_warmup: int = 1
    spike_rtol: float = 2.0
    spike_mad: float = 8.0
    spike_atol: float = 0.0
    spike_scale_tol: float = 0.05
    spike_patience: int = 5
    update_ratio_low: float = 1e-8
    update_ratio_high: float = 10.0
    top_k: int = 5

    def __post_init__(self) -> None:
        for name in (
            "vanishing",
            "vanishing_relative",
            "explosion_factor",
            "spike_rtol",
            "spike_mad",
            "spike_scale_tol",
            "update_ratio_low",
            "update_ratio_high",
        ):
            positive_number(name, getattr(self, name))
        if self.explosion is not None:
            positive_number("explosion", self.explosion)
        non_negative("spike_atol", self.spike_atol)
        for name in (
            "vanishing_patience",
            "explosion_window",
            "spike_window",
            "spike_warmup",
            "spike_patience",
            "top_k",
        ):
            positive_int(name, getattr(self, name))
        if not isinstance(self.vanishing_per_layer, bool):
            msg = f"vanishing_per_layer must be a bool, got {self.vanishing_per_layer!r}"
            raise TypeError(msg)


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
            positive_int(name, getattr(self, name))


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
    any: bool = field(init=False, repr=False, compare=False)
    """True when at least one check is due (a field, not a property: it is read every step)."""

    def __post_init__(self) -> None:
        due = self.loss or self.grads or self.params or self.updates or self.activations
        object.__setattr__(self, "any", due)


_NONE: Final = Checks()
_DUE: dict[tuple[object, ...], Checks] = {}
"""The few distinct ``Checks`` a run meets, built once each (a frozen dataclass costs ~2 µs)."""
_CYCLE_MAX: Final = 1024
"""The longest repeating pattern of due checks kept as a table (longer ones are computed)."""
_CYCLES: dict[tuple[DebugLevel, Cadence], tuple[Checks, ...] | None] = {}
_last: tuple[DebugLevel, Cadence, tuple[Checks, ...] | None] | None = None
"""The last (level, cadence) asked about and its table: one identity test per step."""


def checks_due(level: DebugLevel, cadence: Cadence, step: int) -> Checks:
    """The checks *level* runs at *step* under *cadence*."""
    global _last  # a one-entry memo, replaced whole (no lock needed)
    if level is DebugLevel.OFF:
        return _NONE
    last = _last
    if last is not None and last[0] is level and last[1] is cadence:
        cycle = last[2]
    else:
        key = (level, cadence)
        if key in _CYCLES:
            cycle = _CYCLES[key]
        else:
            cycle = _CYCLES[key] = _cycle(level, cadence)
            if len(_CYCLES) > 64:
                _CYCLES.clear()  # cadences change rarely (an overhead budget); keep it bounded
        _last = (level, cadence, cycle)
    if cycle is not None:
        return cycle[step % len(cycle)]
    return _checks_at(level, cadence, step)


def _cycle(level: DebugLevel, cadence: Cadence) -> tuple[Checks, ...] | None:
    """The due checks of steps ``0 .. period - 1``, which repeat (None: the period is long)."""
    if level is DebugLevel.EXTREME:
        periods: tuple[int, ...] = (cadence.activation_every,)
    else:
        periods = (
            cadence.loss_every,
            cadence.grad_every,
            cadence.param_every,
            cadence.update_every,
            cadence.vanishing_every,
        )
    period = math.lcm(*periods)
    if period > _CYCLE_MAX:
        return None
    return tuple(_checks_at(level, cadence, step) for step in range(period))


def _checks_at(level: DebugLevel, cadence: Cadence, step: int) -> Checks:
    if level is DebugLevel.EXTREME:
        key: tuple[object, ...] = (level, step % cadence.activation_every == 0)
    else:
        key = (
            level,
            step % cadence.loss_every == 0,
            step % cadence.grad_every == 0,
            step % cadence.param_every == 0,
            step % cadence.update_every == 0,
            step % cadence.vanishing_every == 0,
        )
    due = _DUE.get(key)
    if due is None:
        due = _DUE[key] = _build(key)
    return due


def _build(key: tuple[object, ...]) -> Checks:
    if key[0] is DebugLevel.EXTREME:
        return Checks(True, True, True, True, True, bool(key[1]), vanishing=True)
    _, loss, grads, params, updates, vanishing = key
    advanced = key[0] is DebugLevel.ADVANCED
    return Checks(
        loss=bool(loss),
        grads=bool(grads),
        params=bool(params),
        layers=advanced and bool(grads),
        updates=advanced and bool(updates),
        activations=False,
        vanishing=bool(grads) and bool(vanishing),
    )
