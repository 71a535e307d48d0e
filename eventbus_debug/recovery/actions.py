"""Typed recovery actions: what a strategy decides, with its numbers as named fields.

A strategy returns :class:`Decision` objects, each holding one action (``SkipStep(batches=2)``,
``ScaleLR(factor=0.5, steps=200)``...) and the reason, in words. The safe point and retried
calls read the fields; nothing travels as strings or as a dict of floats. The action classes
are part of the event vocabulary (:mod:`eventbus_debug.events.recovery`, a
:class:`~eventbus_debug.events.RecoveryDecided` carries one); this module is their home for
strategy authors, with the decision that wraps them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from ..events import RecoveryAction
from ..events.recovery import (
    ACTION_TYPES,
    Action,
    ClipGradients,
    Continue,
    Fallback,
    FreeMemory,
    RestoreState,
    Retry,
    ScaleLR,
    ShrinkBatch,
    SkipStep,
    Stop,
)

__all__ = (
    "CALL_ACTIONS",
    "STEP_ACTIONS",
    "Action",
    "ClipGradients",
    "Continue",
    "DecidedAction",
    "Decision",
    "Fallback",
    "FreeMemory",
    "RestoreState",
    "Retry",
    "ScaleLR",
    "ShrinkBatch",
    "SkipStep",
    "Stop",
)


STEP_ACTIONS: Final = frozenset(
    {
        RecoveryAction.SKIP_STEP,
        RecoveryAction.CLIP_GRADIENTS,
        RecoveryAction.SCALE_LR,
        RecoveryAction.RESTORE_STATE,
        RecoveryAction.FREE_MEMORY,
    }
)
"""Actions applied to the model/optimizer at a training loop's safe point."""

CALL_ACTIONS: Final = frozenset(
    {RecoveryAction.SHRINK_BATCH, RecoveryAction.RETRY, RecoveryAction.FALLBACK}
)
"""Actions applied by a retried call before it runs again."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    """One action a strategy decided, with its reason.

    Attributes:
        action: what to do, with its numbers (:class:`SkipStep`, :class:`ScaleLR`, ...).
        reason: why, in words (it ends up in the log).

    Raises:
        TypeError: if *action* is not one of the action classes or *reason* not a string.
    """

    action: Action
    reason: str

    def __post_init__(self) -> None:
        if not isinstance(self.action, ACTION_TYPES):
            names = ", ".join(t.__name__ for t in ACTION_TYPES)
            msg = f"Decision.action must be one of {names}, got {self.action!r}"
            raise TypeError(msg)
        if not isinstance(self.reason, str):
            msg = f"Decision.reason must be a string, got {self.reason!r}"
            raise TypeError(msg)

    @property
    def kind(self) -> RecoveryAction:
        """The action's :class:`~eventbus_debug.events.RecoveryAction`."""
        return self.action.kind


@dataclass(frozen=True, slots=True, kw_only=True)
class DecidedAction:
    """A decision together with what triggered it (what the appliers consume).

    Attributes:
        decision: the decision.
        strategy: the name of the strategy that took it (``"exhausted"`` for a STOP).
        trigger_kind: the ``kind`` of the triggering incident.
        trigger_seq: its ``seq`` on the bus.
        step: its step.
    """

    decision: Decision
    strategy: str
    trigger_kind: str
    trigger_seq: int
    step: int | None

    @property
    def kind(self) -> RecoveryAction:
        """The decided action's :class:`~eventbus_debug.events.RecoveryAction`."""
        return self.decision.action.kind

    @property
    def action(self) -> Action:
        """The decided action, with its numbers."""
        return self.decision.action

    @property
    def reason(self) -> str:
        """Why, in words."""
        return self.decision.reason
