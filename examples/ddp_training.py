"""DDP on CPU with gloo: one recovery decision for every rank, no hang, no divergence.

Run with ``torchrun --nproc-per-node 2 examples/ddp_training.py`` (or ``--steps``/``--log-dir``).
Rank 1 gets a NaN batch at a third of the run and rank 0 a sustained loss spike at two thirds.
Every rank skips the NaN step; the spike is judged on the ranks' mean loss, so every rank
reports it at the same step. The default ``"safe"`` policy does not roll back on a loss signal
alone (it cannot tell a fault from a shift of the data); ``--policy aggressive`` makes every rank
roll back to the same state at the same step. Either way the parameters stay bitwise equal.
Each rank writes its own log under the log directory; rank 0 writes the report.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
from datetime import timedelta

import anyio
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from eventbus_debug import Session
from eventbus_debug.events import LossSpiked, RecoveryApplied, StepSkipped
from eventbus_debug.testing import RecordingSink


async def train(steps: int, log_dir: str, policy: str = "safe") -> dict[str, object]:
    """Train a small regressor under DDP; returns what this rank skipped, applied and ended with."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
    model = DistributedDataParallel(net)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own shard of the data
    w = torch.randn(16, 1, generator=torch.Generator().manual_seed(7))
    recorder = RecordingSink()
    async with Session(
        model, optimizer, log_dir=log_dir, sinks=[recorder], policy=policy
    ) as session:
        for step in range(steps):
            x = torch.randn(32, 16, generator=gen)
            y = torch.sin(x @ w)
            if rank == 1 and step == steps // 3:
                x[0, 0] = math.nan  # a corrupt sample on rank 1 only
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(model(x), y)
            if rank == 0 and 2 * steps // 3 <= step < 2 * steps // 3 + 10:
                loss = loss * 50  # a sustained spike seen by rank 0 only
            loss.backward()
            verdict = await session.check_step(step, loss=loss)  # agreed across the ranks
            if verdict.should_step:
                optimizer.step()
            await session.step_completed(step, loss=verdict.loss)
    params = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    return {
        "rank": rank,
        "skipped": sorted({e.step for e in recorder.of_type(StepSkipped)}),
        "applied": [(e.step, e.action.value) for e in recorder.of_type(RecoveryApplied)],
        "spikes": sorted({e.step for e in recorder.of_type(LossSpiked) if e.step is not None}),
        "params": hashlib.sha256(params.numpy().tobytes()).hexdigest()[:16],
    }


def main(
    steps: int = 300, log_dir: str = "debug_logs/ddp", policy: str = "safe"
) -> dict[str, object]:
    """Join the process group torchrun set up, train, and check the ranks agree."""
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    # The ranks' results travel on a group of their own, which is destroyed (its threads
    # joined) before the interpreter exits. DDP keeps the default group alive past
    # destroy_process_group() (torch 2.13), and a gloo thread still releasing a gathered tensor
    # when the interpreter finalizes aborts the process ("terminate called without an active
    # exception"), after a run that succeeded: one run in ten, with or without this library.
    results = dist.new_group(backend="gloo")
    try:
        mine = anyio.run(train, steps, log_dir, policy)
        everyone: list[object] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine, group=results)
        dist.barrier()  # every rank is done with the groups before any tears them down
    finally:
        dist.destroy_process_group(results)
        del results  # the last reference: its gloo threads are joined here
        dist.destroy_process_group()
    if mine["rank"] == 0:
        same = len({r["params"] for r in everyone}) == 1  # type: ignore[index]
        for result in everyone:
            print(result)
        print(f"parameters identical on every rank: {same}")
    return mine


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--log-dir", default=os.environ.get("LOG_DIR", "debug_logs/ddp"))
    parser.add_argument("--policy", default="safe", choices=("observe", "safe", "aggressive"))
    args = parser.parse_args()
    main(args.steps, args.log_dir, args.policy)
