"""The run report: a typed summary of an event stream, written as JSON and a self-contained page.

- :mod:`.summary`: :class:`RunSummary` and its typed parts, :func:`summary_to_dict`;
- :mod:`.aggregate`: :class:`RunAggregator` folds events into a summary in bounded memory,
  :func:`summarize` / :func:`summarize_runs` over a log;
- :mod:`.html`: :func:`render_html`, the page (inline SVG, every string escaped);
- :mod:`.writer`: :class:`ReportWriter` (the sink), :func:`build_report`, :func:`write_report`.

Incidents are worded by :func:`eventbus_debug.events.describe.describe`, the same line the
console and ``eventbus-debug tail`` show (re-exported here as ``describe_incident``).
"""

from __future__ import annotations

from eventbus_debug.events.describe import describe as describe_incident

from .aggregate import (
    RunAggregator as RunAggregator,
    summarize as summarize,
    summarize_runs as summarize_runs,
)
from .html import render_html as render_html
from .summary import (
    IncidentRow as IncidentRow,
    LatestValues as LatestValues,
    LayerSeries as LayerSeries,
    Marker as Marker,
    MemoryStats as MemoryStats,
    RunInfo as RunInfo,
    RunSummary as RunSummary,
    SeriesPoint as SeriesPoint,
    SinkStats as SinkStats,
    Stat as Stat,
    SystemStats as SystemStats,
    summary_to_dict as summary_to_dict,
)
from .writer import (
    REPORT_FORMAT as REPORT_FORMAT,
    ReportPaths as ReportPaths,
    ReportWriter as ReportWriter,
    build_report as build_report,
    write_report as write_report,
)

__all__ = (
    "REPORT_FORMAT",
    "IncidentRow",
    "LatestValues",
    "LayerSeries",
    "Marker",
    "MemoryStats",
    "ReportPaths",
    "ReportWriter",
    "RunAggregator",
    "RunInfo",
    "RunSummary",
    "SeriesPoint",
    "SinkStats",
    "Stat",
    "SystemStats",
    "build_report",
    "describe_incident",
    "render_html",
    "summarize",
    "summarize_runs",
    "summary_to_dict",
    "write_report",
)
