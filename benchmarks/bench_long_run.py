"""A long run under the full default session: does the per-step cost or the memory creep?

Users leave the session on for days: anything that grows with the run (a window scanned
linearly, a list kept per step, a dict keyed by step) shows as a step that slows down or memory
that climbs, hours in. This trains a small classifier (16-32-4 MLP, batch 64, AdamW,
``CosineAnnealingWarmRestarts``: a warm restart every 2,000 steps) for ``--steps`` steps in one
``Session(model, opt, log_dir=..., scheduler=...)`` (log, report, alerts, system sampler,
recovery: the defaults) and prints, for each tenth of the run, the mean step time as a ratio to
the first tenth (the baseline, measured in the same run), the process's resident memory and the
number of objects the garbage collector tracks, then what the run published and reported.

Run: .venv/bin/python benchmarks/bench_long_run.py [--steps 100000] [--threads 1]
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from collections import Counter
from pathlib import Path

import anyio
import psutil
import torch
from torch import nn

from eventbus_debug import Anomaly, Session, read_events

WINDOWS = 10


async def main(steps: int, log_dir: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=2000)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4096, 16, generator=gen)
    y = x[:, :4].argmax(1)
    window = max(1, steps // WINDOWS)
    proc = psutil.Process()
    rows: list[tuple[int, float, float, int]] = []
    async with Session(model, opt, log_dir=log_dir, scheduler=sched) as session:
        t0 = time.perf_counter()
        for step in range(steps):
            idx = torch.randint(0, 4096, (64,), generator=gen)
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
            torch.autograd.backward(loss)
            verdict = await session.check_step(step, loss=loss)
            if verdict.should_step:
                opt.step()
            sched.step()
            await session.step_completed(step, loss=verdict.loss)
            if (step + 1) % window == 0:
                now = time.perf_counter()
                rss = proc.memory_info().rss / 2**20
                rows.append((step + 1, (now - t0) / window, rss, len(gc.get_objects())))
                t0 = now
        stats = session.bus.statistics()
    base = rows[0][1]
    print(
        f"{steps:,} steps, default session (log, report, alerts, sampler, recovery), "
        f"{torch.get_num_threads()} torch thread(s); baseline: the first {window:,} steps"
    )
    print(f"{'up to step':>10} {'us/step':>9} {'ratio':>7} {'RSS MiB':>8} {'objects':>9}")
    for step, per, rss, objects in rows:
        print(f"{step:>10,} {per * 1e6:>9.1f} {per / base:>6.3f}x {rss:>8.1f} {objects:>9,}")
    last = rows[-1]
    print(
        f"last tenth / first: {last[1] / base:.3f}x step time; "
        f"RSS {last[2] - rows[0][2]:+.1f} MiB, objects {last[3] - rows[0][3]:+,} over the run"
    )
    incidents = Counter(e.kind for e in read_events(log_dir) if isinstance(e, Anomaly))
    print(
        f"published {stats.published:,} events; incidents: {dict(incidents) or 'none'}; "
        f"log files: {sorted(p.name for p in log_dir.iterdir())}"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as d:
        anyio.run(main, args.steps, Path(d))
