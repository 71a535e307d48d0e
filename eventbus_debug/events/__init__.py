"""The vocabulary: every event type, in one package that imports only the standard library.

Every event is an immutable, slotted dataclass with a common header (sequence number, wall
time, step, rank, source, severity) and named fields; events carry host-side values only,
never tensors. The modules group them by who publishes them:

- :mod:`._base`: :class:`Event`, :class:`Anomaly`, :class:`Severity`, :class:`Delivery`,
  :func:`event_type` and the registry of kinds;
- :mod:`.bus`: the bus's and sinks' own incidents; :mod:`.session`: a session's start, end
  and steps; :mod:`.training`: what the step probe sees; :mod:`.resources`: memory, system,
  profiles, leaks; :mod:`.recovery`: errors, decisions and what recovery did; :mod:`.extras`:
  the opt-in features' events (latents, input and output checks, timed operations).
"""

from __future__ import annotations

from ._base import (
    Anomaly as Anomaly,
    Delivery as Delivery,
    Event as Event,
    Severity as Severity,
    current_rank as current_rank,
    event_type as event_type,
    event_types as event_types,
    has_incident as has_incident,
    refresh_rank as refresh_rank,
)
from .bus import (
    SELF_EXCLUDING as SELF_EXCLUDING,
    EventsDropped as EventsDropped,
    EventsUndelivered as EventsUndelivered,
    LogWriteResumed as LogWriteResumed,
    LoopStalled as LoopStalled,
    SinkCloseFailed as SinkCloseFailed,
    SinkDisabled as SinkDisabled,
    SinkFailed as SinkFailed,
    SinkUnresponsive as SinkUnresponsive,
)
from .extras import (
    ComponentInfo as ComponentInfo,
    InputValidationFailed as InputValidationFailed,
    LatentAnomalyDetected as LatentAnomalyDetected,
    LatentChecked as LatentChecked,
    OperationCompleted as OperationCompleted,
    OutputAnomalyDetected as OutputAnomalyDetected,
    PipelineAnalyzed as PipelineAnalyzed,
)
from .recovery import (
    CallSettings as CallSettings,
    ErrorCategory as ErrorCategory,
    ErrorRaised as ErrorRaised,
    RecoveryAction as RecoveryAction,
    RecoveryApplied as RecoveryApplied,
    RecoveryDecided as RecoveryDecided,
    SampleSkipped as SampleSkipped,
    ScalerInTrouble as ScalerInTrouble,
    SnapshotPlaced as SnapshotPlaced,
    StepSkipped as StepSkipped,
)
from .resources import (
    MemoryLeakSuspected as MemoryLeakSuspected,
    MemorySampled as MemorySampled,
    ProfileCaptured as ProfileCaptured,
    ResourceThresholdExceeded as ResourceThresholdExceeded,
    SystemSampled as SystemSampled,
)
from .session import (
    RUN_ID_ENV as RUN_ID_ENV,
    SessionEnded as SessionEnded,
    SessionStarted as SessionStarted,
    StepCompleted as StepCompleted,
    UsageWarning as UsageWarning,
    given_run_id as given_run_id,
    new_run_id as new_run_id,
)
from .training import (
    AnomalyLocalized as AnomalyLocalized,
    AutogradAnomalyDetected as AutogradAnomalyDetected,
    GradientExploded as GradientExploded,
    GradientVanished as GradientVanished,
    LossSpiked as LossSpiked,
    NonFiniteDetected as NonFiniteDetected,
    StepChecked as StepChecked,
    TensorRole as TensorRole,
)

__all__ = (
    "RUN_ID_ENV",
    "SELF_EXCLUDING",
    "Anomaly",
    "AnomalyLocalized",
    "AutogradAnomalyDetected",
    "CallSettings",
    "ComponentInfo",
    "Delivery",
    "ErrorCategory",
    "ErrorRaised",
    "Event",
    "EventsDropped",
    "EventsUndelivered",
    "GradientExploded",
    "GradientVanished",
    "InputValidationFailed",
    "LatentAnomalyDetected",
    "LatentChecked",
    "LogWriteResumed",
    "LoopStalled",
    "LossSpiked",
    "MemoryLeakSuspected",
    "MemorySampled",
    "NonFiniteDetected",
    "OperationCompleted",
    "OutputAnomalyDetected",
    "PipelineAnalyzed",
    "ProfileCaptured",
    "RecoveryAction",
    "RecoveryApplied",
    "RecoveryDecided",
    "ResourceThresholdExceeded",
    "SampleSkipped",
    "ScalerInTrouble",
    "SessionEnded",
    "SessionStarted",
    "Severity",
    "SinkCloseFailed",
    "SinkDisabled",
    "SinkFailed",
    "SinkUnresponsive",
    "StepChecked",
    "StepCompleted",
    "SnapshotPlaced",
    "StepSkipped",
    "SystemSampled",
    "TensorRole",
    "UsageWarning",
    "current_rank",
    "event_type",
    "event_types",
    "has_incident",
    "given_run_id",
    "new_run_id",
    "refresh_rank",
)
