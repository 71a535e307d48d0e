"""What strategies the engine runs, on which incidents, within which bounds.

A :class:`StrategySpec` names a strategy, its triggers (an incident class, an exception class,
an :class:`~eventbus_debug.events.ErrorCategory` or a message pattern) and its bounds;
:func:`default_strategies` gives the built-in chain of a :class:`RecoveryPolicy`. The engine
keeps one :class:`Registration` per spec: the compiled triggers and the counts the bounds and
the strategies' :class:`StrategyHistory` are read from.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeAlias

from .._validate import positive_int
from ..events import (
    Anomaly,
    ErrorCategory,
    ErrorRaised,
    Event,
    GradientExploded,
    GradientVanished,
    LossSpiked,
    MemoryLeakSuspected,
    NonFiniteDetected,
    RecoveryAction,
    TensorRole,
    event_types,
)
from .actions import Decision
from .classify import exception_names
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
    Strategy,
    StrategyFunction,
    StrategyHistory,
    recovery_policy,
)

__all__ = ("Registration", "StrategySpec", "Trigger", "default_strategies", "normalize")


Trigger: TypeAlias = "type[Anomaly] | type[BaseException] | ErrorCategory | str | re.Pattern[str]"
"""What a strategy is registered on: an incident class, an exception class (matched against
:attr:`ErrorRaised.exception_types`), an :class:`ErrorCategory`, or a message pattern (a string
is a case-insensitive substring, a compiled pattern is searched)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StrategySpec:
    """A strategy with its triggers and bounds, as given to :class:`RecoveryEngine`.

    Attributes:
        strategy: an object with ``decide(incident, history)`` or a function of the same shape.
        on: what it answers for (see :data:`Trigger`); one trigger or a tuple of them.
        name: the name in decisions and logs (defaults to the strategy's class or function).
        max_attempts: the most decisions it may take over the run; ``None``: no limit.
        max_consecutive: the most decisions in a row with no good step in between.
    """

    strategy: Strategy | StrategyFunction
    on: Trigger | tuple[Trigger, ...]
    name: str = ""
    max_attempts: int | None = None
    max_consecutive: int | None = None


def _call_strategies() -> list[StrategySpec]:
    """Failed calls routed through :func:`~eventbus_debug.recovery.retrying`: the call retries."""
    return [
        StrategySpec(
            strategy=ShrinkBatchOnOOM(), on=ErrorCategory.MEMORY, name="shrink_batch_on_oom"
        ),
        StrategySpec(
            strategy=DataLoaderFallback(), on=ErrorCategory.DATA, name="data_loading_fallback"
        ),
        StrategySpec(
            strategy=ModelLoadingFallback(), on=ErrorCategory.MODEL, name="model_loading_fallback"
        ),
    ]


def default_strategies(policy: RecoveryPolicy | str = RecoveryPolicy.SAFE) -> list[StrategySpec]:
    """The built-in strategies of *policy*, in the order they are tried (a new list each call).

    * ``observe``: none; every incident is published and nothing is done about it.
    * ``safe`` (default): skip non-finite steps (a precautionary restore at the third in a
      row, no LR change, never a stop for bad batches); restore non-finite parameters and
      buffers (stop only when that cannot bring the model back: no good state, or three
      restores in a row that did not hold); clip only a norm 100x beyond the largest the
      run has seen (other explosions are reported); report loss spikes, single or sustained
      (a loss signal alone cannot tell a fault from a legitimate shift of the data: a
      curriculum phase, a multi-task mix, length-bucketed batches; a rollback there throws
      progress away and halves the LR when the new data needs it); report vanishing
      gradients; free memory on a suspected leak; shrink the batch / fall back for failed
      calls.
    * ``aggressive``: skip, then restore with a temporary LR halving, then stop; clip every
      explosion, halving the LR (temporarily) every third in a row; roll back on any loss spike.

    Raises:
        ValueError: if *policy* is not a policy name.
    """
    policy = recovery_policy(policy)
    if policy is RecoveryPolicy.OBSERVE:
        return []
    if policy is RecoveryPolicy.SAFE:
        return [
            StrategySpec(
                strategy=SkipNonFinite(max_consecutive=None, restore_after=3),
                on=NonFiniteDetected,
                name="skip_non_finite",
            ),
            StrategySpec(
                strategy=RestoreLastGood(
                    roles=(TensorRole.PARAMETER, TensorRole.BUFFER), lr_factor=1.0
                ),
                on=NonFiniteDetected,
                name="restore_non_finite_state",
                max_consecutive=3,
            ),
            StrategySpec(
                strategy=ReportNonFinite(), on=NonFiniteDetected, name="report_non_finite"
            ),
            StrategySpec(
                strategy=ClipOnExplosion(min_ratio=100.0, lower_lr_after=None),
                on=GradientExploded,
                name="clip_gradients",
            ),
            StrategySpec(strategy=ReportVanishing(), on=GradientVanished, name="report_vanishing"),
            StrategySpec(
                strategy=FreeMemoryOnLeak(), on=MemoryLeakSuspected, name="free_memory_on_leak"
            ),
            *_call_strategies(),
        ]
    return [
        StrategySpec(strategy=SkipNonFinite(), on=NonFiniteDetected, name="skip_non_finite"),
        StrategySpec(
            strategy=RestoreLastGood(
                roles=(TensorRole.PARAMETER, TensorRole.BUFFER), lr_factor=1.0
            ),
            on=NonFiniteDetected,
            name="restore_non_finite_state",
            max_consecutive=2,
        ),
        StrategySpec(
            strategy=RestoreLastGood(roles=(TensorRole.LOSS, TensorRole.GRADIENT)),
            on=NonFiniteDetected,
            name="restore_and_lower_lr",
            max_consecutive=2,
        ),
        StrategySpec(strategy=ReportNonFinite(), on=NonFiniteDetected, name="report_non_finite"),
        StrategySpec(
            strategy=ClipOnExplosion(),
            on=GradientExploded,
            name="clip_gradients",
            max_consecutive=50,
        ),
        StrategySpec(
            strategy=RollbackOnLossSpike(),
            on=LossSpiked,
            name="rollback_on_loss_spike",
            max_consecutive=3,
        ),
        StrategySpec(strategy=ReportVanishing(), on=GradientVanished, name="report_vanishing"),
        StrategySpec(
            strategy=FreeMemoryOnLeak(), on=MemoryLeakSuspected, name="free_memory_on_leak"
        ),
        *_call_strategies(),
    ]


class Registration:
    """One registered strategy: its triggers, bounds and counts (the engine's bookkeeping)."""

    __slots__ = (
        "actions",
        "attempts",
        "categories",
        "consecutive",
        "decide",
        "event_types",
        "exception_names",
        "last_step",
        "max_attempts",
        "max_consecutive",
        "name",
        "patterns",
        "previous",
    )

    def __init__(self, spec: StrategySpec, index: int) -> None:
        strategy = spec.strategy
        decide = getattr(strategy, "decide", None)
        if decide is None:
            if not callable(strategy):
                msg = (
                    f"strategy must have a decide(incident, history) method or be a function "
                    f"of that shape, got {strategy!r}"
                )
                raise TypeError(msg)
            decide = strategy
        self.decide: Callable[[Anomaly, StrategyHistory], object] = decide
        self.name = spec.name or getattr(strategy, "__name__", "") or type(strategy).__name__
        if not isinstance(self.name, str) or not self.name:
            self.name = f"strategy_{index}"
        for arg, value in (
            ("max_attempts", spec.max_attempts),
            ("max_consecutive", spec.max_consecutive),
        ):
            if value is not None:
                try:
                    positive_int(arg, value)
                except ValueError as exc:  # an ArgumentTypeError keeps its type
                    msg = f"{exc} or None (strategy {self.name!r})"
                    raise type(exc)(msg) from None
        self.max_attempts = spec.max_attempts
        self.max_consecutive = spec.max_consecutive
        self.event_types: list[type[Anomaly]] = []
        self.exception_names: list[str] = []
        self.categories: list[ErrorCategory] = []
        self.patterns: list[re.Pattern[str]] = []
        triggers = spec.on if isinstance(spec.on, tuple) else (spec.on,)
        if not triggers:
            msg = f"on must name at least one trigger, got () (strategy {self.name!r})"
            raise ValueError(msg)
        for trigger in triggers:
            self._add_trigger(trigger)
        self.attempts = 0
        self.consecutive = 0
        self.last_step: int | None = None
        self.actions: dict[RecoveryAction, int] = {}
        self.previous = StrategyHistory()

    def _add_trigger(self, trigger: object) -> None:
        if isinstance(trigger, ErrorCategory):
            self.categories.append(trigger)
        elif isinstance(trigger, re.Pattern):
            self.patterns.append(trigger)
        elif isinstance(trigger, str):
            if not trigger:
                msg = f"on: a message pattern must not be empty (strategy {self.name!r})"
                raise ValueError(msg)
            self.patterns.append(re.compile(re.escape(trigger), re.IGNORECASE))
        elif isinstance(trigger, type) and issubclass(trigger, Anomaly):
            known = event_types().values()
            if trigger is not Anomaly and not any(issubclass(t, trigger) for t in known):
                msg = f"on: {trigger.__qualname__} is not a registered event type (strategy {self.name!r})"
                raise ValueError(msg)
            self.event_types.append(trigger)
        elif isinstance(trigger, type) and issubclass(trigger, BaseException):
            self.exception_names.append(exception_names(trigger)[0])
        elif isinstance(trigger, type) and issubclass(trigger, Event):
            msg = (
                f"on: {trigger.__qualname__} is not an incident (Anomaly subclass); the engine "
                f"only receives anomalies and errors (strategy {self.name!r})"
            )
            raise ValueError(msg)
        else:
            msg = (
                f"on: unknown trigger {trigger!r} for strategy {self.name!r}; use an Anomaly "
                "subclass, an exception class, an ErrorCategory or a message pattern (str)"
            )
            raise TypeError(msg)

    def matches(self, incident: Anomaly) -> bool:
        if any(isinstance(incident, t) for t in self.event_types):
            return True
        if not isinstance(incident, ErrorRaised):
            return False
        if incident.category in self.categories:
            return True
        if self.exception_names and any(
            n in incident.exception_types for n in self.exception_names
        ):
            return True
        return any(p.search(incident.message) for p in self.patterns)

    def exhausted(self) -> bool:
        if self.max_attempts is not None and self.attempts >= self.max_attempts:
            return True
        return self.max_consecutive is not None and self.consecutive >= self.max_consecutive

    def history(self, step: int | None = None) -> StrategyHistory:
        if step is not None and step == self.last_step and self.attempts:
            return self.previous  # a second incident of a step it already answered
        return StrategyHistory(
            attempts=self.attempts, consecutive=self.consecutive, actions=dict(self.actions)
        )

    def answered(self, step: int | None) -> bool:
        return step is not None and self.attempts > 0 and self.last_step == step

    def record(self, step: int | None, decisions: Sequence[Decision]) -> None:
        self.previous = self.history()
        self.attempts += 1
        self.consecutive += 1
        self.last_step = step
        for d in decisions:
            self.actions[d.kind] = self.actions.get(d.kind, 0) + 1


def normalize(result: object, name: str) -> tuple[Decision, ...]:
    """A strategy's answer as a tuple of decisions.

    Raises:
        TypeError: if it is neither ``None``, a :class:`Decision` nor a sequence of them.
    """
    if result is None:
        return ()
    if isinstance(result, Decision):
        return (result,)
    if isinstance(result, (list, tuple)) and all(isinstance(d, Decision) for d in result):
        return tuple(result)
    msg = f"strategy {name!r} returned {result!r}; return a Decision, a sequence of them, or None"
    raise TypeError(msg)
