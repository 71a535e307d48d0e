"""A self-contained HTML page for a :class:`~sinks.report_summary.RunSummary`.

Plots are inline SVG drawn here (no script, no stylesheet or font from the network), so the
page opens from a file on an air-gapped cluster. NaN and infinite values never break a plot:
they appear as gaps in the line and as red crosses at the top of the chart.
"""

from __future__ import annotations

import datetime as _dt
import html
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Final

from .report_summary import IncidentRow, Marker, RunSummary, SeriesPoint, Stat

__all__ = ("render_html",)

_W: Final = 960
_H: Final = 260
_ML: Final = 72
_MR: Final = 16
_MT: Final = 22
_MB: Final = 34

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
"""


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _num(value: float | None, digits: int = 4) -> str:
    if value is None:
        return "–"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return f"{value:.{digits}g}"


def _bytes(value: float | None) -> str:
    if value is None:
        return "–"
    v = float(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(v) < 1024 or unit == "TiB":
            return f"{v:.1f} {unit}" if unit != "B" else f"{int(v)} B"
        v /= 1024
    return f"{v:.1f} TiB"  # pragma: no cover


def _pct(value: float) -> str:
    return f"{value * 100:.2f} %"


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, sec = divmod(seconds, 60)
    if minutes < 60:
        return f"{int(minutes)} min {sec:.0f} s"
    hours, minutes = divmod(minutes, 60)
    return f"{int(hours)} h {int(minutes)} min"


def _time(ns: int | None) -> str:
    if ns is None:
        return "–"
    return _dt.datetime.fromtimestamp(ns / 1e9, tz=_dt.timezone.utc).strftime(
        "%Y-%m-%d %H:%M:%S UTC"
    )


def _nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = min((m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw), default=10 * mag)
    start = math.ceil(lo / step) * step
    ticks: list[float] = []
    t = start
    while t <= hi + step * 1e-9 and len(ticks) < 20:
        ticks.append(round(t, 12))
        t += step
    return ticks


def _chart(
    chart_id: str,
    title: str,
    points: Sequence[SeriesPoint],
    markers: Sequence[Marker],
    *,
    fmt: Callable[[float], str] = lambda v: _num(v, 3),
    scale: float = 1.0,
    log: bool | None = None,
) -> str:
    """One SVG line chart: bucket means as a line (gaps where no finite value), the min–max
    band of each bucket, anomaly markers (red dashed lines), recovery markers (green
    triangles), non-finite buckets (red crosses at the top)."""
    finite = [p for p in points if p.mean is not None]
    if not points:
        return (
            f'<figure id="{chart_id}"><figcaption>{_e(title)}</figcaption>'
            '<div class="empty">no data for this chart in the run</div></figure>'
        )
    values = [v * scale for p in finite for v in (p.min, p.max) if v is not None]
    if log is None:
        log = bool(values) and min(values) > 0 and max(values) / min(values) > 1e3
    if log and values and min(values) <= 0:
        log = False

    def tr(v: float) -> float:
        return math.log10(v) if log else v

    lo = min((tr(v) for v in values), default=0.0)
    hi = max((tr(v) for v in values), default=1.0)
    if hi - lo < 1e-12:
        pad = abs(hi) * 0.1 or 1.0
        lo, hi = lo - pad, hi + pad
    else:
        pad = (hi - lo) * 0.05
        lo, hi = lo - pad, hi + pad
    s_lo = points[0].step
    s_hi = max(p.step for p in points)
    for m in markers:
        s_lo, s_hi = min(s_lo, m.step), max(s_hi, m.step)
    if s_hi == s_lo:
        s_hi = s_lo + 1
    pw, ph = _W - _ML - _MR, _H - _MT - _MB

    def x(step: float) -> float:
        return _ML + (step - s_lo) / (s_hi - s_lo) * pw

    def y(v: float) -> float:
        return _MT + (1 - (tr(v * scale) - lo) / (hi - lo)) * ph

    out = [
        f'<figure id="{chart_id}"><figcaption>{_e(title)}</figcaption>',
        f'<svg class="chart" viewBox="0 0 {_W} {_H}" xmlns="http://www.w3.org/2000/svg" '
        f'role="img" aria-label="{_e(title)}">',
        f'<rect x="{_ML}" y="{_MT}" width="{pw}" height="{ph}" fill="#fff" stroke="#cbd2d9"/>',
    ]
    # y grid and labels
    if log:
        yt = [10.0**k for k in range(math.floor(lo), math.ceil(hi) + 1)]
        yt = [t for t in yt if lo <= math.log10(t) <= hi]
    else:
        yt = _nice_ticks(lo, hi)
    for t in yt:
        yy = (
            _MT + (1 - (math.log10(t) - lo) / (hi - lo)) * ph
            if log
            else _MT + (1 - (t - lo) / (hi - lo)) * ph
        )
        if _MT - 0.5 <= yy <= _MT + ph + 0.5:
            out.append(
                f'<line x1="{_ML}" x2="{_ML + pw}" y1="{yy:.1f}" y2="{yy:.1f}" stroke="#e4e7eb"/>'
            )
            out.append(
                f'<text x="{_ML - 6}" y="{yy + 4:.1f}" text-anchor="end">{_e(fmt(t))}</text>'
            )
    for t in _nice_ticks(float(s_lo), float(s_hi), 8):
        if s_lo <= t <= s_hi:
            xx = x(t)
            out.append(
                f'<line x1="{xx:.1f}" x2="{xx:.1f}" y1="{_MT + ph}" y2="{_MT + ph + 4}" stroke="#9aa5b1"/>'
            )
            out.append(
                f'<text x="{xx:.1f}" y="{_MT + ph + 16}" text-anchor="middle">{int(t)}</text>'
            )
    out.append(f'<text x="{_ML + pw / 2:.1f}" y="{_H - 4}" text-anchor="middle">step</text>')
    # min-max band
    for p in finite:
        if p.min is not None and p.max is not None and p.max > p.min:
            xx = x(p.step)
            out.append(
                f'<line x1="{xx:.1f}" x2="{xx:.1f}" y1="{y(p.max):.1f}" y2="{y(p.min):.1f}" '
                'stroke="#93c5fd" stroke-width="2" opacity="0.6"/>'
            )
    # the line, broken at buckets without a finite value
    segments: list[list[str]] = [[]]
    for p in points:
        if p.mean is None:
            if segments[-1]:
                segments.append([])
            continue
        segments[-1].append(f"{x(p.step):.1f},{y(p.mean):.1f}")
    for seg in segments:
        if len(seg) > 1:
            out.append(
                f'<polyline class="series" fill="none" stroke="#2563eb" stroke-width="1.6" '
                f'points="{" ".join(seg)}"/>'
            )
        elif len(seg) == 1:
            cx, cy = seg[0].split(",")
            out.append(f'<circle class="series" cx="{cx}" cy="{cy}" r="2.5" fill="#2563eb"/>')
    # anomaly and recovery markers, merged per pixel column so a burst stays readable
    columns: dict[tuple[bool, int], list[Marker]] = {}
    for m in markers:
        columns.setdefault((m.recovery, round(x(m.step))), []).append(m)
    anomaly_columns = sum(1 for recovery, _ in columns if not recovery)
    dense = anomaly_columns > 60  # full-height lines would hide the curve: draw ticks
    for (recovery, _), group in sorted(columns.items(), key=lambda kv: kv[0][1]):
        xx = x(group[0].step)
        labels = sorted({m.label if recovery else m.kind for m in group})
        steps = sorted({m.step for m in group})
        where = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}–{steps[-1]}"
        tip = f"{where}: {'recovery ' if recovery else ''}{', '.join(labels)}"
        if recovery:
            out.append(
                f'<path class="marker-recovery" d="M{xx:.1f},{_MT + ph - 10:.1f} l-5,9 h10 z" '
                f'fill="#059669"><title>{_e(tip)}</title></path>'
            )
        else:
            y2 = _MT + 14 if dense else _MT + ph
            out.append(
                f'<line class="marker-anomaly" x1="{xx:.1f}" x2="{xx:.1f}" y1="{_MT}" '
                f'y2="{y2}" stroke="#dc2626" stroke-dasharray="{"none" if dense else "4 3"}" '
                f'stroke-width="{2 if dense else 1}" opacity="0.7"><title>{_e(tip)}</title></line>'
            )
    # non-finite values
    for p in points:
        if p.nonfinite:
            xx = x(p.step)
            yy = _MT + 8
            out.append(
                f'<g class="marker-nonfinite"><title>step {p.step}: {p.nonfinite} non-finite '
                f'value(s)</title><path d="M{xx - 5:.1f},{yy - 5:.1f} l10,10 M{xx + 5:.1f},'
                f'{yy - 5:.1f} l-10,10" stroke="#dc2626" stroke-width="2.2"/></g>'
            )
    out.append("</svg>")
    stride = ""
    if len(points) > 1 and any(p.count > 1 for p in points):
        stride = " · each point is the mean of a bucket of steps; the bar shows its min–max"
    scale_note = " · log scale" if log else ""
    out.append(
        '<div class="legend"><span style="color:#2563eb">━ value</span>'
        '<span style="color:#dc2626">┆ anomaly</span><span style="color:#059669">▲ recovery</span>'
        f'<span style="color:#dc2626">✕ NaN/Inf</span><span>{stride}{scale_note}</span></div>'
    )
    out.append("</figure>")
    return "".join(out)


def _card(label: str, value: str, cls: str = "") -> str:
    return f'<div class="card {cls}"><div class="v">{_e(value)}</div><div class="l">{_e(label)}</div></div>'


def _kv_table(table_id: str, header: tuple[str, str], rows: Iterable[tuple[str, str]]) -> str:
    body = "".join(f"<tr><td>{_e(k)}</td><td class='num'>{_e(v)}</td></tr>" for k, v in rows)
    if not body:
        body = "<tr><td colspan='2' class='note'>none</td></tr>"
    return (
        f'<table id="{table_id}"><thead><tr><th>{_e(header[0])}</th><th>{_e(header[1])}</th>'
        f"</tr></thead><tbody>{body}</tbody></table>"
    )


def _counts(mapping: Mapping[str, int]) -> list[tuple[str, str]]:
    return [(k, str(v)) for k, v in sorted(mapping.items(), key=lambda kv: (-kv[1], kv[0]))]


def _stat_row(name: str, stat: Stat, unit: str = " %") -> str:
    if not stat.samples:
        return f"<tr><td>{_e(name)}</td><td colspan='3' class='note'>not sampled</td></tr>"
    return (
        f"<tr><td>{_e(name)}</td><td class='num'>{_num(stat.mean, 3)}{unit}</td>"
        f"<td class='num'>{_num(stat.min, 3)}{unit}</td><td class='num'>{_num(stat.max, 3)}{unit}</td></tr>"
    )


def _incident_table(rows: Sequence[IncidentRow], total: int) -> str:
    body = []
    for r in reversed(rows):
        body.append(
            f"<tr><td class='num'>{_e(r.step if r.step is not None else '–')}</td>"
            f"<td class='num'>{r.rank}</td><td class='sev-{_e(r.severity)}'>{_e(r.severity)}</td>"
            f"<td>{_e(r.kind)}</td><td>{_e(r.message)}</td><td>{_e(r.source)}</td>"
            f"<td class='num'>{r.seq}</td></tr>"
        )
    if not body:
        body.append("<tr><td colspan='7' class='note'>no incident: a quiet run</td></tr>")
    note = ""
    if total > len(rows):
        note = f"<p class='note'>showing the {len(rows)} most recent of {total} incidents</p>"
    return (
        f"{note}<table id='incidents'><thead><tr><th>step</th><th>rank</th><th>severity</th>"
        "<th>kind</th><th>what happened</th><th>source</th><th>seq</th></tr></thead>"
        f"<tbody>{''.join(body)}</tbody></table>"
    )


def render_html(
    summary: RunSummary, /, *, title: str = "eventbus-debug report", generated_ns: int | None = None
) -> str:
    """Render *summary* as one self-contained HTML document (inline CSS and SVG, no script).

    Args:
        summary: the run summary to show.
        title: the page title.
        generated_ns: when the page was written (shown in the header; omitted when ``None``).
    """
    s = summary
    anomaly_markers = [m for m in s.markers if not m.recovery]
    all_markers = list(s.markers)
    recovery_total = sum(s.recovery_decisions.values())
    cards = [
        _card("steps", f"{s.steps:,}"),
        _card("run time", _duration(s.duration_s)),
        _card("steps / s", _num(s.steps_per_s, 3)),
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
        _card("peak RSS", _bytes(s.memory.peak_rss_bytes)),
        _card(
            "telemetry shed",
            str(sum(s.sinks.dropped.values())),
            "warn" if s.sinks.dropped else "ok",
        ),
    ]
    generated = f" · written {_time(generated_ns)}" if generated_ns is not None else ""
    ranks = ", ".join(str(r) for r in s.ranks) or "–"
    header = (
        f"<h1>{_e(title)}</h1><div class='sub'>{_time(s.started_ns)} → {_time(s.ended_ns)} · "
        f"steps {_e(s.first_step if s.first_step is not None else '–')}–"
        f"{_e(s.last_step if s.last_step is not None else '–')} · ranks {ranks} · "
        f"{s.events:,} events{generated}</div>"
    )
    memory_points = s.rss_bytes
    charts = [
        _chart("chart-loss", "Loss", s.loss, all_markers),
        _chart("chart-grad-norm", "Gradient norm", s.grad_norm, all_markers),
        _chart(
            "chart-memory",
            "Process memory (RSS, MiB)",
            memory_points,
            anomaly_markers,
            scale=1 / (1024 * 1024),
            fmt=lambda v: _num(v, 4),
            log=False,
        ),
    ]
    if s.cuda_allocated_bytes:
        charts.append(
            _chart(
                "chart-cuda",
                "CUDA memory allocated (MiB)",
                s.cuda_allocated_bytes,
                anomaly_markers,
                scale=1 / (1024 * 1024),
                log=False,
            )
        )
    m = s.memory
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
        f"<table id='system'><thead><tr><th>metric ({sy.samples} samples over "
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
        "<meta name='viewport' content='width=device-width, initial-scale=1'>",
        f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>",
        header,
        f"<div class='cards' id='cards'>{''.join(cards)}</div>",
        "<h2>Training curves</h2>",
        *charts,
        "<h2>Incidents</h2>",
        _incident_table(s.incidents, s.incidents_total),
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
