"""Debug modes and how they map onto probes and the debug level.

A :class:`DebugMode` names *what* to debug; a :class:`DebugPlan` says which instruments run.
Modes combine: ``plan_for(DebugMode.ANOMALY_DETECTION, DebugMode.MEMORY_PROFILING)``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

from ..exceptions import ArgumentTypeError
from ..probes import DebugLevel

__all__ = ("DebugMode", "DebugPlan", "plan_for")


class DebugMode(Enum):
    """What a session debugs.

    Attributes:
        NONE: nothing: the step probe is off; only step telemetry and errors are recorded.
        ANOMALY_DETECTION: loss and gradient checks (BASIC level) plus, when one fires, the
            localization of the first module producing NaN/Inf.
        PROFILING: torch.profiler windows with Chrome traces.
        MEMORY_PROFILING: memory samples and leak detection (every 50 steps by default).
        GRADIENT_CHECKING: per-layer gradient norms and update ratios (ADVANCED level).
        FULL: everything, at the EXTREME level.
    """

    NONE = "none"
    ANOMALY_DETECTION = "anomaly_detection"
    PROFILING = "profiling"
    MEMORY_PROFILING = "memory_profiling"
    GRADIENT_CHECKING = "gradient_checking"
    FULL = "full"


@dataclass(frozen=True, slots=True, kw_only=True)
class DebugPlan:
    """The instruments a set of modes turns on.

    Attributes:
        level: the step probe's level.
        anomaly_localization: localize the first non-finite module when an anomaly fires.
        profiling: capture profiler windows.
        memory_tracking: sample memory every step and look for leaks.
    """

    level: DebugLevel
    anomaly_localization: bool = False
    profiling: bool = False
    memory_tracking: bool = False


_LEVEL_OF: dict[DebugMode, DebugLevel] = {
    DebugMode.NONE: DebugLevel.OFF,
    DebugMode.ANOMALY_DETECTION: DebugLevel.BASIC,
    DebugMode.PROFILING: DebugLevel.OFF,
    DebugMode.MEMORY_PROFILING: DebugLevel.OFF,
    DebugMode.GRADIENT_CHECKING: DebugLevel.ADVANCED,
    DebugMode.FULL: DebugLevel.EXTREME,
}


def plan_for(*modes: DebugMode | str | Iterable[DebugMode | str]) -> DebugPlan:
    """The :class:`DebugPlan` of *modes* (names like ``"profiling"`` work too).

    The level is the highest any mode asks for; the instruments are the union.

    Raises:
        ArgumentTypeError: (a ``TypeError`` and a ``ValueError``) if a mode is neither a
            :class:`DebugMode`, a name nor an iterable of them.
        ValueError: if a name is not a :class:`DebugMode` value (the valid ones are listed).
    """
    flat: list[DebugMode] = []
    valid = ", ".join(x.value for x in DebugMode)
    for m in modes:
        if isinstance(m, DebugMode | str):
            items: Iterable[DebugMode | str] = (m,)
        elif isinstance(m, Iterable):
            items = m
        else:
            msg = f"mode must be a DebugMode, its name, or several of them; got {m!r}"
            raise ArgumentTypeError(msg)
        for item in items:
            if isinstance(item, DebugMode):
                flat.append(item)
                continue
            if not isinstance(item, str):
                msg = f"mode must be a DebugMode or one of {valid}; got {item!r}"
                raise ArgumentTypeError(msg)
            try:
                flat.append(DebugMode(item.lower()))  # names in any case, as levels take them
            except ValueError:
                msg = f"mode must be one of {valid}; got {item!r}"
                raise ValueError(msg) from None
    level = DebugLevel.OFF
    for m in flat:
        if _LEVEL_OF[m].rank > level.rank:
            level = _LEVEL_OF[m]
    full = DebugMode.FULL in flat
    return DebugPlan(
        level=level,
        anomaly_localization=full or DebugMode.ANOMALY_DETECTION in flat,
        profiling=full or DebugMode.PROFILING in flat,
        memory_tracking=full or DebugMode.MEMORY_PROFILING in flat,
    )
