"""The session's own events: a session began, ended, a step completed; and the run id."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import field
from typing import ClassVar, Final

from ._base import Delivery, Event, Severity, event_type

__all__ = (
    "RUN_ID_ENV",
    "SessionEnded",
    "SessionStarted",
    "StepCompleted",
    "UsageWarning",
    "given_run_id",
    "new_run_id",
)


RUN_ID_ENV: Final = "EVENTBUS_DEBUG_RUN_ID"
"""Environment variable that fixes the run id (set it to one value on every rank of a job)."""


def given_run_id(resumed: str | None = None) -> str | None:
    """The run id the environment or a checkpoint gives: ``$EVENTBUS_DEBUG_RUN_ID``, else
    *resumed* (the id of the run a session resumed from a checkpoint continues), else torchrun's
    ``$TORCHELASTIC_RUN_ID`` (shared by the ranks of one job, and by its elastic restarts);
    ``None`` when none does."""
    for value in (_env(RUN_ID_ENV), resumed, _env("TORCHELASTIC_RUN_ID")):
        if value:
            return value
    return None


def new_run_id(resumed: str | None = None) -> str:
    """A run id: :func:`given_run_id`'s, else a fresh ``YYYYmmddTHHMMSS-<8 hex>`` (UTC time,
    random)."""
    given = given_run_id(resumed)
    if given is not None:
        return given
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    return f"{stamp}-{os.urandom(4).hex()}"


def _env(name: str) -> str | None:
    """The environment variable *name*, stripped; ``None`` when unset, empty or ``"none"``."""
    value = os.environ.get(name, "").strip()
    return value if value and value.lower() != "none" else None


@event_type
class SessionStarted(Event):
    """A debugging session (or a plain bus used as one) began.

    Attributes:
        name: the session's name.
        config: the session's settings, as text.
        run_id: identifies this run among others written to the same log directory (a rerun
            appends to the same files; reports separate runs by this id). See :func:`new_run_id`.
    """

    kind: ClassVar[str] = "session_started"
    name: str = ""
    config: Mapping[str, str] = field(default_factory=dict)
    run_id: str = field(default_factory=new_run_id)


@event_type
class SessionEnded(Event):
    """A debugging session ended; ``reason`` is ``"completed"``, ``"stopped"``, ``"cancelled"``
    or ``"error: <type>: <message>"``.

    Attributes:
        detail: why a stopped session stopped (the ``TrainingStopped`` message: the decision's
            reason, or which rank could not agree); empty otherwise.
        overhead: the session's own time per step over the rest of the step's time, measured
            over the run (``0.02``: the session made the steps 2 % longer); None when fewer
            than two steps finished, or not measured (a plain bus).
        overhead_budget: the budget the session kept the overhead within (None: none set).
    """

    kind: ClassVar[str] = "session_ended"
    name: str = ""
    reason: str = "completed"
    detail: str = ""
    steps: int = 0
    duration_s: float = 0.0
    overhead: float | None = None
    overhead_budget: float | None = None


@event_type
class StepCompleted(Event):
    """One training step finished (telemetry: may be shed under sustained overload)."""

    kind: ClassVar[str] = "step_completed"
    delivery: ClassVar[Delivery] = Delivery.TELEMETRY
    # Built on every training step: the constructor does not check the field types (it would
    # add about a tenth to the cost of building one); the log writer checks, off the training
    # thread, and counts and names a field it cannot write instead of writing the line.
    _check_fields: ClassVar[bool] = False
    severity: Severity = Severity.DEBUG
    loss: float | None = None
    learning_rate: float | None = None
    samples_per_s: float | None = None
    duration_s: float | None = None


@event_type
class UsageWarning(Event):
    """The session is called in a way that defeats its checks; said once per problem and
    session, on the bus (so the log, the report and the console show it) and in the library's
    log.

    Attributes:
        problem: which, as the library's log names it: ``"check_after_optimizer_step"`` (the
            first check came after an optimizer step: its skips and clips come too late),
            ``"checked_after_scaler_step"`` (the same under AMP: after
            ``scaler.step(optimizer)``), ``"no_gradients_at_check"`` (a gradient check found
            no gradient: called before ``loss.backward()``), ``"step_went_back"`` (a step lower
            than the one before: a per-epoch batch index passed as the step).
        message: what to do about it.
    """

    kind: ClassVar[str] = "usage_warning"
    severity: Severity = Severity.WARNING
    problem: str
    message: str
