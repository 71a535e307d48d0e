"""Built-in subscribers, written only against eventbus_debug's public API.

- :mod:`.rotating_file`: :class:`RotatingFileSink`, the canonical JSON-lines log (its thread
  side in ``_jsonl_writer``);
- :mod:`.console`: :class:`ConsoleSink`, one line per event (:mod:`.lines`);
- :mod:`.alerts`: :class:`AlertSink`, its rules and handlers;
- :mod:`.report`: :class:`ReportWriter`, the run summary and its page;
- :mod:`.http`, :mod:`.tensorboard`, :mod:`.wandb`: optional extras.

The names below are loaded on first access (PEP 562), each from its module: reading a log
with ``eventbus_debug.sinks.report`` imports neither the console, the alerts nor the log
writer, and ``TensorBoardSink`` / ``WandbSink`` import their (optional) libraries only when
asked for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Final

# The sinks' own event kind (AlertHandlerFailed) is registered whenever the package is
# imported, so that any log written with alerts on can be read back; this module is light.
from . import _events  # noqa: F401

if TYPE_CHECKING:
    from .alerts import (
        Alert as Alert,
        AlertHandler as AlertHandler,
        AlertHandlerFailed as AlertHandlerFailed,
        AlertRule as AlertRule,
        AlertSink as AlertSink,
        AlertStatistics as AlertStatistics,
        FileAlert as FileAlert,
        LogAlert as LogAlert,
        StderrAlert as StderrAlert,
        WebhookAlert as WebhookAlert,
        alert_to_dict as alert_to_dict,
        rules as rules,
    )
    from .console import ConsoleSink as ConsoleSink
    from .report import (
        REPORT_FORMAT as REPORT_FORMAT,
        IncidentRow as IncidentRow,
        LatestValues as LatestValues,
        LayerSeries as LayerSeries,
        Marker as Marker,
        MemoryStats as MemoryStats,
        ReportPaths as ReportPaths,
        ReportWriter as ReportWriter,
        RunAggregator as RunAggregator,
        RunInfo as RunInfo,
        RunSummary as RunSummary,
        SeriesPoint as SeriesPoint,
        SinkStats as SinkStats,
        Stat as Stat,
        SystemStats as SystemStats,
        build_report as build_report,
        describe_incident as describe_incident,
        render_html as render_html,
        summarize as summarize,
        summarize_runs as summarize_runs,
        summary_to_dict as summary_to_dict,
        write_report as write_report,
    )
    from .rotating_file import (
        DEFAULT_BACKUP_COUNT as DEFAULT_BACKUP_COUNT,
        DEFAULT_MAX_BYTES as DEFAULT_MAX_BYTES,
        FileSinkStatistics as FileSinkStatistics,
        LogDirectoryError as LogDirectoryError,
        LogWriteError as LogWriteError,
        RotatingFileSink as RotatingFileSink,
    )
    from .tensorboard import TensorBoardSink as TensorBoardSink
    from .wandb import WandbSink as WandbSink

_HOMES: Final[dict[str, str]] = {
    "Alert": "alerts",
    "AlertHandler": "alerts",
    "AlertHandlerFailed": "alerts",
    "AlertRule": "alerts",
    "AlertSink": "alerts",
    "AlertStatistics": "alerts",
    "ConsoleSink": "console",
    "DEFAULT_BACKUP_COUNT": "rotating_file",
    "DEFAULT_MAX_BYTES": "rotating_file",
    "FileAlert": "alerts",
    "FileSinkStatistics": "rotating_file",
    "IncidentRow": "report",
    "LatestValues": "report",
    "LayerSeries": "report",
    "LogAlert": "alerts",
    "LogDirectoryError": "rotating_file",
    "LogWriteError": "rotating_file",
    "Marker": "report",
    "MemoryStats": "report",
    "REPORT_FORMAT": "report",
    "ReportPaths": "report",
    "ReportWriter": "report",
    "RotatingFileSink": "rotating_file",
    "RunAggregator": "report",
    "RunInfo": "report",
    "RunSummary": "report",
    "SeriesPoint": "report",
    "SinkStats": "report",
    "Stat": "report",
    "StderrAlert": "alerts",
    "SystemStats": "report",
    "TensorBoardSink": "tensorboard",
    "WandbSink": "wandb",
    "WebhookAlert": "alerts",
    "alert_to_dict": "alerts",
    "build_report": "report",
    "describe_incident": "report",
    "render_html": "report",
    "rules": "alerts",
    "summarize": "report",
    "summarize_runs": "report",
    "summary_to_dict": "report",
    "write_report": "report",
}

__all__ = (
    "Alert",
    "AlertHandler",
    "AlertHandlerFailed",
    "AlertRule",
    "AlertSink",
    "AlertStatistics",
    "ConsoleSink",
    "DEFAULT_BACKUP_COUNT",
    "DEFAULT_MAX_BYTES",
    "FileAlert",
    "FileSinkStatistics",
    "IncidentRow",
    "LatestValues",
    "LayerSeries",
    "LogAlert",
    "LogDirectoryError",
    "LogWriteError",
    "Marker",
    "MemoryStats",
    "REPORT_FORMAT",
    "ReportPaths",
    "ReportWriter",
    "RotatingFileSink",
    "RunAggregator",
    "RunInfo",
    "RunSummary",
    "SeriesPoint",
    "SinkStats",
    "Stat",
    "StderrAlert",
    "SystemStats",
    "TensorBoardSink",
    "WandbSink",
    "WebhookAlert",
    "alert_to_dict",
    "build_report",
    "describe_incident",
    "render_html",
    "rules",
    "summarize",
    "summarize_runs",
    "summary_to_dict",
    "write_report",
)


def __getattr__(name: str) -> Any:
    module = _HOMES.get(name)
    if module is None:
        msg = f"module {__name__!r} has no attribute {name!r}"
        raise AttributeError(msg)
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
