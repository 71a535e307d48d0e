"""Where a small training step's session time goes: floors, variants and parts, in the loop.

One process, one torch thread, the same 85 k-parameter MLP (batch 128, AdamW) as
``bench_levels.py``; rounds interleave the variants and each prints its median step time as a
ratio against the bare loop of the same run:

  bare            the training loop alone (it reads its loss and yields once per step)
  floor           bare + the issue's "one fused check": one ``_foreach_norm`` over the
                  gradients and one host read of each norm, per step
  off             Session(level=OFF), log on, report and alerts off
  off, no safe pt the same with recovery=False (no safe point, no state snapshots)
  basic           Session(level=BASIC), log on, report and alerts off

Then, in a BASIC session, the microseconds per step spent in each part, timed inside the
loop (the wrappers' own cost, well under a microsecond each, is included): the probe's call
and its launch, read, judge and publish; the safe point; the step's record.

    .venv/bin/python benchmarks/bench_step_parts.py [--steps 400] [--rounds 7]
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel
import torch
from torch import nn

from eventbus_debug import DebugLevel, Session
from eventbus_debug._bus import EventBus
from eventbus_debug.probes.step import _judge, _launch, probe
from eventbus_debug.recovery.safepoint import point
from eventbus_debug.session import boundary


def _setup() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt, torch.randn(128, 64), torch.randint(0, 10, (128,))


async def _bare(steps: int, *, floor: bool = False) -> float:
    model, opt, x, y = _setup()
    params = list(model.parameters())
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        torch.autograd.backward(loss)
        if floor:
            with torch.no_grad():
                norms = torch._foreach_norm([p.grad for p in params if p.grad is not None])
            assert all(math.isfinite(n.item()) for n in norms)
        opt.step()
        float(loss.detach())
        await anyio.lowlevel.checkpoint()
    return (time.perf_counter() - t0) / steps


async def _session(
    steps: int,
    log_dir: str,
    *,
    warmup: int = 0,
    warmed: Callable[[], object] | None = None,
    **knobs: Any,
) -> float:
    """Seconds per step of *steps* session steps after *warmup* untimed ones (*warmed* is
    called between them)."""
    model, opt, x, y = _setup()
    async with Session(model, opt, log_dir=log_dir, report=False, alerts=False, **knobs) as s:
        t0 = time.perf_counter()
        for step in range(warmup + steps):
            if step == warmup:
                if warmed is not None:
                    warmed()
                t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model(x), y)
            torch.autograd.backward(loss)
            verdict = await s.check_step(step, loss=loss)
            if verdict.should_step:
                opt.step()
            await s.step_completed(step, loss=verdict.loss)
        return (time.perf_counter() - t0) / steps


_PARTS: tuple[tuple[Any, str, str], ...] = (
    (probe.StepProbe, "_check", "probe call (all of the below)"),
    (_launch.Launcher, "launch", "  launch: norms + glue"),
    (_launch.Pending, "read", "  read"),
    (_judge.Judge, "judge", "  judge"),
    (EventBus, "publish_many_nowait", "  publish"),
    (point.SafePoint, "before_optimizer_step", "safe point"),
    (boundary.StepBoundary, "completed", "step_completed (with the loop's turn)"),
)


def _timed(fn: Callable[..., Any], label: str, spent: Counter[str]) -> Callable[..., Any]:
    if getattr(fn, "__code__", None) is not None and fn.__code__.co_flags & 0x80:  # async def

        async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter_ns()
            try:
                return await fn(*args, **kwargs)
            finally:
                spent[label] += time.perf_counter_ns() - t0

        return async_wrapper

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[label] += time.perf_counter_ns() - t0

    return wrapper


async def _parts(steps: int, log_dir: str) -> dict[str, float]:
    """Microseconds per step in each part of a BASIC session's step (after 100 warm-up steps)."""
    spent: Counter[str] = Counter()
    originals = [(cls, name, getattr(cls, name)) for cls, name, _ in _PARTS]
    for (cls, name, label), (_, _, fn) in zip(_PARTS, originals, strict=True):
        setattr(cls, name, _timed(fn, label, spent))
    try:
        await _session(steps, log_dir, warmup=100, warmed=spent.clear, level=DebugLevel.BASIC)
    finally:
        for cls, name, fn in originals:
            setattr(cls, name, fn)
    return {label: spent[label] / steps / 1000 for _, _, label in _PARTS}


async def main(steps: int, rounds: int) -> None:
    torch.set_num_threads(1)
    variants: dict[str, Callable[[str], Any]] = {
        "bare": lambda d: _bare(steps),
        "floor": lambda d: _bare(steps, floor=True),
        "off": lambda d: _session(steps, d, level=DebugLevel.OFF),
        "off, no safe pt": lambda d: _session(steps, d, level=DebugLevel.OFF, recovery=False),
        "basic": lambda d: _session(steps, d, level=DebugLevel.BASIC),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as d:
        await _bare(50)  # warm-up
        for _ in range(rounds):
            for name, run in variants.items():
                times[name].append(await run(d))
        parts = await _parts(steps * 3, d)
    base = statistics.median(times["bare"])
    print(f"MLP 85 k params, batch 128, AdamW, 1 torch thread; {steps} steps x {rounds} rounds")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:<16} {med * 1e6:8.1f} us/step  {med / base:6.3f}x")
    print("in a BASIC session, us per step inside the loop:")
    for label, us in parts.items():
        print(f"  {label:<38} {us:7.1f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    anyio.run(main, args.steps, args.rounds)
