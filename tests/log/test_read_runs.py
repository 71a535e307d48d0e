"""``read_events(log_dir, run=...)``: the events of one run of a log that reruns appended to.

A script rerun into the same ``log_dir`` appends; without a selection its checks count every
run's events (``[4]`` becomes ``[4, 4]``)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from eventbus_debug import SyncSession, read_events
from eventbus_debug.events import SessionStarted, StepCompleted, StepSkipped
from eventbus_debug.log.runs import RunSplitter


def _run(log_dir: Path, steps: int, nan_at: int | None = None) -> str:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(16, 4)
    with SyncSession(model, opt, log_dir=log_dir, report=False, alerts=False) as session:
        for step in range(steps):
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            if step == nan_at:
                loss = loss * math.nan
            loss.backward()
            if session.check_step(step, loss=loss).should_step:
                opt.step()
            session.step_completed(step)
    started = next(e for e in read_events(log_dir, run="latest") if isinstance(e, SessionStarted))
    return str(started.run_id)


def _skipped(log_dir: Path, run: str = "all") -> list[int | None]:
    return [e.step for e in read_events(log_dir, run=run) if isinstance(e, StepSkipped)]


def test_latest_and_by_id_pick_one_run_of_a_rerun_directory(tmp_path: Path) -> None:
    first = _run(tmp_path, 6, nan_at=4)
    second = _run(tmp_path, 9, nan_at=4)
    assert first != second
    assert [e.step for e in read_events(tmp_path) if isinstance(e, StepSkipped)] == [4, 4]
    assert _skipped(tmp_path, run="all") == [4, 4]
    assert _skipped(tmp_path, run="latest") == [4]
    latest = [e.step for e in read_events(tmp_path, run="latest") if isinstance(e, StepCompleted)]
    assert latest == list(range(9))
    early = [e.step for e in read_events(tmp_path, run=first) if isinstance(e, StepCompleted)]
    assert early == list(range(6))
    starts = [e for e in read_events(tmp_path, run=second) if isinstance(e, SessionStarted)]
    assert [s.run_id for s in starts] == [second]


def test_events_before_any_session_are_a_run_of_their_own(tmp_path: Path) -> None:
    """A log a bare bus wrote (no session): ``latest`` is everything, as ``all``."""
    log = tmp_path / "events.jsonl"
    line = {"kind": "step_completed", "seq": 0, "time_ns": 1, "step": 3, "rank": 0}
    log.write_text(json.dumps(line) + "\n")
    assert [e.step for e in read_events(tmp_path, run="latest")] == [3]


def test_an_unknown_run_id_names_the_runs_the_log_holds(tmp_path: Path) -> None:
    run_id = _run(tmp_path, 2)
    events = read_events(tmp_path, run="tuesday")  # checked as it is iterated
    with pytest.raises(
        ValueError, match=rf"run 'tuesday' is not in this log; its runs: '{run_id}'"
    ):
        next(events)


@pytest.mark.parametrize(
    ("run", "error"), [(3, TypeError), (None, TypeError), ("", ValueError), ("  ", ValueError)]
)
def test_a_bad_selection_is_refused_at_the_call(tmp_path: Path, run: object, error: type) -> None:
    with pytest.raises(error, match="run must be 'latest', 'all' or a run id"):
        read_events(tmp_path, run=run)  # type: ignore[arg-type]


def test_ranks_that_drew_their_own_ids_are_one_run() -> None:
    """Two ranks starting a session of one name within the join window, each with its own
    id, are one run (the first id)."""
    splitter = RunSplitter()
    a = SessionStarted(name="job", run_id="a", rank=0, time_ns=10**9)
    b = SessionStarted(name="job", run_id="b", rank=1, time_ns=2 * 10**9)
    assert splitter.assign(a)[0] == "a"
    key, joined = splitter.assign(b)
    assert key == "a"
    assert isinstance(joined, SessionStarted)
    assert joined.run_id == "a"
    assert splitter.assign(StepCompleted(step=0, rank=1))[0] == "a"
    assert splitter.latest() == "a"
