"""What the cross-rank agreement costs on a realistic DDP step (2 ranks, gloo, CPU).

Four identical DDP models trained side by side in one loop; every iteration runs one step of
each, in an order that rotates every iteration, so drift on a shared machine hits all alike:
  bare       DDP step, no library
  session    the default Session with distributed=False (checks, recovery, no agreement)
  agreed     the default Session inside the group: the agreement is launched during backward
             and waited at the safe point (RankAgreement(), overlapped)
  blocking   the same with RankAgreement(overlap=False): one blocking collective per safe point
Prints the per-step medians, the ratios agreed/session (the agreement's own cost; target
<= 1.03), blocking/session and agreed/bare, and how long the safe point waited for the other
ranks (median, p90, p99): for the overlapped agreement the wait on the launched collective (and
the blocking round its parameter-check steps add), for the blocking one the collective itself.

    .venv/bin/python benchmarks/bench_distributed.py [--steps 400] [--warmup 20]
"""

from __future__ import annotations

import argparse
import contextlib
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


MODES = ("bare", "session", "agreed", "blocking")


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 10)
    )
    model = DistributedDataParallel(net)
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


async def _run(
    steps: int, warmup: int, rank: int, agreements: dict[str, RankAgreement]
) -> dict[str, list[float]]:
    """One loop of *steps* iterations; each runs one step of every mode, in a rotating order."""
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(BATCH, WIDTH, generator=gen)
    y = torch.randint(0, 10, (BATCH,), generator=gen)
    models = {mode: _model() for mode in MODES}
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    async with contextlib.AsyncExitStack() as stack:
        sessions = {
            mode: await stack.enter_async_context(
                Session(
                    *models[mode],
                    log_dir=None,
                    report=False,
                    alerts=False,
                    system_interval=None,
                    distributed=agreements.get(mode, False),
                )
            )
            for mode in MODES[1:]
        }
        for step in range(steps + warmup):
            shift = step % len(MODES)
            for mode in MODES[shift:] + MODES[:shift]:
                model, opt = models[mode]
                t0 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                if mode == "bare":
                    opt.step()
                else:
                    session = sessions[mode]
                    verdict = await session.check_step(step, loss=loss)
                    if verdict.should_step:
                        opt.step()
                    await session.step_completed(step, loss=verdict.loss)
                if step >= warmup:
                    times[mode].append(time.perf_counter() - t0)
    return times


def _spread(times: Any) -> str:
    """Median, p90 and p99 of *times* (seconds) in microseconds."""
    lat = sorted(times)
    if not lat:
        return "none"
    at = {q: lat[min(len(lat) - 1, int(q * len(lat)))] * 1e6 for q in (0.9, 0.99)}
    return (
        f"median {statistics.median(lat) * 1e6:6.0f} us, p90 {at[0.9]:6.0f} us, "
        f"p99 {at[0.99]:6.0f} us over {len(lat)} steps"
    )


def _worker(rank: int, world: int, init: str, steps: int, warmup: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init}", rank=rank, world_size=world,
        timeout=timedelta(seconds=120),
    )  # fmt: skip
    agreements = {"agreed": RankAgreement(), "blocking": RankAgreement(overlap=False)}
    times = anyio.run(_run, steps, warmup, rank, agreements)
    if rank == 0:
        m = {k: statistics.median(v) for k, v in times.items()}
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
        fast, blocking = agreements["agreed"], agreements["blocking"]
        print(f"  agreed:   the safe point waited   {_spread(fast.waits)}")
        print(f"            blocking rounds         {_spread(fast.blocking_waits)}")
        print("            (parameter-check steps, every 10th, add one)")
        print(f"  blocking: the collective took     {_spread(blocking.blocking_waits)}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        mp.spawn(_worker, args=(2, f"{tmp}/init", args.steps, args.warmup), nprocs=2, join=True)


if __name__ == "__main__":
    main()
