"""The run aggregator: events folded one at a time into the bounded state behind a summary."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from eventbus_debug.events import (
    Anomaly,
    ErrorRaised,
    Event,
    EventsDropped,
    EventsUndelivered,
    GradientExploded,
    GradientVanished,
    LossSpiked,
    MemorySampled,
    NonFiniteDetected,
    RecoveryApplied,
    RecoveryDecided,
    SessionEnded,
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

from ..._checks import count
from .._stats import _LayerGrid, _RankSum, _RunningStat, _Series, _Trend
from ..summary import (
    LatestValues,
    Marker,
    MemoryStats,
    RunInfo,
    RunSummary,
    SinkStats,
    SystemStats,
)
from ._rows import _IncidentRows, end_reason

DEFAULT_MAX_POINTS: Final = 1000
DEFAULT_MAX_INCIDENTS: Final = 500
DEFAULT_MAX_MARKERS: Final = 2000
DEFAULT_MAX_LAYERS: Final = 64
DEFAULT_LAYER_POINTS: Final = 48
_MAX_ENDED: Final = 4096
"""The most ranks whose end reason is kept."""

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


class RunAggregator(_IncidentRows):
    """Folds events into the state behind a :class:`RunSummary`; memory stays bounded.

    Args:
        max_points: the most points each plotted series keeps (older buckets merge).
        max_incidents: the most incidents kept for the table: the run's first tenth of them
            and the most recent rest (all are counted).
        max_markers: the most plot markers kept (the earliest are kept).
        max_layers: the most layers kept for the per-layer views (the first seen; the others
            are counted in ``layers_omitted``).
        layer_points: the most step buckets of each per-layer series.

    Every event costs O(1) (a ``StepChecked`` with per-layer values: O(layers)); the summary
    is assembled on demand.

    Raises:
        ArgumentTypeError: if a bound is not an int (a float, a bool, a string, None; a
            ``TypeError``, and the ``ValueError`` earlier releases raised).
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
            count(name, value, rule="an integer >= 2", minimum=2)
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
        self._last_completed: int | None = None
        self._ended: dict[int, str] = {}  # rank -> its last session's end reason
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
        self._overhead: float | None = None
        self._overhead_budget: float | None = None
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
        self._incidents_by_rank: dict[int, int] = {}
        self._clear_rows(self._max_incidents)
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
                if self._last_completed is None or step > self._last_completed:
                    self._last_completed = step
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
        if isinstance(event, SessionEnded):
            self._end_run(event)
            if event.reason != "completed":
                self._list_ended(event)
            return
        if event.severity < Severity.WARNING and not isinstance(event, _ALWAYS_LISTED):
            return  # lifecycle notices (session started, captures) are not incidents
        rank = event.rank
        self._incidents_by_rank[rank] = self._incidents_by_rank.get(rank, 0) + 1
        key, new = self._merge(event)
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
        if new:
            self._list(event, key, caused_by)

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

    def _list_ended(self, event: SessionEnded) -> None:
        """A session that did not complete (stopped, cancelled, failed) is an incident: its row
        says why (the ranks that ended for the same reason at the same step share it)."""
        rank = event.rank
        self._incidents_by_rank[rank] = self._incidents_by_rank.get(rank, 0) + 1
        key, new = self._merge(event)
        if new:
            self._list(event, key, None)

    def _end_run(self, event: SessionEnded) -> None:
        """Keep each rank's end reason, the session's measured overhead (the largest over
        ranks) and its budget."""
        ended = self._ended
        if event.rank in ended or len(ended) < _MAX_ENDED:
            ended[event.rank] = end_reason(event)
        if event.overhead is not None and (
            self._overhead is None or event.overhead > self._overhead
        ):
            self._overhead = event.overhead
        if event.overhead_budget is not None:
            self._overhead_budget = event.overhead_budget

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
            last_completed_step=self._last_completed,
            ended=dict(sorted(self._ended.items())),
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
            incidents_first=len(self._first_rows),
            incidents_by_rank=dict(sorted(self._incidents_by_rank.items())),
            run_id=run_ids[-1] if len(run_ids) == 1 else None,
            runs=runs,
            overhead=self._overhead,
            overhead_budget=self._overhead_budget,
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


class _RunState:
    __slots__ = ("events", "name", "ranks", "started_ns")

    def __init__(self, name: str, started_ns: int | None) -> None:
        self.name = name
        self.started_ns = started_ns
        self.ranks: set[int] = set()
        self.events = 0
