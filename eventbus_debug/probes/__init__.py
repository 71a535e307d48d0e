"""Probes: what training loops await to check gradients, parameters, loss, memory and more."""

from __future__ import annotations

from .anomaly_arming import AnomalyArming
from .autograd import AnomalyCapture, capture_autograd_anomaly, replay_with_anomaly_detection
from .debug_passes import (
    BackwardReport,
    ForwardReport,
    LayerRecord,
    debug_backward_pass,
    debug_forward_pass,
)
from .finite import NonFiniteCounts, non_finite_counts
from .levels import Cadence, Checks, DebugLevel, Thresholds
from .localize import FirstNonFiniteLocator
from .memory import (
    LeakDetector,
    LeakThresholds,
    MemoryDelta,
    MemoryProfile,
    MemorySnapshot,
    TensorCensus,
    cuda_memory_history,
    memory_snapshot,
    memory_tracking,
    profile_memory,
    tensor_census,
)
from .profiler import ProfileSchedule, StepProfiler, TraceStore, profiling
from .step import StepProbe, StepVerdict
from .system import (
    CpuMeter,
    MetricSummary,
    ResourceThresholds,
    SystemReading,
    SystemSampler,
    SystemSummary,
    read_system,
)
from .tensor import TensorStats, analyze_tensor

__all__: tuple[str, ...] = (
    "AnomalyArming",
    "AnomalyCapture",
    "BackwardReport",
    "Cadence",
    "Checks",
    "FirstNonFiniteLocator",
    "ForwardReport",
    "LayerRecord",
    "NonFiniteCounts",
    "StepProbe",
    "StepVerdict",
    "TensorStats",
    "Thresholds",
    "analyze_tensor",
    "capture_autograd_anomaly",
    "debug_backward_pass",
    "debug_forward_pass",
    "non_finite_counts",
    "replay_with_anomaly_detection",
    # memory, system, profiler
    "CpuMeter",
    "LeakDetector",
    "LeakThresholds",
    "MemoryDelta",
    "MemoryProfile",
    "MemorySnapshot",
    "MetricSummary",
    "ProfileSchedule",
    "ResourceThresholds",
    "StepProfiler",
    "SystemReading",
    "SystemSampler",
    "SystemSummary",
    "TensorCensus",
    "TraceStore",
    "cuda_memory_history",
    "memory_snapshot",
    "memory_tracking",
    "profile_memory",
    "profiling",
    "read_system",
    "tensor_census",
    "DebugLevel",
)
