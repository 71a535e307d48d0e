"""What the cross-rank agreement costs on a realistic DDP step (2 ranks, gloo, CPU).

Three loops, interleaved in blocks so drift on a shared machine hits all alike:
  bare       DDP step, no library
  session    the default Session with distributed=False (checks, recovery, no agreement)
  agreed     the default Session inside the group (checks, recovery, one agreement per step)
Prints the per-step medians, the ratio agreed/session (the agreement's own cost; target
<= 1.03) and agreed/bare, and the agreement collective's median and p99 latency.

    .venv/bin/python benchmarks/bench_distributed.py [--steps 60] [--blocks 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from datetime import timedelta
from typing import Any

import anyio
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from eventbus_debug import Session
from eventbus_debug.recovery.agreement import AgreedStep, RankAgreement

WIDTH = 768
BATCH = 128


class TimedAgreement:
    """A RankAgreement that records how long each agreement took."""

    def __init__(self) -> None:
        self.inner = RankAgreement()
        self.times: list[float] = []

    def agree(
        self, step: int, decisions: Any, noted: bool, /, *, loss: float | None = None
    ) -> AgreedStep:
        t0 = time.perf_counter()
        out = self.inner.agree(step, decisions, noted, loss=loss)
        self.times.append(time.perf_counter() - t0)
        return out


async def _loop(mode: str, steps: int, rank: int, agreement: TimedAgreement) -> float:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 10)
    )
    model = DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(BATCH, WIDTH, generator=gen)
    y = torch.randint(0, 10, (BATCH,), generator=gen)
    times: list[float] = []
    if mode == "bare":
        for _ in range(steps):
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    distributed: Any = agreement if mode == "agreed" else False
    async with Session(
        model, opt, log_dir=None, report=False, alerts=False, system_interval=None,
        distributed=distributed,
    ) as session:  # fmt: skip
        for step in range(steps):
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            verdict = await session.check_step(step, loss=loss)
            if verdict.should_step:
                opt.step()
            await session.step_completed(step, loss=verdict.loss)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _worker(rank: int, world: int, init: str, steps: int, blocks: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init}", rank=rank, world_size=world,
        timeout=timedelta(seconds=120),
    )  # fmt: skip
    agreement = TimedAgreement()
    medians: dict[str, list[float]] = {"bare": [], "session": [], "agreed": []}
    for _ in range(blocks):
        for mode in medians:
            dist.barrier()
            medians[mode].append(anyio.run(_loop, mode, steps, rank, agreement))
    if rank == 0:
        m = {k: statistics.median(v) for k, v in medians.items()}
        lat = sorted(agreement.times)
        p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
        print(f"DDP step, 2 ranks, gloo, MLP {WIDTH}x3 batch {BATCH}, 1 thread per rank")
        print(f"  bare step              {m['bare'] * 1e3:8.2f} ms")
        print(f"  session, no agreement  {m['session'] * 1e3:8.2f} ms")
        print(f"  session, agreed        {m['agreed'] * 1e3:8.2f} ms")
        print(f"  agreed / no agreement  {m['agreed'] / m['session']:8.3f}x   (target <= 1.03)")
        print(f"  agreed / bare          {m['agreed'] / m['bare']:8.3f}x")
        print(
            f"  agreement collective   median {statistics.median(lat) * 1e6:.0f} us, "
            f"p99 {p99 * 1e6:.0f} us over {len(lat)} steps"
        )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--blocks", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        mp.spawn(_worker, args=(2, f"{tmp}/init", args.steps, args.blocks), nprocs=2, join=True)


if __name__ == "__main__":
    main()
