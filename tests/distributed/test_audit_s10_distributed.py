"""A session's agreement ends with the session (real gloo groups of 2 ranks, bounded).

Regressions: every session entered in a process group built a ``RankAgreement`` whose new gloo
group was never destroyed, so a job entering one session per epoch gained sockets and threads
per epoch (5 file descriptors and 3 threads a session on 2 ranks: the default limit of 1024
open files was reached after ~200 epochs); and a session's exit left an overlapped agreement's
forward hook on the model, launching all-reduces in later backward passes.

Run as ``python -m tests.distributed.test_audit_s10_distributed RANK WORLD INIT_FILE OUT_DIR``
for one rank (the tests start the ranks).
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from eventbus_debug import SyncSession
from eventbus_debug.exceptions import TrainingStopped
from eventbus_debug.recovery.agreement import RankAgreement

from ._ranks import run_ranks, stay_alive_until

LIMIT = 60.0  # seconds for the whole group; a regression fails instead of hanging
EPOCHS = 40


def _open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


def _epoch(model: nn.Module, opt: torch.optim.Optimizer, epoch: int, distributed: Any) -> None:
    """One short session of two steps."""
    with SyncSession(
        model, opt, log_dir=None, alerts=False, system_interval=None, distributed=distributed
    ) as session:
        for i in range(2):
            step = 2 * epoch + i
            opt.zero_grad(set_to_none=True)
            loss = model(torch.randn(8, 4)).pow(2).mean()
            loss.backward()
            if session.check_step(step, loss=loss).should_step:
                opt.step()
            session.step_completed(step)


def _join(rank: int, world: int, init: str) -> nn.Linear:
    """Join the gloo group of *world* ranks through the file *init*; the same seeded model on
    every rank."""
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=30),
    )
    torch.manual_seed(0)
    return nn.Linear(4, 1)


def _rank(rank: int, world: int, init: str, out: Path) -> None:
    net = _join(rank, world, init)
    model = DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    result: dict[str, Any] = {}
    files = []
    for epoch in range(EPOCHS):
        _epoch(model, opt, epoch, None)
        files.append(_open_files())
    result["files"] = files
    # An agreement given as distributed= is detached at exit (no hook left) and serves again.
    given = RankAgreement(overlap=True)
    _epoch(model, opt, EPOCHS, given)
    result["hooks_after_given"] = len(model._forward_hooks)
    _epoch(model, opt, EPOCHS + 1, given)
    result["given_agreements"] = given.agreements
    result["given_overlapped"] = given.overlapped
    result["hooks_after_reuse"] = len(model._forward_hooks)
    with SyncSession(model, opt, log_dir=None, alerts=False, system_interval=None) as session:
        built = session.agreement
    assert isinstance(built, RankAgreement)
    try:
        built.agree(0, (), False)
    except RuntimeError as exc:
        result["closed"] = str(exc)
    params = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    result["params"] = params.tolist()
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _run_ranks(tmp: Path, *mode: str) -> list[dict[str, Any]]:
    """Run this module as two gloo ranks (``python -m ... [mode] RANK 2 INIT OUT``) within
    LIMIT seconds; each rank's result, read from ``rank{N}.json``."""
    outputs = run_ranks("tests.distributed.test_audit_s10_distributed", mode, 2, tmp, LIMIT)
    paths = [tmp / f"rank{r}.json" for r in range(2)]
    if not all(p.exists() for p in paths):
        pytest.fail(f"a rank wrote no result:\n{outputs}")
    return [json.loads(p.read_text()) for p in paths]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _run_ranks(tmp_path_factory.mktemp("audit_s10"))


def test_one_session_per_epoch_holds_one_agreement_group(ranks: list[dict[str, Any]]) -> None:
    """40 sessions in a row: the open files stay flat (they grew by 5 a session)."""
    for result in ranks:
        files = result["files"]
        assert files[-1] - files[4] <= 2, files


def test_session_exit_detaches_an_overlapped_agreement(ranks: list[dict[str, Any]]) -> None:
    """No forward hook is left on the model; the same agreement serves the next session."""
    for result in ranks:
        assert result["hooks_after_given"] == 0
        assert result["hooks_after_reuse"] == 0
        assert result["given_agreements"] == 4  # two safe points in each of two sessions
        assert result["given_overlapped"] > 0


def test_a_closed_agreement_refuses_to_agree(ranks: list[dict[str, Any]]) -> None:
    """Its group may be destroyed: it says so instead of reducing on another group."""
    for result in ranks:
        assert "closed" in result.get("closed", "")


def test_parameters_stay_identical(ranks: list[dict[str, Any]]) -> None:
    assert ranks[0]["params"] == ranks[1]["params"]


def test_distributed_true_outside_a_group_says_what_to_do() -> None:
    """``distributed=True`` without a process group: the error names the option and the call
    that makes the group."""
    if dist.is_available() and dist.is_initialized():  # pragma: no cover - a group left behind
        pytest.skip("a process group is initialized in this worker")
    model = torch.nn.Linear(2, 2)
    session = SyncSession(
        model, torch.optim.SGD(model.parameters(), lr=0.1), log_dir=None, distributed=True
    )
    with pytest.raises(RuntimeError, match=r"distributed=True needs .* dist\.init_process_group"):
        session.__enter__()


HOLD = 12.0
"""Seconds the failed rank stays alive after its error (its process keeps the group open)."""


def _failing_rank(rank: int, world: int, init: str, out: Path) -> None:
    """Rank 1 raises inside its session at step 5 and stays alive; rank 0 trains on."""
    model = DistributedDataParallel(_join(rank, world, init))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    result: dict[str, Any] = {}
    last = time.monotonic()
    try:
        with SyncSession(model, opt, log_dir=None, alerts=False, system_interval=None) as session:
            for step in range(40):
                opt.zero_grad(set_to_none=True)
                loss = model(torch.randn(8, 4)).pow(2).mean()
                loss.backward()
                if rank == 1 and step == 5:
                    raise ValueError("this rank's own bug")
                last = time.monotonic()
                if session.check_step(step, loss=loss).should_step:
                    opt.step()
                session.step_completed(step)
    except (ValueError, TrainingStopped) as exc:
        result["error"] = type(exc).__name__
        result["message"] = str(exc)
        result["waited_s"] = time.monotonic() - last
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    if rank == 1:  # alive: without the abort, rank 0 waits for this process to end
        stay_alive_until([out / "rank0.json"], HOLD)


def test_a_rank_failing_in_its_session_stops_the_others_at_once(tmp_path: Path) -> None:
    """A rank whose session ends with its own error destroys the agreement group it built:
    the other rank, waiting in its next agreement, stops with TrainingStopped within seconds,
    not after the failed process ends (nor the 300 s agreement timeout)."""
    first, failed = _run_ranks(tmp_path, "fail")
    assert failed["error"] == "ValueError"
    assert first["error"] == "TrainingStopped", first
    assert first["waited_s"] < HOLD / 2, first
    assert "could not agree on step" in first["message"]
    assert "(the timeout is 300 s)" in first["message"]  # says it did not wait that long


if __name__ == "__main__":
    if sys.argv[1] == "fail":
        _failing_rank(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], Path(sys.argv[5]))
    else:
        _rank(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]))
