"""The opt-in features' events (:mod:`eventbus_debug.extras`): latents, pipelines, input and
output checks, timed operations.

They live with the rest of the vocabulary so that reading a log that holds them imports neither
torch nor the features that publish them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ._base import Anomaly, Delivery, Event, Severity, event_type

__all__ = (
    "ComponentInfo",
    "InputValidationFailed",
    "LatentAnomalyDetected",
    "LatentChecked",
    "OperationCompleted",
    "OutputAnomalyDetected",
    "PipelineAnalyzed",
)

# diffusion pipelines (extras.diffusion)


@event_type
class LatentChecked(Event):
    """The statistics of one denoising step's latents (telemetry).

    Attributes:
        denoising_step: the index of the step in the sampling loop.
        timestep: the scheduler's timestep, when given.
        norm: the 2-norm of the latents divided by sqrt(numel) (an RMS, comparable across sizes).
        mean: the mean of the latents.
        std: their standard deviation.
        finite: False when any element is NaN or infinite.
        norm_ratio: ``norm`` relative to the previous step's.
    """

    kind: ClassVar[str] = "latent_checked"
    delivery: ClassVar[Delivery] = Delivery.TELEMETRY
    severity: Severity = Severity.DEBUG
    denoising_step: int
    timestep: int | None = None
    norm: float
    mean: float
    std: float
    finite: bool = True
    norm_ratio: float | None = None


@event_type
class LatentAnomalyDetected(Anomaly):
    """A denoising step's latents became non-finite or their norm drifted.

    Attributes:
        denoising_step: the index of the step in the sampling loop.
        timestep: the scheduler's timestep, when given.
        rule: ``"non_finite"`` or ``"norm_drift"``.
        message: the anomaly in words.
        norm: the latents' RMS at this step.
        reference_norm: the RMS it is compared with (the previous step's).
        nonfinite_count: NaN or infinite elements.
    """

    kind: ClassVar[str] = "latent_anomaly_detected"
    severity: Severity = Severity.WARNING
    denoising_step: int
    timestep: int | None = None
    rule: str
    message: str
    norm: float | None = None
    reference_norm: float | None = None
    nonfinite_count: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class ComponentInfo:
    """One component of a pipeline.

    Attributes:
        name: the component's name (``"unet"``).
        module_type: its class name.
        parameters: its parameter count.
        trainable: how many of them require gradients.
        size_bytes: the memory its parameters and buffers take.
        dtypes: the parameter dtypes present, sorted.
        devices: the devices its parameters live on, sorted.
        training: whether it is in training mode.
    """

    name: str
    module_type: str
    parameters: int
    trainable: int
    size_bytes: int
    dtypes: tuple[str, ...]
    devices: tuple[str, ...]
    training: bool


@event_type
class PipelineAnalyzed(Event):
    """The components of a diffusion pipeline (parameter counts, dtypes, devices).

    Attributes:
        components: one entry per component.
        total_parameters: the parameter count of all components (shared modules counted once).
        mixed_dtypes: True when components disagree on dtype (a common cause of NaN latents).
        mixed_devices: True when components live on different devices.
    """

    kind: ClassVar[str] = "pipeline_analyzed"
    components: tuple[ComponentInfo, ...] = ()
    total_parameters: int = 0
    mixed_dtypes: bool = False
    mixed_devices: bool = False


# input and output checks (extras.validation)


@event_type
class InputValidationFailed(Anomaly):
    """A batch broke a rule of its :class:`InputSpec`.

    Attributes:
        name: what was validated (``"inputs"``, a feature name...).
        rule: ``"non_finite"``, ``"range"``, ``"shape"`` or ``"dtype"``.
        message: the violation in words.
        nan_count: NaN elements (``non_finite`` rule).
        inf_count: infinite elements (``non_finite`` rule).
        min_value: the smallest finite value seen.
        max_value: the largest finite value seen.
        shape: the batch's shape.
        dtype: the batch's dtype.
    """

    kind: ClassVar[str] = "input_validation_failed"
    severity: Severity = Severity.ERROR
    name: str
    rule: str
    message: str
    nan_count: int = 0
    inf_count: int = 0
    min_value: float | None = None
    max_value: float | None = None
    shape: tuple[int, ...] = ()
    dtype: str = ""


@event_type
class OutputAnomalyDetected(Anomaly):
    """A model's outputs look wrong: non-finite, out of the expected range, or collapsed.

    Attributes:
        name: what was checked (``"outputs"``, ``"probabilities"``...).
        rule: ``"non_finite"``, ``"range"`` or ``"collapsed"`` (predictions nearly identical).
        message: the anomaly in words.
        min_value: the smallest finite output.
        max_value: the largest finite output.
        std: the standard deviation of the finite outputs.
        nonfinite_count: NaN or infinite elements.
    """

    kind: ClassVar[str] = "output_anomaly_detected"
    severity: Severity = Severity.WARNING
    name: str
    rule: str
    message: str
    min_value: float | None = None
    max_value: float | None = None
    std: float | None = None
    nonfinite_count: int = 0


# timed blocks (extras.debug_context)


@event_type
class OperationCompleted(Event):
    """A timed block or function finished (telemetry).

    Attributes:
        name: the operation's name.
        duration_s: its wall-clock duration.
        cpu_time_s: the process CPU time it used (all threads).
        rss_delta_bytes: the change of the process's resident memory.
        rss_bytes: the resident memory at the end.
        cuda_allocated_delta_bytes: the change of allocated CUDA memory (None without CUDA).
        cuda_peak_bytes: the peak allocated CUDA memory during the block (None without CUDA).
        error: the exception type that ended the block, if any.
    """

    kind: ClassVar[str] = "operation_completed"
    delivery: ClassVar[Delivery] = Delivery.TELEMETRY
    severity: Severity = Severity.DEBUG
    name: str
    duration_s: float
    cpu_time_s: float = 0.0
    rss_delta_bytes: int = 0
    rss_bytes: int = 0
    cuda_allocated_delta_bytes: int | None = None
    cuda_peak_bytes: int | None = None
    error: str | None = None
