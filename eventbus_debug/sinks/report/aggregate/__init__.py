"""The run summary: a typed aggregate of an event stream, built live or from a log.

:class:`RunAggregator` folds events one at a time into bounded state (counters, running
statistics, downsampled series, the most recent incidents) and produces a frozen
:class:`RunSummary`. The aggregate depends only on the events and their order, never on the
time of aggregation, so a report rebuilt from the JSON-lines log equals the live one.

The parts: :mod:`._aggregator` (:class:`RunAggregator`: counters, series, memory and system
accounting, the runs seen, the summary), :mod:`._rows` (the incident table it builds on: rows
merged over the ranks that had the same incident, recovery chains linked across rows) and
:mod:`._runs` (:func:`summarize`, and :func:`summarize_runs` for a log several runs appended
to).
"""

from __future__ import annotations

# The public names, and the helpers the module defined: importable from here as they were
# when the aggregate was one module.
from ._aggregator import (
    _ALWAYS_LISTED as _ALWAYS_LISTED,
    DEFAULT_LAYER_POINTS as DEFAULT_LAYER_POINTS,
    DEFAULT_MAX_INCIDENTS as DEFAULT_MAX_INCIDENTS,
    DEFAULT_MAX_LAYERS as DEFAULT_MAX_LAYERS,
    DEFAULT_MAX_MARKERS as DEFAULT_MAX_MARKERS,
    DEFAULT_MAX_POINTS as DEFAULT_MAX_POINTS,
    RunAggregator as RunAggregator,
    _RunState as _RunState,
)
from ._rows import (
    _MAX_GROUPS as _MAX_GROUPS,
    _MAX_LINKS as _MAX_LINKS,
    _MAX_PENDING as _MAX_PENDING,
    _RowState as _RowState,
)
from ._runs import (
    RUN_JOIN_WINDOW_S as RUN_JOIN_WINDOW_S,
    summarize as summarize,
    summarize_runs as summarize_runs,
)

__all__ = (
    "DEFAULT_LAYER_POINTS",
    "DEFAULT_MAX_INCIDENTS",
    "DEFAULT_MAX_LAYERS",
    "DEFAULT_MAX_MARKERS",
    "DEFAULT_MAX_POINTS",
    "RUN_JOIN_WINDOW_S",
    "RunAggregator",
    "summarize",
    "summarize_runs",
)
