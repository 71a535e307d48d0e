"""Overhead of each DebugLevel against a bare training loop, measured in the same run.

The same model, data and optimizer run bare and inside a Session (step probe at the level,
JSON-lines log, recovery safe point) for each level; rounds interleave the variants and the
median step time is compared. Printed beside seed 002's claimed overheads.

Run: python benchmarks/bench_levels.py [--steps 300] [--width 256] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import anyio
import torch
from torch import nn

from eventbus_debug import DebugLevel, Session

CLAIMS = {
    DebugLevel.OFF: "-",
    DebugLevel.BASIC: "~1-2 %",
    DebugLevel.ADVANCED: "5-10 %",
    DebugLevel.EXTREME: "15-25 %",
}


def _setup(width: int) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt, torch.randn(128, 64), torch.randint(0, 10, (128,))


async def _bare(steps: int, width: int) -> float:
    model, opt, x, y = _setup(width)
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        float(loss.detach())  # the bare loop reads its loss too
        await anyio.lowlevel.checkpoint()
    return (time.perf_counter() - t0) / steps


async def _session(level: DebugLevel, steps: int, width: int) -> float:
    model, opt, x, y = _setup(width)
    with tempfile.TemporaryDirectory() as d:
        async with Session(model, opt, log_dir=d, level=level, report=False, alerts=False) as s:
            t0 = time.perf_counter()
            for step in range(steps):
                opt.zero_grad(set_to_none=True)
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                verdict = await s.check_step(step, loss=loss)
                if verdict.should_step:
                    opt.step()
                await s.step_completed(step, loss=verdict.loss)
            elapsed = time.perf_counter() - t0
    return elapsed / steps


async def main(steps: int, width: int, rounds: int) -> None:
    levels = list(DebugLevel)
    times: dict[str, list[float]] = {"bare": [], **{lv.value: [] for lv in levels}}
    await _bare(20, width)  # warm-up
    for _ in range(rounds):
        times["bare"].append(await _bare(steps, width))
        for lv in levels:
            times[lv.value].append(await _session(lv, steps, width))
    base = statistics.median(times["bare"])
    params = sum(p.numel() for p in _setup(width)[0].parameters())
    print(f"model: MLP, {params:,} parameters, batch 128; {steps} steps x {rounds} rounds (median)")
    print(f"{'variant':<10} {'ms/step':>9} {'overhead':>10}   seed 002 claims")
    print(f"{'bare':<10} {base * 1e3:>9.3f} {'':>10}")
    for lv in levels:
        med = statistics.median(times[lv.value])
        print(f"{lv.value:<10} {med * 1e3:>9.3f} {(med / base - 1) * 100:>9.1f}%   {CLAIMS[lv]}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    anyio.run(main, args.steps, args.width, args.rounds)
