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

Two pieces of the safe point are then timed against the code they replaced (issue #13, items 6
and 7), both written out here as the baseline, alternated in the same run:

- the healthy-step check "is an incident waiting for the engine?": ``engine.caught_up()``
  against ``has_undispatched(Anomaly)`` + ``subscription.statistics().queued``;
- a snapshot: ``StateSnapshots.capture`` (preallocated copies, ``_foreach_copy_``) against the
  walk of ``model.state_dict()`` and ``optimizer.state_dict()`` copying tensor by tensor (both
  after the same finite check of the parameters).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import anyio
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eventbus_debug import Anomaly, Event, EventBus, RecoveryEngine, SafePoint, StepProbe
from eventbus_debug.recovery import StateSnapshots
from eventbus_debug.recovery.safepoint._plan import all_finite, finite_groups

Step = Callable[[int], Awaitable[None]]


def build() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt, torch.randn(64, 784), torch.randint(0, 10, (64,))


def tree_copy(old: Any, new: Any) -> Any:
    """The snapshot copy before issue #13 (the baseline): walk the state dict, copy per tensor."""
    if isinstance(new, torch.Tensor):
        if isinstance(old, torch.Tensor) and old.shape == new.shape and old.dtype == new.dtype:
            return old.copy_(new.detach())
        return new.detach().clone()
    if isinstance(new, Mapping):
        prev = old if isinstance(old, Mapping) else {}
        return {k: tree_copy(prev.get(k), v) for k, v in new.items()}
    if isinstance(new, (list, tuple)):
        prev_seq = old if isinstance(old, (list, tuple)) and len(old) == len(new) else ()
        items = [tree_copy(prev_seq[i] if prev_seq else None, v) for i, v in enumerate(new)]
        return items if isinstance(new, list) else tuple(items)
    return copy.deepcopy(new)


def alternate(a: Callable[[], object], b: Callable[[], object], n: int) -> tuple[float, float]:
    """Median seconds of *a* and of *b*, called alternately *n* times each (order swapped
    every round, so neither always runs on the other's cache)."""
    times: dict[int, list[float]] = {0: [], 1: []}
    fns = (a, b)
    for i in range(n):
        for which in (0, 1) if i % 2 == 0 else (1, 0):
            t0 = time.perf_counter()
            fns[which]()
            times[which].append(time.perf_counter() - t0)
    return statistics.median(times[0]), statistics.median(times[1])


def pieces(engine: RecoveryEngine, bus: EventBus, n: int) -> None:
    """Items 6 and 7 of issue #13, each against its baseline (see the module docstring)."""
    sub = engine.subscription

    def old_check() -> bool:
        return not bus.has_undispatched(Anomaly) and sub.statistics().queued == 0

    new, old = alternate(engine.caught_up, old_check, n * 20)
    print(f"  caught-up check: {new * 1e6:.2f} us vs {old * 1e6:.2f} us before ({new / old:.2f}x)")
    small = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU())
    small.append(nn.Linear(256, 10))
    for label, model in (("W1 MLP", build()[0]), ("MLP 64-256-256-10", small)):
        capture_vs_walk(label, model, n)


def capture_vs_walk(label: str, model: nn.Module, n: int) -> None:
    """One model trained 3 AdamW steps, its snapshot taken both ways, alternately."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(64, model[0].in_features)  # type: ignore[index]
    for _ in range(3):
        model(x).pow(2).mean().backward()
        opt.step()
    snaps = StateSnapshots()
    held: list[Any] = [None, None]

    def old_capture() -> None:
        assert all_finite(finite_groups(model))
        held[0] = tree_copy(held[0], model.state_dict())
        held[1] = tree_copy(held[1], opt.state_dict())

    def new_capture() -> None:
        snaps.capture(0, model, opt)

    new_capture()
    old_capture()
    new, old = alternate(new_capture, old_capture, n)
    print(
        f"  snapshot capture, {label}: {new * 1e6:.0f} us vs {old * 1e6:.0f} us walking the "
        f"state dicts ({new / old:.2f}x; both with the finite check of the parameters)"
    )


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
        pieces_args = (engine, bus)

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
    pieces(*pieces_args, n=repeats * 20)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=150)
    args = parser.parse_args()
    anyio.run(main, args.repeats, args.steps)
