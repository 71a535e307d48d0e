"""The page's inline SVG charts: a line chart with markers, and the per-layer heatmap.

NaN and infinite values never break a plot: they appear as gaps in the line and as red crosses
at the top of the chart (red cells in a heatmap).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Final

from ..summary import LayerSeries, Marker, SeriesPoint
from ._format import _e, _int, _is_number, _num, _slug

_W: Final = 960
_H: Final = 260
_ML: Final = 72
_MR: Final = 16
_MT: Final = 22
_MB: Final = 34


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
