"""What the cross-rank agreement costs on a realistic DDP step (2 ranks, gloo, CPU).

Five identical DDP models trained side by side in one loop; every iteration runs one step of
each, in an order that rotates every iteration, so drift on a shared machine hits all alike:
  bare       DDP step, no library
  floor      the bare step plus what any per-step agreement costs at least, without the library:
             one asynchronous MAX all_reduce of a vector of the agreement's size on a gloo
             group of its own, launched from a hook on the output's gradient and waited after
             backward (what the overlapped agreement does, minus everything else)
  floor_blocking
             the bare step plus one blocking MAX all_reduce of the same vector after backward,
             where the default agreement runs it (what any blocking agreement costs at least)
  session    the default Session with distributed=False (checks, recovery, no agreement)
  agreed     the Session inside the group with RankAgreement(overlap=True) (opt-in): the
             agreement is launched during backward and waited at the safe point
  blocking   the default Session inside the group (RankAgreement(), overlap=False): one
             blocking collective per safe point
Prints the per-step medians, the ratios agreed/session (the overlapped agreement's own cost;
target <= 1.03), blocking/session (the default's), floor/bare (the collective alone), blocking/session and agreed/bare, what the
agreement costs beyond the floor, and how long the safe point waited for the other
ranks (median, p90, p99): for the overlapped agreement the wait on the launched collective (and
the blocking round its parameter-check steps add), for the blocking one the collective itself;
and how long launching the overlapped collective held the training thread (the asynchronous
``all_reduce`` call, which hands the collective to gloo's thread: on a machine with as many
busy ranks as cores the thread switch it causes is most of what the agreement costs).

    .venv/bin/python benchmarks/bench_distributed.py [--steps 500] [--warmup 20]
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

from eventbus_debug import Cadence, Session
from eventbus_debug.recovery import agreement_codec as codec
from eventbus_debug.recovery.agreement import RankAgreement

WIDTH = 768
BATCH = 128


MODES = ("bare", "floor", "floor_blocking", "session", "agreed", "blocking")
SESSIONS = ("session", "agreed", "blocking")


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 10)
    )
    model = DistributedDataParallel(net)
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


class _Floor:
    """The floor mode's collective: launched when the output's gradient arrives, then waited."""

    def __init__(self, model: nn.Module, group: Any) -> None:
        self.vec = torch.zeros(codec.SIZE + dist.get_world_size(), dtype=torch.float64)
        self.group = group
        self.work: Any = None
        model.register_forward_hook(self._forward)

    def _forward(self, module: nn.Module, args: Any, output: torch.Tensor) -> None:
        output.register_hook(self._launch)  # type: ignore[no-untyped-call]

    def _launch(self, grad: torch.Tensor) -> None:
        self.work = dist.all_reduce(self.vec, op=dist.ReduceOp.MAX, group=self.group, async_op=True)

    def wait(self) -> None:
        self.work.wait()
        self.work = None


async def _run(
    steps: int, warmup: int, rank: int, agreements: dict[str, RankAgreement], floor_group: Any
) -> dict[str, list[float]]:
    """One loop of *steps* iterations; each runs one step of every mode, in a rotating order."""
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(BATCH, WIDTH, generator=gen)
    y = torch.randint(0, 10, (BATCH,), generator=gen)
    models = {mode: _model() for mode in MODES}
    floor = _Floor(models["floor"][0], floor_group)
    blocking_vec = torch.zeros_like(floor.vec)
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
            for mode in SESSIONS
        }
        for step in range(steps + warmup):
            shift = step % len(MODES)
            for mode in MODES[shift:] + MODES[:shift]:
                model, opt = models[mode]
                t0 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                if mode in ("bare", "floor", "floor_blocking"):
                    if mode == "floor":
                        floor.wait()
                    elif mode == "floor_blocking":
                        dist.all_reduce(blocking_vec, op=dist.ReduceOp.MAX, group=floor_group)
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
    agreements = {"agreed": RankAgreement(overlap=True), "blocking": RankAgreement()}
    floor_group = dist.new_group(backend="gloo")
    times = anyio.run(_run, steps, warmup, rank, agreements, floor_group)
    if rank == 0:
        m = {k: statistics.median(v) for k, v in times.items()}
        every = Cadence().param_every  # the parameter-check steps, which add a blocking round
        plain = {
            k: statistics.median(t for i, t in enumerate(v) if (warmup + i) % every)
            for k, v in times.items()
        }
        print(f"DDP step, 2 ranks, gloo, MLP {WIDTH}x3 batch {BATCH}, 1 thread per rank")
        print(f"  bare step                   {m['bare'] * 1e3:8.2f} ms")
        print(f"  bare + one all_reduce       {m['floor'] * 1e3:8.2f} ms   (floor)")
        print(
            f"  bare + one blocking reduce  {m['floor_blocking'] * 1e3:8.2f} ms   (blocking floor)"
        )
        print(f"  session, no agreement       {m['session'] * 1e3:8.2f} ms")
        print(f"  session, agreed             {m['agreed'] * 1e3:8.2f} ms   (overlap=True, opt-in)")
        print(f"  session, agreed, blocking   {m['blocking'] * 1e3:8.2f} ms   (the default)")
        print(
            f"  agreed / no agreement       {m['agreed'] / m['session']:8.3f}x   (target <= 1.03)"
        )
        print(
            f"  floor / bare                {m['floor'] / m['bare']:8.3f}x   (the collective alone)"
        )
        beyond = (m["agreed"] - m["session"]) - (m["floor"] - m["bare"])
        print(f"  agreed beyond the floor     {beyond * 1e3:8.2f} ms a step")
        print(
            f"  agreed / no agreement       {plain['agreed'] / plain['session']:8.3f}x   "
            f"(steps without a parameter check, 1 in {every} has one)"
        )
        print(f"  blocking / no agreement     {m['blocking'] / m['session']:8.3f}x")
        print(
            f"  blocking floor / bare       {m['floor_blocking'] / m['bare']:8.3f}x   "
            "(any blocking collective after backward)"
        )
        beyond_blocking = (m["blocking"] - m["session"]) - (m["floor_blocking"] - m["bare"])
        print(f"  blocking beyond its floor   {beyond_blocking * 1e3:8.2f} ms a step")
        print(f"  agreed / bare               {m['agreed'] / m['bare']:8.3f}x")
        fast, blocking = agreements["agreed"], agreements["blocking"]
        print(f"  agreed:   the launch call took     {_spread(fast.launches)}")
        print(
            "            (dist.all_reduce(async_op=True) during backward: the hand-over to gloo's thread)"
        )
        print(f"            the safe point waited   {_spread(fast.waits)}")
        print(f"            blocking rounds         {_spread(fast.blocking_waits)}")
        print("            (parameter-check steps, every 10th, add one)")
        print(f"  blocking: the collective took     {_spread(blocking.blocking_waits)}")
    dist.barrier()  # torch 2.13's gloo may abort a rank whose peer tears the group down early
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        mp.spawn(_worker, args=(2, f"{tmp}/init", args.steps, args.warmup), nprocs=2, join=True)


if __name__ == "__main__":
    main()
