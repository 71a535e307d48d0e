"""Probes: what training loops await to check gradients, parameters, loss, memory and more."""

from __future__ import annotations

from .autograd import AnomalyCapture, capture_autograd_anomaly, replay_with_anomaly_detection
from .events import (
    AnomalyLocalized,
    AutogradAnomalyDetected,
    DebugLevel,
    GradientExploded,
    GradientVanished,
    LossSpiked,
    MemoryLeakSuspected,
    MemorySampled,
    NonFiniteDetected,
    ProfileCaptured,
    ResourceThresholdExceeded,
    StepChecked,
    SystemSampled,
    TensorRole,
)
from .functions import (
    GradientReport,
    ParameterStats,
    analyze_gradients,
    analyze_model_parameters,
    check_gradient_explosion,
    check_gradient_vanishing,
    check_gradients,
    check_model_parameters,
    monitor_training_step,
)
from .levels import Cadence, Checks, Thresholds
from .localize import (
    BackwardReport,
    FirstNonFiniteLocator,
    ForwardReport,
    LayerRecord,
    debug_backward_pass,
    debug_forward_pass,
)
from .step import StepProbe, StepVerdict
from .tensor import TensorStats, analyze_tensor

__all__: tuple[str, ...] = (
    "AnomalyCapture",
    "BackwardReport",
    "Cadence",
    "Checks",
    "FirstNonFiniteLocator",
    "ForwardReport",
    "GradientReport",
    "LayerRecord",
    "ParameterStats",
    "StepProbe",
    "StepVerdict",
    "TensorStats",
    "Thresholds",
    "analyze_gradients",
    "analyze_model_parameters",
    "analyze_tensor",
    "capture_autograd_anomaly",
    "check_gradient_explosion",
    "check_gradient_vanishing",
    "check_gradients",
    "check_model_parameters",
    "debug_backward_pass",
    "debug_forward_pass",
    "monitor_training_step",
    "replay_with_anomaly_detection",
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
