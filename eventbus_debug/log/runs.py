"""Which run each event of a log belongs to, when several runs appended to one directory.

A rerun into the same log directory appends to the same files; each session announces its run
with a :class:`~eventbus_debug.events.SessionStarted` carrying a ``run_id``. Each rank's events
belong to the run its latest ``SessionStarted`` announced (events before any belong to a run of
their own, key ``""``). Ranks whose sessions have different run ids but the same name and start
within :data:`RUN_JOIN_WINDOW_S` are one run (a job whose ranks each drew an id; set
``EVENTBUS_DEBUG_RUN_ID`` to make it explicit).

:class:`RunSplitter` does the sorting for :func:`~.files.read_events` (``run=``) and for the
report's :func:`~eventbus_debug.sinks.report.summarize_runs`.
"""

from __future__ import annotations

import dataclasses
from typing import Final

from ..events import Event, SessionStarted

__all__ = ("RUN_JOIN_WINDOW_S", "RunSplitter", "check_run")

RUN_JOIN_WINDOW_S: Final = 60.0
"""Ranks that start sessions of the same name within this many seconds, without a shared run
id, are taken as one run (set ``EVENTBUS_DEBUG_RUN_ID`` to make it explicit)."""


def check_run(run: object) -> str:
    """*run* as a run selection: ``"latest"``, ``"all"`` or a run id.

    Raises:
        TypeError: if *run* is not a str.
        ValueError: if *run* is empty.
    """
    if not isinstance(run, str):
        msg = f"run must be 'latest', 'all' or a run id (a str), got {type(run).__name__} {run!r}"
        raise TypeError(msg)
    if not run.strip():
        msg = f"run must be 'latest', 'all' or a run id, got {run!r}"
        raise ValueError(msg)
    return run


class RunSplitter:
    """Sorts a log's events, in log order, into runs (see the module's rules).

    Attributes:
        starts: per run key, ``(session name, start time in ns, ranks)`` of its sessions.
    """

    __slots__ = ("_alias", "_rank_run", "_window_ns", "starts")

    def __init__(self, *, join_window_s: float = RUN_JOIN_WINDOW_S) -> None:
        self._window_ns = int(join_window_s * 1e9)
        self._alias: dict[str, str] = {}
        self._rank_run: dict[int, str] = {}
        self.starts: dict[str, tuple[str, int, set[int]]] = {}

    def assign(self, event: Event) -> tuple[str, Event]:
        """The run key of *event*, and the event (a ``SessionStarted`` joined to another
        rank's run carries that run's id)."""
        if isinstance(event, SessionStarted):
            run_id = str(event.run_id)
            key = self._alias.get(run_id)
            if key is None:
                key = run_id
                for other, (name, started, ranks) in self.starts.items():
                    if (
                        other != run_id
                        and name == event.name
                        and event.rank not in ranks
                        and abs(event.time_ns - started) <= self._window_ns
                    ):
                        key = other
                        break
                self._alias[run_id] = key
            entry = self.starts.setdefault(key, (event.name, event.time_ns, set()))
            entry[2].add(event.rank)
            self._rank_run[event.rank] = key
            if key != run_id:
                event = dataclasses.replace(event, run_id=key)
            return key, event
        return self._rank_run.get(event.rank, ""), event

    def latest(self) -> str:
        """The key of the run that started last (``""`` when no session started)."""
        if not self.starts:
            return ""
        return max(self.starts, key=lambda k: self.starts[k][1])

    def choose(self, run: str) -> str:
        """The key *run* selects: ``"latest"`` or a run id of the log.

        Raises:
            ValueError: if *run* names no run of the log (the message lists those it holds).
        """
        if run == "latest":
            return self.latest()
        if run in self.starts:
            return run
        known = ", ".join(repr(k) for k in sorted(self.starts)) or "none"
        msg = f"run {run!r} is not in this log; its runs: {known}"
        raise ValueError(msg)
