"""Events as the numbers and notes experiment trackers show: shared by the TensorBoard and W&B sinks.

:func:`metrics_of` turns a batch of events into :class:`Point` rows (a step, a tag, a value)
and :class:`Note` rows (incidents as text). Tags are grouped the way dashboards group them::

    train/loss  train/learning_rate  train/samples_per_s  train/step_time_s
    check/grad_norm  check/param_norm
    layers/grad_norm/<parameter>  layers/update_ratio/<parameter>   (ADVANCED level and above)
    memory/rss_mib  memory/cuda_allocated_mib  memory/cuda_reserved_mib
    system/cpu_percent  system/memory_percent  system/disk_percent  system/gpu_utilization ...
    incidents/<kind>   (1 at the step of each incident: a marker)

NaN and Inf values are kept: they are what the run needs to show.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

from eventbus_debug.events import Anomaly, Event, Severity

from .lines import describe

__all__ = ("Note", "Point", "StepClock", "metrics_of")

_MIB: Final = 1024.0 * 1024.0

_STEP_FIELDS: Final = (
    ("loss", "train/loss"),
    ("learning_rate", "train/learning_rate"),
    ("samples_per_s", "train/samples_per_s"),
    ("duration_s", "train/step_time_s"),
)
_CHECK_FIELDS: Final = (("grad_norm", "check/grad_norm"), ("param_norm", "check/param_norm"))
_MEMORY_FIELDS: Final = (
    ("rss_bytes", "memory/rss_mib"),
    ("cuda_allocated", "memory/cuda_allocated_mib"),
    ("cuda_reserved", "memory/cuda_reserved_mib"),
    ("cuda_peak", "memory/cuda_peak_mib"),
)
_SYSTEM_FIELDS: Final = (
    "cpu_percent",
    "memory_percent",
    "disk_percent",
    "gpu_utilization",
    "gpu_memory_percent",
)


@dataclass(frozen=True, slots=True)
class Point:
    """One scalar: its step, tag, value and wall time (seconds)."""

    step: int
    tag: str
    value: float
    wall_time: float


@dataclass(frozen=True, slots=True)
class Note:
    """One incident as text: its step, kind, severity, one-line description and wall time.

    ``anomaly`` is True for problems of training itself (:class:`~eventbus_debug.Anomaly`:
    non-finite values, explosions, spikes, leaks...), False for the other incidents (recovery
    decisions, errors, sink failures).
    """

    step: int
    kind: str
    severity: Severity
    text: str
    wall_time: float
    rank: int
    anomaly: bool


class StepClock:
    """The step to file an event under: its own, else the latest step seen (0 before any)."""

    def __init__(self) -> None:
        self.step = 0

    def of(self, event: Event) -> int:
        """The step for *event*, remembering the highest step seen so far."""
        if event.step is not None:
            self.step = max(self.step, event.step)
            return event.step
        return self.step


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _fields(
    event: Event, step: int, wall: float, table: Iterable[tuple[str, str]], scale: float = 1.0
) -> list[Point]:
    out = []
    for attr, tag in table:
        value = _number(getattr(event, attr, None))
        if value is not None:
            out.append(Point(step, tag, value / scale, wall))
    return out


def _layers(prefix: str, values: Mapping[str, float], step: int, wall: float) -> list[Point]:
    return [
        Point(step, f"{prefix}/{name}", float(v), wall)
        for name, v in values.items()
        if _number(v) is not None
    ]


def metrics_of(
    events: Iterable[Event], clock: StepClock, *, per_layer: bool = True
) -> tuple[list[Point], list[Note]]:
    """The scalars and incident notes of *events* (pure: no I/O).

    Args:
        events: a batch, in bus order.
        clock: gives each event its step (events without one use the latest step seen).
        per_layer: include per-parameter gradient norms and update ratios when the events
            carry them (``StepChecked`` at ADVANCED level and above).
    """
    points: list[Point] = []
    notes: list[Note] = []
    for event in events:
        step = clock.of(event)
        wall = event.time_ns / 1e9
        kind = event.kind
        if kind == "step_completed":
            points += _fields(event, step, wall, _STEP_FIELDS)
        elif kind == "step_checked":
            points += _fields(event, step, wall, _CHECK_FIELDS)
            if per_layer:
                points += _layers(
                    "layers/grad_norm", getattr(event, "layer_grad_norms", {}), step, wall
                )
                points += _layers(
                    "layers/update_ratio", getattr(event, "update_ratios", {}), step, wall
                )
        elif kind == "memory_sampled":
            points += _fields(event, step, wall, _MEMORY_FIELDS, _MIB)
        elif kind == "system_sampled":
            points += _fields(event, step, wall, ((f, f"system/{f}") for f in _SYSTEM_FIELDS))
        elif event.is_incident and kind not in ("session_started", "session_ended"):
            points.append(Point(step, f"incidents/{kind}", 1.0, wall))
            notes.append(
                Note(
                    step,
                    kind,
                    event.severity,
                    describe(event),
                    wall,
                    event.rank,
                    isinstance(event, Anomaly),
                )
            )
    return points, notes
