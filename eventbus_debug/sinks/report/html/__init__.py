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

The parts: :mod:`._format` (escaping and number formatting, the one way values reach the
page), :mod:`._charts` (the SVG line charts and the per-layer heatmap), :mod:`._sections`
(cards, tables, the incident table and the recovery chain, the runs and ranks sections) and
:mod:`._page` (the head, the stylesheet and :func:`render_html`, which lays the sections out).
"""

from __future__ import annotations

# The two public names, and the page's helpers: importable from here as they were when the
# page was one module.
from ._charts import (
    _H as _H,
    _MB as _MB,
    _ML as _ML,
    _MR as _MR,
    _MT as _MT,
    _PALETTE as _PALETTE,
    _W as _W,
    _chart as _chart,
    _color as _color,
    _heatmap as _heatmap,
    _nice_ticks as _nice_ticks,
)
from ._format import (
    _SLUG_RE as _SLUG_RE,
    _anchor as _anchor,
    _bytes as _bytes,
    _duration as _duration,
    _e as _e,
    _int as _int,
    _is_number as _is_number,
    _num as _num,
    _pct as _pct,
    _slug as _slug,
    _time as _time,
)
from ._page import (
    _CSS as _CSS,
    CONTENT_SECURITY_POLICY as CONTENT_SECURITY_POLICY,
    render_html as render_html,
)
from ._sections import (
    _card as _card,
    _counts as _counts,
    _incident_table as _incident_table,
    _kv_table as _kv_table,
    _overhead_card as _overhead_card,
    _rank_header as _rank_header,
    _ranks as _ranks,
    _ranks_section as _ranks_section,
    _recovery_chain as _recovery_chain,
    _ref as _ref,
    _runs_section as _runs_section,
    _stat_row as _stat_row,
)

__all__ = ("CONTENT_SECURITY_POLICY", "render_html")
