"""Resource telemetry and incidents: memory, system load, profiles, leaks, thresholds."""

from __future__ import annotations

from typing import ClassVar

from ._base import Anomaly, Delivery, Event, Severity, event_type

__all__ = (
    "MemoryLeakSuspected",
    "MemorySampled",
    "ProfileCaptured",
    "ResourceThresholdExceeded",
    "SystemSampled",
)


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
