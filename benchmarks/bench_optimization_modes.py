"""Speed-up and peak-memory ratio of each OptimizationMode against the plain run, same run.

Trains the same MLP from the same seed under each mode and prints step time and peak RSS
growth relative to the plain float32 run. On CPU several modes are slower (bf16 autocast has
casting costs, checkpointing recomputes the forward pass, compile pays its compilation once):
the table shows that as ratios < 1.

Run: python benchmarks/bench_optimization_modes.py [--steps 100] [--width 512] [--no-compile]
"""

from __future__ import annotations

import argparse
import gc
import time

import psutil
import torch
from torch import nn

from eventbus_debug.extras import OptimizationMode, OptimizedStep, optimize_model


def _run(mode: OptimizationMode, steps: int, width: int) -> tuple[float, float, float]:
    torch.manual_seed(0)
    model = nn.Sequential(
        *[m for _ in range(4) for m in (nn.Linear(width, width), nn.GELU())], nn.Linear(width, 10)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    trained = optimize_model(model, mode)
    step = OptimizedStep(trained, opt, nn.functional.cross_entropy, mode, accumulation_steps=4)
    x, y = torch.randn(256, width), torch.randint(0, 10, (256,))
    gc.collect()
    proc = psutil.Process()
    rss0 = proc.memory_info().rss
    t_first = time.perf_counter()
    step.run(x, y)  # first step: compilation happens here
    first = time.perf_counter() - t_first
    peak = proc.memory_info().rss
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step.run(x, y).loss
        peak = max(peak, proc.memory_info().rss)
    float(loss)
    return (time.perf_counter() - t0) / steps, max(1, peak - rss0), first


def main(steps: int, width: int, compile_: bool) -> None:
    modes = [m for m in OptimizationMode if m is not OptimizationMode.FULL]
    if not compile_:
        modes.remove(OptimizationMode.COMPILE)
    results = {m: _run(m, steps, width) for m in modes}
    base_t, base_mem, _ = results[OptimizationMode.NONE]
    print(f"MLP width {width}, batch 256, {steps} steps, CPU threads {torch.get_num_threads()}")
    print(
        f"{'mode':<24} {'ms/step':>8} {'speed-up':>9} {'RSS growth':>11} {'vs plain':>9} {'1st step s':>11}"
    )
    for m, (t, mem, first) in results.items():
        print(
            f"{m.value:<24} {t * 1e3:>8.2f} {base_t / t:>8.2f}x {mem / 2**20:>9.1f}MB {mem / base_mem:>8.2f}x {first:>11.2f}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()
    main(args.steps, args.width, not args.no_compile)
