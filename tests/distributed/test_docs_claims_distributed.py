"""The claims of docs/distributed.md and of the README's "Distributed training" section, checked
as a new user would (real gloo groups of 2 and 3 ranks, each bounded by a timeout).

Run as ``python -m tests.distributed.test_docs_claims_distributed MODE RANK WORLD INIT OUT``
for one rank (the tests start the ranks); each rank writes ``OUT/MODE.rank{RANK}.json``.
"""

from __future__ import annotations

import copy
import faulthandler
import json
import math
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from eventbus_debug import Cadence, RankAgreement, Session, SyncSession, TrainingStopped
from eventbus_debug.events import MemoryLeakSuspected, SessionEnded, StepSkipped
from eventbus_debug.recovery import agreement_codec as codec
from eventbus_debug.recovery.actions import ClipGradients, DecidedAction, Decision, SkipStep, Stop
from eventbus_debug.recovery.agreement import AGREE_TIMEOUT
from eventbus_debug.testing import RecordingSink

from ._ranks import run_ranks, stay_alive_until

LIMIT = 90.0  # seconds for a whole group; a regression fails instead of hanging
STEPS = 12
DUMP_AFTER = float(os.environ.get("DOCS_CLAIMS_DUMP_AFTER", LIMIT - 10))
QUIET: dict[str, Any] = {"alerts": False, "system_interval": None}


# -- the ranks' side ------------------------------------------------------------------------------


def _model() -> tuple[nn.Module, DistributedDataParallel, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    model = DistributedDataParallel(net)
    return net, model, torch.optim.SGD(model.parameters(), lr=0.01)


def _params(net: nn.Module) -> list[float]:
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()]).tolist()


def _train(
    session: SyncSession,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    rank: int,
    *,
    steps: int = STEPS,
    nan_at: int | None = None,
    step_of: Callable[[int], int] = lambda s: s,
    before_check: Callable[[int], None] = lambda s: None,
) -> dict[str, Any]:
    """Train *steps* steps (a NaN loss on rank 1 at *nan_at*); what the rank saw."""
    gen = torch.Generator().manual_seed(10 + rank)
    out: dict[str, Any] = {"stopped_at": None, "reason": "", "should_step": []}
    step = -1
    try:
        for step in range(steps):
            opt.zero_grad(set_to_none=True)
            x = torch.randn(8, 4, generator=gen)
            loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
            if rank == 1 and step == nan_at:
                loss = loss * math.nan
            loss.backward()  # type: ignore[no-untyped-call]
            before_check(step)
            verdict = session.check_step(step_of(step), loss=loss)
            out["should_step"].append(verdict.should_step)
            if verdict.should_step:
                opt.step()
            session.step_completed(step_of(step))
    except TrainingStopped as exc:
        out["stopped_at"] = step
        out["reason"] = str(exc)
    return out


def _claims(rank: int, world: int, out: Path) -> dict[str, Any]:
    """Many claims, one process group: each check a short session on the same DDP model."""
    net, model, opt = _model()
    res: dict[str, Any] = {}

    # distributed=None (the default) agrees by itself, blocking: one collective a safe point
    rec = RecordingSink()
    logs = out / "logs"
    with SyncSession(model, opt, log_dir=logs, sinks=[rec], **QUIET) as session:
        agreement = session.agreement
        res["default_type"] = type(agreement).__name__
        trained = _train(session, model, opt, rank, nan_at=5)
    assert isinstance(agreement, RankAgreement)
    res["default"] = {
        "timeout": agreement.timeout,
        "overlap": agreement.overlap,
        "agreements": agreement.agreements,
        "overlapped": agreement.overlapped,
        "skipped": sorted({e.step for e in rec.of_type(StepSkipped) if e.step is not None}),
        **trained,
    }
    res["logs"] = sorted(p.name for p in logs.iterdir())

    # distributed=False opts out, distributed=True insists, an agreement given is used
    alone = copy.deepcopy(net)  # no collective at all (no DDP): rank 1 runs more steps
    alone_opt = torch.optim.SGD(alone.parameters(), lr=0.01)
    with SyncSession(alone, alone_opt, log_dir=None, distributed=False, **QUIET) as session:
        res["false_agreement"] = session.agreement is None
        res["false"] = _train(session, alone, alone_opt, rank, steps=3 + rank)
    with SyncSession(model, opt, log_dir=None, distributed=True, **QUIET) as session:
        res["true_type"] = type(session.agreement).__name__
        _train(session, model, opt, rank, steps=2)
    given = RankAgreement(timeout=600.0)
    with SyncSession(model, opt, log_dir=None, distributed=given, **QUIET) as session:
        res["given_is_used"] = session.agreement is given
        _train(session, model, opt, rank, steps=2)
    res["given_timeout"] = given.timeout
    res["given_agreements"] = given.agreements

    # the async Session agrees the same way
    async def async_run() -> str:
        async with Session(model, opt, log_dir=None, **QUIET) as session:
            for step in range(3):
                opt.zero_grad(set_to_none=True)
                model(torch.ones(2, 4)).sum().backward()
                if (await session.check_step(step)).should_step:
                    opt.step()
                await session.step_completed(step)
            return type(session.agreement).__name__

    res["async_type"] = anyio.run(async_run)

    # a rank whose level is OFF still agrees at every safe point, and applies the agreed skip
    level = "off" if rank == 0 else "basic"
    with SyncSession(model, opt, log_dir=None, level=level, **QUIET) as session:
        off = _train(session, model, opt, rank, nan_at=4)
        res["level_off_agreements"] = getattr(session.agreement, "agreements", None)
    res["level_off"] = off

    # overlap=True under DDP launches during backward; an overhead budget keeps it blocking
    overlapped = RankAgreement(overlap=True)
    with SyncSession(model, opt, log_dir=None, distributed=overlapped, **QUIET) as session:
        _train(session, model, opt, rank, steps=4)
    res["overlapped"] = overlapped.overlapped
    budgeted = RankAgreement(overlap=True)
    with SyncSession(
        model, opt, log_dir=None, distributed=budgeted, overhead_budget=0.5, **QUIET
    ) as session:
        _train(session, model, opt, rank, steps=4)
    res["budget_overlapped"] = budgeted.overlapped

    # a stop decided on one rank stops every rank at the same step, naming the deciding rank
    rec = RecordingSink()
    with pytest.raises(TrainingStopped) as stopped:
        with SyncSession(model, opt, log_dir=None, sinks=[rec], **QUIET) as session:
            assert session.recovery is not None
            session.recovery.register(_stop, on=MemoryLeakSuspected)

            def leak(step: int) -> None:
                if rank == 1 and step == 3:
                    session.publish(_leak(step))

            # the session lets the agreed TrainingStopped through: re-raised here
            stop = _train(session, model, opt, rank, before_check=leak)
            if stop["stopped_at"] is not None:
                raise TrainingStopped(stop["reason"])
    res["stop"] = {
        "stopped_at": stop["stopped_at"],
        "message": str(stopped.value),
        "ended": [[e.reason, e.detail] for e in rec.of_type(SessionEnded)],
    }

    # ranks passing different step numbers to check_step
    with SyncSession(model, opt, log_dir=None, **QUIET) as session:
        res["steps_apart"] = _train(session, model, opt, rank, steps=4, step_of=lambda s: s + rank)
    res["params"] = _params(net)
    return res


def _leak(step: int) -> MemoryLeakSuspected:
    return MemoryLeakSuspected(
        source="test", step=step, resource="rss", slope=1e6, window=10, retained="test"
    )


def _stop(incident: Any, history: Any) -> Decision:
    return Decision(action=Stop(), reason=f"leak on this rank at step {incident.step}")


def _raises(rank: int, world: int, out: Path) -> dict[str, Any]:
    """The last rank raises its own error inside its session after backward at step 5 and
    stays alive (the error is caught outside the session); the others train on."""
    _, model, opt = _model()
    res: dict[str, Any] = {}
    last = time.monotonic()
    try:
        with SyncSession(model, opt, log_dir=None, **QUIET) as session:
            for step in range(40):
                opt.zero_grad(set_to_none=True)
                model(torch.ones(2, 4)).sum().backward()
                if rank == world - 1 and step == 5:
                    raise ValueError("this rank's own bug")
                last = time.monotonic()
                if session.check_step(step).should_step:
                    opt.step()
                session.step_completed(step)
    except (ValueError, TrainingStopped) as exc:
        res = {
            "error": type(exc).__name__,
            "message": str(exc),
            "waited_s": time.monotonic() - last,
        }
    (out / f"raises.rank{rank}.json").write_text(json.dumps(res))
    if rank == world - 1:  # alive: the others must not wait for this process to end
        stay_alive_until([out / f"raises.rank{r}.json" for r in range(world - 1)], 10.0)
    return res


def _mixed(rank: int, world: int, out: Path) -> dict[str, Any]:
    """Rank 1 opts out (distributed=False) while rank 0 builds an agreement (timeout 4 s)."""
    _, model, opt = _model()
    distributed: Any = False if rank == 1 else None
    res: dict[str, Any] = {}
    started = time.monotonic()
    try:
        if rank == 0:
            distributed = RankAgreement(timeout=4.0)
        with SyncSession(model, opt, log_dir=None, distributed=distributed, **QUIET) as session:
            res = _train(session, model, opt, rank, steps=3)
    except Exception as exc:
        res = {"error": type(exc).__name__, "message": str(exc)}
    res["elapsed_s"] = time.monotonic() - started
    return res


def _before_init(rank: int, world: int, init: str) -> dict[str, Any]:
    """A session entered before init_process_group (a plain model, distributed=None)."""
    net = nn.Linear(4, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    res: dict[str, Any] = {}
    with SyncSession(net, opt, log_dir=None, **QUIET) as session:
        res["agreement"] = session.agreement is not None
        _join_group(rank, world, init)
        # every rank's init done before one refuses and leaves: a rank that left while the
        # other still connected its mesh failed it ("Connection closed by peer")
        dist.barrier()
        try:
            _train(session, net, opt, rank, steps=2)
        except RuntimeError as exc:
            res["error"] = str(exc)
    return res


def _join_group(rank: int, world: int, init: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=30),
    )


def main() -> None:
    mode, rank_, world_, init, out_ = sys.argv[1:6]
    faulthandler.dump_traceback_later(DUMP_AFTER, exit=True)  # a hang says where
    rank, world, out = int(rank_), int(world_), Path(out_)
    if mode == "before_init":
        result = _before_init(rank, world, init)
    else:
        _join_group(rank, world, init)
        result = {"claims": _claims, "raises": _raises, "mixed": _mixed}[mode](rank, world, out)
    if mode != "raises":
        (out / f"{mode}.rank{rank}.json").write_text(json.dumps(result))
    if mode in ("claims", "before_init"):
        dist.barrier()
    if mode != "raises":
        dist.destroy_process_group()


# -- the tests' side -------------------------------------------------------------------------------


def _group(tmp: Path, mode: str, world: int = 2, limit: float = LIMIT) -> list[dict[str, Any]]:
    outputs = run_ranks("tests.distributed.test_docs_claims_distributed", [mode], world, tmp, limit)
    paths = [tmp / f"{mode}.rank{r}.json" for r in range(world)]
    if not all(p.exists() for p in paths):
        pytest.fail(f"a rank wrote no result:\n{outputs}")
    return [json.loads(p.read_text()) for p in paths]


@pytest.fixture(scope="module")
def claims(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _group(tmp_path_factory.mktemp("claims"), "claims")


def test_the_default_agrees_by_itself_blocking_with_a_300_s_timeout(
    claims: list[dict[str, Any]],
) -> None:
    """distributed=None in a group of 2: a RankAgreement (Session and SyncSession alike),
    300 s, blocking: one collective per safe point, none launched during backward."""
    assert AGREE_TIMEOUT == 300.0
    for r in claims:
        assert r["default_type"] == r["async_type"] == "RankAgreement"
        d = r["default"]
        assert d["timeout"] == 300.0 and d["overlap"] is False
        assert d["agreements"] == STEPS and d["overlapped"] == 0


def test_a_nan_on_one_rank_is_skipped_by_every_rank(claims: list[dict[str, Any]]) -> None:
    for r in claims:
        assert r["default"]["skipped"] == [5]
        assert r["default"]["stopped_at"] is None
    assert claims[0]["default"]["should_step"] == claims[1]["default"]["should_step"]


def test_each_rank_writes_its_own_log_and_rank_0_the_live_report(
    claims: list[dict[str, Any]], tmp_path: Path
) -> None:
    """events.jsonl, events.rank1.jsonl; the live report from rank 0 only."""
    logs = claims[0]["logs"]  # after rank 0's session ended (rank 1 may list it earlier)
    assert "events.jsonl" in logs and "events.rank1.jsonl" in logs
    assert [n for n in logs if n.startswith("report")] == ["report.html", "report.json"]
    assert not [n for n in logs if "rank1" in n and not n.startswith("events")]


def test_the_options_opt_out_insist_and_set_the_timeout(claims: list[dict[str, Any]]) -> None:
    """distributed=False: no agreement (no collective: the ranks may run different numbers of
    steps); True: a RankAgreement; RankAgreement(timeout=600.0): used as given."""
    for rank, r in enumerate(claims):
        assert r["false_agreement"] is True
        assert len(r["false"]["should_step"]) == 3 + rank
        assert r["true_type"] == "RankAgreement"
        assert r["given_is_used"] is True and r["given_timeout"] == 600.0
        assert r["given_agreements"] == 2


def test_a_rank_whose_level_is_off_agrees_at_every_safe_point(claims: list[dict[str, Any]]) -> None:
    """Rank 0 at level OFF, rank 1 BASIC with a NaN loss at step 4: both agree each step and
    both skip step 4 (the off rank applies the agreed skip)."""
    assert [r["level_off_agreements"] for r in claims] == [STEPS, STEPS]
    assert claims[0]["level_off"]["should_step"] == claims[1]["level_off"]["should_step"]
    assert claims[0]["level_off"]["should_step"][4] is False


def test_overlap_is_opt_in_and_an_overhead_budget_keeps_it_blocking(
    claims: list[dict[str, Any]],
) -> None:
    for r in claims:
        assert r["overlapped"] > 0
        assert r["budget_overlapped"] == 0


def test_a_stop_on_one_rank_stops_every_rank_at_the_same_step(
    claims: list[dict[str, Any]],
) -> None:
    """TrainingStopped on every rank at step 3; the other rank's message names rank 1;
    SessionEnded says "stopped" with the reason as its detail."""
    stops = [r["stop"] for r in claims]
    assert [s["stopped_at"] for s in stops] == [3, 3]
    assert "rank 1" in stops[0]["message"]
    assert "leak on this rank at step 3" in stops[1]["message"]
    for s in stops:
        assert s["ended"] and s["ended"][-1][0] == "stopped"
        assert s["ended"][-1][1] and s["ended"][-1][1] in s["message"]


def test_ranks_passing_different_step_numbers_stop_together(claims: list[dict[str, Any]]) -> None:
    results = [r["steps_apart"] for r in claims]
    assert [r["stopped_at"] for r in results] == [0, 0]
    for r in results:
        assert "different step numbers" in r["reason"]


def test_parameters_end_equal(claims: list[dict[str, Any]]) -> None:
    assert claims[0]["params"] == claims[1]["params"]


def test_a_rank_raising_its_own_error_stops_the_others_together(tmp_path: Path) -> None:
    """3 ranks: rank 2 raises after backward and stays alive; ranks 0 and 1 both stop with
    TrainingStopped within seconds (not the 300 s timeout), saying they could not agree."""
    results = _group(tmp_path, "raises", world=3)
    assert results[2]["error"] == "ValueError"
    for r in results[:2]:
        assert r["error"] == "TrainingStopped", r
        assert r["waited_s"] < 8.0, r
        assert "could not agree on step 5" in r["message"]
        assert "RankAgreement(timeout=SECONDS)" in r["message"]


def test_one_rank_opting_out_while_another_agrees_fails_clearly(tmp_path: Path) -> None:
    """distributed=False on rank 1, an agreement on rank 0: rank 0 cannot build its group and
    says why within its timeout, instead of hanging; rank 1 then meets rank 0's exit in DDP's
    own all-reduce (an error, not a hang)."""
    first, second = _group(tmp_path, "mixed")
    assert first["error"] == "RuntimeError", first
    assert "could not create the agreement's group within 4 s" in first["message"], first
    assert "distributed=False on some ranks only" in first["message"], first
    assert first["elapsed_s"] < 30.0 and second["elapsed_s"] < 30.0


def test_a_session_entered_before_init_process_group_says_so(tmp_path: Path) -> None:
    """It built no agreement (no group then); once the group exists, its next safe point
    refuses to go on alone instead of letting the ranks decide apart silently."""
    results = _group(tmp_path, "before_init")
    for r in results:
        assert r["agreement"] is False
        assert "before" in r.get("error", "") and "init_process_group" in r["error"], r


# -- single-process claims --------------------------------------------------------------------------


def test_rank_agreement_is_exported_and_checks_its_arguments_first() -> None:
    """``from eventbus_debug import RankAgreement``; a bad timeout or overlap is named before
    the missing process group."""
    if dist.is_initialized():  # pragma: no cover - a group left behind
        pytest.skip("a process group is initialized in this worker")
    with pytest.raises(ValueError, match="timeout"):
        RankAgreement(timeout=0)
    with pytest.raises(TypeError, match="overlap must be a bool"):
        RankAgreement(overlap="yes")  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match=r"initialized torch\.distributed process group"):
        RankAgreement()


def test_a_session_alone_has_no_agreement() -> None:
    net = nn.Linear(2, 1)
    with SyncSession(net, torch.optim.SGD(net.parameters(), lr=0.1), log_dir=None, **QUIET) as s:
        assert s.agreement is None


def _decided(action: Any, kind: str = "test") -> DecidedAction:
    return DecidedAction(
        decision=Decision(action=action, reason=f"mine: {kind}"),
        strategy="s",
        trigger_kind=kind,
        trigger_seq=0,
        step=3,
    )


def test_skip_on_one_rank_and_clip_on_another_both_survive() -> None:
    """One flag per action, the smallest max norm, each rank's loss in its own slot, the mean
    read by every rank; another rank's decision is logged as agreed."""
    a = codec.encode(codec.vector(2), [_decided(SkipStep())], True, 0, loss=1.0).clone()
    b = codec.encode(
        codec.vector(2), [_decided(ClipGradients(max_norm=2.0, total_norm=9.0))], False, 1, loss=3.0
    )
    c = codec.encode(
        codec.vector(2), [_decided(ClipGradients(max_norm=5.0, total_norm=7.0))], False, 1
    )
    agreed = torch.maximum(torch.maximum(a, b), c).tolist()
    decided = codec.decode(agreed, [_decided(SkipStep())], 3, 2)
    kinds = {d.kind.value: d for d in decided}
    assert set(kinds) == {"skip_step", "clip_gradients"}
    clip = kinds["clip_gradients"].decision.action
    assert isinstance(clip, ClipGradients) and clip.max_norm == 2.0
    assert kinds["skip_step"].decision.reason == "mine: test"
    assert kinds["clip_gradients"].decision.reason.startswith(
        "agreed across 2 ranks: another rank decided to clip"
    )
    assert codec.mean_loss(agreed) == 2.0
    assert bool(agreed[codec.Slot.NOTED])


def test_parameter_checks_default_to_every_10th_step() -> None:
    assert Cadence().param_every == 10


if __name__ == "__main__":
    main()
