"""Real gloo process groups (2 and 3 ranks): one decision per step, no hang, no divergence."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from eventbus_debug.events import RecoveryAction
from eventbus_debug.recovery import agreement_codec as codec
from eventbus_debug.recovery.actions import (
    Action,
    ClipGradients,
    DecidedAction,
    Decision,
    RestoreState,
    ScaleLR,
    SkipStep,
    Stop,
)
from eventbus_debug.recovery.agreement import AgreedStep, RankAgreement
from eventbus_debug.recovery.agreement_overlap import OutputGradLaunch, finite, split_late
from tests._doubles import FSDP2_ON_CPU, needs_fsdp2_on_cpu

from ._ranks import run_ranks

LIMIT = 120.0  # seconds for a whole group; a regression fails instead of hanging


TWO_RANKS = (
    "nan_one_rank",
    "nan_one_rank_every5",
    "spike_one_rank",
    "spike_one_rank:aggressive",
    "nan_param_one_rank",
    *(("fsdp2",) if FSDP2_ON_CPU else ()),
    "oom_one_rank",
    "nan_loss_only_one_rank",
    "nan_three_one_rank_every5",
    "stop_early_one_rank",
    "stop_late_one_rank",
    "blocking_nan_one_rank_every5",
    "nan_one_rank_every5:observe",
    "no_sync_accumulate",
    "ov_nan_one_rank",  # ov_: RankAgreement(overlap=True), launched during backward
    "ov_spike_one_rank",
    "ov_nan_three_one_rank_every5",
    "ov_no_sync_accumulate",
    "ov_stop_late_one_rank",
    "unheld_nan_param_late",  # unheld_: rank 1 has no memory for a snapshot
    "ov_unheld_nan_param_late",
    "unheld_nan_three_one_rank_every5",
    "explode_samples_one_rank",
    "crash_one_rank",  # last: rank 1 exits
)
STEPS = 40  # tests/distributed/_worker.py's STEPS
THREE_RANKS = ("sustained_one_rank", "sustained_one_rank:aggressive")


def run_group(tmp: Path, scenarios: tuple[str, ...], world: int) -> dict[str, list[Any]]:
    """Start *world* ranks running *scenarios* in turn; wait (bounded); results by scenario."""
    outputs = run_ranks("tests.distributed._worker", [",".join(scenarios)], world, tmp, LIMIT)
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
def crashed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    return run_group(tmp_path_factory.mktemp("crash"), ("crash_one_rank_overlapped",), 2)


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


def test_sustained_spike_on_one_rank_is_reported_by_every_rank(three: dict[str, list[Any]]) -> None:
    """A sustained spike on rank 0 of 3, safe policy: judged on the global loss, the same
    spikes reported by every rank at the same steps, no rollback or LR change anywhere (the
    40x gradients are clipped, on every rank alike), parameters equal."""
    results = ranks(three, "sustained_one_rank")
    assert results[0]["spikes"] and same_everywhere(results, "spikes")
    assert "sustained" in {rule for _, rule in results[0]["spikes"]}
    actions = {a[1] for a in results[0]["applied"]}
    assert actions <= {RecoveryAction.CLIP_GRADIENTS.value}
    assert all(r["skipped"] == [] for r in results)
    assert same_everywhere(results, "applied") and same_everywhere(results, "params")


def test_sustained_spike_on_one_rank_rolls_back_every_rank(three: dict[str, list[Any]]) -> None:
    """The same spike under the aggressive policy: rolled back everywhere, at the same step."""
    results = ranks(three, "sustained_one_rank:aggressive")
    actions = [a[1] for a in results[0]["applied"]]
    assert RecoveryAction.RESTORE_STATE.value in actions
    assert same_everywhere(results, "applied") and same_everywhere(results, "params")


def test_stop_on_one_rank_stops_every_rank_at_the_same_step(two: dict[str, list[Any]]) -> None:
    """A NaN parameter on rank 1 before any good state: every rank stops at step 0."""
    results = ranks(two, "nan_param_one_rank")
    assert [r["stopped_at"] for r in results] == [0, 0]


@needs_fsdp2_on_cpu
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
    assert "distributed=RankAgreement(timeout=" in rank0["reason"]  # how to wait longer
    assert two["crash_one_rank"][1] is None


@pytest.mark.parametrize("scenario", ["ov_nan_one_rank", "ov_spike_one_rank"])
def test_ddp_agrees_during_backward_at_every_step(two: dict[str, list[Any]], scenario: str) -> None:
    """With RankAgreement(overlap=True) every safe point's agreement under DDP was launched
    during backward, every launch's hold on the training thread was measured, and the fault is
    answered as by the blocking agreement."""
    results = ranks(two, scenario)
    assert [r["overlapped"] for r in results] == [STEPS, STEPS]
    assert [r["launches"] for r in results] == [[STEPS, True], [STEPS, True]]
    blocking = ranks(two, scenario.removeprefix("ov_"))
    assert [r["applied"] for r in results] == [r["applied"] for r in blocking]
    assert same_everywhere(results, "params")


@pytest.mark.parametrize(
    "scenario", ["nan_one_rank", "spike_one_rank:aggressive", "oom_one_rank", "no_sync_accumulate"]
)
def test_the_default_agreement_blocks_at_the_safe_point(
    two: dict[str, list[Any]], scenario: str
) -> None:
    """By default nothing is launched during backward: one agreement per safe point."""
    assert [r["overlapped"] for r in ranks(two, scenario)] == [0, 0]
    assert [r["launches"] for r in ranks(two, scenario)] == [[0, True], [0, True]]


def test_sustained_spike_agreed_at_the_safe_point(three: dict[str, list[Any]]) -> None:
    """Three ranks: every agreement of the sustained-spike run blocked at the safe point."""
    for scenario in THREE_RANKS:
        assert [r["overlapped"] for r in ranks(three, scenario)] == [0] * 3


@pytest.mark.parametrize(
    "scenario",
    [pytest.param("fsdp2", marks=needs_fsdp2_on_cpu), "blocking_nan_one_rank_every5"],
)
def test_fsdp_and_overlap_off_fall_back_to_the_blocking_agreement(
    two: dict[str, list[Any]], scenario: str
) -> None:
    """FSDP2 and RankAgreement(overlap=False) agree at the safe point; a NaN batch on rank 1
    with gradient checks every 5th step is still skipped by both ranks at step 12."""
    results = ranks(two, scenario)
    assert [r["overlapped"] for r in results] == [0, 0]
    assert all(r["skipped"] == [12] and r["finite"] for r in results)
    assert same_everywhere(results, "params")


@pytest.mark.parametrize("scenario", ["nan_three_one_rank_every5", "ov_nan_three_one_rank_every5"])
def test_escalation_on_one_rank_restores_every_rank_together(
    two: dict[str, list[Any]], scenario: str
) -> None:
    """Three NaN batches in a row on rank 1 with gradient checks every 5th step: rank 1's
    strategy escalates to a restore that only it counted; every rank skips 12-14 and restores
    at the same safe point (overlapped: one later, as agreed), ending equal and finite."""
    results = ranks(two, scenario)
    assert all({12, 13, 14} <= set(r["skipped"]) and r["finite"] for r in results)
    assert any(a[1] == RecoveryAction.RESTORE_STATE.value for a in results[0]["applied"])
    assert same_everywhere(results, "applied") and same_everywhere(results, "params")


@pytest.mark.parametrize("scenario", ["unheld_nan_param_late", "ov_unheld_nan_param_late"])
def test_a_required_restore_with_a_rank_holding_no_state_stops_every_rank(
    two: dict[str, list[Any]], scenario: str
) -> None:
    """Rank 1's snapshot did not fit in memory; its parameters turn NaN at step 20. Restored on
    rank 0 alone the replicas would differ (and rank 1, stopping alone, would leave rank 0 in
    DDP's next all-reduce): both stop at the same step, saying why, and neither restores."""
    results = ranks(two, scenario)
    assert results[0]["stopped_at"] == results[1]["stopped_at"]
    assert results[0]["stopped_at"] is not None and results[0]["stopped_at"] >= 20
    assert all("some rank holds no good state to restore" in r["reason"] for r in results)
    assert not any(a[1:] == ["restore_state", "applied"] for r in results for a in r["applied"])


def test_a_precautionary_restore_with_a_rank_holding_no_state_skips_on_every_rank(
    two: dict[str, list[Any]],
) -> None:
    """Three NaN batches on rank 1 escalate to a precautionary restore; rank 1 holds no state:
    no rank restores, both skip, and they end equal, finite and running."""
    results = ranks(two, "unheld_nan_three_one_rank_every5")
    assert all({12, 13, 14} <= set(r["skipped"]) and r["finite"] for r in results)
    assert all(r["stopped_at"] is None for r in results)
    assert not any(a[1:] == ["restore_state", "applied"] for r in results for a in r["applied"])
    assert same_everywhere(results, "params") and same_everywhere(results, "skipped")


def test_ranks_told_different_samples_still_apply_the_same_decisions(
    two: dict[str, list[Any]],
) -> None:
    """Step 20's all-reduced gradient explodes (x1000) where rank 0 calls the step a one-sample
    batch (judged 320x more leniently: no explosion there) and rank 1 a full one (an explosion,
    clipped by the safe policy): the clip is agreed, both ranks apply it, and the replicas stay
    equal, finite and running."""
    results = ranks(two, "explode_samples_one_rank")
    assert 20 not in results[0]["exploded"] and 20 in results[1]["exploded"]
    assert all([20, "clip_gradients", "applied"] in r["applied"] for r in results)
    assert all(r["stopped_at"] is None and r["finite"] for r in results)
    assert same_everywhere(results, "applied") and same_everywhere(results, "params")


def test_observe_policy_is_not_made_to_skip(two: dict[str, list[Any]]) -> None:
    """Policy "observe" answers nothing: the NaN batch on rank 1 is not skipped by any rank
    (the agreed flag only acts when a strategy answers non-finite losses); ranks stay equal."""
    results = ranks(two, "nan_one_rank_every5:observe")
    assert all(r["skipped"] == [] and r["applied"] == [] for r in results)
    assert same_everywhere(results, "params")


def test_no_sync_micro_batches_do_not_launch(two: dict[str, list[Any]]) -> None:
    """Gradient accumulation with DDP's no_sync() and overlap=True: only the all-reduced
    backward launches the agreement, once per safe point; parameters stay equal."""
    results = ranks(two, "ov_no_sync_accumulate")
    assert [r["overlapped"] for r in results] == [STEPS, STEPS]
    assert same_everywhere(results, "params") and all(r["finite"] for r in results)


def test_nan_only_in_the_loss_does_not_split_the_ranks(two: dict[str, list[Any]]) -> None:
    """A NaN added to rank 1's loss (its gradient stays finite): no rank skips alone (every
    rank skips it, agreed at the safe point), the ranks end equal and finite, nobody stops."""
    results = ranks(two, "nan_loss_only_one_rank")
    assert all(r["skipped"] == [12] and r["stopped_at"] is None and r["finite"] for r in results)
    assert same_everywhere(results, "params")


def test_stop_decided_on_one_rank_before_backward_stops_both(two: dict[str, list[Any]]) -> None:
    """A rank-local incident answered with STOP on rank 1 at step 15: both ranks stop at the
    same step (15 when decided before the launch, else the next safe point), rank 0 naming
    rank 1."""
    results = ranks(two, "stop_early_one_rank")
    stops = [r["stopped_at"] for r in results]
    assert stops[0] == stops[1] and stops[0] in (15, 16)
    assert "rank 1" in results[0]["reason"] and "leak" in results[1]["reason"]
    assert same_everywhere(results, "params")


def test_stop_decided_on_one_rank_after_backward_stops_both_next_step(
    two: dict[str, list[Any]],
) -> None:
    """The same incident published after backward (after the launch) rides in the next
    agreement: both ranks stop together at step 16, parameters equal."""
    assert [r["stopped_at"] for r in ranks(two, "ov_stop_late_one_rank")] == [16, 16]
    results = ranks(two, "stop_late_one_rank")  # blocking: agreed at the safe point of step 15
    assert [r["stopped_at"] for r in results] == [15, 15]
    assert same_everywhere(results, "params")


def test_a_crashed_rank_ends_the_overlapped_group_without_a_hang(
    crashed: dict[str, list[Any]],
) -> None:
    """Rank 1 dies after backward at step 10 with the overlapped agreement: rank 0 ends with an
    error at step 10 (the agreement) or 11 (DDP's all-reduce meets the dead peer), never hangs."""
    rank0 = crashed["crash_one_rank_overlapped"][0]
    assert rank0 is not None, crashed["_output"]
    assert rank0["stopped_at"] in (10, 11) and rank0["reason"]
    assert crashed["crash_one_rank_overlapped"][1] is None


class TestOverlap:
    @staticmethod
    def decided(action: Action, trigger: str) -> DecidedAction:
        return DecidedAction(
            decision=Decision(action=action, reason=trigger),
            strategy="s",
            trigger_kind=trigger,
            trigger_seq=1,
            step=3,
        )

    def test_non_finite_gradients_act_now_and_their_rest_later(self) -> None:
        """Non-finite all-reduced gradients: the skip acts now; a restore skips now and restores
        at the next safe point; an LR change waits for the next agreement."""
        late = [
            self.decided(SkipStep(), "non_finite_detected"),
            self.decided(RestoreState(), "non_finite_detected"),
            self.decided(ScaleLR(factor=0.5), "non_finite_detected"),
        ]
        now, later = split_late(late, local_loss_uncovered=False)
        assert [type(d.action) for d in now] == [SkipStep, SkipStep]
        assert [type(d.action) for d in later] == [RestoreState, ScaleLR]

    def test_explosions_and_spikes_act_now_whole(self) -> None:
        """Strategies that only see shared incidents (explosion, spike on the mean loss) stay
        equal on every rank: their whole decisions act at once."""
        late = [
            self.decided(ClipGradients(max_norm=1.0, total_norm=9.0), "gradient_exploded"),
            self.decided(ScaleLR(factor=0.5), "gradient_exploded"),
            self.decided(RestoreState(), "loss_spiked"),
        ]
        now, later = split_late(late, local_loss_uncovered=False)
        assert now == tuple(late) and later == ()

    def test_local_incidents_wait_for_the_next_agreement(self) -> None:
        """Rank-local: a clip is dropped, a skip of 3 batches skips the 2 after, a stop waits."""
        late = [
            self.decided(SkipStep(batches=3), "memory_leak_suspected"),
            self.decided(SkipStep(), "memory_leak_suspected"),
            self.decided(ClipGradients(max_norm=1.0, total_norm=9.0), "custom"),
            self.decided(Stop(), "memory_leak_suspected"),
        ]
        now, later = split_late(late, local_loss_uncovered=False)
        assert now == ()
        assert [d.action for d in later] == [SkipStep(batches=2), Stop()]

    def test_a_nan_loss_with_a_finite_gradient_is_local(self) -> None:
        """This rank's loss is NaN but its gradient was finite: its skip is rank-local."""
        late = [self.decided(SkipStep(), "non_finite_detected")]
        assert split_late(late, local_loss_uncovered=True) == ((), ())

    def test_a_non_finite_loss_gradient_on_any_rank_skips(self) -> None:
        """The agreed flag alone makes every rank skip the step."""
        v = codec.encode(codec.vector(2), [], False, 1, loss_grad_bad=True).tolist()
        (only,) = codec.decode(v, [], 12, 2)
        assert only.action == SkipStep() and "loss gradient" in only.reason

    def test_ranks_that_applied_different_decisions_are_named(self) -> None:
        """The digest of what each rank applied: equal -> None, different -> what differed."""
        a = codec.encode(codec.vector(2), [], False, 0, applied=(True, False, True))
        b = codec.encode(codec.vector(2), [], False, 1, applied=(False, False, True))
        assert codec.digest_mismatch(a.maximum(a).tolist()) is None
        assert codec.digest_mismatch(a.maximum(b).tolist()) == "skipped"

    def test_mean_loss_ignores_ranks_without_one(self) -> None:
        """Each rank's loss has its slot; missing or non-finite ones are not averaged."""
        a = codec.encode(codec.vector(3), [], False, 0, 2.0)
        b = codec.encode(codec.vector(3), [], False, 1, math.nan)
        c = codec.encode(codec.vector(3), [], False, 2, 4.0)
        assert codec.mean_loss(a.maximum(b).maximum(c).tolist()) == 3.0
        assert codec.mean_loss(b.tolist()) is None

    def test_launch_hook_sees_the_output_gradient_once_and_leaves_it(self) -> None:
        """The hook reports whether the output's gradient is finite, at each backward, and
        leaves the parameters' gradients as they were; no_grad forwards are not hooked."""
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        x = torch.randn(3, 4)
        model(x).sum().backward()
        reference = model.weight.grad.clone() if model.weight.grad is not None else None
        model.zero_grad()
        seen: list[bool] = []
        launch = OutputGradLaunch(model, seen.append)
        model(x).sum().backward()
        assert seen == [False] and model.weight.grad is not None
        assert reference is not None and torch.equal(model.weight.grad, reference)
        (model(x).sum() * math.nan).backward()
        assert seen == [False, True]
        with torch.no_grad():
            model(x)
        launch.remove()
        model(x).sum().backward()
        assert seen == [False, True]

    @pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
    def test_finite_finds_one_bad_element(self, bad: float) -> None:
        """One NaN, +inf or -inf among finite gradient values makes the check fail."""
        grad = torch.randn(128, 10, generator=torch.Generator().manual_seed(0))
        assert finite(grad)
        grad[7, 3] = bad
        assert not finite(grad)

    def test_finite_values_whose_sum_overflows_are_finite(self) -> None:
        """Huge finite values overflow their float32 sum: the elements are checked, not the sum,
        so the flag (which makes every rank skip) is not raised for them."""
        huge = torch.full((64,), 3e38)
        assert not math.isfinite(float(huge.sum()))
        assert finite(huge)
        assert finite(torch.full((100,), 6e4, dtype=torch.float16))
        huge[-1] = math.nan
        assert not finite(huge)

    def test_finite_handles_complex_half_and_empty(self) -> None:
        """Complex, bfloat16 and empty gradients are judged like any other."""
        z = torch.randn(4, dtype=torch.complex64, generator=torch.Generator().manual_seed(1))
        assert finite(z)
        z[2] = torch.tensor(complex(0.0, math.inf))
        assert not finite(z)
        assert not finite(torch.tensor([1.0, math.nan], dtype=torch.bfloat16))
        assert finite(torch.empty(0))

    def test_launch_needs_a_callable(self) -> None:
        """A launch that is not callable is a clear error."""
        with pytest.raises(TypeError, match="launch must be callable"):
            OutputGradLaunch(nn.Linear(1, 1), "x")  # type: ignore[arg-type]

    def test_overlap_must_be_a_bool(self) -> None:
        """RankAgreement(overlap=...) takes a bool only."""
        with pytest.raises(TypeError, match="overlap must be a bool"):
            RankAgreement(overlap="yes")  # type: ignore[arg-type]


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

    @pytest.mark.parametrize(
        ("world", "rank", "loss"),
        [(2, 0, 1.5), (2, 1, None), (3, 2, math.nan), (3, 0, -math.inf), (4, 3, 0.0)],
    )
    def test_a_rank_with_nothing_to_say_encodes_as_the_general_path(
        self, world: int, rank: int, loss: float | None
    ) -> None:
        """The healthy-step shortcut (a cached vector plus the loss) writes exactly what the
        slot-by-slot encoding writes, into a vector that held another step's decisions."""
        reused = codec.encode(
            codec.vector(world),
            [self.decided(Stop()), self.decided(ScaleLR(factor=0.5, steps=3))],
            True,
            rank,
            9.0,
            loss_grad_bad=True,
            applied=(True, True, True),
        )
        quiet = codec.encode(reused, [], False, rank, loss)
        general = codec.encode(codec.vector(world), [], True, rank, loss)
        general[codec.Slot.NOTED] = 0.0  # the only slot the general path was asked to set
        assert quiet is reused and torch.equal(quiet, general)
        agreed = quiet.tolist()
        assert codec.decode(agreed, [], 3, world) == () and codec.digest_mismatch(agreed) is None
        finite_loss = loss is not None and math.isfinite(loss)
        assert codec.mean_loss(agreed) == (loss if finite_loss else None)

    @pytest.mark.parametrize("held", [True, False])
    def test_a_rank_holding_no_state_says_so_on_quiet_steps_too(self, held: bool) -> None:
        quiet = codec.encode(codec.vector(2), [], False, 1, 2.0, held=held)
        general = codec.encode(codec.vector(2), [], True, 1, 2.0, held=held)
        general[codec.Slot.NOTED] = 0.0
        assert torch.equal(quiet, general)
        assert quiet[codec.Slot.UNHELD] == float(not held)

    @pytest.mark.parametrize("required", [True, False])
    def test_a_restore_with_some_rank_holding_no_state_is_applied_nowhere(
        self, required: bool
    ) -> None:
        """Restored on some ranks only, DDP's replicas would differ: a required restore stops
        every rank, a precautionary one becomes a skip on every rank."""
        a = codec.encode(codec.vector(2), [self.decided(RestoreState(required=required))], True, 0)
        b = codec.encode(codec.vector(2), [], False, 1, held=False)
        agreed = codec.decode(a.maximum(b).tolist(), [], 3, 2)
        kinds = [d.kind for d in agreed]
        assert RecoveryAction.RESTORE_STATE not in kinds
        if required:
            assert kinds == [RecoveryAction.STOP]
            assert "some rank holds no good state to restore" in agreed[0].reason
        else:
            assert kinds == [RecoveryAction.SKIP_STEP]
            assert "no rank restores" in agreed[0].reason
        held = codec.encode(codec.vector(2), [], False, 1)  # every rank holds one: restored
        restored = codec.decode(a.maximum(held).tolist(), [], 3, 2)
        assert [d.action for d in restored] == [RestoreState(required=required)]

    def test_needs_a_process_group(self) -> None:
        """RankAgreement outside a process group is a clear error."""
        with pytest.raises(RuntimeError, match=r"initialized torch\.distributed"):
            RankAgreement()
