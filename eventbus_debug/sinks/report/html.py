"""A self-contained HTML page for a :class:`~sinks.report_summary.RunSummary`.

Plots are inline SVG drawn here (no script, no stylesheet or font from the network), so the
page opens from a file on an air-gapped cluster. NaN and infinite values never break a plot:
they appear as gaps in the line and as red crosses at the top of the chart.

Everything in the page that the renderer did not write itself comes from events, and events
come from a log anyone could have crafted: kinds, reasons, names, messages, sources, layer
and parameter names, even fields declared as numbers (a log is untrusted input). Every such
value goes through :func:`_e` (HTML-escaped, quotes included) or is formatted as a number by
code here; identifiers in ``id``/``href`` attributes are reduced to ``[A-Za-z0-9_-]``; no
value ever lands in a URL, a ``style`` or an event-handler attribute. As a second line of
defence the page declares a Content-Security-Policy that forbids every script and every
network load, so markup injected by a future bug still could not run.
"""

from __future__ import annotations

import datetime as _dt
import html
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Final

from .summary import IncidentRow, LayerSeries, Marker, RunInfo, RunSummary, SeriesPoint, Stat

__all__ = ("CONTENT_SECURITY_POLICY", "render_html")

CONTENT_SECURITY_POLICY: Final = (
    "default-src 'none'; style-src 'unsafe-inline'; img-src data:; "
    "base-uri 'none'; form-action 'none'"
)
"""The policy the page declares: inline CSS only; no script, frame, form target or fetch."""

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
.banner { background: #fff7ed; border: 1px solid #fdba74; border-radius: 8px; padding: 8px 12px;
          margin: 0 0 14px; }
.heat text.layer { font: 10px ui-monospace, monospace; fill: var(--fg); }
tr:target { background: #fef9c3; }
a.link { color: var(--line); text-decoration: none; white-space: nowrap; }
code.rid { font-size: 12px; }
"""

_SLUG_RE: Final = re.compile(r"[^A-Za-z0-9_-]")


def _e(text: object) -> str:
    """*text* as HTML text or a quoted attribute value: ``& < > " '`` escaped."""
    return html.escape(str(text), quote=True)


def _slug(value: object) -> str:
    """*value* reduced to ``[A-Za-z0-9_-]``: safe in ``id`` and ``href="#..."``."""
    return _SLUG_RE.sub("_", str(value))[:80]


def _anchor(rank: object, seq: object) -> str:
    return f"ev-{_slug(rank)}-{_slug(seq)}"


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _num(value: float | None, digits: int = 4) -> str:
    if value is None:
        return "–"
    if not _is_number(value):
        return _e(value)  # a crafted log can put anything in a numeric field
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return f"{value:.{digits}g}"


def _int(value: object) -> str:
    """An integer field as text (escaped when a crafted log put something else there)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return "–" if value is None else _e(value)


def _bytes(value: float | None) -> str:
    if value is None:
        return "–"
    if not _is_number(value):
        return _e(value)
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
    empty: str = "no data for this chart in the run",
    over_ranks: bool = False,
) -> str:
    """One SVG line chart: bucket means as a line (gaps where no finite value), the min–max
    band of each bucket, anomaly markers (red dashed lines), recovery markers (green
    triangles), non-finite buckets (red crosses at the top). *over_ranks*: the points hold
    the values of several ranks (the legend says the line is their mean)."""
    finite = [p for p in points if p.mean is not None]
    if not points:
        return (
            f'<figure id="{chart_id}"><figcaption>{_e(title)}</figcaption>'
            f'<div class="empty">{_e(empty)}</div></figure>'
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
                f'<g class="marker-nonfinite"><title>step {_int(p.step)}: {_int(p.nonfinite)} '
                f'non-finite value(s)</title><path d="M{xx - 5:.1f},{yy - 5:.1f} l10,10 M{xx + 5:.1f},'
                f'{yy - 5:.1f} l-10,10" stroke="#dc2626" stroke-width="2.2"/></g>'
            )
    out.append("</svg>")
    stride = ""
    if over_ranks:
        stride = (
            " · each point is the mean over the ranks (and over a bucket of steps on a long "
            "run); the bar shows their min–max"
        )
    elif len(points) > 1 and any(p.count > 1 for p in points):
        stride = " · each point is the mean of a bucket of steps; the bar shows its min–max"
    scale_note = " · log scale" if log else ""
    out.append(
        '<div class="legend"><span style="color:#2563eb">━ value</span>'
        '<span style="color:#dc2626">┆ anomaly</span><span style="color:#059669">▲ recovery</span>'
        f'<span style="color:#dc2626">✕ NaN/Inf</span><span>{stride}{scale_note}</span></div>'
    )
    out.append("</figure>")
    return "".join(out)


def _overhead_card(s: RunSummary) -> list[str]:
    """The debugger's measured cost per step, beside its budget (no card when unmeasured)."""
    if s.overhead is None:
        return []
    over = s.overhead_budget is not None and s.overhead > s.overhead_budget
    label = "debugger overhead" + (
        f" (budget {_pct(s.overhead_budget)})" if s.overhead_budget is not None else ""
    )
    return [_card(label, _pct(s.overhead), "warn" if over else "ok", card_id="overhead")]


def _card(label: str, value: str, cls: str = "", card_id: str = "") -> str:
    ident = f' id="{_slug(card_id)}"' if card_id else ""
    return (
        f'<div class="card {_slug(cls)}"{ident}><div class="v">{_e(value)}</div>'
        f'<div class="l">{_e(label)}</div></div>'
    )


def _kv_table(table_id: str, header: tuple[str, str], rows: Iterable[tuple[str, str]]) -> str:
    body = "".join(f"<tr><td>{_e(k)}</td><td class='num'>{_e(v)}</td></tr>" for k, v in rows)
    if not body:
        body = "<tr><td colspan='2' class='note'>none</td></tr>"
    return (
        f'<table id="{_slug(table_id)}"><thead><tr><th>{_e(header[0])}</th><th>{_e(header[1])}</th>'
        f"</tr></thead><tbody>{body}</tbody></table>"
    )


def _counts(mapping: Mapping[str, int]) -> list[tuple[str, str]]:
    return [(k, str(v)) for k, v in sorted(mapping.items(), key=lambda kv: (-kv[1], str(kv[0])))]


def _stat_row(name: str, stat: Stat, unit: str = " %") -> str:
    if not stat.samples:
        return f"<tr><td>{_e(name)}</td><td colspan='3' class='note'>not sampled</td></tr>"
    return (
        f"<tr><td>{_e(name)}</td><td class='num'>{_num(stat.mean, 3)}{unit}</td>"
        f"<td class='num'>{_num(stat.min, 3)}{unit}</td><td class='num'>{_num(stat.max, 3)}{unit}</td></tr>"
    )


def _ref(rank: int, seq: int, rows: Mapping[tuple[int, int], IncidentRow]) -> str:
    """A link to the row of event *seq* on *rank* (plain text when that row left the table)."""
    row = rows.get((rank, seq))
    what = f" {_e(row.kind)}" if row is not None else ""
    if row is None:
        return f"<span class='note'>#{_int(seq)} (no longer listed)</span>"
    return f"<a class='link' href='#{_anchor(rank, seq)}'>#{_int(seq)}{what}</a>"


def _ranks(row: IncidentRow) -> str:
    """The ranks that had the incident of *row*, e.g. ``0, 1``."""
    ranks = row.ranks if isinstance(row.ranks, tuple) and row.ranks else (row.rank,)
    return ", ".join(_int(k) for k in ranks)


def _rank_header(rows: Sequence[IncidentRow]) -> str:
    return "ranks" if any(len(r.ranks) > 1 for r in rows) else "rank"


def _incident_table(rows: Sequence[IncidentRow], total: int) -> str:
    by_key = {(r.rank, r.seq): r for r in rows}
    body = []
    for r in reversed(rows):
        caused = "" if r.caused_by is None else _ref(r.rank, r.caused_by, by_key)
        led = " ".join(_ref(r.rank, seq, by_key) for seq in r.led_to)
        body.append(
            f"<tr id='{_anchor(r.rank, r.seq)}'>"
            f"<td class='num'>{_int(r.step)}</td>"
            f"<td class='num'>{_ranks(r)}</td><td class='sev-{_slug(r.severity)}'>{_e(r.severity)}</td>"
            f"<td>{_e(r.kind)}</td><td>{_e(r.message)}</td><td>{_e(r.source)}</td>"
            f"<td class='caused-by'>{caused}</td><td class='led-to'>{led}</td>"
            f"<td class='num'>{_int(r.seq)}</td></tr>"
        )
    if not body:
        body.append("<tr><td colspan='9' class='note'>no incident: a quiet run</td></tr>")
    note = ""
    if total > len(rows):
        note = (
            f"<p class='note'>showing the {_int(len(rows))} most recent of {_int(total)} "
            "incidents</p>"
        )
    return (
        f"{note}<table id='incidents'><thead><tr><th>step</th><th>{_rank_header(rows)}</th><th>severity</th>"
        "<th>kind</th><th>what happened</th><th>source</th><th>caused by</th><th>led to</th>"
        f"<th>seq</th></tr></thead><tbody>{''.join(body)}</tbody></table>"
    )


def _recovery_chain(rows: Sequence[IncidentRow]) -> str:
    """One row per recovery decision: the incident that triggered it, the decision, and the
    action applied for it, each linked to its row of the incident table."""
    by_key = {(r.rank, r.seq): r for r in rows}
    body = []
    for r in rows:
        if r.kind != "recovery_decided":
            continue
        trigger = (
            "<span class='note'>–</span>"
            if r.caused_by is None
            else _ref(r.rank, r.caused_by, by_key)
        )
        applied = [by_key.get((r.rank, seq)) for seq in r.led_to]
        done = (
            " ".join(
                f"{_ref(a.rank, a.seq, by_key)}: {_e(a.message)}" for a in applied if a is not None
            )
            or "<span class='note'>not applied (yet)</span>"
        )
        body.append(
            f"<tr><td class='num'>{_int(r.step)}</td><td class='num'>{_ranks(r)}</td>"
            f"<td class='trigger'>{trigger}</td>"
            f"<td class='decision'><a class='link' href='#{_anchor(r.rank, r.seq)}'>#{_int(r.seq)}</a> "
            f"{_e(r.message)}</td><td class='applied'>{done}</td></tr>"
        )
    if not body:
        body.append("<tr><td colspan='5' class='note'>no recovery decision</td></tr>")
    return (
        f"<table id='recovery-chain'><thead><tr><th>step</th><th>{_rank_header(rows)}</th><th>incident</th>"
        "<th>decision</th><th>applied</th></tr></thead>"
        f"<tbody>{''.join(body)}</tbody></table>"
    )


_PALETTE: Final = (
    (68, 1, 84),
    (59, 82, 139),
    (33, 145, 140),
    (94, 201, 98),
    (253, 231, 37),
)


def _color(t: float) -> str:
    t = min(max(t, 0.0), 1.0) * (len(_PALETTE) - 1)
    i = min(int(t), len(_PALETTE) - 2)
    f = t - i
    a, b = _PALETTE[i], _PALETTE[i + 1]
    return "#{:02x}{:02x}{:02x}".format(*(round(a[k] + (b[k] - a[k]) * f) for k in range(3)))


def _heatmap(chart_id: str, title: str, layers: Sequence[LayerSeries], omitted: int) -> str:
    """Layers (rows) × step buckets (columns), coloured by log10 of the bucket mean;
    non-finite buckets in red, buckets without a value left white."""
    head = f'<figure id="{_slug(chart_id)}" class="heat"><figcaption>{_e(title)}</figcaption>'
    if not layers:
        return (
            f"{head}<div class='empty'>no per-layer values in the run (the step probe logs "
            "them at the ADVANCED level and above)</div></figure>"
        )
    steps = [p.step for layer in layers for p in layer.points if _is_number(p.step)]
    values = [
        math.log10(p.mean)
        for layer in layers
        for p in layer.points
        if _is_number(p.mean) and p.mean is not None and p.mean > 0
    ]
    s_lo, s_hi = (min(steps), max(steps)) if steps else (0, 1)
    if s_hi == s_lo:
        s_hi = s_lo + 1
    v_lo, v_hi = (min(values), max(values)) if values else (0.0, 1.0)
    if v_hi - v_lo < 1e-12:
        v_lo, v_hi = v_lo - 0.5, v_hi + 0.5
    columns = max(len(layer.points) for layer in layers)
    label_w, row_h, top, legend_h = 220, 12, 6, 40
    plot_w = _W - label_w - _MR
    cell_w = plot_w / max(columns, 1)
    height = top + row_h * len(layers) + legend_h
    out = [
        head,
        f'<svg class="chart" viewBox="0 0 {_W} {height}" xmlns="http://www.w3.org/2000/svg" '
        f'role="img" aria-label="{_e(title)}">',
    ]
    for row, layer in enumerate(layers):
        yy = top + row * row_h
        name = str(layer.name)
        short = name if len(name) <= 34 else "…" + name[-33:]
        out.append(
            f'<text class="layer" x="{label_w - 6}" y="{yy + row_h - 3}" text-anchor="end">'
            f"<title>{_e(name)}</title>{_e(short)}</text>"
        )
        for p in layer.points:
            if not _is_number(p.step):
                continue
            xx = label_w + (p.step - s_lo) / (s_hi - s_lo) * (plot_w - cell_w)
            if p.mean is None or not _is_number(p.mean):
                if not p.nonfinite:
                    continue
                fill = "#dc2626"
            elif p.mean <= 0:
                fill = "#e5e7eb"
            else:
                fill = _color((math.log10(p.mean) - v_lo) / (v_hi - v_lo))
            out.append(
                f'<rect x="{xx:.1f}" y="{yy}" width="{cell_w + 0.6:.1f}" height="{row_h - 1}" '
                f'fill="{fill}"/>'
            )
    ly = top + row_h * len(layers) + 8
    for k in range(20):
        out.append(
            f'<rect x="{label_w + k * 12}" y="{ly}" width="12" height="10" '
            f'fill="{_color(k / 19)}"/>'
        )
    out.append(
        f'<text x="{label_w - 6}" y="{ly + 9}" text-anchor="end">{_num(10**v_lo, 3)}</text>'
        f'<text x="{label_w + 246}" y="{ly + 9}">{_num(10**v_hi, 3)} (log scale) · '
        f"steps {_int(s_lo)}–{_int(s_hi)} · red: NaN/Inf</text>"
    )
    out.append("</svg>")
    if omitted:
        out.append(
            f"<p class='note'>{_int(omitted)} more layer(s) not shown (the first "
            f"{_int(len(layers))} seen are kept)</p>"
        )
    out.append("</figure>")
    return "".join(out)


def _runs_section(s: RunSummary) -> str:
    if len(s.runs) <= 1:
        return ""
    shown = [r for r in s.runs if r.shown]
    if len(shown) > 1:
        what = (
            f"<strong>This summary mixes {_int(len(shown))} runs</strong> (their events were "
            "folded together)."
        )
    else:
        run = shown[0] if shown else None
        label = _e(run.run_id) if run is not None and run.run_id else "events before any session"
        what = (
            f"This log holds <strong>{_int(len(s.runs))} runs</strong>; this report shows "
            f"<code class='rid'>{label}</code>"
            + (" (the latest)" if run is not None and run is s.runs[-1] else "")
            + ". Rebuild another with <code>build_report(log, run=RUN_ID)</code>."
        )

    def row(r: RunInfo) -> str:
        rid = _e(r.run_id) if r.run_id else "<span class='note'>(before any session)</span>"
        ranks = ", ".join(_int(k) for k in r.ranks) or "–"
        return (
            f"<tr class='{'shown' if r.shown else 'other'}'><td><code class='rid'>{rid}</code></td>"
            f"<td>{_e(r.name)}</td><td>{_time(r.started_ns)}</td><td>{ranks}</td>"
            f"<td class='num'>{_int(r.events)}</td><td>{'shown' if r.shown else ''}</td></tr>"
        )

    return (
        f"<div class='banner' id='runs-banner'>{what}</div>"
        "<table id='runs'><thead><tr><th>run id</th><th>session</th><th>started</th>"
        "<th>ranks</th><th>events</th><th></th></tr></thead><tbody>"
        + "".join(row(r) for r in s.runs)
        + "</tbody></table>"
    )


def _ranks_section(s: RunSummary) -> str:
    """The ranks of a merged log: each rank's steps and incidents (the cards count each step
    and each incident once, whichever ranks had it)."""
    steps = s.steps_by_rank if isinstance(s.steps_by_rank, Mapping) else {}
    incidents = s.incidents_by_rank if isinstance(s.incidents_by_rank, Mapping) else {}
    rows = "".join(
        f"<tr><td class='num'>{_int(rank)}</td><td class='num'>{_int(steps.get(rank, 0))}</td>"
        f"<td class='num'>{_int(incidents.get(rank, 0))}</td></tr>"
        for rank in s.ranks
    )
    return (
        f"<h2 id='ranks'>Ranks</h2><p class='note'>{_int(len(s.ranks))} ranks: a step that "
        "every rank completed is one step, an incident that several ranks had (same step, same "
        "kind) is one row naming them and is counted once; throughput is summed over the "
        "ranks, the other curves are the mean over the ranks.</p>"
        "<table id='ranks-table'><thead><tr><th>rank</th><th>steps</th><th>incidents</th>"
        f"</tr></thead><tbody>{rows}</tbody></table>"
    )


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
    header = (
        f"<h1>{_e(title)}</h1><div class='sub'>{_time(s.started_ns)} → {_time(s.ended_ns)} · "
        f"steps {_int(s.first_step)}–{_int(s.last_step)} · ranks {ranks} · "
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
    if s.cuda_allocated_bytes:
        memory.append(
            _chart(
                "chart-cuda",
                "CUDA memory allocated (MiB)",
                s.cuda_allocated_bytes,
                anomaly_markers,
                scale=1 / (1024 * 1024),
                log=False,
            )
        )
    if s.cuda_reserved_bytes:
        memory.append(
            _chart(
                "chart-cuda-reserved",
                "CUDA memory reserved (MiB)",
                s.cuda_reserved_bytes,
                anomaly_markers,
                scale=1 / (1024 * 1024),
                log=False,
            )
        )
    if s.host_memory_percent:
        memory.append(
            _chart(
                "chart-host-memory",
                "Host memory used (%)",
                s.host_memory_percent,
                anomaly_markers,
                log=False,
            )
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
        _incident_table(s.incidents, s.incidents_total),
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
