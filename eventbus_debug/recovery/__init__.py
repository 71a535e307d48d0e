"""Recovery: turn incidents into typed decisions, applied by the loop at safe points."""

from __future__ import annotations

from .actions import (
    Action,
    ClipGradients,
    Continue,
    DecidedAction,
    Decision,
    Fallback,
    FreeMemory,
    RestoreState,
    Retry,
    ScaleLR,
    ShrinkBatch,
    SkipStep,
    Stop,
)
from .agreement import RankAgreement
from .amp import ScalerMonitor, ScalerStepWatcher
from .calls import report_error, report_error_sync
from .classify import ErrorClassification, ErrorClassifier, ErrorRule, is_out_of_memory
from .corrupt_samples import (
    CollatedBatch,
    CorruptDataError,
    CorruptSample,
    CorruptSampleCollate,
    SkipCorruptSamples,
    SkippingLoader,
    skip_corrupt_samples,
)
from .engine import Pending, RecoveryEngine, RecoveryStatistics
from .fixes import CommonFixes, apply_common_fixes
from .lr import scale_learning_rate
from .memory import FreedMemory, free_memory
from .registry import StrategySpec, default_strategies
from .retry import Attempt, CallState, Retrying, retrying
from .safepoint import NoGoodStateError, Placement, SafePoint, StateSnapshots, StepDecision
from .strategies import (
    ClipOnExplosion,
    DataLoaderFallback,
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
    "Action",
    "Attempt",
    "CallState",
    "ClipGradients",
    "ClipOnExplosion",
    "CollatedBatch",
    "CommonFixes",
    "Continue",
    "CorruptDataError",
    "CorruptSample",
    "CorruptSampleCollate",
    "DataLoaderFallback",
    "DecidedAction",
    "Decision",
    "ErrorClassification",
    "ErrorClassifier",
    "ErrorRule",
    "Fallback",
    "FreeMemory",
    "FreeMemoryOnLeak",
    "FreedMemory",
    "ModelLoadingFallback",
    "NoGoodStateError",
    "Pending",
    "Placement",
    "RankAgreement",
    "RecoveryEngine",
    "RecoveryPolicy",
    "RecoveryStatistics",
    "ReportNonFinite",
    "ReportVanishing",
    "RestoreLastGood",
    "RestoreState",
    "Retry",
    "Retrying",
    "RollbackOnLossSpike",
    "SafePoint",
    "ScaleLR",
    "ScalerMonitor",
    "ScalerStepWatcher",
    "ShrinkBatch",
    "ShrinkBatchOnOOM",
    "SkipCorruptSamples",
    "SkipNonFinite",
    "SkipStep",
    "SkippingLoader",
    "StateSnapshots",
    "StepDecision",
    "Stop",
    "StrategyHistory",
    "StrategySpec",
    "apply_common_fixes",
    "default_strategies",
    "free_memory",
    "is_out_of_memory",
    "report_error",
    "report_error_sync",
    "retrying",
    "scale_learning_rate",
    "skip_corrupt_samples",
)
