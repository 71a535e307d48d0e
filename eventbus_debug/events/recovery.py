"""The recovery vocabulary: error categories, recovery actions and the events that report them.

The typed actions (:class:`SkipStep`, :class:`ScaleLR`, ...) live here, beside the events
that carry them: each holds its numbers as named fields and its :class:`RecoveryAction` as
``kind``; the ``tag`` field (the same value) is what the log writes, so that a decoded
:class:`RecoveryDecided` gets the right class back.

These classes are a contract shared with the probes, the sinks and the report: the names and
fields are stable. Events carry host-side values only, never tensors.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import ClassVar, Final, Literal, TypeAlias

from ._base import Anomaly, Event, Severity, event_type

__all__ = (
    "ACTION_TYPES",
    "Action",
    "CallSettings",
    "ClipGradients",
    "Continue",
    "ErrorCategory",
    "ErrorRaised",
    "Fallback",
    "FreeMemory",
    "RecoveryAction",
    "RecoveryApplied",
    "RecoveryDecided",
    "RestoreState",
    "Retry",
    "SampleSkipped",
    "ScaleLR",
    "ScalerInTrouble",
    "ShrinkBatch",
    "SkipStep",
    "SnapshotPlaced",
    "StepSkipped",
    "Stop",
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


def _check_number(name: str, value: object, *, minimum: float, strict: bool, integer: bool) -> None:
    """The action fields' rules (this package imports nothing outside the standard library)."""
    kinds: tuple[type, ...] = (int,) if integer else (int, float)
    ok = isinstance(value, kinds) and not isinstance(value, bool)
    if ok:
        number = float(value)  # type: ignore[arg-type]
        ok = math.isfinite(number) and (number > minimum if strict else number >= minimum)
    if not ok:
        what = "an int" if integer else "a finite number"
        msg = f"{name} must be {what} {'>' if strict else '>='} {minimum:g}, got {value!r}"
        raise ValueError(msg)


def _check_tag(action: object, tag: str, kind: RecoveryAction) -> None:
    if tag != kind.value:
        msg = f"{type(action).__name__}.tag must be {kind.value!r} (leave it out), got {tag!r}"
        raise ValueError(msg)


def _check_flag(action: object, name: str, value: object, *, optional: bool = False) -> None:
    if isinstance(value, bool) or (optional and value is None):
        return
    what = "a bool or None" if optional else "a bool"
    msg = f"{type(action).__name__}.{name} must be {what}, got {value!r}"
    raise TypeError(msg)


@dataclass(frozen=True, slots=True, kw_only=True)
class Continue:
    """Nothing to do: the incident was noted (reported) and needs no action."""

    kind: ClassVar[RecoveryAction] = RecoveryAction.CONTINUE
    tag: Literal["continue"] = field(default="continue", repr=False)

    def __post_init__(self) -> None:
        _check_tag(self, self.tag, self.kind)


@dataclass(frozen=True, slots=True, kw_only=True)
class SkipStep:
    """Do not call ``optimizer.step()`` for this batch and the next ``batches - 1``.

    Raises:
        ValueError: if *batches* is not an int >= 1.
    """

    kind: ClassVar[RecoveryAction] = RecoveryAction.SKIP_STEP
    batches: int = 1
    tag: Literal["skip_step"] = field(default="skip_step", repr=False)

    def __post_init__(self) -> None:
        _check_tag(self, self.tag, self.kind)
        _check_number("SkipStep.batches", self.batches, minimum=1, strict=False, integer=True)


@dataclass(frozen=True, slots=True, kw_only=True)
class ClipGradients:
    """Scale the gradients down to *max_norm*, using the *total_norm* the probe measured.

    Raises:
        ValueError: if *max_norm* is not a finite number > 0 or *total_norm* not one >= 0.
    """

    kind: ClassVar[RecoveryAction] = RecoveryAction.CLIP_GRADIENTS
    max_norm: float
    total_norm: float
    tag: Literal["clip_gradients"] = field(default="clip_gradients", repr=False)

    def __post_init__(self) -> None:
        _check_tag(self, self.tag, self.kind)
        _check_number(
            "ClipGradients.max_norm", self.max_norm, minimum=0, strict=True, integer=False
        )
        _check_number(
            "ClipGradients.total_norm", self.total_norm, minimum=0, strict=False, integer=False
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class ScaleLR:
    """Multiply the learning rate of every param group by *factor*.

    Attributes:
        factor: the multiplier (> 0; below 1 lowers the LR).
        steps: undo the change after this many healthy steps; ``None``: permanent.

    Raises:
        ValueError: if *factor* is not a finite number > 0 or *steps* not an int >= 1.
    """

    kind: ClassVar[RecoveryAction] = RecoveryAction.SCALE_LR
    factor: float
    steps: int | None = None
    tag: Literal["scale_lr"] = field(default="scale_lr", repr=False)

    def __post_init__(self) -> None:
        _check_tag(self, self.tag, self.kind)
        _check_number("ScaleLR.factor", self.factor, minimum=0, strict=True, integer=False)
        if self.steps is not None:
            _check_number("ScaleLR.steps", self.steps, minimum=1, strict=False, integer=True)


@dataclass(frozen=True, slots=True, kw_only=True)
class RestoreState:
    """Load the last good model and optimizer state.

    Attributes:
        required: True when the state itself is broken (no good state held means stop); False
            for a precaution, skipped when no good state is held.

    Raises:
        TypeError: if *required* is not a bool.
    """

    kind: ClassVar[RecoveryAction] = RecoveryAction.RESTORE_STATE
    required: bool = True
    tag: Literal["restore_state"] = field(default="restore_state", repr=False)

    def __post_init__(self) -> None:
        _check_tag(self, self.tag, self.kind)
        _check_flag(self, "required", self.required)


@dataclass(frozen=True, slots=True, kw_only=True)
class FreeMemory:
    """Collect garbage and empty the CUDA cache at the next safe point."""

    kind: ClassVar[RecoveryAction] = RecoveryAction.FREE_MEMORY
    tag: Literal["free_memory"] = field(default="free_memory", repr=False)

    def __post_init__(self) -> None:
        _check_tag(self, self.tag, self.kind)


@dataclass(frozen=True, slots=True, kw_only=True)
class ShrinkBatch:
    """Retry the failed call with batch size *size* (after freeing memory when asked).

    Raises:
        ValueError: if *size* is not an int >= 1.
        TypeError: if *free_memory* is not a bool.
    """

    kind: ClassVar[RecoveryAction] = RecoveryAction.SHRINK_BATCH
    size: int
    free_memory: bool = True
    tag: Literal["shrink_batch"] = field(default="shrink_batch", repr=False)

    def __post_init__(self) -> None:
        _check_tag(self, self.tag, self.kind)
        _check_number("ShrinkBatch.size", self.size, minimum=1, strict=False, integer=True)
        _check_flag(self, "free_memory", self.free_memory)


@dataclass(frozen=True, slots=True, kw_only=True)
class Retry:
    """Retry the failed call as it is (after freeing memory when asked).

    Raises:
        TypeError: if *free_memory* is not a bool.
    """

    kind: ClassVar[RecoveryAction] = RecoveryAction.RETRY
    free_memory: bool = False
    tag: Literal["retry"] = field(default="retry", repr=False)

    def __post_init__(self) -> None:
        _check_tag(self, self.tag, self.kind)
        _check_flag(self, "free_memory", self.free_memory)


@dataclass(frozen=True, slots=True, kw_only=True)
class Fallback:
    """Retry the failed call with safer settings; each field left at its default is unchanged.

    Attributes:
        num_workers: data loader workers to use (0: the main process).
        pin_memory: the data loader's pinned memory setting.
        cpu: run on the CPU.
        half_precision: load/run the model in half precision.
        smaller_model: use the user's smaller model factory.
        free_memory: free memory first.

    Raises:
        ValueError: if *num_workers* is negative.
        TypeError: if a flag is not a bool.
    """

    kind: ClassVar[RecoveryAction] = RecoveryAction.FALLBACK
    num_workers: int | None = None
    pin_memory: bool | None = None
    cpu: bool = False
    half_precision: bool = False
    smaller_model: bool = False
    free_memory: bool = False
    tag: Literal["fallback"] = field(default="fallback", repr=False)

    def __post_init__(self) -> None:
        _check_tag(self, self.tag, self.kind)
        if self.num_workers is not None:
            _check_number(
                "Fallback.num_workers", self.num_workers, minimum=0, strict=False, integer=True
            )
        _check_flag(self, "pin_memory", self.pin_memory, optional=True)
        for name in ("cpu", "half_precision", "smaller_model", "free_memory"):
            _check_flag(self, name, getattr(self, name))


@dataclass(frozen=True, slots=True, kw_only=True)
class Stop:
    """Training cannot continue: :class:`~eventbus_debug.TrainingStopped` at the next safe point."""

    kind: ClassVar[RecoveryAction] = RecoveryAction.STOP
    tag: Literal["stop"] = field(default="stop", repr=False)

    def __post_init__(self) -> None:
        _check_tag(self, self.tag, self.kind)


Action: TypeAlias = (
    Continue
    | SkipStep
    | ClipGradients
    | ScaleLR
    | RestoreState
    | FreeMemory
    | ShrinkBatch
    | Retry
    | Fallback
    | Stop
)
"""Any typed recovery action."""


ACTION_TYPES: Final[tuple[type, ...]] = (
    Continue,
    SkipStep,
    ClipGradients,
    ScaleLR,
    RestoreState,
    FreeMemory,
    ShrinkBatch,
    Retry,
    Fallback,
    Stop,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class CallSettings:
    """The settings a retried call ran with, as the strategies read them from its error.

    Attributes:
        batch_size: the batch size (``None``: not set).
        num_workers: data loader workers (``None``: not set).
        pin_memory: the data loader's pinned memory (``None``: not set).
        device: the device it ran on (``None``: not set).
        half_precision: whether the model ran in half precision.
        smaller_model: ``None`` when no smaller model factory was given, False when one is
            available, True when it is in use.
    """

    batch_size: int | None = None
    num_workers: int | None = None
    pin_memory: bool | None = None
    device: str | None = None
    half_precision: bool = False
    smaller_model: bool | None = None


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
        settings: the settings the failed call ran with (a retried call's
            :class:`CallSettings`; ``None`` for other errors).
        retry_id: the id under which a retried call waits for its decisions (``""``: none).
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
    settings: CallSettings | None = None
    retry_id: str = ""


@event_type
class RecoveryDecided(Event):
    """The recovery engine decided what to do about an incident.

    Attributes:
        action: what it decided.
        reason: why, in words (names the incident and the limit that applied).
        strategy: the name of the strategy that decided.
        trigger_kind: the ``kind`` of the incident that triggered the decision.
        trigger_seq: the ``seq`` of that incident on the bus.
        decided: the action with its numbers (``ScaleLR(factor=0.5, steps=200)``...).
    """

    kind: ClassVar[str] = "recovery_decided"
    severity: Severity = Severity.WARNING
    action: RecoveryAction
    reason: str
    strategy: str
    trigger_kind: str
    trigger_seq: int
    decided: Action | None = None


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
class SnapshotPlaced(Event):
    """Recovery keeps no last good state (no memory for one: no restore is possible), or
    keeps one again; where a kept one lives is logged (``snapshot_placed``), not published.

    Attributes:
        where: ``"device"`` (beside the model), ``"host"`` (host memory) or ``"none"``: it
            would not fit in memory, so no restore is possible (a non-finite parameter then
            stops the run); severity WARNING then, INFO otherwise.
        nbytes: the bytes one snapshot takes.
        reason: the figures behind the choice.
    """

    kind: ClassVar[str] = "snapshot_placed"
    severity: Severity = Severity.INFO
    where: str
    nbytes: int
    reason: str


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
