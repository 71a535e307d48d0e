"""The debug server's ``/metrics``: Prometheus families built from the run summary at each
scrape (events, incidents, anomalies, steps, recovery decisions, drops, the latest values,
memory peaks, the debug level, the requests refused)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .report import RunSummary


class _Scraped(Protocol):
    """The server, as its collector sees it: the summary, the level, the refusals."""

    @property
    def refused(self) -> Mapping[str, int]: ...

    def _summary_now(self) -> RunSummary: ...

    def _current_level(self) -> str | None: ...


class _Metrics(Collector):
    """Builds the Prometheus families from the current summary at each scrape."""

    def __init__(self, server: _Scraped) -> None:
        self.server = server

    def collect(self) -> Iterator[Metric]:
        server = self.server
        s = server._summary_now()
        yield _labelled(
            CounterMetricFamily,
            "eventbus_debug_events",
            "Events received, by kind.",
            "kind",
            s.counts_by_kind,
        )
        yield _labelled(
            CounterMetricFamily,
            "eventbus_debug_anomalies",
            "Anomaly incidents, by kind.",
            "kind",
            s.anomalies_by_kind,
        )
        yield _labelled(
            CounterMetricFamily,
            "eventbus_debug_recovery_decisions",
            "Recovery decisions, by action.",
            "action",
            s.recovery_decisions,
        )
        yield _labelled(
            CounterMetricFamily,
            "eventbus_debug_events_dropped",
            "Telemetry shed by a subscriber's full queue, by sink.",
            "sink",
            s.sinks.dropped,
        )
        yield _labelled(
            CounterMetricFamily,
            "eventbus_debug_events_undelivered",
            "Events lost at close, by sink.",
            "sink",
            s.sinks.undelivered,
        )
        yield _labelled(
            CounterMetricFamily,
            "eventbus_debug_http_refused",
            "Requests this server refused, by reason.",
            "reason",
            server.refused,
        )
        for name, doc, value in (
            (
                "eventbus_debug_incidents",
                "Incidents (anomalies, errors, decisions, ...).",
                s.incidents_total,
            ),
            ("eventbus_debug_steps", "Training steps completed (else checked).", s.steps),
            ("eventbus_debug_anomalous_steps", "Steps with at least one anomaly.", s.anomaly_steps),
            ("eventbus_debug_steps_skipped", "Optimizer steps skipped.", s.steps_skipped),
        ):
            yield CounterMetricFamily(name, doc, value=float(value))
        latest, memory = s.latest, s.memory
        for name, doc, gauge in (
            ("eventbus_debug_last_step", "The most recent step.", latest.step),
            ("eventbus_debug_loss", "The most recent loss.", latest.loss),
            ("eventbus_debug_grad_norm", "The most recent total gradient norm.", latest.grad_norm),
            (
                "eventbus_debug_learning_rate",
                "The most recent learning rate.",
                latest.learning_rate,
            ),
            (
                "eventbus_debug_samples_per_second",
                "The most recent throughput.",
                latest.samples_per_s,
            ),
            (
                "eventbus_debug_step_duration_seconds",
                "The most recent step duration.",
                latest.step_duration_s,
            ),
            ("eventbus_debug_rss_bytes_peak", "Peak resident set size.", memory.peak_rss_bytes),
            ("eventbus_debug_rss_bytes", "Last resident set size.", memory.last_rss_bytes),
            (
                "eventbus_debug_cuda_allocated_bytes_peak",
                "Peak CUDA memory allocated.",
                memory.peak_cuda_allocated_bytes,
            ),
        ):
            if gauge is not None:
                yield GaugeMetricFamily(name, doc, value=float(gauge))
        level = server._current_level()
        if level is not None:
            info = GaugeMetricFamily(
                "eventbus_debug_level",
                "The probes' debug level (1 for the current one).",
                labels=["level"],
            )
            info.add_metric([level], 1.0)
            yield info
        if s.run_id:
            run = GaugeMetricFamily(
                "eventbus_debug_run", "The run this server reports on.", labels=["run_id"]
            )
            run.add_metric([s.run_id], 1.0)
            yield run


def _labelled(
    family: type[CounterMetricFamily],
    name: str,
    doc: str,
    label: str,
    values: Mapping[str, int],
) -> Metric:
    metric = family(name, doc, labels=[label])
    for key, value in sorted(values.items()):
        metric.add_metric([str(key)], float(value))
    return metric
