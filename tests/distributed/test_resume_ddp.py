"""Resuming a DDP run from a checkpoint with rank 0's session state (real gloo, 2 ranks, CPU).

The README: "In a distributed run, save rank 0's state and load it on every rank (their
detectors judge the same all-reduced numbers)." Two jobs, as after a preemption: the first runs
an uninterrupted reference and the first half of the run, and writes a checkpoint (rank 0's
model, optimizer and session state, plus each rank's own session state); the second resumes from
it in new processes, faults planted after the resume on one rank only (a gradient burst, a loss
spike rolled back with a temporary LR cut, a NaN loss seen by one rank, a NaN batch), under the
``"aggressive"`` policy so that the decisions after the resume are agreed ones.

Before the fix, whether the loss converged (the largest loss of the run, which gates the
vanishing checks) was learned from each rank's own loss: the ranks' detectors differed, and a
rank resumed from rank 0's state ended with rank 0's. Every run is bounded by ``run_ranks``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ._ranks import run_ranks
from ._resume_worker import BURST, NAN_BATCH, NAN_LOSS, RESUME, SPIKE, STEPS

LIMIT = 60.0  # seconds for each job; a hang fails the test instead of blocking it
FIRST_JOB = ("full", "first")
SECOND_JOB = ("resume-rank0", "resume-own", "resume-none1")
MODULE = "tests.distributed._resume_worker"


def _job(tmp: Path, runs: tuple[str, ...]) -> list[str]:
    (tmp / "init").unlink(missing_ok=True)  # a new job: a new rendezvous
    return run_ranks(MODULE, [",".join(runs)], 2, tmp, LIMIT)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("resume")
    outputs = _job(tmp, FIRST_JOB)
    if not (tmp / "checkpoint.pt").exists():
        pytest.fail(f"the first job wrote no checkpoint:\n{outputs}")
    outputs += _job(tmp, SECOND_JOB)
    results: dict[str, list[dict[str, Any]]] = {}
    for run in FIRST_JOB + SECOND_JOB:
        paths = [tmp / f"{run}.rank{r}.json" for r in range(2)]
        if not all(p.exists() for p in paths):
            pytest.fail(f"a rank wrote no result for {run}:\n{outputs}")
        results[run] = [json.loads(p.read_text()) for p in paths]
    return results


def _from_resume(items: list[list[Any]]) -> list[list[Any]]:
    """*items* (``[step, ...]``) of the steps from the resume on."""
    return [i for i in items if i[0] is not None and i[0] >= RESUME]


def test_the_ranks_detectors_hold_the_same_state(runs: dict[str, list[dict[str, Any]]]) -> None:
    """The premise of loading rank 0's state everywhere: at the checkpoint and at the end, the
    two ranks' session states are equal, though their own losses differ at every step."""
    for run in ("first", "full"):
        rank0, rank1 = runs[run]
        assert rank0["state"] == rank1["state"], run
    assert runs["first"][0]["state"]["step"] == RESUME - 1


def test_the_uninterrupted_run_meets_every_fault(runs: dict[str, list[dict[str, Any]]]) -> None:
    """The reference: the spike is rolled back with a temporary LR cut (still in force at the
    end), both NaN steps are skipped by both ranks, the burst is quiet; nothing before the
    resume."""
    for result in runs["full"]:
        assert [SPIKE, "loss_spiked"] in result["incidents"]
        assert [SPIKE + 1, "restore_state", "applied"] in result["applied"]
        skipped = [step for step, ok in enumerate(result["should_step"]) if not ok]
        assert skipped == [SPIKE + 1, NAN_LOSS, NAN_BATCH]
        assert not any(i[0] == BURST for i in result["incidents"])
        assert result["state"]["recovery"]["temporary_lr_changes"]
        assert result["finite"]
    assert [NAN_LOSS, "non_finite_detected"] not in runs["full"][0]["incidents"]  # rank 1's own
    assert runs["full"][0]["params"] == runs["full"][1]["params"]


@pytest.mark.parametrize("run", ["resume-rank0", "resume-own"])
def test_every_rank_resumed_is_judged_as_the_uninterrupted_run(
    runs: dict[str, list[dict[str, Any]]], run: str
) -> None:
    """Every rank resumed from rank 0's state (the README's way; or from its own, now the same)
    reports the uninterrupted run's incidents and actions at the same steps, steps when it
    stepped, and ends with its parameters and its exact session state (run id aside)."""
    for resumed, full in zip(runs[run], runs["full"], strict=True):
        assert resumed["next_step"] == RESUME
        assert resumed["incidents"] == _from_resume(full["incidents"])
        assert resumed["applied"] == _from_resume(full["applied"])
        assert resumed["should_step"] == full["should_step"][RESUME:]
        assert resumed["state"] == full["state"]
        assert resumed["params"] == full["params"]


def test_a_rank_resumed_cold_still_decides_with_the_others(
    runs: dict[str, list[dict[str, Any]]],
) -> None:
    """Rank 1 loads no session state (rank 0 loads rank 0's): its cold detectors report the
    burst that rank 0's do not (a gradient explosion and a loss spike); the agreement makes
    both ranks clip it and roll it back at the same steps. The run differs from the
    uninterrupted one, but no rank hangs, skips or steps alone, and the parameters stay equal."""
    rank0, rank1 = runs["resume-none1"]
    assert rank0["next_step"] == RESUME and rank1["next_step"] == 0  # rank 1 knows nothing
    assert [BURST, "gradient_exploded"] in rank1["incidents"]
    assert not any(i[0] == BURST for i in rank0["incidents"])
    assert rank0["state"]["probe"] != rank1["state"]["probe"]  # the detectors still differ
    assert rank0["applied"] == rank1["applied"]
    assert [BURST, "clip_gradients", "applied"] in rank0["applied"]
    assert [BURST + 1, "restore_state", "applied"] in rank0["applied"]
    assert rank0["should_step"] == rank1["should_step"]
    assert len(rank0["should_step"]) == STEPS - RESUME
    assert rank0["params"] == rank1["params"] and rank0["finite"] and rank1["finite"]
    assert rank0["state"]["recovery"] == rank1["state"]["recovery"]
    assert rank0["should_step"] != runs["full"][0]["should_step"][RESUME:]
