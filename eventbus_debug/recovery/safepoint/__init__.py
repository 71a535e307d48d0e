"""Safe points: applying recovery decisions to the model and optimizer, and the last good state."""

from __future__ import annotations

from ._placement import Location, Placement
from .point import AgreeHook, SafePoint, StepDecision
from .snapshot import NoGoodStateError, StateSnapshots

__all__ = (
    "AgreeHook",
    "Location",
    "NoGoodStateError",
    "Placement",
    "SafePoint",
    "StateSnapshots",
    "StepDecision",
)
