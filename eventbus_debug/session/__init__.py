"""The session: one object wiring the bus, probes, sinks, sampler and recovery for a model.

:class:`Session` (``async with``) and :class:`SyncSession` (``with``, for plain loops) take the
same keywords (the fields of :class:`SessionOptions`) and have the same methods;
``check_step`` returns a :class:`Verdict`. A :class:`DebugMode` names what to debug.
"""

from __future__ import annotations

from .async_session import Session
from .modes import DebugMode, DebugPlan, plan_for
from .options import SessionOptions
from .sync_session import SyncSession
from .verdict import TrainingStepResult, Verdict

__all__ = (
    "DebugMode",
    "DebugPlan",
    "Session",
    "SessionOptions",
    "SyncSession",
    "TrainingStepResult",
    "Verdict",
    "plan_for",
)
