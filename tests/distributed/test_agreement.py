"""Real gloo process groups (2 and 3 ranks): one decision per step, no hang, no divergence."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from eventbus_debug.events import RecoveryAction
from eventbus_debug.recovery.actions import (
    Action,
    ClipGradients,
    DecidedAction,
    Decision,
    ScaleLR,
    SkipStep,
)
from eventbus_debug.recovery import agreement_codec as codec
from eventbus_debug.recovery.agreement import AgreedStep, RankAgreement

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 120.0  # seconds for a whole group; a regression fails instead of hanging


TWO_RANKS = (
    "nan_one_rank",
    "nan_one_rank_every5",
    "spike_one_rank",
    "spike_one_rank:aggressive",
    "nan_param_one_rank",
    "fsdp2",
    "oom_one_rank",
    "crash_one_rank",  # last: rank 1 exits
)
THREE_RANKS = ("sustained_one_rank",)


def run_group(tmp: Path, scenarios: tuple[str, ...], world: int) -> dict[str, list[Any]]:
    """Start *world* ranks running *scenarios* in turn; wait (bounded); results by scenario."""
    init = tmp / "init"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.distributed._worker",
                ",".join(scenarios),
                str(r),
                str(world),
                str(init),
                str(tmp),
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(world)
    ]
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=LIMIT)
            outputs.append(out.decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    results: dict[str, list[Any]] = {}
    for item in scenarios:
        name, _, policy = item.partition(":")
        key = f"{name}-{policy or 'safe'}"
        results[item] = []
        for r in range(world):
            path = tmp / f"{key}.rank{r}.json"
            results[item].append(json.loads(path.read_text()) if path.exists() else None)
    return {**results, "_output": outputs}


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    return run_group(tmp_path_factory.mktemp("two"), TWO_RANKS, 2)


@pytest.fixture(scope="module")
def three(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    return run_group(tmp_path_factory.mktemp("three"), THREE_RANKS, 3)


def ranks(group: dict[str, list[Any]], scenario: str) -> list[Any]:
    results = group[scenario]
    if any(r is None for r in results):
        pytest.fail(f"a rank wrote no result for {scenario}:\n{group['_output']}")
    return results


def same_everywhere(results: list[Any], key: str) -> bool:
    return len({json.dumps(r[key]) for r in results}) == 1


@pytest.mark.parametrize("scenario", ["nan_one_rank", "nan_one_rank_every5"])
def test_nan_on_one_rank_is_skipped_on_every_rank(two: dict[str, list[Any]], scenario: str) -> None:
    """A NaN batch on rank 1 (gradient checks every step or every 5th): all ranks skip step 12."""
    results = ranks(two, scenario)
    assert all(r["skipped"] == [12] for r in results)
    assert all(r["finite"] and r["stopped_at"] is None for r in results)
    assert same_everywhere(results, "params")


def test_single_spike_on_one_rank_is_clipped_everywhere(two: dict[str, list[Any]]) -> None:
    """Loss x1e4 on rank 0 (safe policy): its gradient explosion is clipped on every rank at the
    same step with the same norm; no rollback, no LR change; parameters equal."""
    results = ranks(two, "spike_one_rank")
    assert results[0]["applied"] == [[20, "clip_gradients", "applied"]]
    assert same_everywhere(results, "applied") and same_everywhere(results, "params")
    assert same_everywhere(results, "lr")


def test_single_spike_aggressive_rolls_back_every_rank(two: dict[str, list[Any]]) -> None:
    """The aggressive policy rolls back on a spike: every rank at the same step, same state."""
    results = ranks(two, "spike_one_rank:aggressive")
    assert results[0]["applied"] and same_everywhere(results, "applied")
    assert same_everywhere(results, "params") and same_everywhere(results, "lr")


def test_sustained_spike_on_one_rank_rolls_back_every_rank(three: dict[str, list[Any]]) -> None:
    """A sustained spike on rank 0 of 3: judged on the global loss, rolled back everywhere."""
    results = ranks(three, "sustained_one_rank")
    actions = [a[1] for a in results[0]["applied"]]
    assert RecoveryAction.RESTORE_STATE.value in actions
    assert same_everywhere(results, "applied") and same_everywhere(results, "params")


def test_stop_on_one_rank_stops_every_rank_at_the_same_step(two: dict[str, list[Any]]) -> None:
    """A NaN parameter on rank 1 before any good state: every rank stops at step 0."""
    results = ranks(two, "nan_param_one_rank")
    assert [r["stopped_at"] for r in results] == [0, 0]


def test_fsdp2_norms_are_global_and_nan_is_skipped_everywhere(two: dict[str, list[Any]]) -> None:
    """FSDP2 (fully_shard, DTensor gradient shards): the probe's norm is the global one that
    get_total_norm computes, on every rank; a NaN on rank 1 is skipped by both."""
    results = ranks(two, "fsdp2")
    for r in results:
        assert r["probe_norm"] == pytest.approx(r["reference_norm"], rel=1e-5)
        assert r["skipped"] == [12] and r["finite"]
    assert same_everywhere(results, "probe_norm") and same_everywhere(results, "params")


def test_oom_on_one_rank_shrinks_every_rank_alike(two: dict[str, list[Any]]) -> None:
    """An OOM on rank 1 (batch 32 too big there): the flag and the new batch size are agreed,
    every rank re-runs with batch 8, step counts stay equal, parameters stay identical."""
    results = ranks(two, "oom_one_rank")
    assert [r["batch_size"] for r in results] == [8, 8]
    assert [r["steps_completed"] for r in results] == [40, 40]
    assert all(r["stopped_at"] is None for r in results)
    assert same_everywhere(results, "params")


def test_a_crashed_rank_stops_the_others_with_a_reason(two: dict[str, list[Any]]) -> None:
    """Rank 1 dies at step 10: rank 0 stops there (gloo notices the closed peer), naming why."""
    rank0 = two["crash_one_rank"][0]
    assert rank0 is not None and rank0["stopped_at"] == 10
    assert "could not agree" in rank0["reason"]
    assert two["crash_one_rank"][1] is None


class TestEncoding:
    @staticmethod
    def decided(action: Action) -> DecidedAction:
        return DecidedAction(
            decision=Decision(action=action, reason=action.kind.value),
            strategy="s",
            trigger_kind="k",
            trigger_seq=1,
            step=3,
        )

    @staticmethod
    def enc(decisions: list[DecidedAction], noted: bool, rank: int) -> torch.Tensor:
        return codec.encode(codec.vector(2), decisions, noted, rank)

    def test_skip_and_clip_from_different_ranks_both_survive(self) -> None:
        """'skip' on one rank and 'clip' on another: one flag each, never a lossy bit mask."""
        a = self.enc([self.decided(SkipStep())], False, 0)
        b = self.enc([self.decided(ClipGradients(max_norm=5.0, total_norm=50.0))], True, 1)
        agreed = codec.decode(a.maximum(b).tolist(), [], 3, 2)
        assert {d.kind for d in agreed} == {
            RecoveryAction.SKIP_STEP,
            RecoveryAction.CLIP_GRADIENTS,
        }

    def test_smallest_factor_and_max_norm_win(self) -> None:
        """LR factors and clip norms agree on the smallest of any rank."""
        a = self.enc(
            [
                self.decided(ScaleLR(factor=0.5)),
                self.decided(ClipGradients(max_norm=5.0, total_norm=9.0)),
            ],
            False,
            0,
        )
        b = self.enc(
            [
                self.decided(ScaleLR(factor=0.25)),
                self.decided(ClipGradients(max_norm=2.0, total_norm=9.0)),
            ],
            False,
            1,
        )
        agreed = {d.kind: d.action for d in codec.decode(a.maximum(b).tolist(), [], 3, 2)}
        assert agreed[RecoveryAction.SCALE_LR] == ScaleLR(factor=0.25)
        assert agreed[RecoveryAction.CLIP_GRADIENTS] == ClipGradients(max_norm=2.0, total_norm=9.0)

    def test_nothing_pending_anywhere_is_no_decision(self) -> None:
        """A healthy step agrees on nothing and on 'noted' only when some rank had an incident."""
        v = self.enc([], True, 0)
        assert codec.decode(v.tolist(), [], 3, 2) == ()
        assert AgreedStep((), noted=True).noted

    def test_needs_a_process_group(self) -> None:
        """RankAgreement outside a process group is a clear error."""
        with pytest.raises(RuntimeError, match=r"initialized torch\.distributed"):
            RankAgreement()
