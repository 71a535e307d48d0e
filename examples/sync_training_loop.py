"""The library from a plain ``for`` loop: SyncSession runs the bus on a background thread.

Run: python examples/sync_training_loop.py
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from torch import nn

from eventbus_debug import SyncSession, read_events
from eventbus_debug.events import StepSkipped


def main(steps: int = 300, log_dir: str = "debug_logs/sync") -> dict[str, int]:
    """Train a small regressor for *steps* steps; a NaN batch at 1/3 of the run is skipped."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    with SyncSession(model, optimizer, log_dir=log_dir, name="sync_example") as session:
        for step in range(steps):
            x = torch.randn(32, 8)
            y = x.sum(dim=1, keepdim=True)
            if step == steps // 3:
                x[0, 0] = math.nan  # a corrupt sample
            session.training_step(x, y, nn.functional.mse_loss, step=step)
    events = list(read_events(log_dir))
    skipped = sum(isinstance(e, StepSkipped) for e in events)
    print(f"{len(events)} events in {Path(log_dir).resolve()}, {skipped} step(s) skipped")
    return {"events": len(events), "skipped": skipped}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--log-dir", default="debug_logs/sync")
    args = parser.parse_args()
    main(args.steps, args.log_dir)
