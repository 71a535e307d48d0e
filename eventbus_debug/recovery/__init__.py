"""Recovery: turn incidents into typed decisions, applied by the loop at safe points."""

from __future__ import annotations

from .amp import ScalerMonitor, ScalerStepWatcher
from .classify import ErrorClassification, ErrorClassifier, ErrorRule, is_out_of_memory
from .data import (
    CollatedBatch,
    CorruptDataError,
    CorruptSample,
    CorruptSampleCollate,
    SkipCorruptSamples,
    SkippingLoader,
    skip_corrupt_samples,
)
from .engine import (
    DecidedAction,
    RecoveryEngine,
    RecoveryStatistics,
    StrategySpec,
    default_strategies,
)
from .fixes import CommonFixes, apply_common_fixes
from .lr import scale_learning_rate
from .memory import FreedMemory, free_memory
from .retry import Attempt, CallState, Retrying, retrying
from .safepoint import NoGoodStateError, SafePoint, StateSnapshots, StepDecision
from .strategies import (
    ClipOnExplosion,
    DataLoaderFallback,
    Decision,
    FreeMemoryOnLeak,
    ModelLoadingFallback,
    RecoveryPolicy,
    ReportNonFinite,
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
    "CollatedBatch",
    "CommonFixes",
    "CorruptDataError",
    "CorruptSample",
    "CorruptSampleCollate",
    "DataLoaderFallback",
    "DecidedAction",
    "Decision",
    "ErrorClassification",
    "ErrorClassifier",
    "ErrorRule",
    "FreeMemoryOnLeak",
    "FreedMemory",
    "ModelLoadingFallback",
    "NoGoodStateError",
    "RecoveryEngine",
    "RecoveryStatistics",
    "RecoveryPolicy",
    "ReportNonFinite",
    "ReportVanishing",
    "RestoreLastGood",
    "Retrying",
    "RollbackOnLossSpike",
    "SafePoint",
    "ScalerMonitor",
    "ScalerStepWatcher",
    "ShrinkBatchOnOOM",
    "SkipCorruptSamples",
    "SkipNonFinite",
    "SkippingLoader",
    "StateSnapshots",
    "StepDecision",
    "StrategyHistory",
    "StrategySpec",
    "apply_common_fixes",
    "default_strategies",
    "free_memory",
    "is_out_of_memory",
    "retrying",
    "scale_learning_rate",
    "skip_corrupt_samples",
)
