"""Per-step cost of the recovery safe point on a healthy run, as ratios to a bare step.

Run: ``.venv/bin/python benchmarks/bench_safepoint.py [--repeats 5] [--steps 150]``

Workload W1 (CPU, one torch thread): MLP 784-512-512-10, batch 64, AdamW. Three variants run
the same seeded step inside one ``anyio.run`` with a bus, round-robin, *repeats* times:

- ``bare``: forward, backward, ``optimizer.step()``, ``zero_grad()``;
- ``probe``: + ``await probe.check_step(step, loss=loss)`` (default level, every step);
- ``probe+safe``: + ``await safe.before_optimizer_step(step)`` with a ``RecoveryEngine`` on the
  default strategies and the default ``StateSnapshots`` (a copy every 50 good steps).

It prints the median ms/step of each, the ratios to ``bare``, and the time spent inside
``before_optimizer_step`` itself (timed around the call, median and mean over all steps, the
snapshot steps included) as a fraction of the bare step. Target (issue 4): the safe point adds
<= 1 % to the step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eventbus_debug import Event, EventBus, RecoveryEngine, SafePoint, StepProbe

Step = Callable[[int], Awaitable[None]]


def build() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt, torch.randn(64, 784), torch.randint(0, 10, (64,))


async def main(repeats: int, steps: int) -> None:
    torch.set_num_threads(1)
    safe_times: list[float] = []

    async def noop(event: Event) -> None:
        return None

    async with EventBus() as bus:
        bus.subscribe(noop, name="noop")
        variants: dict[str, Step] = {}

        model, opt, x, y = build()

        async def bare(step: int) -> None:
            nn.functional.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
            opt.step()
            opt.zero_grad()

        variants["bare"] = bare

        pmodel, popt, px, py = build()
        probe = StepProbe(pmodel, bus)

        async def probed(step: int) -> None:
            loss = nn.functional.cross_entropy(pmodel(px), py)
            loss.backward()  # type: ignore[no-untyped-call]
            await probe.check_step(step, loss=loss)
            popt.step()
            popt.zero_grad()

        variants["probe"] = probed

        smodel, sopt, sx, sy = build()
        sprobe = StepProbe(smodel, bus)
        engine = RecoveryEngine(bus)
        safe = SafePoint(engine, smodel, sopt)

        async def safe_step(step: int) -> None:
            loss = nn.functional.cross_entropy(smodel(sx), sy)
            loss.backward()  # type: ignore[no-untyped-call]
            await sprobe.check_step(step, loss=loss)
            t0 = time.perf_counter()
            decision = await safe.before_optimizer_step(step)
            safe_times.append(time.perf_counter() - t0)
            if decision.should_step:
                sopt.step()
            sopt.zero_grad()

        variants["probe+safe"] = safe_step

        for fn in variants.values():  # warm-up
            for step in range(10):
                await fn(step)
        safe_times.clear()
        samples: dict[str, list[float]] = {name: [] for name in variants}
        step = 10
        for _ in range(repeats):
            for name, fn in variants.items():
                t0 = time.perf_counter()
                for _ in range(steps):
                    await fn(step)
                    step += 1
                samples[name].append((time.perf_counter() - t0) / steps * 1e3)
        await bus.drain()
        assert engine.statistics().incidents == 0, "the benchmark run must be healthy"

    ms = {name: statistics.median(v) for name, v in samples.items()}
    base = ms["bare"]
    print(f"W1 MLP 784-512-512-10 batch 64, AdamW, 1 thread; {repeats} x {steps} steps/variant")
    for name, value in ms.items():
        print(f"  {name:<11} {value:7.3f} ms/step  {value / base:6.3f}x bare")
    print(
        f"  safe point vs probe: {(ms['probe+safe'] - ms['probe']) / base * 100:+.2f} % of the "
        "bare step (difference of medians; noisy)"
    )
    med = statistics.median(safe_times) * 1e3
    mean = statistics.fmean(safe_times) * 1e3
    print(
        f"  before_optimizer_step itself: median {med * 1e3:.1f} us ({med / base * 100:.2f} % of "
        f"the bare step), mean {mean * 1e3:.1f} us ({mean / base * 100:.2f} %, snapshots included)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=150)
    args = parser.parse_args()
    anyio.run(main, args.repeats, args.steps)
