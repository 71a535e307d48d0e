"""What the cross-rank agreement costs on a realistic DDP step (2 ranks, gloo, CPU).

Four loops, interleaved in blocks (the order rotates each block) so drift on a shared machine
hits all alike:
  bare       DDP step, no library
  session    the default Session with distributed=False (checks, recovery, no agreement)
  agreed     the default Session inside the group: the agreement is launched during backward
             and waited at the safe point (RankAgreement(), overlapped)
  blocking   the same with RankAgreement(overlap=False): one blocking collective per safe point
Prints the per-step medians, the ratios agreed/session (the agreement's own cost; target
<= 1.03), blocking/session and agreed/bare, and how long the safe point waited for the other
ranks (median, p99): for the overlapped agreement the wait on the launched collective, for the
blocking one the collective itself.

    .venv/bin/python benchmarks/bench_distributed.py [--steps 60] [--blocks 8]
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
from eventbus_debug.recovery.agreement import RankAgreement

WIDTH = 768
BATCH = 128


async def _loop(mode: str, steps: int, rank: int, agreements: dict[str, RankAgreement]) -> float:
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
    distributed: Any = agreements.get(mode, False)
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
    agreements = {"agreed": RankAgreement(), "blocking": RankAgreement(overlap=False)}
    medians: dict[str, list[float]] = {"bare": [], "session": [], "agreed": [], "blocking": []}
    order = list(medians)
    for block in range(blocks):
        for mode in order[block % len(order) :] + order[: block % len(order)]:
            dist.barrier()
            medians[mode].append(anyio.run(_loop, mode, steps, rank, agreements))
    if rank == 0:
        m = {k: statistics.median(v) for k, v in medians.items()}
        print(f"DDP step, 2 ranks, gloo, MLP {WIDTH}x3 batch {BATCH}, 1 thread per rank")
        print(f"  bare step                   {m['bare'] * 1e3:8.2f} ms")
        print(f"  session, no agreement       {m['session'] * 1e3:8.2f} ms")
        print(f"  session, agreed             {m['agreed'] * 1e3:8.2f} ms   (overlapped)")
        print(f"  session, agreed, blocking   {m['blocking'] * 1e3:8.2f} ms   (overlap=False)")
        print(
            f"  agreed / no agreement       {m['agreed'] / m['session']:8.3f}x   (target <= 1.03)"
        )
        print(f"  blocking / no agreement     {m['blocking'] / m['session']:8.3f}x")
        print(f"  agreed / bare               {m['agreed'] / m['bare']:8.3f}x")
        for name, agreement in agreements.items():
            lat = sorted(agreement.waits)
            p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
            what = "safe point waited" if name == "agreed" else "collective took"
            print(
                f"  {name:9s} {what:17s} median {statistics.median(lat) * 1e6:6.0f} us, "
                f"p99 {p99 * 1e6:6.0f} us over the last {len(lat)} steps "
                f"({agreement.overlapped} overlapped)"
            )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--blocks", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        mp.spawn(_worker, args=(2, f"{tmp}/init", args.steps, args.blocks), nprocs=2, join=True)


if __name__ == "__main__":
    main()
