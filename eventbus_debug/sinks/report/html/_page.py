"""The page: its head (the Content-Security-Policy, the stylesheet) and its layout, section by
section, in :func:`render_html`."""

from __future__ import annotations

from typing import Final

from ..summary import RunSummary
from ._charts import _chart, _heatmap
from ._format import _bytes, _duration, _e, _int, _is_number, _num, _pct, _time
from ._sections import (
    _card,
    _counts,
    _ended_banner,
    _incident_table,
    _kv_table,
    _overhead_card,
    _ranks_section,
    _recovery_chain,
    _runs_section,
    _stat_row,
)

CONTENT_SECURITY_POLICY: Final = (
    "default-src 'none'; style-src 'unsafe-inline'; img-src data:; "
    "base-uri 'none'; form-action 'none'"
)
"""The policy the page declares: inline CSS only; no script, frame, form target or fetch."""

_CSS: Final = """
:root { --fg:#1f2933; --muted:#616e7c; --line:#2563eb; --bad:#dc2626; --warn:#d97706;
        --ok:#059669; --bg:#f8fafc; --card:#ffffff; --grid:#e4e7eb; }
* { box-sizing: border-box; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif;
       color: var(--fg); background: var(--bg); margin: 0; padding: 24px 32px; }
h1 { font-size: 22px; margin: 0 0 4px; } h2 { font-size: 17px; margin: 28px 0 10px; }
.sub { color: var(--muted); margin-bottom: 18px; }
.cards { display: grid; grid-template-columns: repeat(auto-fill, minmax(170px, 1fr)); gap: 10px; }
.card { background: var(--card); border: 1px solid var(--grid); border-radius: 8px; padding: 10px 12px; }
.card .v { font-size: 20px; font-weight: 600; } .card .l { color: var(--muted); font-size: 12px; }
.card.bad .v { color: var(--bad); } .card.warn .v { color: var(--warn); } .card.ok .v { color: var(--ok); }
figure { background: var(--card); border: 1px solid var(--grid); border-radius: 8px;
         margin: 0 0 14px; padding: 8px 8px 2px; }
figcaption { font-weight: 600; margin: 2px 6px 4px; }
svg.chart { width: 100%; height: auto; display: block; }
svg text { font: 11px system-ui, sans-serif; fill: var(--muted); }
.empty { color: var(--muted); padding: 20px; }
table { border-collapse: collapse; background: var(--card); width: 100%; margin-bottom: 10px; }
th, td { border-bottom: 1px solid var(--grid); padding: 5px 8px; text-align: left; vertical-align: top; }
th { background: #eef2f6; font-weight: 600; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
.sev-error, .sev-critical { color: var(--bad); font-weight: 600; } .sev-warning { color: var(--warn); }
.grid2 { display: grid; grid-template-columns: 1fr 1fr; gap: 14px; }
.legend span { margin-right: 14px; color: var(--muted); font-size: 12px; }
.note { color: var(--muted); font-size: 12px; }
.banner { background: #fff7ed; border: 1px solid #fdba74; border-radius: 8px; padding: 8px 12px;
          margin: 0 0 14px; }
.heat text.layer { font: 10px ui-monospace, monospace; fill: var(--fg); }
tr:target { background: #fef9c3; }
a.link { color: var(--line); text-decoration: none; white-space: nowrap; }
code.rid { font-size: 12px; }
"""


def render_html(
    summary: RunSummary, /, *, title: str = "eventbus-debug report", generated_ns: int | None = None
) -> str:
    """Render *summary* as one self-contained HTML document (inline CSS and SVG, no script).

    Every string taken from the summary is escaped; the page forbids scripts and network
    loads with a Content-Security-Policy (:data:`CONTENT_SECURITY_POLICY`).

    Args:
        summary: the run summary to show.
        title: the page title.
        generated_ns: when the page was written (shown in the header; omitted when ``None``).
    """
    s = summary
    anomaly_markers = [m for m in s.markers if not m.recovery]
    all_markers = list(s.markers)
    recovery_total = sum(s.recovery_decisions.values())
    m = s.memory
    latest = s.latest
    several = isinstance(s.ranks, tuple) and len(s.ranks) > 1
    cards = [
        _card("steps", f"{s.steps:,}" if _is_number(s.steps) else str(s.steps)),
        _card("run time", _duration(s.duration_s)),
        _card("steps / s", _num(s.steps_per_s, 3)),
        *_overhead_card(s),
        _card(
            "anomalous steps",
            f"{s.anomaly_steps} ({_pct(s.anomaly_rate)})",
            "bad" if s.anomaly_steps else "ok",
        ),
        _card("non-finite", str(s.non_finite), "bad" if s.non_finite else "ok"),
        _card(
            "gradient explosions",
            str(s.gradient_explosions),
            "warn" if s.gradient_explosions else "ok",
        ),
        _card(
            "vanishing gradients",
            str(s.gradient_vanishings),
            "warn" if s.gradient_vanishings else "ok",
        ),
        _card("loss anomalies", str(s.loss_anomalies), "warn" if s.loss_anomalies else "ok"),
        _card("recovery decisions", str(recovery_total), "warn" if recovery_total else ""),
        _card(
            "errors",
            str(sum(s.errors_by_category.values())),
            "bad" if s.errors_by_category else "ok",
        ),
        _card("last learning rate", _num(latest.learning_rate, 3), card_id="card-lr"),
        _card(
            "last samples / s, all ranks" if several else "last samples / s",
            _num(latest.samples_per_s, 4),
            card_id="card-throughput",
        ),
        _card("peak RSS", _bytes(m.peak_rss_bytes)),
        _card("peak CUDA allocated", _bytes(m.peak_cuda_allocated_bytes), card_id="card-cuda-peak"),
        _card(
            "telemetry shed",
            str(sum(s.sinks.dropped.values())),
            "warn" if s.sinks.dropped else "ok",
        ),
    ]
    generated = f" · written {_time(generated_ns)}" if generated_ns is not None else ""
    ranks = ", ".join(_int(r) for r in s.ranks) or "–"
    run = f" · run <code class='rid' id='run-id'>{_e(s.run_id)}</code>" if s.run_id else ""
    last = s.last_completed_step if s.last_completed_step is not None else s.last_step
    header = (
        f"<h1>{_e(title)}</h1><div class='sub'>{_time(s.started_ns)} → {_time(s.ended_ns)} · "
        f"steps {_int(s.first_step)}–{_int(last)} · ranks {ranks} · "
        f"{_int(s.events)} events{run}{generated}</div>"
    )
    mean = ", mean over the ranks" if several else ""
    training = [
        _chart("chart-loss", f"Loss{mean}", s.loss, all_markers, over_ranks=several),
        _chart(
            "chart-grad-norm",
            f"Gradient norm{mean}",
            s.grad_norm,
            all_markers,
            over_ranks=several,
        ),
        _chart(
            "chart-lr",
            f"Learning rate{mean}",
            s.learning_rate,
            all_markers,
            fmt=lambda v: _num(v, 3),
            empty="no learning rate in the run (StepCompleted.learning_rate)",
            over_ranks=several,
        ),
    ]
    throughput = [
        _chart(
            "chart-throughput",
            "Throughput (samples / s, summed over the ranks)"
            if several
            else "Throughput (samples / s)",
            s.samples_per_s,
            anomaly_markers,
            log=False,
            empty="no throughput in the run (StepCompleted.samples_per_s)",
        ),
        _chart(
            "chart-step-time",
            f"Step duration (s{mean})",
            s.step_duration_s,
            anomaly_markers,
            empty="no step durations in the run (StepCompleted.duration_s)",
            over_ranks=several,
        ),
    ]
    memory = [
        _chart(
            "chart-memory",
            f"Process memory (RSS, MiB{mean})",
            s.rss_bytes,
            anomaly_markers,
            scale=1 / (1024 * 1024),
            fmt=lambda v: _num(v, 4),
            log=False,
            empty="no memory samples (MemorySampled) in the run",
            over_ranks=several,
        ),
    ]
    mib = 1 / (1024 * 1024)
    for chart_id, chart_title, points, scale in (
        ("chart-cuda", "CUDA memory allocated (MiB)", s.cuda_allocated_bytes, mib),
        ("chart-cuda-reserved", "CUDA memory reserved (MiB)", s.cuda_reserved_bytes, mib),
        ("chart-host-memory", "Host memory used (%)", s.host_memory_percent, 1.0),
    ):
        if points:  # only the runs that sampled them
            memory.append(
                _chart(chart_id, chart_title, points, anomaly_markers, scale=scale, log=False)
            )
    memory_rows = [
        ("samples", str(m.samples)),
        ("first RSS", _bytes(m.first_rss_bytes)),
        ("last RSS", _bytes(m.last_rss_bytes)),
        ("peak RSS", _bytes(m.peak_rss_bytes)),
        (
            "RSS trend",
            "–"
            if m.rss_trend_bytes_per_step is None
            else f"{_bytes(m.rss_trend_bytes_per_step)} / step",
        ),
        ("peak CUDA allocated", _bytes(m.peak_cuda_allocated_bytes)),
        ("peak CUDA reserved", _bytes(m.peak_cuda_reserved_bytes)),
        ("CUDA OOMs", "–" if m.cuda_ooms is None else str(m.cuda_ooms)),
    ]
    sy = s.system
    system = (
        f"<table id='system'><thead><tr><th>metric ({_int(sy.samples)} samples over "
        f"{_duration(sy.span_s)})</th><th>mean</th><th>min</th><th>max</th></tr></thead><tbody>"
        + _stat_row("CPU", sy.cpu_percent)
        + _stat_row("memory", sy.memory_percent)
        + _stat_row("disk", sy.disk_percent)
        + _stat_row("GPU utilization", sy.gpu_utilization)
        + _stat_row("GPU memory", sy.gpu_memory_percent)
        + "</tbody></table>"
    )
    sinks_rows = [
        *((f"{k}: telemetry shed", str(v)) for k, v in s.sinks.dropped.items()),
        *((f"{k}: lost at close", str(v)) for k, v in s.sinks.undelivered.items()),
        *((f"{k}: failures", str(v)) for k, v in s.sinks.failures.items()),
        *((f"{k}: disabled", "yes") for k in s.sinks.disabled),
    ]
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        f'<meta http-equiv="Content-Security-Policy" content="{CONTENT_SECURITY_POLICY}">',
        "<meta name='referrer' content='no-referrer'>",
        "<meta name='viewport' content='width=device-width, initial-scale=1'>",
        f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>",
        header,
        _ended_banner(s),
        _runs_section(s),
        f"<div class='cards' id='cards'>{''.join(cards)}</div>",
        _ranks_section(s) if several else "",
        "<h2>Training curves</h2>",
        *training,
        "<h2 id='throughput'>Throughput</h2>",
        *throughput,
        "<h2 id='layers'>Per layer</h2>",
        _heatmap(
            "heat-grad-norms",
            "Gradient norm per layer (log10 of the bucket mean)",
            s.layer_grad_norms,
            s.layers_omitted,
        ),
        _heatmap(
            "heat-update-ratios",
            "Update ratio ‖Δw‖/‖w‖ per layer (log10 of the bucket mean)",
            s.update_ratios,
            s.layers_omitted,
        ),
        "<h2>Incidents</h2>",
        _incident_table(s.incidents, s.incidents_total, s.incidents_first),
        "<h2 id='recovery'>Recovery: incident → decision → action</h2>",
        _recovery_chain(s.incidents),
        "<div class='grid2'><div><h2>Anomalies by kind</h2>",
        _kv_table("anomalies-by-kind", ("kind", "count"), _counts(s.anomalies_by_kind)),
        "<h2>Recovery</h2>",
        _kv_table("recovery-decisions", ("decided action", "count"), _counts(s.recovery_decisions)),
        _kv_table("recovery-outcomes", ("action: outcome", "count"), _counts(s.recovery_outcomes)),
        _kv_table("skipped", ("", ""), [("optimizer steps skipped", str(s.steps_skipped))]),
        "<h2>Errors by category</h2>",
        _kv_table("errors", ("category", "count"), _counts(s.errors_by_category)),
        "</div><div><h2>Memory</h2>",
        _kv_table("memory", ("", ""), memory_rows),
        "<h2>System</h2>",
        system,
        "<h2>Sinks</h2>",
        _kv_table("sinks", ("sink", "count"), sinks_rows),
        "</div></div>",
        "<h2 id='memory-charts'>Memory over the run</h2>",
        *memory,
        "<h2>Events by kind</h2>",
        _kv_table("events-by-kind", ("kind", "count"), _counts(s.counts_by_kind)),
        _kv_table(
            "events-by-severity",
            ("severity", "count"),
            [(k, str(v)) for k, v in s.counts_by_severity.items()],
        ),
        "<p class='note'>Generated by eventbus-debug. Rebuild it from the log with "
        "<code>eventbus-debug report LOGDIR</code>.</p>",
        "</body></html>\n",
    ]
    return "".join(parts)
