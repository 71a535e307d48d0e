"""The run summary: :class:`RunSummary` and its typed parts, frozen values a report is drawn from.

:func:`summary_to_dict` gives the JSON form (NaN and Inf as strings).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

__all__ = (
    "IncidentRow",
    "LatestValues",
    "LayerSeries",
    "Marker",
    "MemoryStats",
    "RunInfo",
    "RunSummary",
    "SeriesPoint",
    "SinkStats",
    "Stat",
    "SystemStats",
    "summary_to_dict",
)


@dataclass(frozen=True, slots=True)
class Stat:
    """Mean, minimum and maximum of a sampled quantity (finite samples only)."""

    samples: int
    mean: float | None
    min: float | None
    max: float | None


@dataclass(frozen=True, slots=True)
class SeriesPoint:
    """One point of a downsampled series: a bucket of ``stride`` consecutive steps.

    Attributes:
        step: the first step seen in the bucket.
        mean: the mean of the bucket's finite values (``None`` when none was finite).
        min: the smallest finite value.
        max: the largest finite value.
        count: how many values fell in the bucket.
        nonfinite: how many of them were NaN or infinite.
    """

    step: int
    mean: float | None
    min: float | None
    max: float | None
    count: int
    nonfinite: int


@dataclass(frozen=True, slots=True)
class Marker:
    """Something to mark on the plots at a step: an anomaly or a recovery action."""

    step: int
    kind: str
    label: str
    recovery: bool


@dataclass(frozen=True, slots=True)
class IncidentRow:
    """One incident in the report's table.

    ``caused_by`` and ``led_to`` link the recovery chain, by ``seq`` on the same rank: a
    :class:`~eventbus_debug.events.RecoveryDecided` is caused by the incident of its ``trigger_seq``
    and leads to the :class:`~eventbus_debug.events.RecoveryApplied` that carried it out (the next one
    of the same action on the same rank); an incident leads to the decisions it triggered.

    ``ranks`` names every rank that had this incident: the same kind at the same step (the
    same occurrence of it on each rank) on several ranks is one row. ``rank``, ``seq`` and the
    links are those of the first rank seen with it.
    """

    seq: int
    time_ns: int
    step: int | None
    rank: int
    kind: str
    severity: str
    source: str
    message: str
    caused_by: int | None = None
    led_to: tuple[int, ...] = ()
    ranks: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class LayerSeries:
    """A per-layer (per-parameter) series, e.g. one row of the gradient-norm heatmap."""

    name: str
    points: tuple[SeriesPoint, ...]


@dataclass(frozen=True, slots=True)
class LatestValues:
    """The most recent value of each headline quantity (``None`` until one was seen)."""

    step: int | None
    loss: float | None
    grad_norm: float | None
    learning_rate: float | None
    samples_per_s: float | None
    step_duration_s: float | None


@dataclass(frozen=True, slots=True)
class RunInfo:
    """One run found in the events: what a ``SessionStarted`` announced, and what followed.

    Attributes:
        run_id: the session's run id (``""``: events before any ``SessionStarted``).
        name: the session's name.
        started_ns: when the run started (its first ``SessionStarted``).
        ranks: the ranks that started it.
        events: how many events belong to it (on each rank, those after its start).
        shown: whether this summary describes it.
    """

    run_id: str
    name: str
    started_ns: int | None
    ranks: tuple[int, ...]
    events: int
    shown: bool


@dataclass(frozen=True, slots=True)
class MemoryStats:
    """Process (and device) memory over the run.

    Attributes:
        samples: how many ``MemorySampled`` events were seen.
        first_rss_bytes / last_rss_bytes / peak_rss_bytes: resident set size.
        rss_trend_bytes_per_step: the least-squares slope of RSS over steps (``None`` with fewer
            than two distinct steps); a steadily positive trend is what a leak looks like.
        peak_cuda_allocated_bytes / peak_cuda_reserved_bytes: device peaks, when sampled.
        cuda_ooms: the largest out-of-memory count reported by the allocator.
    """

    samples: int
    first_rss_bytes: int | None
    last_rss_bytes: int | None
    peak_rss_bytes: int | None
    rss_trend_bytes_per_step: float | None
    peak_cuda_allocated_bytes: int | None
    peak_cuda_reserved_bytes: int | None
    cuda_ooms: int | None


@dataclass(frozen=True, slots=True)
class SystemStats:
    """Host (and GPU) utilisation over the time span of the samples (the seeds' performance
    summary)."""

    samples: int
    span_s: float
    cpu_percent: Stat
    memory_percent: Stat
    disk_percent: Stat
    gpu_utilization: Stat
    gpu_memory_percent: Stat


@dataclass(frozen=True, slots=True)
class SinkStats:
    """What the sinks reported about themselves: shed telemetry, losses at close, failures."""

    dropped: Mapping[str, int]
    undelivered: Mapping[str, int]
    failures: Mapping[str, int]
    disabled: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class RunSummary:
    """Everything the report says about a run, as typed values.

    Rates are per step: ``anomaly_rate`` is the fraction of steps with at least one anomaly;
    the other rates are incident counts divided by ``steps``.

    Several ranks (a merged log of a ``torch.distributed`` job) describe one run: ``steps`` is
    the number of training steps, not ranks × steps (the ranks of a data-parallel job complete
    the same steps: it is the count of the rank that completed the most; ``steps_by_rank``
    has each rank's). An incident that several ranks had (same step, same kind, same identity:
    the same tensors of a non-finite check, the same rule of a spike, a decision for the same
    trigger...) is one row naming them (:attr:`IncidentRow.ranks`) and is counted once, in the anomaly and recovery
    counts too; ``incidents_by_rank`` counts each rank's. ``samples_per_s`` is the global
    throughput, summed over the ranks at each step; the other series (loss, step duration,
    memory...) are the mean over the ranks at each step, their min–max the spread across
    ranks. One rank's summary is what it was before any of this.
    """

    events: int
    counts_by_kind: Mapping[str, int]
    counts_by_severity: Mapping[str, int]
    ranks: tuple[int, ...]
    started_ns: int | None
    ended_ns: int | None
    duration_s: float
    steps: int
    steps_by_rank: Mapping[int, int]
    first_step: int | None
    last_step: int | None
    """The last step any event named: a step begun, perhaps not completed (see
    ``last_completed_step``)."""
    steps_per_s: float | None
    anomalies: int
    anomaly_steps: int
    anomaly_rate: float
    loss_anomalies: int
    loss_anomaly_rate: float
    gradient_explosions: int
    gradient_explosion_rate: float
    gradient_vanishings: int
    gradient_vanishing_rate: float
    non_finite: int
    first_anomaly_step: int | None
    last_anomaly_step: int | None
    anomalies_by_kind: Mapping[str, int]
    recovery_decisions: Mapping[str, int]
    recovery_outcomes: Mapping[str, int]
    steps_skipped: int
    errors_by_category: Mapping[str, int]
    memory: MemoryStats
    system: SystemStats
    sinks: SinkStats
    loss: tuple[SeriesPoint, ...]
    grad_norm: tuple[SeriesPoint, ...]
    learning_rate: tuple[SeriesPoint, ...]
    samples_per_s: tuple[SeriesPoint, ...]
    step_duration_s: tuple[SeriesPoint, ...]
    rss_bytes: tuple[SeriesPoint, ...]
    cuda_allocated_bytes: tuple[SeriesPoint, ...]
    cuda_reserved_bytes: tuple[SeriesPoint, ...]
    host_memory_percent: tuple[SeriesPoint, ...]
    layer_grad_norms: tuple[LayerSeries, ...]
    update_ratios: tuple[LayerSeries, ...]
    layers_omitted: int
    latest: LatestValues
    markers: tuple[Marker, ...]
    incidents_total: int
    incidents: tuple[IncidentRow, ...]
    incidents_by_rank: Mapping[int, int]
    run_id: str | None = None
    runs: tuple[RunInfo, ...] = ()
    overhead: float | None = None
    """The debugger's own time per step over the rest of the step (``SessionEnded.overhead``;
    the largest of the ranks'), or None when no session measured it."""
    overhead_budget: float | None = None
    """The session's ``overhead_budget``, if one was set."""
    incidents_first: int = 0
    """How many of ``incidents`` are the run's first ones. When the run had more than the
    table keeps (``incidents_total > len(incidents)``), the ones left out came between these
    and the most recent rest."""
    last_completed_step: int | None = None
    """The last step a rank completed (``StepCompleted``), None when none did."""
    ended: Mapping[int, str] = dataclasses.field(default_factory=dict)
    """Each rank's ``SessionEnded.reason`` (its last session's): ``"completed"``,
    ``"stopped: <why>"``, ``"cancelled"`` or ``"error: <exception>"``; empty when no session
    ended in the log (a run still going, or killed)."""

    @property
    def mixed_runs(self) -> bool:
        """True when this summary folds the events of more than one run together."""
        return sum(1 for r in self.runs if r.shown) > 1

    def training_summary(self) -> dict[str, Any]:
        """The seeds' ``get_training_summary()`` shape: step counts and rates, JSON-ready."""
        return {
            "total_steps": self.steps,
            "anomaly_steps": self.anomaly_steps,
            "gradient_explosions": self.gradient_explosions,
            "gradient_vanishing": self.gradient_vanishings,
            "loss_anomalies": self.loss_anomalies,
            "anomaly_rate": self.anomaly_rate,
            "loss_anomaly_rate": self.loss_anomaly_rate,
            "gradient_explosion_rate": self.gradient_explosion_rate,
            "gradient_vanishing_rate": self.gradient_vanishing_rate,
            "first_anomaly_step": self.first_anomaly_step,
            "last_anomaly_step": self.last_anomaly_step,
        }


_COMPUTED: Final = (("mixed_runs", "runs"),)
"""The documented fields :class:`RunSummary` computes (properties): each written after the
field it is computed from, so the JSON holds every field the reference lists."""


def summary_to_dict(summary: RunSummary, /) -> dict[str, Any]:
    """A JSON-ready mapping of *summary* (non-finite floats written as ``"NaN"``/``"Infinity"``).

    Every field, the computed ones (``mixed_runs``) included.
    """
    fields: dict[str, Any] = _jsonable(dataclasses.asdict(summary))
    after = {anchor: name for name, anchor in _COMPUTED}
    result: dict[str, Any] = {}
    for key, value in fields.items():
        result[key] = value
        name = after.get(key)
        if name is not None:
            result[name] = _jsonable(getattr(summary, name))
    return result


def _jsonable(value: Any) -> Any:
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        if math.isinf(value):
            return "Infinity" if value > 0 else "-Infinity"
        return value
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value
