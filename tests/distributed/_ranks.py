"""Running a module as a gloo group of processes, bounded: what the distributed tests share."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_ranks(module: str, head: Sequence[str], world: int, tmp: Path, limit: float) -> list[str]:
    """Run ``python -m module *head RANK WORLD TMP/init TMP`` for each rank and wait for them
    all within *limit* seconds (a rank still running then is killed: a hang fails the test
    instead of blocking it); each rank's output, by rank."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", module, *head, str(r), str(world), str(tmp / "init"), str(tmp)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(world)
    ]
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=limit)
            outputs.append(out.decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outputs


def stay_alive_until(paths: Sequence[Path], limit: float) -> None:
    """Keep this process alive until every file of *paths* exists (the other ranks wrote
    their results) or *limit* seconds passed: a rank that failed holds its end of the group
    open while the others are judged, and the test does not wait out a fixed sleep."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and not all(p.exists() for p in paths):
        time.sleep(0.05)
