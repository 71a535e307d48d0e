"""Training telemetry and incidents: what a step probe sees in the loss, gradients and parameters.

Events carry host-side numbers and strings only, never tensors.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import field
from enum import Enum
from typing import ClassVar

from ._base import Anomaly, Delivery, Event, Severity, event_type

__all__ = (
    "AnomalyLocalized",
    "AutogradAnomalyDetected",
    "GradientExploded",
    "GradientVanished",
    "LossSpiked",
    "NonFiniteDetected",
    "StepChecked",
    "TensorRole",
)


class TensorRole(Enum):
    """What a checked tensor is in the training step."""

    LOSS = "loss"
    GRADIENT = "gradient"
    PARAMETER = "parameter"
    BUFFER = "buffer"
    ACTIVATION = "activation"
    OUTPUT = "output"
    INPUT = "input"
    UPDATE = "update"


@event_type
class StepChecked(Event):
    """The result of one step check (telemetry: may be shed under sustained overload).

    Attributes:
        loss: the loss value, when one was given.
        grad_norm: the total 2-norm of all gradients (tied weights counted once).
        param_norm: the total 2-norm of all parameters, on steps where parameters were checked.
        finite: False when any checked value was NaN or infinite.
        fired: the ``kind`` of every incident this check published.
        layer_grad_norms: per-parameter gradient norms (ADVANCED level and above).
        update_ratios: per-parameter ``‖Δw‖/‖w‖`` since the previous check (ADVANCED and above).
        dead_fractions: per-module fraction of activations that are exactly zero (EXTREME).
        saturated_fractions: per-module fraction of saturated activations (EXTREME).
        deferred: True when the values are those of an earlier step, read without waiting.
    """

    kind: ClassVar[str] = "step_checked"
    delivery: ClassVar[Delivery] = Delivery.TELEMETRY
    # Built on every training step: the constructor does not check the field types (it would
    # add about a tenth to the cost of building one); the log writer checks, off the training
    # thread, and counts and names a field it cannot write instead of writing the line.
    _check_fields: ClassVar[bool] = False
    severity: Severity = Severity.DEBUG
    loss: float | None = None
    grad_norm: float | None = None
    param_norm: float | None = None
    finite: bool = True
    fired: tuple[str, ...] = ()
    layer_grad_norms: Mapping[str, float] = field(default_factory=dict)
    update_ratios: Mapping[str, float] = field(default_factory=dict)
    dead_fractions: Mapping[str, float] = field(default_factory=dict)
    saturated_fractions: Mapping[str, float] = field(default_factory=dict)
    deferred: bool = False


@event_type
class NonFiniteDetected(Anomaly):
    """NaN or infinite values were found in a loss, gradients, parameters or another tensor.

    Attributes:
        role: what the offending tensors are.
        names: the offending parameter or tensor names (``"loss"`` for the loss).
        nan_count: how many NaN elements, when counted.
        inf_count: how many infinite elements, when counted.
    """

    kind: ClassVar[str] = "non_finite_detected"
    severity: Severity = Severity.ERROR
    role: TensorRole
    names: tuple[str, ...] = ()
    nan_count: int | None = None
    inf_count: int | None = None


@event_type
class GradientExploded(Anomaly):
    """The total gradient norm exceeded its threshold.

    Attributes:
        total_norm: the total 2-norm of all gradients.
        threshold: the threshold it exceeded (the absolute cap, or ``explosion_factor`` x the
            running median of the run's accepted norms).
        top: the largest per-parameter gradient norms, ``(name, norm)``, largest first.
        baseline: the running median of accepted norms (``nan`` at the first check).
        largest: the largest norm the run had accepted before (``0.0`` at the first check).
        rule: ``"growth"`` (against the median) or ``"cap"`` (the absolute cap).
    """

    kind: ClassVar[str] = "gradient_exploded"
    severity: Severity = Severity.WARNING
    total_norm: float
    threshold: float
    top: tuple[tuple[str, float], ...] = ()
    baseline: float = math.nan
    largest: float = 0.0
    rule: str = "growth"


@event_type
class GradientVanished(Anomaly):
    """The gradients vanished: the whole model's, or some parameters' (dead layers).

    Attributes:
        mean_abs: when the whole model vanished, the mean of ``|grad|`` over every gradient
            element (0.0 when all are zero); ``None`` when only dead layers were found.
        threshold: what it fell below: the absolute mean ``|grad|`` threshold when the whole
            model vanished (*mean_abs* set); for dead layers only, a fraction of the model's
            gradient RMS that every listed parameter's gradient RMS is below.
        layers: the parameters that had a gradient and lost it: their gradient RMS fell a
            thousandfold below what it used to be (relative to the model's), and below
            ``vanishing_relative`` of the model's, for ``vanishing_patience`` checks in a row.
        all_zero: True when every gradient element is exactly zero.
    """

    kind: ClassVar[str] = "gradient_vanished"
    severity: Severity = Severity.WARNING
    mean_abs: float | None
    threshold: float
    layers: tuple[str, ...] = ()
    all_zero: bool = False


@event_type
class LossSpiked(Anomaly):
    """The loss jumped relative to its recent history.

    Attributes:
        loss: the loss of this step.
        running_mean: the baseline: the running median of the recent finite, non-spiking
            losses (the name is kept for compatibility).
        ratio: ``loss / running_mean`` (``inf`` for a zero baseline; negative losses give
            ratios below 1 or negative values — read *tolerance* instead).
        rule: ``"spike"`` (one loss far above the baseline) or ``"sustained"`` (``patience``
            spikes in a row: the strong evidence a rollback needs).
        tolerance: how far above the baseline a loss could go before it was a spike.
        streak: spiking steps in a row, this one included.
    """

    kind: ClassVar[str] = "loss_spiked"
    severity: Severity = Severity.WARNING
    loss: float
    running_mean: float
    ratio: float
    rule: str
    tolerance: float = 0.0
    streak: int = 1


@event_type
class AnomalyLocalized(Anomaly):
    """Where a NaN/Inf was made: the first module whose inputs were finite and output not.

    In the backward pass: the first module that received finite gradients and produced a
    non-finite one, or the parameter whose gradient alone is non-finite. When the model's own
    inputs already held NaN/Inf, *role* is INPUT and *module* the first module that got them.

    Attributes:
        module: the qualified name of that module (``""`` for the root module).
        phase: ``"forward"`` or ``"backward"``.
        role: what was non-finite (its OUTPUT in forward, a GRADIENT in backward, its INPUT
            when the NaN/Inf came in with the model's inputs).
        shapes: the shapes of the offending tensors.
        input_min: the smallest finite input value of that module, when known.
        input_max: the largest finite input value of that module, when known.
        parameter: the qualified name of the parameter whose gradient was the first
            non-finite one, when the NaN/Inf exists only in a parameter's gradient (``""``
            otherwise); *module* is then the module that owns it.
    """

    kind: ClassVar[str] = "anomaly_localized"
    severity: Severity = Severity.ERROR
    module: str
    phase: str
    role: TensorRole
    shapes: tuple[tuple[int, ...], ...] = ()
    input_min: float | None = None
    input_max: float | None = None
    parameter: str = ""


@event_type
class AutogradAnomalyDetected(Anomaly):
    """``torch.autograd.detect_anomaly`` caught a backward function producing NaN (or erroring).

    Attributes:
        backward_fn: the name of the failing backward function (e.g. ``"DivBackward0"``).
        forward_stack: the traceback of the forward call that created it, as PyTorch recorded it.
        message: the error message.
    """

    kind: ClassVar[str] = "autograd_anomaly_detected"
    severity: Severity = Severity.ERROR
    backward_fn: str
    forward_stack: str = ""
    message: str = ""
