"""The run summary: a typed aggregate of an event stream, built live or from a log.

:class:`RunAggregator` folds events one at a time into bounded state (counters, running
statistics, downsampled series, the most recent incidents) and produces a frozen
:class:`RunSummary`. The aggregate depends only on the events and their order, never on the
time of aggregation, so a report rebuilt from the JSON-lines log equals the live one.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from eventbus_debug.events import (
    Anomaly,
    AnomalyLocalized,
    AutogradAnomalyDetected,
    ErrorRaised,
    Event,
    EventsDropped,
    EventsUndelivered,
    GradientExploded,
    GradientVanished,
    LossSpiked,
    MemoryLeakSuspected,
    MemorySampled,
    NonFiniteDetected,
    RecoveryApplied,
    RecoveryDecided,
    ResourceThresholdExceeded,
    SessionStarted,
    Severity,
    SinkDisabled,
    SinkFailed,
    StepChecked,
    StepCompleted,
    StepSkipped,
    SystemSampled,
    TensorRole,
)

__all__ = (
    "IncidentRow",
    "LatestValues",
    "LayerSeries",
    "Marker",
    "MemoryStats",
    "RunAggregator",
    "RunInfo",
    "RunSummary",
    "SeriesPoint",
    "SinkStats",
    "Stat",
    "SystemStats",
    "describe_incident",
    "summarize",
    "summarize_runs",
    "summary_to_dict",
)

DEFAULT_MAX_POINTS: Final = 1000
DEFAULT_MAX_INCIDENTS: Final = 500
DEFAULT_MAX_MARKERS: Final = 2000
DEFAULT_MAX_LAYERS: Final = 64
DEFAULT_LAYER_POINTS: Final = 48
RUN_JOIN_WINDOW_S: Final = 60.0
"""Ranks that start sessions of the same name within this many seconds, without a shared run
id, are taken as one run (set ``EVENTBUS_DEBUG_RUN_ID`` to make it explicit)."""
_MAX_LINKS: Final = 4096
_MAX_PENDING: Final = 64
_MAX_GROUPS: Final = 4096
"""How many recent incidents are remembered for recognising the same incident on another rank
(an incident at the same step, of the same kind, the same occurrence of it on each rank)."""
RANK_SUM_WINDOW: Final = 64
"""Throughput is summed over the ranks at each step; a step's values wait among this many most
recent steps for the other ranks' (a merged log interleaves the ranks by time, so the ranks of a
data-parallel job are at most a step or two apart in it)."""


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
    :class:`~eventbus_debug.RecoveryDecided` is caused by the incident of its ``trigger_seq``
    and leads to the :class:`~eventbus_debug.RecoveryApplied` that carried it out (the next one
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
    has each rank's). An incident that several ranks had (same step, same kind) is one row
    naming them (:attr:`IncidentRow.ranks`) and is counted once, in the anomaly and recovery
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


def summary_to_dict(summary: RunSummary, /) -> dict[str, Any]:
    """A JSON-ready mapping of *summary* (non-finite floats written as ``"NaN"``/``"Infinity"``)."""
    result: dict[str, Any] = _jsonable(dataclasses.asdict(summary))
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


class _RunningStat:
    __slots__ = ("max", "min", "n", "total")

    def __init__(self) -> None:
        self.n = 0
        self.total = 0.0
        self.min: float | None = None
        self.max: float | None = None

    def add(self, value: float | None) -> None:
        if value is None or not math.isfinite(value):
            return
        self.n += 1
        self.total += value
        self.min = value if self.min is None else min(self.min, value)
        self.max = value if self.max is None else max(self.max, value)

    def freeze(self) -> Stat:
        return Stat(self.n, self.total / self.n if self.n else None, self.min, self.max)


_isfinite = math.isfinite
_ALWAYS_LISTED: Final = (
    Anomaly,
    RecoveryDecided,
    RecoveryApplied,
    StepSkipped,
    EventsDropped,
    EventsUndelivered,
    SinkFailed,
    SinkDisabled,
)
"""Incidents listed whatever their severity (the others from WARNING up)."""


class _Bucket:
    __slots__ = ("count", "index", "max", "min", "nonfinite", "step", "total")

    def __init__(self, index: int, step: int) -> None:
        self.index = index
        self.step = step
        self.count = 0
        self.nonfinite = 0
        self.total = 0.0
        self.min: float | None = None
        self.max: float | None = None

    def add(self, value: float) -> None:
        self.count += 1
        if not _isfinite(value):
            self.nonfinite += 1
            return
        self.total += value
        low = self.min
        if low is None or value < low:
            self.min = value
        high = self.max
        if high is None or value > high:
            self.max = value

    def merge(self, other: _Bucket) -> None:
        self.step = min(self.step, other.step)
        self.count += other.count
        self.nonfinite += other.nonfinite
        self.total += other.total
        for v in (other.min, other.max):
            if v is not None:
                self.min = v if self.min is None else min(self.min, v)
                self.max = v if self.max is None else max(self.max, v)

    def freeze(self) -> SeriesPoint:
        finite = self.count - self.nonfinite
        mean = self.total / finite if finite else None
        return SeriesPoint(self.step, mean, self.min, self.max, self.count, self.nonfinite)


class _Series:
    """A series over steps in at most *max_points* buckets; the stride doubles when full."""

    __slots__ = ("buckets", "max_points", "stride")

    def __init__(self, max_points: int) -> None:
        self.max_points = max_points
        self.stride = 1
        self.buckets: list[_Bucket] = []

    def add(self, step: int, value: float) -> None:
        index = step // self.stride
        buckets = self.buckets
        if buckets:
            last = buckets[-1]
            if last.index == index:  # the common case, inlined: one call per value
                last.count += 1
                if not _isfinite(value):
                    last.nonfinite += 1
                    return
                last.total += value
                low = last.min
                if low is None or value < low:
                    last.min = value
                high = last.max
                if high is None or value > high:
                    last.max = value
                return
        if buckets and index < buckets[-1].index:
            # Out-of-order step (a restored checkpoint replays steps): find its bucket.
            for b in reversed(buckets):
                if b.index == index:
                    b.add(value)
                    return
        bucket = _Bucket(index, step)
        bucket.add(value)
        buckets.append(bucket)
        if len(buckets) > 1 and buckets[-2].index > index:
            buckets.sort(key=lambda b: b.index)
        if len(buckets) > self.max_points:
            self._halve()

    def _halve(self) -> None:
        self.stride *= 2
        merged: list[_Bucket] = []
        for b in self.buckets:
            b.index //= 2
            if merged and merged[-1].index == b.index:
                merged[-1].merge(b)
            else:
                merged.append(b)
        self.buckets = merged

    def freeze(self) -> tuple[SeriesPoint, ...]:
        return tuple(b.freeze() for b in self.buckets)

    def clone(self) -> _Series:
        copy = _Series(self.max_points)
        copy.stride = self.stride
        for b in self.buckets:
            c = _Bucket(b.index, b.step)
            c.count, c.nonfinite, c.total, c.min, c.max = (
                b.count,
                b.nonfinite,
                b.total,
                b.min,
                b.max,
            )
            copy.buckets.append(c)
        return copy


class _RankSum:
    """A per-rank quantity summed over the ranks at each step (the global throughput of a
    data-parallel job), fed to a :class:`_Series` one value per step.

    While the events name one rank (the live writer, a single-rank log), the aggregator holds
    only the latest value back in ``held`` (it goes to the series when the next one comes), so
    a second rank appearing within a step still adds to it; then :meth:`add` sums. A step's sum
    waits among the :data:`RANK_SUM_WINDOW` most recent steps for the other ranks'
    values; it goes to the series when it leaves that window, when the same rank gives a value
    for the same step again (a replayed step: everything waiting goes first, so one rank's
    values reach the series in the order they came), or, on a copy, when the summary is frozen.
    O(1) per value.
    """

    __slots__ = ("held", "pending", "series", "window")

    def __init__(self, series: _Series, window: int = RANK_SUM_WINDOW) -> None:
        self.series = series
        self.window = window
        # step -> [sum over the ranks so far, the first rank, the other ranks (or None)]
        self.pending: dict[int, list[Any]] = {}
        self.held: tuple[int, int, float] | None = None  # (step, rank, value) of add_one

    def add(self, step: int, rank: int, value: float) -> float | None:
        """Add *rank*'s *value* at *step*; the step's sum so far when it is the newest step
        waiting (``None`` for a value that completes an older step)."""
        pending = self.pending
        held = self.held
        if held is not None:
            self.held = None
            pending[held[0]] = [held[2], held[1], None]
        entry = pending.get(step)
        if entry is not None:
            others: set[int] | None = entry[2]
            if rank != entry[1] and (others is None or rank not in others):
                entry[0] += value
                if others is None:
                    entry[2] = {rank}
                else:
                    others.add(rank)
                return float(entry[0]) if next(reversed(pending)) == step else None
            self.flush()
        pending[step] = [value, rank, None]
        if len(pending) > self.window:
            oldest = next(iter(pending))
            self.series.add(oldest, pending.pop(oldest)[0])
        return value

    def flush(self) -> None:
        series = self.series
        for step, entry in self.pending.items():
            series.add(step, entry[0])
        self.pending.clear()

    def freeze(self) -> tuple[SeriesPoint, ...]:
        if not self.pending and self.held is None:
            return self.series.freeze()
        copy = self.series.clone()
        if self.held is not None:
            copy.add(self.held[0], self.held[2])
        for step, entry in self.pending.items():
            copy.add(step, entry[0])
        return copy.freeze()


class _RowState:
    """An incident row being built: its first rank's row and every rank that had it."""

    __slots__ = ("ranks", "row")

    def __init__(self, row: IncidentRow) -> None:
        self.row = row
        self.ranks = [row.rank]


class _Column:
    __slots__ = ("cells", "index", "step")

    def __init__(self, index: int, step: int) -> None:
        self.index = index
        self.step = step
        # name -> [sum of finite values, finite count, non-finite count]
        self.cells: dict[str, list[float]] = {}

    def merge(self, other: _Column) -> None:
        self.step = min(self.step, other.step)
        cells = self.cells
        for name, (total, finite, nonfinite) in other.cells.items():
            cell = cells.get(name)
            if cell is None:
                cells[name] = [total, finite, nonfinite]
            else:
                cell[0] += total
                cell[1] += finite
                cell[2] += nonfinite


class _LayerGrid:
    """Per-layer values over steps, for a heatmap: one column per bucket of steps shared by
    every layer (at most *max_points*; the stride doubles when full), the bucket mean per
    layer. O(1) per value (a dict lookup and two additions), and once *max_layers* layers are
    known, O(max_layers) per step whatever the model's size."""

    __slots__ = ("columns", "max_layers", "max_points", "names", "omitted", "stride")

    def __init__(self, max_points: int, max_layers: int) -> None:
        self.max_points = max_points
        self.max_layers = max_layers
        self.stride = 1
        self.columns: list[_Column] = []
        self.names: dict[str, None] = {}
        self.omitted = 0

    def _column(self, step: int) -> _Column:
        index = step // self.stride
        columns = self.columns
        if columns and columns[-1].index == index:
            return columns[-1]
        if columns and index < columns[-1].index:
            for column in reversed(columns):
                if column.index == index:
                    return column
        column = _Column(index, step)
        columns.append(column)
        if len(columns) > 1 and columns[-2].index > index:
            columns.sort(key=lambda c: c.index)
        if len(columns) > self.max_points:
            self.stride *= 2
            merged: list[_Column] = []
            for c in columns:
                c.index //= 2
                if merged and merged[-1].index == c.index:
                    merged[-1].merge(c)
                else:
                    merged.append(c)
            self.columns = merged
            return self._column(step)
        return column

    def add(self, step: int, values: Mapping[str, float]) -> None:
        cells = self._column(step).cells
        names = self.names
        if len(names) >= self.max_layers:
            # full: look up the kept layers only, never walk a huge model's every parameter
            pairs: Iterable[tuple[str, float | None]] = [(n, values.get(n)) for n in names]
            kept = sum(1 for _, v in pairs if v is not None)
            self.omitted = max(self.omitted, len(values) - kept)
        else:
            pairs = values.items()
        for name, value in pairs:
            if value is None:
                continue
            cell = cells.get(name)
            if cell is None:
                if name not in names:
                    if len(names) >= self.max_layers:
                        self.omitted = max(self.omitted, len(values) - len(names))
                        continue
                    names[name] = None
                cell = cells[name] = [0.0, 0, 0]
            if _isfinite(value):
                cell[0] += value
                cell[1] += 1
            else:
                cell[2] += 1

    def freeze(self) -> tuple[LayerSeries, ...]:
        out = []
        for name in self.names:
            points = []
            for column in self.columns:
                cell = column.cells.get(name)
                if cell is None:
                    continue
                total, finite, nonfinite = cell[0], int(cell[1]), int(cell[2])
                mean = total / finite if finite else None
                points.append(
                    SeriesPoint(column.step, mean, None, None, finite + nonfinite, nonfinite)
                )
            out.append(LayerSeries(name, tuple(points)))
        return tuple(out)


class _Trend:
    """Online least-squares slope of y over x."""

    __slots__ = ("n", "sx", "sxx", "sxy", "sy")

    def __init__(self) -> None:
        self.n = 0
        self.sx = self.sy = self.sxx = self.sxy = 0.0

    def add(self, x: float, y: float) -> None:
        self.n += 1
        self.sx += x
        self.sy += y
        self.sxx += x * x
        self.sxy += x * y

    def slope(self) -> float | None:
        if self.n < 2:
            return None
        den = self.n * self.sxx - self.sx * self.sx
        if den <= 0:
            return None
        return (self.n * self.sxy - self.sx * self.sy) / den


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}"


def describe_incident(event: Event) -> str:
    """A one-line description of an incident for the report table and the command line."""
    match event:
        case NonFiniteDetected():
            names = ", ".join(event.names[:3]) + ("..." if len(event.names) > 3 else "")
            counts = []
            if event.nan_count:
                counts.append(f"{event.nan_count} NaN")
            if event.inf_count:
                counts.append(f"{event.inf_count} Inf")
            extra = f" ({', '.join(counts)})" if counts else ""
            return f"non-finite {event.role.value}: {names or '?'}{extra}"
        case GradientExploded():
            top = f"; largest {event.top[0][0]}={_fmt(event.top[0][1])}" if event.top else ""
            return f"gradient norm {_fmt(event.total_norm)} > {_fmt(event.threshold)}{top}"
        case GradientVanished():
            layers = f" in {len(event.layers)} layer(s)" if event.layers else ""
            zero = " (all zero)" if event.all_zero else ""
            return f"mean |grad| {_fmt(event.mean_abs)} < {_fmt(event.threshold)}{layers}{zero}"
        case LossSpiked():
            return (
                f"loss {_fmt(event.loss)} = {_fmt(event.ratio)}x running mean "
                f"{_fmt(event.running_mean)} ({event.rule})"
            )
        case AnomalyLocalized():
            return (
                f"first non-finite {event.role.value} in {event.module or '<root>'} ({event.phase})"
            )
        case AutogradAnomalyDetected():
            return f"autograd anomaly in {event.backward_fn}: {event.message[:120]}"
        case MemoryLeakSuspected():
            return f"{event.resource} grows {_fmt(event.slope)}/sample over {event.window}: {event.retained}"
        case ResourceThresholdExceeded():
            return f"{event.metric} {_fmt(event.value)} > {_fmt(event.threshold)}"
        case ErrorRaised():
            return (
                f"{event.category.value} error {event.error_type} (attempt {event.attempt}): "
                f"{event.message[:160]}"
            )
        case RecoveryDecided():
            return f"decided {event.action.value} for {event.trigger_kind}: {event.reason[:160]}"
        case RecoveryApplied():
            return f"{event.action.value} {event.outcome}: {event.detail[:160]}"
        case StepSkipped():
            return f"step skipped: {event.reason[:160]}"
        case SinkFailed():
            return f"sink {event.sink} failed on {event.event_kind}: {event.error_type}: {event.message[:120]}"
        case SinkDisabled():
            return f"sink {event.sink} disabled: {event.reason[:160]}"
        case EventsDropped():
            return f"sink {event.sink} shed {event.dropped} telemetry event(s) ({event.total_dropped} total)"
        case EventsUndelivered():
            return f"sink {event.sink} lost {event.undelivered} event(s) at {event.phase}"
    message = getattr(event, "message", None)
    if isinstance(message, str) and message:
        return message[:200]
    reason = getattr(event, "reason", None)
    if isinstance(reason, str) and reason:
        return reason[:200]
    return event.kind


class RunAggregator:
    """Folds events into the state behind a :class:`RunSummary`; memory stays bounded.

    Args:
        max_points: the most points each plotted series keeps (older buckets merge).
        max_incidents: the most recent incidents kept for the table (all are counted).
        max_markers: the most plot markers kept (the earliest are kept).
        max_layers: the most layers kept for the per-layer views (the first seen; the others
            are counted in ``layers_omitted``).
        layer_points: the most step buckets of each per-layer series.

    Every event costs O(1) (a ``StepChecked`` with per-layer values: O(layers)); the summary
    is assembled on demand.

    Raises:
        ValueError: if a bound is smaller than 2.
    """

    def __init__(
        self,
        *,
        max_points: int = DEFAULT_MAX_POINTS,
        max_incidents: int = DEFAULT_MAX_INCIDENTS,
        max_markers: int = DEFAULT_MAX_MARKERS,
        max_layers: int = DEFAULT_MAX_LAYERS,
        layer_points: int = DEFAULT_LAYER_POINTS,
    ) -> None:
        for name, value in (
            ("max_points", max_points),
            ("max_incidents", max_incidents),
            ("max_markers", max_markers),
            ("max_layers", max_layers),
            ("layer_points", layer_points),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 2:
                msg = f"{name} must be an integer >= 2, got {value!r}"
                raise ValueError(msg)
        self._max_points = max_points
        self._max_incidents = max_incidents
        self._max_markers = max_markers
        self._max_layers = max_layers
        self._layer_points = layer_points
        self.clear()

    def clear(self) -> None:
        """Forget everything aggregated so far."""
        self._events = 0
        self._by_kind: dict[str, int] = {}
        self._by_severity: dict[str, int] = {}
        self._ranks: set[int] = set()
        self._first_ns: int | None = None
        self._last_ns: int | None = None
        # step completions and checks: counted plainly while one rank is seen, per rank after
        self._several = False
        self._completed = 0
        self._checked = 0
        self._completed_by_rank: dict[int, int] = {}
        self._checked_by_rank: dict[int, int] = {}
        self._first_step: int | None = None
        self._last_step: int | None = None
        self._anomalies = 0
        self._anomaly_steps: set[int] = set()
        self._anomalies_by_kind: dict[str, int] = {}
        self._loss_anomalies = 0
        self._explosions = 0
        self._vanishings = 0
        self._non_finite = 0
        self._first_anomaly: int | None = None
        self._last_anomaly: int | None = None
        self._decisions: dict[str, int] = {}
        self._outcomes: dict[str, int] = {}
        self._skipped = 0
        self._errors: dict[str, int] = {}
        self._mem_samples = 0
        self._rss_first: int | None = None
        self._rss_last: int | None = None
        self._rss_peak: int | None = None
        self._rss_trend = _Trend()
        self._cuda_peak: int | None = None
        self._cuda_reserved_peak: int | None = None
        self._cuda_ooms: int | None = None
        self._sys_samples = 0
        self._sys_first_ns: int | None = None
        self._sys_last_ns: int | None = None
        self._cpu = _RunningStat()
        self._mem_pct = _RunningStat()
        self._disk = _RunningStat()
        self._gpu_util = _RunningStat()
        self._gpu_mem = _RunningStat()
        self._dropped: dict[str, int] = {}
        self._undelivered: dict[str, int] = {}
        self._failures: dict[str, int] = {}
        self._disabled: list[str] = []
        self._loss_checked = _Series(self._max_points)
        self._loss_completed = _Series(self._max_points)
        self._grad = _Series(self._max_points)
        self._rss = _Series(self._max_points)
        self._cuda = _Series(self._max_points)
        self._cuda_reserved = _Series(self._max_points)
        self._host_mem = _Series(self._max_points)
        self._lr = _Series(self._max_points)
        self._throughput = _RankSum(_Series(self._max_points))
        self._duration = _Series(self._max_points)
        self._layer_grad = _LayerGrid(self._layer_points, self._max_layers)
        self._layer_update = _LayerGrid(self._layer_points, self._max_layers)
        self._latest: dict[str, float | None] = {}
        self._latest_step: int | None = None
        self._markers: list[Marker] = []
        self._incidents_total = 0
        self._incidents: deque[_RowState] = deque(maxlen=self._max_incidents)
        self._incidents_by_rank: dict[int, int] = {}
        # the same incident on several ranks: (rank, step, kind) -> occurrences on that rank;
        # (step, kind, occurrence) -> its row; (rank, seq) of a merged event -> its row's
        self._occurrences: dict[tuple[int, int, str], int] = {}
        self._groups: dict[tuple[int, str, int], _RowState] = {}
        self._alias: dict[tuple[int, int], tuple[int, int]] = {}
        # recovery chain: (rank, seq) -> seqs it led to; (rank, action) -> undone decisions
        self._led_to: dict[tuple[int, int], list[int]] = {}
        self._pending: dict[tuple[int, str], deque[int]] = {}
        # runs: rank -> current run id; run id -> [name, started_ns, ranks, events]
        self._rank_run: dict[int, str] = {}
        self._runs: dict[str, _RunState] = {}

    def add_all(self, events: Iterable[Event], /) -> None:
        """Fold every event of *events*, in order."""
        for event in events:
            self.add(event)

    def add(self, event: Event, /) -> None:
        """Fold one event."""
        self._events += 1
        kind = event.kind
        self._by_kind[kind] = self._by_kind.get(kind, 0) + 1
        sev = event.severity.value
        self._by_severity[sev] = self._by_severity.get(sev, 0) + 1
        if event.rank not in self._ranks:
            self._new_rank(event.rank)
        t = event.time_ns
        if self._first_ns is None or t < self._first_ns:
            self._first_ns = t
        if self._last_ns is None or t > self._last_ns:
            self._last_ns = t
        step = event.step
        if step is not None:
            if self._first_step is None or step < self._first_step:
                self._first_step = step
            if self._last_step is None or step > self._last_step:
                self._last_step = step
        if self._rank_run:
            run = self._runs.get(self._rank_run.get(event.rank, ""))
            if run is not None:
                run.events += 1

        if isinstance(event, StepChecked):
            if self._several:
                checked = self._checked_by_rank
                checked[event.rank] = checked.get(event.rank, 0) + 1
            else:
                self._checked += 1
            if step is not None:
                latest = self._latest
                self._latest_step = step
                if event.loss is not None:
                    self._loss_checked.add(step, event.loss)
                    latest["loss"] = event.loss
                if event.grad_norm is not None:
                    self._grad.add(step, event.grad_norm)
                    latest["grad_norm"] = event.grad_norm
                if event.layer_grad_norms:
                    self._layer_grad.add(step, event.layer_grad_norms)
                if event.update_ratios:
                    self._layer_update.add(step, event.update_ratios)
            return
        if isinstance(event, StepCompleted):
            if self._several:
                completed = self._completed_by_rank
                completed[event.rank] = completed.get(event.rank, 0) + 1
            else:
                self._completed += 1
            if step is not None:
                latest = self._latest
                self._latest_step = step
                if event.loss is not None:
                    self._loss_completed.add(step, event.loss)
                    latest["loss"] = event.loss
                if event.learning_rate is not None:
                    self._lr.add(step, event.learning_rate)
                    latest["learning_rate"] = event.learning_rate
                value = event.samples_per_s
                if value is not None:
                    throughput = self._throughput
                    if self._several:  # a merged log: summed over the ranks at each step
                        total = throughput.add(step, event.rank, value)
                        if total is not None:
                            latest["samples_per_s"] = total
                    else:  # one rank so far (the live writer): nothing to sum
                        held = throughput.held
                        if held is not None:
                            throughput.series.add(held[0], held[2])
                        throughput.held = (step, event.rank, value)
                        latest["samples_per_s"] = value
                if event.duration_s is not None:
                    self._duration.add(step, event.duration_s)
                    latest["step_duration_s"] = event.duration_s
            return
        if isinstance(event, MemorySampled):
            self._add_memory(event)
            return
        if isinstance(event, SystemSampled):
            self._add_system(event)
            return
        if not event.is_incident:
            return
        if isinstance(event, SessionStarted):
            self._start_run(event)
            return
        if event.severity < Severity.WARNING and not isinstance(event, _ALWAYS_LISTED):
            return  # lifecycle notices (session started/ended, captures) are not incidents
        rank = event.rank
        self._incidents_by_rank[rank] = self._incidents_by_rank.get(rank, 0) + 1
        # Another rank's copy of an incident already listed joins that row; it is counted once.
        key = None if step is None else (step, kind, self._occurrence(rank, step, kind))
        new = key is None or not self._join_group(event, key)
        caused_by: int | None = None
        if isinstance(event, Anomaly):
            if new:
                self._add_anomaly(event)
        elif isinstance(event, RecoveryDecided):
            action = event.action.value
            if new:
                self._decisions[action] = self._decisions.get(action, 0) + 1
                self._mark(event, action, recovery=True)
            caused_by = self._link_decision(event, action)
        elif isinstance(event, RecoveryApplied):
            if new:
                outcome = f"{event.action.value}:{event.outcome}"
                self._outcomes[outcome] = self._outcomes.get(outcome, 0) + 1
            caused_by = self._link_applied(event)
        elif isinstance(event, StepSkipped):
            if new:
                self._skipped += 1
                self._mark(event, "skip", recovery=True)
        # what each rank's sinks shed, lost or failed on adds up over the ranks
        elif isinstance(event, EventsDropped):
            self._dropped[event.sink] = self._dropped.get(event.sink, 0) + event.dropped
        elif isinstance(event, EventsUndelivered):
            self._undelivered[event.sink] = self._undelivered.get(event.sink, 0) + event.undelivered
        elif isinstance(event, SinkFailed):
            self._failures[event.sink] = self._failures.get(event.sink, 0) + 1
        elif isinstance(event, SinkDisabled):
            if event.sink not in self._disabled:
                self._disabled.append(event.sink)
        if not new:
            return
        self._incidents_total += 1
        state = _RowState(
            IncidentRow(
                seq=event.seq,
                time_ns=event.time_ns,
                step=step,
                rank=rank,
                kind=kind,
                severity=sev,
                source=event.source,
                message=describe_incident(event),
                caused_by=caused_by,
            )
        )
        self._incidents.append(state)
        if key is not None:
            groups = self._groups
            if len(groups) >= _MAX_GROUPS and key not in groups:
                del groups[next(iter(groups))]
            groups[key] = state

    def _occurrence(self, rank: int, step: int, kind: str) -> int:
        """How many incidents of *kind* at *step* *rank* had before this one (bounded memory)."""
        occurrences = self._occurrences
        key = (rank, step, kind)
        n = occurrences.get(key, 0)
        if not n and len(occurrences) >= _MAX_GROUPS:
            del occurrences[next(iter(occurrences))]
        occurrences[key] = n + 1
        return n

    def _join_group(self, event: Event, key: tuple[int, str, int]) -> bool:
        """Whether another rank already listed this incident (*key*: its step, kind and
        occurrence on the rank); its row then names this rank too."""
        group = self._groups.get(key)
        rank = event.rank
        if group is None or rank in group.ranks:
            return False
        group.ranks.append(rank)
        if event.seq >= 0 and group.row.seq >= 0:
            alias = self._alias
            if len(alias) >= _MAX_LINKS:
                del alias[next(iter(alias))]
            alias[(rank, event.seq)] = (group.row.rank, group.row.seq)
        return True

    def _new_rank(self, rank: int) -> None:
        ranks = self._ranks
        if len(ranks) == 1 and not self._several:
            # a second rank: from now on count per rank, the first rank's counts so far its own
            self._several = True
            (first,) = ranks
            if self._completed:
                self._completed_by_rank[first] = self._completed
            if self._checked:
                self._checked_by_rank[first] = self._checked
        ranks.add(rank)

    def _link(self, rank: int, source_seq: int, target_seq: int) -> int | None:
        """Link *source_seq* to *target_seq* (both of *rank*) on the rows that list them (a
        merged copy's row is its first rank's); the source's seq on that row, or ``None`` when
        the two rows are not of the same rank."""
        alias = self._alias
        src_rank, src = alias.get((rank, source_seq), (rank, source_seq))
        dst_rank, dst = alias.get((rank, target_seq), (rank, target_seq))
        if src_rank != dst_rank:
            return None
        links = self._led_to
        key = (src_rank, src)
        targets = links.get(key)
        if targets is None:
            if len(links) >= _MAX_LINKS:
                del links[next(iter(links))]  # the oldest chain: its rows left the table
            targets = links[key] = []
        if len(targets) < _MAX_PENDING and dst not in targets:
            targets.append(dst)
        return src

    def _link_decision(self, event: RecoveryDecided, action: str) -> int | None:
        if event.seq < 0:
            return None
        pending = self._pending.get((event.rank, action))
        if pending is None:
            pending = self._pending[(event.rank, action)] = deque(maxlen=_MAX_PENDING)
        pending.append(event.seq)
        if event.trigger_seq < 0:
            return None
        return self._link(event.rank, event.trigger_seq, event.seq)

    def _link_applied(self, event: RecoveryApplied) -> int | None:
        pending = self._pending.get((event.rank, event.action.value))
        if not pending or event.seq < 0:
            return None
        decision = pending.popleft()
        return self._link(event.rank, decision, event.seq)

    def _start_run(self, event: SessionStarted) -> None:
        run_id = event.run_id if isinstance(event.run_id, str) else str(event.run_id)
        previous = self._runs.get(self._rank_run.get(event.rank, ""))
        if previous is not None:
            previous.events -= 1  # counted above, before the rank switched runs
        state = self._runs.get(run_id)
        if state is None:
            state = self._runs[run_id] = _RunState(event.name, event.time_ns)
            state.events = 1
        else:
            state.events += 1
            if state.started_ns is None or event.time_ns < state.started_ns:
                state.started_ns = event.time_ns
        state.ranks.add(event.rank)
        self._rank_run[event.rank] = run_id

    def _add_anomaly(self, event: Anomaly) -> None:
        self._anomalies += 1
        kind = event.kind
        self._anomalies_by_kind[kind] = self._anomalies_by_kind.get(kind, 0) + 1
        step = event.step
        if step is not None:
            self._anomaly_steps.add(step)
            if self._first_anomaly is None or step < self._first_anomaly:
                self._first_anomaly = step
            if self._last_anomaly is None or step > self._last_anomaly:
                self._last_anomaly = step
        if isinstance(event, LossSpiked):
            self._loss_anomalies += 1
        elif isinstance(event, NonFiniteDetected):
            self._non_finite += 1
            if event.role is TensorRole.LOSS:
                self._loss_anomalies += 1
        elif isinstance(event, GradientExploded):
            self._explosions += 1
        elif isinstance(event, GradientVanished):
            self._vanishings += 1
        elif isinstance(event, ErrorRaised):
            cat = event.category.value
            self._errors[cat] = self._errors.get(cat, 0) + 1
        self._mark(event, kind, recovery=False)

    def _mark(self, event: Event, label: str, *, recovery: bool) -> None:
        step = event.step if event.step is not None else self._last_step
        if step is None or len(self._markers) >= self._max_markers:
            return
        self._markers.append(Marker(step=step, kind=event.kind, label=label, recovery=recovery))

    def _add_memory(self, event: MemorySampled) -> None:
        self._mem_samples += 1
        rss = event.rss_bytes
        if self._rss_first is None:
            self._rss_first = rss
        self._rss_last = rss
        self._rss_peak = rss if self._rss_peak is None else max(self._rss_peak, rss)
        step = event.step if event.step is not None else self._last_step
        if step is not None:
            self._rss_trend.add(float(step), float(rss))
            self._rss.add(step, float(rss))
            if event.cuda_allocated is not None:
                self._cuda.add(step, float(event.cuda_allocated))
            if event.cuda_reserved is not None:
                self._cuda_reserved.add(step, float(event.cuda_reserved))
        for attr, value in (
            (
                "_cuda_peak",
                event.cuda_peak if event.cuda_peak is not None else event.cuda_allocated,
            ),
            ("_cuda_reserved_peak", event.cuda_reserved),
            ("_cuda_ooms", event.cuda_ooms),
        ):
            if value is not None:
                current = getattr(self, attr)
                setattr(self, attr, value if current is None else max(current, value))

    def _add_system(self, event: SystemSampled) -> None:
        self._sys_samples += 1
        t = event.time_ns
        if self._sys_first_ns is None or t < self._sys_first_ns:
            self._sys_first_ns = t
        if self._sys_last_ns is None or t > self._sys_last_ns:
            self._sys_last_ns = t
        self._cpu.add(event.cpu_percent)
        self._mem_pct.add(event.memory_percent)
        step = event.step if event.step is not None else self._last_step
        if step is not None:
            self._host_mem.add(step, event.memory_percent)
        self._disk.add(event.disk_percent)
        self._gpu_util.add(event.gpu_utilization)
        self._gpu_mem.add(event.gpu_memory_percent)

    def summary(self) -> RunSummary:
        """The typed summary of everything folded so far."""
        if self._several:
            by_rank = self._completed_by_rank or self._checked_by_rank
        else:
            count = self._completed or self._checked
            by_rank = {next(iter(self._ranks)): count} if count else {}
        steps = max(by_rank.values(), default=0)
        if not steps and self._first_step is not None and self._last_step is not None:
            steps = self._last_step - self._first_step + 1
        duration = (
            (self._last_ns - self._first_ns) / 1e9
            if self._first_ns is not None and self._last_ns is not None
            else 0.0
        )

        def rate(n: int) -> float:
            return n / steps if steps else 0.0

        loss = self._loss_checked if self._loss_checked.buckets else self._loss_completed
        sys_span = (
            (self._sys_last_ns - self._sys_first_ns) / 1e9
            if self._sys_first_ns is not None and self._sys_last_ns is not None
            else 0.0
        )
        latest = self._latest
        runs = self.runs()
        run_ids = [r.run_id for r in runs if r.run_id]
        return RunSummary(
            events=self._events,
            counts_by_kind=dict(sorted(self._by_kind.items())),
            counts_by_severity={
                s.value: self._by_severity[s.value]
                for s in Severity
                if s.value in self._by_severity
            },
            ranks=tuple(sorted(self._ranks)),
            started_ns=self._first_ns,
            ended_ns=self._last_ns,
            duration_s=duration,
            steps=steps,
            steps_by_rank=dict(sorted(by_rank.items())),
            first_step=self._first_step,
            last_step=self._last_step,
            steps_per_s=steps / duration if duration > 0 and steps else None,
            anomalies=self._anomalies,
            anomaly_steps=len(self._anomaly_steps),
            anomaly_rate=rate(len(self._anomaly_steps)),
            loss_anomalies=self._loss_anomalies,
            loss_anomaly_rate=rate(self._loss_anomalies),
            gradient_explosions=self._explosions,
            gradient_explosion_rate=rate(self._explosions),
            gradient_vanishings=self._vanishings,
            gradient_vanishing_rate=rate(self._vanishings),
            non_finite=self._non_finite,
            first_anomaly_step=self._first_anomaly,
            last_anomaly_step=self._last_anomaly,
            anomalies_by_kind=dict(sorted(self._anomalies_by_kind.items())),
            recovery_decisions=dict(sorted(self._decisions.items())),
            recovery_outcomes=dict(sorted(self._outcomes.items())),
            steps_skipped=self._skipped,
            errors_by_category=dict(sorted(self._errors.items())),
            memory=MemoryStats(
                samples=self._mem_samples,
                first_rss_bytes=self._rss_first,
                last_rss_bytes=self._rss_last,
                peak_rss_bytes=self._rss_peak,
                rss_trend_bytes_per_step=self._rss_trend.slope(),
                peak_cuda_allocated_bytes=self._cuda_peak,
                peak_cuda_reserved_bytes=self._cuda_reserved_peak,
                cuda_ooms=self._cuda_ooms,
            ),
            system=SystemStats(
                samples=self._sys_samples,
                span_s=sys_span,
                cpu_percent=self._cpu.freeze(),
                memory_percent=self._mem_pct.freeze(),
                disk_percent=self._disk.freeze(),
                gpu_utilization=self._gpu_util.freeze(),
                gpu_memory_percent=self._gpu_mem.freeze(),
            ),
            sinks=SinkStats(
                dropped=dict(sorted(self._dropped.items())),
                undelivered=dict(sorted(self._undelivered.items())),
                failures=dict(sorted(self._failures.items())),
                disabled=tuple(self._disabled),
            ),
            loss=loss.freeze(),
            grad_norm=self._grad.freeze(),
            learning_rate=self._lr.freeze(),
            samples_per_s=self._throughput.freeze(),
            step_duration_s=self._duration.freeze(),
            rss_bytes=self._rss.freeze(),
            cuda_allocated_bytes=self._cuda.freeze(),
            cuda_reserved_bytes=self._cuda_reserved.freeze(),
            host_memory_percent=self._host_mem.freeze(),
            layer_grad_norms=self._layer_grad.freeze(),
            update_ratios=self._layer_update.freeze(),
            layers_omitted=max(self._layer_grad.omitted, self._layer_update.omitted),
            latest=LatestValues(
                step=self._latest_step,
                loss=latest.get("loss"),
                grad_norm=latest.get("grad_norm"),
                learning_rate=latest.get("learning_rate"),
                samples_per_s=latest.get("samples_per_s"),
                step_duration_s=latest.get("step_duration_s"),
            ),
            markers=tuple(self._markers),
            incidents_total=self._incidents_total,
            incidents=self._linked_incidents(),
            incidents_by_rank=dict(sorted(self._incidents_by_rank.items())),
            run_id=run_ids[-1] if len(run_ids) == 1 else None,
            runs=runs,
        )

    def runs(self) -> tuple[RunInfo, ...]:
        """The runs this aggregator saw (in start order), each marked as shown."""
        infos = [
            RunInfo(
                run_id=run_id,
                name=state.name,
                started_ns=state.started_ns,
                ranks=tuple(sorted(state.ranks)),
                events=state.events,
                shown=True,
            )
            for run_id, state in self._runs.items()
        ]
        unattributed = self._events - sum(info.events for info in infos)
        if infos and unattributed > 0:
            infos.insert(0, RunInfo("", "", None, (), unattributed, shown=True))
        infos.sort(key=lambda r: (r.started_ns is not None, r.started_ns or 0))
        return tuple(infos)

    def _linked_incidents(self) -> tuple[IncidentRow, ...]:
        links = self._led_to
        out = []
        for state in self._incidents:
            row = state.row
            led = links.get((row.rank, row.seq))
            out.append(
                dataclasses.replace(
                    row,
                    led_to=row.led_to if led is None else tuple(led),
                    ranks=tuple(sorted(state.ranks)),
                )
            )
        return tuple(out)


class _RunState:
    __slots__ = ("events", "name", "ranks", "started_ns")

    def __init__(self, name: str, started_ns: int | None) -> None:
        self.name = name
        self.started_ns = started_ns
        self.ranks: set[int] = set()
        self.events = 0


def summarize(events: Iterable[Event], /, **options: int) -> RunSummary:
    """Aggregate *events* (e.g. ``read_events(log_dir)``) into a :class:`RunSummary`.

    *options* are those of :class:`RunAggregator`.
    """
    aggregator = RunAggregator(**options)
    aggregator.add_all(events)
    return aggregator.summary()


def summarize_runs(
    events: Iterable[Event], /, *, run: str = "latest", **options: int
) -> RunSummary:
    """Aggregate *events* of a log that may hold several runs (reruns into one directory).

    Each rank's events belong to the run its latest ``SessionStarted`` announced (events
    before any are a run of their own, id ``""``). Ranks whose sessions have different run ids
    but the same name and start within :data:`RUN_JOIN_WINDOW_S` are joined into one run.

    Args:
        events: the events, in log order (e.g. ``read_events(log_dir)``).
        run: ``"latest"`` (the run that started last), ``"all"`` (every event folded together,
            as one summary that says it mixes runs), or a run id.
        options: the bounds of :class:`RunAggregator`.

    Returns:
        The summary of the chosen run; its ``runs`` lists every run found, the chosen one
        marked ``shown``.

    Raises:
        ValueError: if *run* names no run of the log (the message lists those it holds).
    """
    if not isinstance(run, str) or not run:
        msg = f"run must be 'latest', 'all' or a run id, got {run!r}"
        raise ValueError(msg)
    if run == "all":
        return summarize(events, **options)
    aggregators: dict[str, RunAggregator] = {}
    rank_run: dict[int, str] = {}
    alias: dict[str, str] = {}
    starts: dict[str, tuple[str, int, set[int]]] = {}
    window_ns = int(RUN_JOIN_WINDOW_S * 1e9)
    for event in events:
        if isinstance(event, SessionStarted):
            run_id = str(event.run_id)
            key = alias.get(run_id)
            if key is None:
                key = run_id
                for other, (name, started, ranks) in starts.items():
                    if (
                        other != run_id
                        and name == event.name
                        and event.rank not in ranks
                        and abs(event.time_ns - started) <= window_ns
                    ):
                        key = other
                        break
                alias[run_id] = key
            entry = starts.setdefault(key, (event.name, event.time_ns, set()))
            entry[2].add(event.rank)
            rank_run[event.rank] = key
            if key != run_id:
                event = dataclasses.replace(event, run_id=key)
        key = rank_run.get(event.rank, "")
        aggregator = aggregators.get(key)
        if aggregator is None:
            aggregator = aggregators[key] = RunAggregator(**options)
        aggregator.add(event)
    if not aggregators:
        return RunAggregator(**options).summary()
    named = [key for key in aggregators if key]
    if run == "latest":
        chosen = max(named, key=lambda k: starts[k][1]) if named else ""
    elif run in aggregators:
        chosen = run
    else:
        known = ", ".join(repr(k) for k in sorted(named)) or "none"
        msg = f"run {run!r} is not in this log; its runs: {known}"
        raise ValueError(msg)
    summaries = {key: agg.summary() for key, agg in aggregators.items()}
    runs: list[RunInfo] = []
    for key, summary in summaries.items():
        info = next((r for r in summary.runs if r.run_id == key), None)
        if info is None:
            info = RunInfo(key, "", None if not key else starts[key][1], summary.ranks, 0, False)
        runs.append(dataclasses.replace(info, events=summary.events, shown=key == chosen))
    if len(runs) == 1 and not runs[0].run_id:
        return summaries[chosen]
    runs.sort(key=lambda r: (r.started_ns is not None, r.started_ns or 0))
    return dataclasses.replace(summaries[chosen], runs=tuple(runs))
