"""The recovery vocabulary: error categories, recovery actions and the events that report them.

These classes are a contract shared with the probes, the sinks and the report: the names and
fields are stable. Events carry host-side values only, never tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import field
from enum import Enum
from typing import ClassVar

from ._base import Anomaly, Event, Severity, event_type

__all__ = (
    "ErrorCategory",
    "ErrorRaised",
    "RecoveryAction",
    "RecoveryApplied",
    "RecoveryDecided",
    "SampleSkipped",
    "ScalerInTrouble",
    "StepSkipped",
)


class ErrorCategory(Enum):
    """What part of a training job an error comes from (derived by an error classifier).

    Attributes:
        DATA: reading, decoding or collating samples; data loader workers.
        MODEL: building, loading or running the model (shape mismatches, bad checkpoints).
        MEMORY: out of memory on the device or the host.
        NUMERICAL: NaN/Inf, overflow, singular matrices and other numerical failures.
        SYSTEM: the operating system, the driver, the network, the file system.
        CONFIGURATION: invalid arguments or settings given by the user.
        UNKNOWN: none of the above could be established.
    """

    DATA = "data"
    MODEL = "model"
    MEMORY = "memory"
    NUMERICAL = "numerical"
    SYSTEM = "system"
    CONFIGURATION = "configuration"
    UNKNOWN = "unknown"


class RecoveryAction(Enum):
    """What a recovery decision asks the training loop (or a retried call) to do.

    Attributes:
        CONTINUE: nothing; the incident was noted and needs no action.
        SKIP_STEP: do not call ``optimizer.step()``; zero the gradients instead.
        CLIP_GRADIENTS: scale the gradients down to a maximum total norm.
        SCALE_LR: multiply the learning rate of every parameter group by a factor.
        RESTORE_STATE: load the last good model and optimizer state.
        SHRINK_BATCH: retry the failed call with a smaller batch.
        RETRY: retry the failed call after freeing memory or changing a setting.
        FALLBACK: retry the failed call with a fallback (fewer workers, CPU, half precision...).
        FREE_MEMORY: collect garbage and empty the CUDA cache at the next safe point.
        STOP: training cannot continue; :class:`~eventbus_debug.TrainingStopped` is raised at the
            next safe point.
    """

    CONTINUE = "continue"
    SKIP_STEP = "skip_step"
    CLIP_GRADIENTS = "clip_gradients"
    SCALE_LR = "scale_lr"
    RESTORE_STATE = "restore_state"
    SHRINK_BATCH = "shrink_batch"
    RETRY = "retry"
    FALLBACK = "fallback"
    FREE_MEMORY = "free_memory"
    STOP = "stop"


@event_type
class ErrorRaised(Anomaly):
    """An exception was raised by a call run under recovery (or reported by the user).

    Attributes:
        error_type: the exception's qualified class name (``"torch.OutOfMemoryError"``).
        message: ``str(exception)``.
        traceback: the formatted traceback.
        category: what part of the job it comes from (see :class:`ErrorCategory`).
        attempt: 1 for the first failure of a call, 2 for the failure of its first retry, ...
        context: what the caller said about the call (function name, batch size, ...).
        exception_types: the qualified names of the exception's class and its bases, most
            derived first, so strategies registered for a base class match without the object.
    """

    kind: ClassVar[str] = "error_raised"
    severity: Severity = Severity.ERROR
    error_type: str
    message: str
    traceback: str = ""
    category: ErrorCategory = ErrorCategory.UNKNOWN
    attempt: int = 1
    context: Mapping[str, str] = field(default_factory=dict)
    exception_types: tuple[str, ...] = ()


@event_type
class RecoveryDecided(Event):
    """The recovery engine decided what to do about an incident.

    Attributes:
        action: what it decided.
        reason: why, in words (names the incident and the limit that applied).
        strategy: the name of the strategy that decided.
        trigger_kind: the ``kind`` of the incident that triggered the decision.
        trigger_seq: the ``seq`` of that incident on the bus.
        parameters: the action's numbers (``lr_factor``, ``max_norm``, ``batch_size``, ...).
    """

    kind: ClassVar[str] = "recovery_decided"
    severity: Severity = Severity.WARNING
    action: RecoveryAction
    reason: str
    strategy: str
    trigger_kind: str
    trigger_seq: int
    parameters: Mapping[str, float] = field(default_factory=dict)


@event_type
class RecoveryApplied(Event):
    """A decided action was applied at a safe point (or failed, or was exhausted).

    Attributes:
        action: the action.
        detail: what exactly changed (``"lr 0.1 -> 0.05 in 1 param group"``).
        outcome: ``"applied"``, ``"failed"``, ``"exhausted"``, ``"skipped"`` (a precautionary
            restore with no good state held: nothing to do) or ``"restored"`` (a temporary
            learning-rate change undone after its healthy steps).
    """

    kind: ClassVar[str] = "recovery_applied"
    severity: Severity = Severity.WARNING
    action: RecoveryAction
    detail: str
    outcome: str = "applied"


@event_type
class StepSkipped(Event):
    """An optimizer step was not taken (by recovery, or by a ``GradScaler`` that saw inf/NaN).

    Attributes:
        reason: why the step was skipped.
        scale_before: the loss scale before ``scaler.update()`` (AMP only).
        scale_after: the loss scale after it (AMP only).
    """

    kind: ClassVar[str] = "step_skipped"
    severity: Severity = Severity.WARNING
    reason: str
    scale_before: float | None = None
    scale_after: float | None = None


@event_type
class ScalerInTrouble(Anomaly):
    """An AMP ``GradScaler`` keeps overflowing: its scale collapsed or it skipped many steps.

    Occasional overflow steps are the scaler's routine business (reported as
    :class:`StepSkipped` with the scales); this incident means fp16 cannot represent the
    gradients even at a tiny scale, or the model stopped learning because every step is skipped.
    No default strategy acts on it.

    Attributes:
        scale: the scale now.
        floor: the scale below which the scaler is in trouble.
        consecutive_skips: overflow steps in a row.
    """

    kind: ClassVar[str] = "scaler_in_trouble"
    severity: Severity = Severity.ERROR
    scale: float
    floor: float
    consecutive_skips: int


@event_type
class SampleSkipped(Anomaly):
    """A sample raised while being loaded and was left out of its batch.

    Published by :class:`~eventbus_debug.recovery.SkippingLoader` in the training process (also
    for samples that failed in a data loader worker).

    Attributes:
        index: the sample's index in the dataset.
        error_type: the qualified class name of the exception it raised.
        message: ``str(exception)``.
        skipped: corrupt samples skipped so far in this pass over the data, this one included.
        max_skipped: the most a pass may skip before :class:`~eventbus_debug.recovery.
            CorruptDataError` is raised.
    """

    kind: ClassVar[str] = "sample_skipped"
    severity: Severity = Severity.WARNING
    index: int
    error_type: str
    message: str
    skipped: int = 1
    max_skipped: int = 0
