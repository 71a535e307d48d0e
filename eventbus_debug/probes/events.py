"""The probes' event vocabulary: debug levels, tensor roles, step telemetry and incidents.

Every class here is shared with the recovery engine and the sinks; the names and fields are a
contract between them. Events carry host-side numbers and strings only, never tensors.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import field
from enum import Enum
from typing import ClassVar

from ..events import Anomaly, Delivery, Event, Severity, event_type

__all__ = (
    "AnomalyLocalized",
    "AutogradAnomalyDetected",
    "DebugLevel",
    "GradientExploded",
    "GradientVanished",
    "LossSpiked",
    "MemoryLeakSuspected",
    "MemorySampled",
    "NonFiniteDetected",
    "ProfileCaptured",
    "ResourceThresholdExceeded",
    "StepChecked",
    "SystemSampled",
    "TensorRole",
)


class DebugLevel(Enum):
    """How much the probes check, from nothing to everything.

    Attributes:
        OFF: no check runs; a probe call costs one comparison.
        BASIC: loss, gradient norm and non-finite checks (one device transfer per step).
        ADVANCED: BASIC plus parameter norms, per-layer norms and weight-update ratios.
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


# -- telemetry ----------------------------------------------------------------------------------


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
class MemorySampled(Event):
    """Process and device memory at one point in time (bytes, integers)."""

    kind: ClassVar[str] = "memory_sampled"
    delivery: ClassVar[Delivery] = Delivery.TELEMETRY
    severity: Severity = Severity.DEBUG
    rss_bytes: int
    cuda_allocated: int | None = None
    cuda_reserved: int | None = None
    cuda_peak: int | None = None
    cuda_alloc_retries: int | None = None
    cuda_ooms: int | None = None
    live_tensors: int | None = None
    label: str = ""


@event_type
class SystemSampled(Event):
    """Host (and optionally GPU) utilisation, sampled by the system sampler's timer."""

    kind: ClassVar[str] = "system_sampled"
    delivery: ClassVar[Delivery] = Delivery.TELEMETRY
    severity: Severity = Severity.DEBUG
    cpu_percent: float
    memory_percent: float
    disk_percent: float
    gpu_utilization: float | None = None
    gpu_memory_percent: float | None = None


@event_type
class ProfileCaptured(Event):
    """A torch.profiler capture finished and its Chrome trace was written.

    Attributes:
        path: the gzipped Chrome trace file (``""`` when writing was disabled).
        steps: how many profiled steps the trace covers.
        size_bytes: the size of the written file.
        top_ops: the operators with the largest self time, ``(name, self_time_us)``, largest first.
        trigger: why the capture ran (``"manual"``, or the kind of the incident that armed it).
    """

    kind: ClassVar[str] = "profile_captured"
    path: str
    steps: int
    size_bytes: int = 0
    top_ops: tuple[tuple[str, float], ...] = ()
    trigger: str = "manual"


# -- incidents ----------------------------------------------------------------------------------


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
    """The mean absolute gradient fell below its threshold.

    Attributes:
        mean_abs: the mean of ``|grad|`` over every gradient element (``nan`` when only dead
            layers were found and the model-wide mean was not computed at this step).
        threshold: the threshold it fell below (absolute for the model, relative to the
            model's gradient for dead layers).
        layers: the parameters that had a gradient and lost it (their gradient RMS fell below
            ``vanishing_relative`` x the model's for ``vanishing_patience`` checks in a row).
        all_zero: True when every gradient element is exactly zero.
    """

    kind: ClassVar[str] = "gradient_vanished"
    severity: Severity = Severity.WARNING
    mean_abs: float
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


@event_type
class MemoryLeakSuspected(Anomaly):
    """A resource grew steadily over a window of samples.

    Attributes:
        resource: ``"rss"``, ``"cuda_allocated"``, ``"live_tensors"`` or ``"graph"``.
        slope: growth per sample (bytes, tensors or graphs per sample).
        window: how many samples the trend covers.
        retained: what is being retained, in words.
    """

    kind: ClassVar[str] = "memory_leak_suspected"
    severity: Severity = Severity.WARNING
    resource: str
    slope: float
    window: int
    retained: str = ""


@event_type
class ResourceThresholdExceeded(Anomaly):
    """A system metric crossed its threshold.

    Attributes:
        metric: ``"cpu_percent"``, ``"memory_percent"``, ``"disk_percent"``,
            ``"gpu_memory_percent"`` or ``"gpu_utilization"``.
        value: the sampled value.
        threshold: the threshold it exceeded.
    """

    kind: ClassVar[str] = "resource_threshold_exceeded"
    severity: Severity = Severity.WARNING
    metric: str
    value: float
    threshold: float
