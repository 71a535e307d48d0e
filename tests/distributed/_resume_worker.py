"""One rank of a DDP run checkpointed and resumed with the session's state (gloo, CPU).

Run as ``python -m tests.distributed._resume_worker RUNS RANK WORLD INIT_FILE OUT_DIR`` where RUNS
is a comma-separated list run one after the other in the same process group:

- ``full``: one session for steps ``0..STEPS-1``;
- ``first``: steps ``0..RESUME-1``, then a checkpoint as a training script writes one: rank 0
  saves the model's, the optimizer's and its session's state to ``OUT_DIR/checkpoint.pt``;
  every rank also saves its own session's state to ``OUT_DIR/debug.rank{RANK}.pt``;
- ``resume-{how}``: a new model, optimizer and session load the checkpoint and run
  ``RESUME..STEPS-1``; the session's state loaded is rank 0's on every rank (``rank0``, what
  the README says to do), each rank's own (``own``), or none on rank 1 (``none1``).

Each run writes ``OUT_DIR/{run}.rank{RANK}.json``: the incidents and the recovery actions by step,
``should_step`` at each step, the session's final ``state_dict()`` and the parameters' hash.
Faults are planted after the resume, on one rank only, so the decisions taken after it are
agreed ones.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from eventbus_debug import Session
from eventbus_debug.events import Anomaly, RecoveryApplied
from eventbus_debug.testing import RecordingSink
from tests._doubles import quiet

POLICY = "aggressive"
"""Every detected explosion clipped, a loss spike rolled back (with a temporary LR cut)."""
STEPS = 300
RESUME = 150
BURST = 155
"""Rank 0's loss and gradient x30, early after the resume: below the gradient norms the run has
already shown (quiet for the warm detector), a burst for a cold one (rank 1's in ``none1``)."""
SPIKE = 200
"""Rank 0's loss alone jumps (its gradient does not): the ranks' mean loss spikes."""
NAN_LOSS = 230
"""Rank 1's loss alone is NaN (its gradient is finite): only rank 1 sees it; every rank skips."""
NAN_BATCH = 260
"""Rank 1's batch is NaN: its gradient too, which DDP's all-reduce spreads to every rank."""


def _data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's minibatches (noisy, its own), by step: a resumed run sees the same ones."""
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(STEPS, 16, 8, generator=gen)
    w = torch.randn(8, 1, generator=torch.Generator().manual_seed(7))
    return x, x @ w + 0.3 * torch.randn(STEPS, 16, 1, generator=gen)


def _build() -> tuple[nn.Module, DistributedDataParallel, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    model = DistributedDataParallel(net)  # broadcasts rank 0's initial parameters
    return net, model, torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)


def _loss(model: nn.Module, data: tuple[torch.Tensor, torch.Tensor], rank: int, step: int) -> Any:
    x, y = data
    batch = x[step]
    if rank == 1 and step == NAN_BATCH:
        batch = batch.clone()
        batch[0, 0] = math.nan
    loss = nn.functional.mse_loss(model(batch), y[step])
    if rank == 0 and step == BURST:
        return loss * 30.0
    if rank == 0 and step == SPIKE:
        return loss + 25.0
    if rank == 1 and step == NAN_LOSS:
        return loss + math.nan
    return loss


async def _run(
    run: str, rank: int, lo: int, hi: int, out: Path, state: dict[str, Any] | None
) -> dict[str, Any]:
    net, model, opt = _build()
    if lo > 0:  # the checkpoint's model and optimizer (rank 0's, as every rank loads it)
        checkpoint = torch.load(out / "checkpoint.pt", weights_only=True)
        net.load_state_dict(checkpoint["model"])
        opt.load_state_dict(checkpoint["optimizer"])
    data = _data(rank)
    recorder = RecordingSink()
    session = Session(model, opt, **quiet(sinks=[recorder], policy=POLICY))
    if state is not None:
        session.load_state_dict(state)  # before the start: applied at it
    should_step: list[bool] = []
    async with session:
        next_step = session.next_step()
        for step in range(lo, hi):
            opt.zero_grad(set_to_none=True)
            loss = _loss(model, data, rank, step)
            loss.backward()
            verdict = await session.check_step(step, loss=loss)
            should_step.append(verdict.should_step)
            if verdict.should_step:
                opt.step()
            await session.step_completed(step, loss=verdict.loss)
        final = session.state_dict()
    if run == "first":
        if rank == 0:
            torch.save(
                {"model": net.state_dict(), "optimizer": opt.state_dict(), "debug": final},
                out / "checkpoint.pt",
            )
        torch.save(final, out / f"debug.rank{rank}.pt")
    params = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    return {
        "rank": rank,
        "next_step": next_step,
        "should_step": should_step,
        "incidents": [[e.step, e.kind] for e in recorder.events if isinstance(e, Anomaly)],
        "applied": [[e.step, e.action.value, e.outcome] for e in recorder.of_type(RecoveryApplied)],
        "state": {k: v for k, v in final.items() if k != "run_id"},
        "finite": bool(torch.isfinite(params).all()),
        "params": hashlib.sha256(params.numpy().tobytes()).hexdigest(),
    }


def _state_for(run: str, rank: int, out: Path) -> dict[str, Any] | None:
    """The session state *run* loads on *rank* (``None``: none)."""
    how = run.removeprefix("resume-")
    if how == "rank0":
        checkpoint = torch.load(out / "checkpoint.pt", weights_only=True)
        state: dict[str, Any] = checkpoint["debug"]
        return state
    if how == "own":
        own: dict[str, Any] = torch.load(out / f"debug.rank{rank}.pt", weights_only=True)
        return own
    if how == "none1":
        return None if rank == 1 else _state_for("resume-rank0", rank, out)
    msg = f"unknown run {run!r}"
    raise ValueError(msg)


def main() -> None:
    runs, rank, world, init, out_dir = sys.argv[1:6]
    r = int(rank)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init}",
        rank=r,
        world_size=int(world),
        timeout=timedelta(seconds=30),
    )
    out = Path(out_dir)
    # Every rank is done (the checkpoint written) before any tears the groups down, on a group
    # of its own destroyed first: DDP keeps the default group alive past destroy_process_group()
    # (torch 2.13), and a gloo thread still running at the interpreter's end aborts it.
    done = dist.new_group(backend="gloo")
    try:
        for run in runs.split(","):
            if run == "full":
                result = anyio.run(_run, run, r, 0, STEPS, out, None)
            elif run == "first":
                result = anyio.run(_run, run, r, 0, RESUME, out, None)
            else:
                state = _state_for(run, r, out)
                result = anyio.run(_run, run, r, RESUME, STEPS, out, state)
            (out / f"{run}.rank{r}.json").write_text(json.dumps(result))
        dist.barrier(group=done)
    finally:
        dist.destroy_process_group(done)
        del done
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
