"""A log that several runs appended to: one summary each.

:func:`summarize` folds a whole stream; :func:`summarize_runs` first splits it by run
(:class:`~eventbus_debug.log.runs.RunSplitter`: each rank's events go to the run its latest
``SessionStarted`` announced, the ranks of one run that started without a shared run id
joined) and returns the chosen run's summary naming the others.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from eventbus_debug.events import Event
from eventbus_debug.log.runs import RUN_JOIN_WINDOW_S, RunSplitter

from ..summary import RunInfo, RunSummary
from ._aggregator import RunAggregator

__all__ = ("RUN_JOIN_WINDOW_S", "summarize", "summarize_runs")


def summarize(events: Iterable[Event], /, **options: int) -> RunSummary:
    """Aggregate *events* (e.g. ``read_events(log_dir)``) into a :class:`RunSummary`.

    *options* are those of :class:`RunAggregator`.
    """
    aggregator = RunAggregator(**options)
    aggregator.add_all(events)
    return aggregator.summary()


def summarize_runs(
    events: Iterable[Event], /, *, run: str = "latest", **options: int
) -> RunSummary:
    """Aggregate *events* of a log that may hold several runs (reruns into one directory).

    Each rank's events belong to the run its latest ``SessionStarted`` announced (events
    before any are a run of their own, id ``""``). Ranks whose sessions have different run ids
    but the same name and start within :data:`RUN_JOIN_WINDOW_S` are joined into one run.

    Args:
        events: the events, in log order (e.g. ``read_events(log_dir)``).
        run: ``"latest"`` (the run that started last), ``"all"`` (every event folded together,
            as one summary that says it mixes runs), or a run id.
        options: the bounds of :class:`RunAggregator`.

    Returns:
        The summary of the chosen run; its ``runs`` lists every run found, the chosen one
        marked ``shown``.

    Raises:
        ValueError: if *run* names no run of the log (the message lists those it holds).
    """
    if not isinstance(run, str) or not run:
        msg = f"run must be 'latest', 'all' or a run id, got {run!r}"
        raise ValueError(msg)
    if run == "all":
        return summarize(events, **options)
    aggregators: dict[str, RunAggregator] = {}
    splitter = RunSplitter()
    for event in events:
        key, event = splitter.assign(event)
        aggregator = aggregators.get(key)
        if aggregator is None:
            aggregator = aggregators[key] = RunAggregator(**options)
        aggregator.add(event)
    if not aggregators:
        return RunAggregator(**options).summary()
    chosen = splitter.choose(run)
    starts = splitter.starts
    summaries = {key: agg.summary() for key, agg in aggregators.items()}
    runs: list[RunInfo] = []
    for key, summary in summaries.items():
        info = next((r for r in summary.runs if r.run_id == key), None)
        if info is None:
            info = RunInfo(key, "", None if not key else starts[key][1], summary.ranks, 0, False)
        runs.append(dataclasses.replace(info, events=summary.events, shown=key == chosen))
    if len(runs) == 1 and not runs[0].run_id:
        return summaries[chosen]
    runs.sort(key=lambda r: (r.started_ns is not None, r.started_ns or 0))
    return dataclasses.replace(summaries[chosen], runs=tuple(runs))
