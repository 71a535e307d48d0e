"""Recovery strategies: pure functions from an incident (and a little history) to decisions.

A strategy is any object with ``decide(incident, history)`` — or a plain callable with the same
signature — returning a :class:`~eventbus_debug.recovery.actions.Decision` (a typed action and
its reason), a sequence of them (applied together, in order), or ``None`` to let the next
strategy answer. Strategies never touch the model: the
:class:`~eventbus_debug.recovery.SafePoint` or a retried call applies what they decide.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Final, Protocol, TypeAlias, runtime_checkable

from .._validate import fraction, positive_int, positive_number
from ..events import (
    Anomaly,
    ErrorCategory,
    ErrorRaised,
    GradientExploded,
    GradientVanished,
    LossSpiked,
    MemoryLeakSuspected,
    NonFiniteDetected,
    RecoveryAction,
    TensorRole,
)
from ..events.recovery import CallSettings
from .actions import (
    ClipGradients,
    Continue,
    Decision,
    Fallback,
    FreeMemory,
    RestoreState,
    Retry,
    ScaleLR,
    ShrinkBatch,
    SkipStep,
)

__all__ = (
    "ClipOnExplosion",
    "DataLoaderFallback",
    "FreeMemoryOnLeak",
    "ModelLoadingFallback",
    "RecoveryPolicy",
    "ReportNonFinite",
    "ReportVanishing",
    "RestoreLastGood",
    "RollbackOnLossSpike",
    "ShrinkBatchOnOOM",
    "SkipNonFinite",
    "Strategy",
    "StrategyFunction",
    "StrategyHistory",
    "StrategyResult",
    "recovery_policy",
)


class RecoveryPolicy(Enum):
    """How much the recovery engine may do on its own; every detection is published in all three.

    Attributes:
        OBSERVE: never act. Incidents are published and logged; the loop decides (the
            verdict's ``finite`` says whether the step was clean).
        SAFE: the default, what a careful engineer does unattended on a three-day run: skip a
            step whose loss or gradients are non-finite, restore non-finite parameters and
            buffers from the last good state, clip only a gradient norm two orders of magnitude
            beyond anything the run has seen, and report loss spikes, single or sustained,
            without acting (a loss signal alone cannot tell a fault from a shift of the data).
            Never an LR change or a rollback; never stops a run that can be brought back to a
            finite state; never touches a healthy one.
        AGGRESSIVE: also clip every detected explosion, roll back (with a temporary LR cut) on
            single and sustained loss spikes, and lower the learning rate (temporarily) when
            faults repeat; stops when every strategy for an incident is exhausted.
    """

    OBSERVE = "observe"
    SAFE = "safe"
    AGGRESSIVE = "aggressive"


def recovery_policy(value: RecoveryPolicy | str) -> RecoveryPolicy:
    """*value* as a :class:`RecoveryPolicy` (names are case-insensitive).

    Raises:
        ValueError: if *value* names no policy (the message lists them).
    """
    if isinstance(value, RecoveryPolicy):
        return value
    try:
        return RecoveryPolicy(str(value).lower())
    except ValueError:
        valid = ", ".join(repr(p.value) for p in RecoveryPolicy)
        msg = f"policy must be one of {valid}, got {value!r}"
        raise ValueError(msg) from None


TEMPORARY_LR_STEPS: Final = 200
"""Healthy steps after which a temporary learning-rate change is undone."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StrategyHistory:
    """What a strategy decided before, as the engine counted it (a snapshot).

    Attributes:
        attempts: how many times this strategy decided something, over the whole run.
        consecutive: how many incidents in a row it decided with no good step in between.
        actions: how many times it decided each action.
    """

    attempts: int = 0
    consecutive: int = 0
    actions: Mapping[RecoveryAction, int] = field(default_factory=dict)


StrategyResult: TypeAlias = "Decision | Sequence[Decision] | None"
StrategyFunction: TypeAlias = Callable[
    [Anomaly, StrategyHistory], "Decision | Sequence[Decision] | None"
]


@runtime_checkable
class Strategy(Protocol):
    """The interface of a recovery strategy object (plain functions work too)."""

    def decide(
        self, incident: Anomaly, history: StrategyHistory, /
    ) -> Decision | Sequence[Decision] | None:
        """The decisions for *incident*, or ``None`` to let the next strategy answer."""
        ...


def _check_factor(name: str, value: float, *, above_one: bool = False) -> None:
    if above_one:
        if positive_number(name, value) <= 1:
            msg = f"{name} must be a finite number > 1, got {value!r}"
            raise ValueError(msg)
    else:
        fraction(name, value, inclusive=False)


def _lr(factor: float, reason: str, steps: int | None = None) -> Decision:
    if steps:
        reason = f"{reason} (for {steps} healthy steps)"
    return Decision(action=ScaleLR(factor=factor, steps=steps or None), reason=reason)


def _report(reason: str) -> Decision:
    return Decision(action=Continue(), reason=reason)


_GRAD_ROLES: Final = (TensorRole.LOSS, TensorRole.GRADIENT)
_STATE_ROLES: Final = (TensorRole.PARAMETER, TensorRole.BUFFER)


@dataclass(frozen=True, slots=True, kw_only=True)
class SkipNonFinite:
    """Skip the optimizer step when the loss or the gradients are not finite.

    Args:
        max_consecutive: declines after this many skips with no good step in between, so that
            the next strategy takes over; ``None`` never declines (the SAFE policy: a run of bad
            batches is skipped, not stopped).
        restore_after: at this many skips in a row also restore the last good state, once per
            run of skips, as a precaution (optimizer moments or buffers may hold what the
            checks do not see); skipped when no good state is held. ``None``: never.
        roles: the tensor roles it answers for.

    Raises:
        ValueError: if a count is < 1 or *roles* is empty.
    """

    max_consecutive: int | None = 3
    restore_after: int | None = None
    roles: tuple[TensorRole, ...] = _GRAD_ROLES

    def __post_init__(self) -> None:
        if self.max_consecutive is not None:
            positive_int("max_consecutive", self.max_consecutive)
        if self.restore_after is not None:
            positive_int("restore_after", self.restore_after)
        if not self.roles:
            msg = "roles must name at least one TensorRole, got ()"
            raise ValueError(msg)

    def decide(self, incident: Anomaly, history: StrategyHistory, /) -> Sequence[Decision] | None:
        """SKIP_STEP for a non-finite loss/gradient, while under the consecutive limit."""
        if not isinstance(incident, NonFiniteDetected) or incident.role not in self.roles:
            return None
        limit = self.max_consecutive
        if limit is not None and history.consecutive >= limit:
            return None
        names = ", ".join(incident.names[:5]) or incident.role.value
        run = history.consecutive + 1
        of = f"/{limit}" if limit is not None else " in a row"
        out = [
            Decision(
                action=SkipStep(),
                reason=f"non-finite {incident.role.value} ({names}); skip {run}{of}",
            )
        ]
        if self.restore_after is not None and run == self.restore_after:
            out.insert(
                0,
                Decision(
                    action=RestoreState(required=False),
                    reason=f"{run} non-finite steps in a row: restore the last good state "
                    "as a precaution",
                ),
            )
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class RestoreLastGood:
    """Restore the last good model + optimizer state (and lower the LR) on non-finite values.

    Registered after :class:`SkipNonFinite` for losses and gradients (it answers once skipping
    is exhausted) and alone for non-finite parameters, which are never zeroed.

    Args:
        roles: the tensor roles it answers for.
        lr_factor: multiply the LR by this after restoring; ``1.0`` keeps it.

    Raises:
        ValueError: if *lr_factor* is not in (0, 1] or *roles* is empty.
    """

    roles: tuple[TensorRole, ...] = (*_GRAD_ROLES, *_STATE_ROLES)
    lr_factor: float = 0.5
    lr_steps: int | None = TEMPORARY_LR_STEPS

    def __post_init__(self) -> None:
        if self.lr_factor != 1.0:
            _check_factor("lr_factor", self.lr_factor)
        if self.lr_steps is not None:
            positive_int("lr_steps", self.lr_steps)
        if not self.roles:
            msg = "roles must name at least one TensorRole, got ()"
            raise ValueError(msg)

    def decide(self, incident: Anomaly, history: StrategyHistory, /) -> Sequence[Decision] | None:
        """RESTORE_STATE (+ SCALE_LR) for a non-finite value of one of *roles*."""
        if not isinstance(incident, NonFiniteDetected) or incident.role not in self.roles:
            return None
        what = f"non-finite {incident.role.value} ({', '.join(incident.names[:5])})"
        out = [
            Decision(
                action=RestoreState(required=incident.role in _STATE_ROLES),
                reason=f"{what}: restore last good state",
            )
        ]
        if self.lr_factor != 1.0:
            out.append(_lr(self.lr_factor, f"{what}: lower the learning rate", self.lr_steps))
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class ReportNonFinite:
    """Report non-finite tensors of roles no action belongs to (inputs, outputs, activations).

    A NaN activation shows up in the loss and the gradients of the same step, where the step's
    strategies act on it; the tensor check itself is evidence, not a reason to stop.
    """

    roles: tuple[TensorRole, ...] = (
        TensorRole.INPUT,
        TensorRole.OUTPUT,
        TensorRole.ACTIVATION,
        TensorRole.UPDATE,
    )

    def decide(self, incident: Anomaly, history: StrategyHistory, /) -> Decision | None:
        """CONTINUE for a non-finite tensor of one of *roles*."""
        if not isinstance(incident, NonFiniteDetected) or incident.role not in self.roles:
            return None
        names = ", ".join(incident.names[:5]) or incident.role.value
        return _report(f"non-finite {incident.role.value} ({names}): reported")


@dataclass(frozen=True, slots=True, kw_only=True)
class ClipOnExplosion:
    """Clip the gradients to a maximum norm, using the total norm the probe already computed.

    Args:
        max_norm: the norm to clip to; ``None`` clips to the probe's threshold.
        min_ratio: clip only when the norm is at least this many times the largest norm the run
            had accepted (``GradientExploded.largest``); below that the explosion is reported
            (``CONTINUE``). The SAFE policy uses 100: only a norm orders of magnitude beyond
            anything the run has seen is touched, and above 1 nothing is clipped before the
            run has accepted a norm (no evidence of its scale). ``1.0`` clips every detected
            explosion.
        lower_lr_after: consecutive explosions before the LR is lowered as well; ``None``:
            never.
        lr_factor: the LR multiplier then.
        lr_steps: healthy steps after which the LR change is undone; ``None``: permanent.

    Raises:
        ValueError: if *max_norm* ≤ 0, *min_ratio* < 1, *lower_lr_after* < 1 or *lr_factor*
            not in (0, 1).
    """

    max_norm: float | None = None
    min_ratio: float = 1.0
    lower_lr_after: int | None = 3
    lr_factor: float = 0.5
    lr_steps: int | None = TEMPORARY_LR_STEPS

    def __post_init__(self) -> None:
        if self.max_norm is not None:
            positive_number("max_norm", self.max_norm)
        if positive_number("min_ratio", self.min_ratio) < 1:
            msg = f"min_ratio must be a finite number >= 1, got {self.min_ratio!r}"
            raise ValueError(msg)
        if self.lower_lr_after is not None:
            positive_int("lower_lr_after", self.lower_lr_after)
        _check_factor("lr_factor", self.lr_factor)
        if self.lr_steps is not None:
            positive_int("lr_steps", self.lr_steps)

    def decide(self, incident: Anomaly, history: StrategyHistory, /) -> Sequence[Decision] | None:
        """CLIP_GRADIENTS (+ SCALE_LR once explosions repeat), or CONTINUE below the bar."""
        if not isinstance(incident, GradientExploded):
            return None
        total = incident.total_norm
        what = f"gradient norm {total:.4g} > {incident.threshold:.4g} ({incident.rule})"
        if not math.isfinite(total):
            return (_report(f"{what}: not finite, left to the non-finite strategies"),)
        largest = incident.largest
        if largest <= 0 and self.min_ratio > 1:
            # nothing accepted yet (the cap judged a norm with no history): there is no evidence
            # that it is min_ratio x anything the run produces, and a raw-scale regression has
            # such norms from its first step
            return (_report(f"{what}; not clipped: no accepted norm to compare with yet"),)
        bar = self.min_ratio * largest if largest > 0 else incident.threshold
        if total < bar:
            return (
                _report(
                    f"{what}; not clipped: below {self.min_ratio:g}x the largest norm "
                    f"accepted so far ({largest:.4g})"
                ),
            )
        max_norm = self.max_norm if self.max_norm is not None else incident.threshold
        if not math.isfinite(max_norm):
            max_norm = largest if largest > 0 else 1.0
        out = [
            Decision(action=ClipGradients(max_norm=float(max_norm), total_norm=total), reason=what)
        ]
        run = history.consecutive + 1
        if self.lower_lr_after is not None and run % self.lower_lr_after == 0:
            out.append(_lr(self.lr_factor, f"{run} gradient explosions in a row", self.lr_steps))
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class RollbackOnLossSpike:
    """Roll back to the last good state, skip the offending batches and lower the LR for a while.

    Args:
        rules: the :class:`LossSpiked` rules that roll back (``"sustained"``: the loss stayed
            far above its baseline for ``spike_patience`` steps; ``"spike"``: one loss). Other
            spikes are reported (``CONTINUE``).
        skip_batches: batches not applied, counting the one that spiked.
        lr_factor: the LR multiplier.
        lr_steps: healthy steps after which the LR change is undone; ``None``: permanent.
        max_rollbacks: the most rollbacks over the run; later spikes are reported only.

    Raises:
        ValueError: if a count is < 1, *rules* is empty or *lr_factor* not in (0, 1).
    """

    rules: tuple[str, ...] = ("spike", "sustained")
    skip_batches: int = 1
    lr_factor: float = 0.5
    lr_steps: int | None = TEMPORARY_LR_STEPS
    max_rollbacks: int | None = None

    def __post_init__(self) -> None:
        positive_int("skip_batches", self.skip_batches)
        _check_factor("lr_factor", self.lr_factor)
        if self.lr_steps is not None:
            positive_int("lr_steps", self.lr_steps)
        if self.max_rollbacks is not None:
            positive_int("max_rollbacks", self.max_rollbacks)
        if not self.rules:
            msg = 'rules must name at least one rule ("spike", "sustained"), got ()'
            raise ValueError(msg)

    def decide(self, incident: Anomaly, history: StrategyHistory, /) -> Sequence[Decision] | None:
        """RESTORE_STATE + SKIP_STEP + SCALE_LR for a spike of one of *rules*, else CONTINUE."""
        if not isinstance(incident, LossSpiked):
            return None
        what = (
            f"loss {incident.loss:.4g} vs baseline {incident.running_mean:.4g} "
            f"(tolerance {incident.tolerance:.3g}, {incident.rule})"
        )
        if incident.rule not in self.rules:
            return (_report(f"{what}: reported, no action"),)
        done = history.actions.get(RecoveryAction.RESTORE_STATE, 0)
        if self.max_rollbacks is not None and done >= self.max_rollbacks:
            return (_report(f"{what}: rolled back {done} times already; reporting only"),)
        return (
            Decision(action=RestoreState(required=False), reason=f"{what}: roll back"),
            Decision(
                action=SkipStep(batches=self.skip_batches),
                reason=f"{what}: skip {self.skip_batches} batch(es)",
            ),
            _lr(self.lr_factor, f"{what}: lower the learning rate", self.lr_steps),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class ReportVanishing:
    """Report vanishing or all-zero gradients (naming the dead layers); optionally raise the LR.

    Args:
        window: consecutive vanishing incidents before the LR is raised.
        lr_factor: multiply the LR by this (> 1) every *window* incidents in a row; ``None``
            only reports.
        max_raises: the most times the LR is raised over the run.

    Raises:
        ValueError: if *window* < 1, *max_raises* < 1 or *lr_factor* is not > 1.
    """

    window: int = 5
    lr_factor: float | None = None
    max_raises: int = 3

    def __post_init__(self) -> None:
        positive_int("window", self.window)
        positive_int("max_raises", self.max_raises)
        if self.lr_factor is not None:
            _check_factor("lr_factor", self.lr_factor, above_one=True)

    def decide(self, incident: Anomaly, history: StrategyHistory, /) -> Decision | None:
        """CONTINUE naming the dead layers, or SCALE_LR (> 1) after *window* in a row."""
        if not isinstance(incident, GradientVanished):
            return None
        layers = ", ".join(incident.layers[:10]) or "all layers"
        if incident.all_zero:
            what = "all gradients are zero"
        elif incident.mean_abs is not None and incident.mean_abs < incident.threshold:
            what = f"mean |grad| {incident.mean_abs:.3g} < {incident.threshold:.3g}"
        else:
            what = (
                f"{len(incident.layers)} parameter(s) lost their gradient (RMS below "
                f"{incident.threshold:.3g}x the model's)"
            )
        run = history.consecutive + 1
        raised = history.actions.get(RecoveryAction.SCALE_LR, 0)
        if self.lr_factor is not None and run % self.window == 0 and raised < self.max_raises:
            return _lr(self.lr_factor, f"{what} for {run} checks in a row; dead layers: {layers}")
        return _report(f"{what}; dead layers: {layers}")


@dataclass(frozen=True, slots=True, kw_only=True)
class FreeMemoryOnLeak:
    """A suspected memory leak: free memory (gc, CUDA cache) at the next safe point, and report.

    Freeing cannot fix a real leak (something still references the memory), but it releases
    cycles and cached blocks and tells the log how much was reclaimable. After *max_frees* frees
    over the run it only reports (``CONTINUE``): the incident stays visible, nothing loops.

    Args:
        max_frees: the most frees over the run.

    Raises:
        ValueError: if *max_frees* < 1.
    """

    max_frees: int = 3

    def __post_init__(self) -> None:
        positive_int("max_frees", self.max_frees)

    def decide(self, incident: Anomaly, history: StrategyHistory, /) -> Decision | None:
        """FREE_MEMORY while under *max_frees*, then CONTINUE (report only)."""
        if not isinstance(incident, MemoryLeakSuspected):
            return None
        what = (
            f"{incident.resource} grows {incident.slope:.4g}/sample over {incident.window} samples"
            + (f" ({incident.retained})" if incident.retained else "")
        )
        done = history.actions.get(RecoveryAction.FREE_MEMORY, 0)
        if done >= self.max_frees:
            return _report(
                f"memory leak suspected: {what}; memory already freed {done} times, reporting only"
            )
        return Decision(
            action=FreeMemory(),
            reason=f"memory leak suspected: {what}; free memory {done + 1}/{self.max_frees}",
        )


def _settings(incident: ErrorRaised) -> CallSettings:
    return incident.settings if incident.settings is not None else CallSettings()


@dataclass(frozen=True, slots=True, kw_only=True)
class ShrinkBatchOnOOM:
    """Out of memory: free memory, shrink the batch by *factor* (floor *min_batch_size*), retry.

    The batch size comes from the failed call's :class:`~eventbus_debug.events.CallSettings`. At the
    floor it falls back to the CPU when *cpu_fallback* is set, else declines (exhausted).
    Without a batch size it frees memory and retries once.

    Raises:
        ValueError: if *factor* is not in (0, 1) or *min_batch_size* < 1.
    """

    factor: float = 0.5
    min_batch_size: int = 1
    cpu_fallback: bool = False

    def __post_init__(self) -> None:
        _check_factor("factor", self.factor)
        positive_int("min_batch_size", self.min_batch_size)

    def decide(self, incident: Anomaly, history: StrategyHistory, /) -> Decision | None:
        """SHRINK_BATCH, then FALLBACK to the CPU (if enabled), for a MEMORY error."""
        if not isinstance(incident, ErrorRaised) or incident.category is not ErrorCategory.MEMORY:
            return None
        settings = _settings(incident)
        size = settings.batch_size
        if size is not None:
            new = max(self.min_batch_size, int(size * self.factor))
            if new < size:
                return Decision(
                    action=ShrinkBatch(size=new, free_memory=True),
                    reason=f"out of memory at batch size {size}: retry with {new}",
                )
        elif incident.attempt <= 1:
            return Decision(
                action=Retry(free_memory=True), reason="out of memory: free memory and retry"
            )
        if self.cpu_fallback and settings.device != "cpu":
            return Decision(
                action=Fallback(cpu=True, free_memory=True),
                reason="out of memory at the smallest batch size: fall back to the CPU",
            )
        return None


@dataclass(frozen=True, slots=True, kw_only=True)
class DataLoaderFallback:
    """Data loading errors: fewer workers, then no pinned memory, then the main process.

    Reads ``num_workers`` and ``pin_memory`` from the failed call's settings.
    """

    def decide(self, incident: Anomaly, history: StrategyHistory, /) -> Decision | None:
        """The next FALLBACK step for a DATA error raised while loading."""
        if not isinstance(incident, ErrorRaised) or incident.category is not ErrorCategory.DATA:
            return None
        settings = _settings(incident)
        workers = settings.num_workers
        if workers is not None and workers > 1 and incident.attempt <= 1:
            return Decision(
                action=Fallback(num_workers=workers // 2),
                reason=f"data loading failed with {workers} workers: retry with {workers // 2}",
            )
        if settings.pin_memory:
            return Decision(
                action=Fallback(pin_memory=False),
                reason="data loading failed: retry without pinned memory",
            )
        if workers is not None and workers > 0:
            return Decision(
                action=Fallback(num_workers=0),
                reason="data loading failed: retry in the main process (num_workers=0)",
            )
        return None


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelLoadingFallback:
    """Model loading errors: half precision, then the CPU, then the user's smaller factory.

    Reads ``half_precision``, ``device`` and ``smaller_model`` (False when a smaller factory
    was given and is not in use yet) from the failed call's settings, and ``operation`` from its
    context.
    """

    def decide(self, incident: Anomaly, history: StrategyHistory, /) -> Decision | None:
        """The next FALLBACK step for an error raised while loading a model."""
        if (
            not isinstance(incident, ErrorRaised)
            or incident.context.get("operation") != "model_loading"
        ):
            return None
        settings = _settings(incident)
        if not settings.half_precision:
            return Decision(
                action=Fallback(half_precision=True, free_memory=True),
                reason="model loading failed: retry in half precision",
            )
        if settings.device not in (None, "cpu"):
            return Decision(
                action=Fallback(cpu=True, free_memory=True),
                reason="model loading failed: retry on the CPU",
            )
        if settings.smaller_model is False:
            return Decision(
                action=Fallback(smaller_model=True),
                reason="model loading failed: retry with the smaller model factory",
            )
        return None
