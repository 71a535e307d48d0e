"""A session's saved state: what it learned of the run, to resume a checkpointed run with.

:meth:`SessionBase.state_dict` writes it, :meth:`SessionBase.load_state_dict` reads it back;
this module holds the format and its checks, so the session keeps only the wiring.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from .._saved import StateReader, check_format
from ..probes import StepProbe
from ..recovery.safepoint.point import read_temporary

__all__ = ("STATE_FORMAT", "STATE_VERSION", "SavedState", "read_state", "session_state")

STATE_FORMAT: Final = "eventbus_debug.Session"
"""The ``"format"`` of a session's :meth:`~SessionBase.state_dict`."""
STATE_VERSION: Final = 1
"""Its ``"version"`` (a later one is refused with a clear error)."""


@dataclass(frozen=True, slots=True)
class SavedState:
    """A session's state, checked.

    Attributes:
        step: the step the run had reached (``None``: none checked yet).
        probe: the step probe's :meth:`~StepProbe.state_dict` (``None``: nothing learned).
        recovery: the safe point's state (the temporary LR changes in force; ``None``: no
            safe point).
        run_id: the run's id in the log (``SessionStarted.run_id``): the resumed session
            continues that run (``None``: the session had not started).
    """

    step: int | None
    probe: Mapping[str, Any] | None
    recovery: Mapping[str, Any] | None = None
    run_id: str | None = None


def session_state(
    step: int | None,
    probe: Mapping[str, Any] | None,
    recovery: Mapping[str, Any] | None = None,
    run_id: str | None = None,
) -> dict[str, Any]:
    """The plain dict a session's ``state_dict()`` returns."""
    return {
        "format": STATE_FORMAT,
        "version": STATE_VERSION,
        "run_id": run_id,
        "step": step,
        "probe": probe,
        "recovery": recovery,
    }


def read_state(state: object) -> SavedState:
    """*state* (a session's ``state_dict()``, maybe through ``torch.save`` or ``json``) checked
    whole, the probe's part included.

    Raises:
        ValueError: if it is not a session's state dict, is of a later version, or a field is
            missing or malformed (the message names it).
    """
    reader = StateReader(state, "state")
    check_format(reader, STATE_FORMAT, STATE_VERSION, "a Session.state_dict()")
    step = reader.optional_count("step")
    run_id = reader.optional_text("run_id")
    probe = reader.raw("probe")
    if probe is not None:
        StepProbe.check_state_dict(probe, reader.at("probe"))
        assert isinstance(probe, Mapping)  # checked above
    recovery = reader.raw("recovery")
    if recovery is not None:
        read_temporary(reader.child("recovery"))
        assert isinstance(recovery, Mapping)  # checked above
    return SavedState(step=step, probe=probe, recovery=recovery, run_id=run_id)
