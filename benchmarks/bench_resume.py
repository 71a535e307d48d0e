"""A run resumed from a checkpoint: judged as the uninterrupted run, or from nothing.

Each healthy workload of ``bench_decisions.py`` (real shapes, noisy minibatches, converged and
negative losses, AMP, warm restarts, a task switch...) runs three ways in one process:

* **uninterrupted**: one default session (recovery on; log, report, alerts and sampler off)
  for all the steps;
* **resumed**: a session for the first ``--resume-at`` steps, whose ``state_dict()`` goes
  through ``json`` (as a Hugging Face ``trainer_state.json`` would carry it), then a new
  session, ``load_state_dict()``, for the rest, on the same model and optimizer (what a
  checkpoint restores);
* **cold**: the same, without the state (a resumed job that saves only model and optimizer).

The table lists each way's incidents and actions after the resume step, and whether the
resumed run's equal the uninterrupted run's (they must: a resumed run is judged exactly as if
it never stopped). Then the cost of the state: its size, and ``state_dict()`` plus
``json.dumps`` against ``torch.save(model.state_dict())`` of the same model, timed in the same
run (ratio).

Run: python benchmarks/bench_resume.py [--steps 6000] [--resume-at 4000] [--runs a,b]
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_decisions as bd

from eventbus_debug import Session

MODES = ("uninterrupted", "resumed", "cold")


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one way of running a workload reported after the resume step."""

    incidents: tuple[tuple[int, str], ...]
    actions: tuple[tuple[int, str], ...]
    state_bytes: int = 0
    state_us: float = 0.0
    model_save_us: float = 0.0


def _timed_us(fn: Any, repeat: int = 20) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


async def _run(spec: bd.RunSpec, steps: int, resume_at: int, mode: str) -> Outcome:
    wl = spec.build(steps, 1.0)
    tally = bd._Tally()

    def session() -> Session:
        return bd.library_session(wl, tally)

    size = 0
    state_us = save_us = 0.0
    if mode == "uninterrupted":
        async with session() as s:
            await bd._train(wl, steps, None, s, bd._Trace())
    else:
        async with session() as first:
            await bd._train(wl, resume_at, None, first, bd._Trace())
            text = json.dumps(first.state_dict())
            size = len(text)
            state_us = _timed_us(lambda: json.dumps(first.state_dict()))
            save_us = _timed_us(lambda: torch.save(wl.model.state_dict(), io.BytesIO()))
        second = session()
        if mode == "resumed":
            second.load_state_dict(json.loads(text))
        async with second:
            await bd._train(wl, steps, None, second, bd._Trace(), start=resume_at)
    return Outcome(
        incidents=tuple(
            (i.step, i.kind) for i in tally.incidents if i.step is not None and i.step >= resume_at
        ),
        actions=tuple(
            (a.step, a.action) for a in tally.actions if a.step is not None and a.step >= resume_at
        ),
        state_bytes=size,
        state_us=state_us,
        model_save_us=save_us,
    )


def run_workload(spec: bd.RunSpec, steps: int, resume_at: int) -> dict[str, Outcome]:
    """The three ways of running *spec* (one torch thread, as bench_decisions runs them)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=bd._SCHEDULER_WARNING, category=UserWarning)
            return {
                mode: anyio.run(_run, spec, steps, resume_at, mode, backend="asyncio")
                for mode in MODES
            }
    finally:
        torch.set_num_threads(threads)


def _brief(items: Sequence[tuple[int, str]]) -> str:
    if not items:
        return "-"
    shown = ", ".join(f"{kind}@{step}" for step, kind in items[:3])
    return shown + (f" (+{len(items) - 3})" if len(items) > 3 else "")


def main(argv: Sequence[str] | None = None) -> int:
    """Command line; returns the exit code (1 when a resumed run differs)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=6000)
    parser.add_argument("--resume-at", type=int, default=4000)
    parser.add_argument("--runs", default=None, help="comma-separated healthy workloads")
    args = parser.parse_args(argv)
    if not 0 < args.resume_at < args.steps:
        parser.error("--resume-at must be between 0 and --steps")
    healthy = [s for s in bd.RUNS if s.kind is bd.RunKind.HEALTHY and s.name != "gan_two_sessions"]
    if args.runs:
        wanted = {n.strip() for n in args.runs.split(",") if n.strip()}
        unknown = wanted - {s.name for s in healthy}
        if unknown:
            parser.error(f"unknown workloads {sorted(unknown)}; known: {[s.name for s in healthy]}")
        healthy = [s for s in healthy if s.name in wanted]
    print(
        f"{args.steps} steps, resumed at step {args.resume_at}; incidents and actions from "
        "the resume step on"
    )
    print(f"{'workload':<20} {'uninterrupted':<28} {'resumed (state)':<28} {'cold':<40} same")
    same = 0
    extra_incidents = extra_actions = 0
    sizes: list[int] = []
    ratios: list[float] = []
    costs: list[float] = []
    for spec in healthy:
        out = run_workload(spec, args.steps, args.resume_at)
        full, resumed, cold = out["uninterrupted"], out["resumed"], out["cold"]
        identical = (full.incidents, full.actions) == (resumed.incidents, resumed.actions)
        same += identical
        extra_incidents += max(0, len(cold.incidents) - len(full.incidents))
        extra_actions += max(0, len(cold.actions) - len(full.actions))
        sizes.append(resumed.state_bytes)
        costs.append(resumed.state_us)
        if resumed.model_save_us:
            ratios.append(resumed.state_us / resumed.model_save_us)

        def cell(o: Outcome) -> str:
            return _brief(o.incidents) + (f"; actions {_brief(o.actions)}" if o.actions else "")

        print(
            f"{spec.name:<20} {cell(full):<28} {cell(resumed):<28} {cell(cold):<40} "
            f"{'yes' if identical else 'NO'}"
        )
    print(
        f"resumed with the state: {same}/{len(healthy)} workloads report exactly what the "
        f"uninterrupted run reports; cold: {extra_incidents} more incidents, "
        f"{extra_actions} more actions"
    )
    if sizes:
        print(
            f"state: {min(sizes):,}-{max(sizes):,} bytes as JSON; state_dict() + json.dumps: "
            f"{min(costs):.0f}-{max(costs):.0f} us, {min(ratios):.2f}x-{max(ratios):.2f}x "
            "torch.save(model.state_dict()) of the same model (median per workload, same run)"
        )
    return 0 if same == len(healthy) else 1


if __name__ == "__main__":
    bd._library_errors_to_stderr()
    sys.exit(main())
