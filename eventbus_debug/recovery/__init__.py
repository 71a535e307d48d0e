"""Recovery: turn incidents into typed decisions, applied by the loop at safe points."""

from __future__ import annotations

from .amp import ScalerStepWatcher
from .classify import ErrorClassification, ErrorClassifier, ErrorRule, is_out_of_memory
from .engine import (
    DecidedAction,
    RecoveryEngine,
    RecoveryStatistics,
    StrategySpec,
    default_strategies,
)
from .events import (
    ErrorCategory,
    ErrorRaised,
    RecoveryAction,
    RecoveryApplied,
    RecoveryDecided,
    StepSkipped,
)
from .retry import Attempt, CallState, Retrying, retrying
from .safepoint import NoGoodStateError, SafePoint, StateSnapshots, StepDecision
from .strategies import (
    ClipOnExplosion,
    DataLoaderFallback,
    Decision,
    ModelLoadingFallback,
    ReportVanishing,
    RestoreLastGood,
    RollbackOnLossSpike,
    ShrinkBatchOnOOM,
    SkipNonFinite,
    StrategyHistory,
)

__all__: tuple[str, ...] = (
    "Attempt",
    "CallState",
    "ClipOnExplosion",
    "DataLoaderFallback",
    "DecidedAction",
    "Decision",
    "ErrorCategory",
    "ErrorClassification",
    "ErrorClassifier",
    "ErrorRaised",
    "ErrorRule",
    "ModelLoadingFallback",
    "NoGoodStateError",
    "RecoveryAction",
    "RecoveryApplied",
    "RecoveryDecided",
    "RecoveryEngine",
    "RecoveryStatistics",
    "ReportVanishing",
    "RestoreLastGood",
    "Retrying",
    "RollbackOnLossSpike",
    "SafePoint",
    "ScalerStepWatcher",
    "ShrinkBatchOnOOM",
    "SkipNonFinite",
    "StateSnapshots",
    "StepDecision",
    "StepSkipped",
    "StrategyHistory",
    "StrategySpec",
    "default_strategies",
    "is_out_of_memory",
    "retrying",
)
