"""Overhead of each DebugLevel, and of the full default session, against a bare training loop
measured in the same run.

The same model, data and optimizer run bare and inside a Session for each level (step probe at
the level, JSON-lines log, recovery safe point; report and alerts off), then as the full
default session (log, report, alerts, system sampler: ``Session(model, opt, log_dir=d)``), and
that session with ``overhead_budget=0.02``. Rounds interleave the variants; the median step
time of each is compared with the bare loop's (ratio); each round runs them in a new seeded
order. The last column is the overhead the
session measured itself (its time in check_step/step_completed over the rest of the step).
Printed beside seed 002's claimed overheads.

Run: python benchmarks/bench_levels.py [--steps 300] [--warmup 50] [--width 256] [--rounds 5]
[--threads N]

``--warmup`` steps run untimed before the timed ones, in the bare loop and in every session
alike: the ratios are the per-step cost of a run in its steady state (a multi-day run's), not
one-time start costs (the optimizer's state and the session's first snapshot allocated, the
probe's plans built); ``--warmup 0`` times from the first step.

``--threads 1`` pins torch to one thread: on a machine shared with other jobs, torch's OpenMP
threads stall whenever another process takes a core, which moves every ratio by points between
runs; one thread gives the steadier comparison (the default keeps torch's own choice).
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from typing import Any

import anyio
import torch
from torch import nn

from eventbus_debug import DebugLevel, Session

CLAIMS = {
    DebugLevel.OFF.value: "-",
    DebugLevel.BASIC.value: "~1-2 %",
    DebugLevel.ADVANCED.value: "5-10 %",
    DebugLevel.EXTREME.value: "15-25 %",
}
DEFAULT = "default"
"""The full default session: log, report, alerts, system sampler (level BASIC)."""
BUDGET = "default+2%"
"""The default session with overhead_budget=0.02."""


def _setup(width: int) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt, torch.randn(128, 64), torch.randint(0, 10, (128,))


async def _bare(steps: int, width: int, warmup: int = 0) -> float:
    model, opt, x, y = _setup(width)
    t0 = time.perf_counter()
    for step in range(warmup + steps):
        if step == warmup:
            t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        float(loss.detach())  # the bare loop reads its loss too
        await anyio.lowlevel.checkpoint()
    return (time.perf_counter() - t0) / steps


def _options(variant: str) -> dict[str, Any]:
    if variant == DEFAULT:
        return {}
    if variant == BUDGET:
        return {"overhead_budget": 0.02}
    return {"level": DebugLevel(variant), "report": False, "alerts": False}


async def _session(
    variant: str, steps: int, width: int, measured: list[float], warmup: int = 0
) -> float:
    model, opt, x, y = _setup(width)
    with tempfile.TemporaryDirectory() as d:
        async with Session(model, opt, log_dir=d, **_options(variant)) as s:
            t0 = time.perf_counter()
            for step in range(warmup + steps):
                if step == warmup:
                    t0 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                verdict = await s.check_step(step, loss=loss)
                if verdict.should_step:
                    opt.step()
                await s.step_completed(step, loss=verdict.loss)
            elapsed = time.perf_counter() - t0
            if s.overhead is not None:
                measured.append(s.overhead)
    return elapsed / steps


async def main(steps: int, width: int, rounds: int, warmup: int) -> None:
    variants = [lv.value for lv in DebugLevel] + [DEFAULT, BUDGET]
    times: dict[str, list[float]] = {"bare": [], **{v: [] for v in variants}}
    measured: dict[str, list[float]] = {v: [] for v in variants}
    await _bare(20, width)  # warm-up
    shuffle = random.Random(0).shuffle
    for _ in range(rounds):
        # Each round runs the bare loop and every variant once, in a new (seeded) order: no
        # variant always follows the same one (the previous session's teardown, its garbage).
        order = ["bare", *variants]
        shuffle(order)
        for v in order:
            if v == "bare":
                times["bare"].append(await _bare(steps, width, warmup))
            else:
                times[v].append(await _session(v, steps, width, measured[v], warmup))
    base = statistics.median(times["bare"])
    params = sum(p.numel() for p in _setup(width)[0].parameters())
    print(
        f"model: MLP, {params:,} parameters, batch 128; {steps} steps (after {warmup} untimed) "
        f"x {rounds} rounds (median); {torch.get_num_threads()} torch threads"
    )
    print(
        f"{'variant':<11} {'ms/step':>8} {'ratio':>7} {'overhead':>9} {'self-measured':>14}   seed 002 claims"
    )
    print(f"{'bare':<11} {base * 1e3:>8.3f} {1.0:>6.3f}x")
    for v in variants:
        med = statistics.median(times[v])
        own = f"{statistics.median(measured[v]) * 100:.1f}%" if measured[v] else "-"
        print(
            f"{v:<11} {med * 1e3:>8.3f} {med / base:>6.3f}x {(med / base - 1) * 100:>8.1f}%"
            f" {own:>14}   {CLAIMS.get(v, '')}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument(
        "--warmup", type=int, default=50, help="untimed steps first, in every variant alike"
    )
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's)"
    )
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    anyio.run(main, args.steps, args.width, args.rounds, args.warmup)
