"""A session left on for a long run holds a bounded amount of memory.

Users leave the session switched on for days: anything kept per step (an event, a verdict, a
list entry, a report point) grows without bound and ends the run hours in. The default session
(log, report, alerts, system sampler, recovery) runs a healthy, noisy classifier for 2,050
steps; the number of objects the garbage collector tracks is counted at two steps where the
report's series (each at most 1,000 buckets, its stride doubling when full) hold the same
number of buckets: 1,025 (stride 2: 500 + 12) and 2,050 (stride 4: 500 + 12). One object kept
per step would add over a thousand between them.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path

import anyio
import torch
from torch import nn

from eventbus_debug import Session
from eventbus_debug.sinks import RotatingFileSink

MARKS = (1025, 2050)
LEAK_BOUND = 200
"""Objects the count may grow by between the marks (a cache filled late); a leak of one object
a step adds 1,025."""
ROOT = Path(__file__).resolve().parents[2]


def test_a_long_healthy_run_keeps_its_memory_flat(tmp_path: Path) -> None:
    """Run in a fresh interpreter: in a test worker, what earlier tests left behind (threads,
    caches, cycles) moves the count by hundreds either way."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.session.test_long_run", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    counts = {int(k): v for k, v in json.loads(done.stdout.splitlines()[-1]).items()}
    first, last = (counts[m] for m in MARKS)
    assert last - first <= LEAK_BOUND, counts


async def _train(log_dir: Path, steps: int) -> dict[int, int]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    inputs = torch.randn(256, 16, generator=gen)
    labels = torch.randint(0, 4, (256,), generator=gen)
    counts: dict[int, int] = {}
    async with Session(model, optimizer, log_dir=log_dir) as session:
        for step in range(steps):
            batch = torch.randint(0, 256, (32,), generator=gen)  # noisy minibatches
            loss = nn.functional.cross_entropy(model(inputs[batch]), labels[batch])
            torch.autograd.backward(loss)
            verdict = await session.check_step(step, loss=loss)
            if verdict.should_step:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            await session.step_completed(step, loss=verdict.loss)
            if step in MARKS:
                await session.bus.drain()  # what is queued for the sinks is not kept
                for sub in session.bus.subscriptions:
                    if isinstance(sub.sink, RotatingFileSink):
                        # nor what the log's writer thread has not written yet (up to 4,096
                        # events, more of them the busier the machine: +443 objects in a CI run)
                        await sub.sink.flush()
                await anyio.sleep(0)
                gc.collect()
                counts[step] = len(gc.get_objects())
        assert session.steps_completed == steps
    return counts


def _main(log_dir: str) -> None:
    """Train with one torch thread (a tiny model: two OpenMP threads only wait for each other)
    and print the counts at the marks as JSON."""
    torch.set_num_threads(1)
    counts = anyio.run(_train, Path(log_dir), MARKS[-1] + 1)
    print(json.dumps(counts))


if __name__ == "__main__":
    _main(sys.argv[1])
