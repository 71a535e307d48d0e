"""Registering a custom sink: a running loss average, in about 20 lines.

Run: python examples/custom_sink.py
"""

from __future__ import annotations

import anyio
import torch
from torch import nn

from eventbus_debug import Event, Session
from eventbus_debug.events import StepCompleted, StepSkipped


class LossAverage:
    """A sink: any object with an async ``handle(event)`` (``aclose`` is optional)."""

    def __init__(self, window: int = 20) -> None:
        self.window = window
        self.losses: list[float] = []
        self.closed = False

    async def handle(self, event: Event) -> None:
        if isinstance(event, StepCompleted) and event.loss is not None:
            self.losses.append(event.loss)

    @property
    def average(self) -> float:
        recent = self.losses[-self.window :]
        return sum(recent) / max(1, len(recent))

    async def aclose(self) -> None:
        self.closed = True


async def main(steps: int = 200) -> float:
    """Train a tiny model with the custom sink subscribed through the session."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    average = LossAverage()

    async def on_skip(event: Event) -> None:  # an async function is a sink too
        print("skipped:", event)

    async with Session(model, optimizer, log_dir=None, report=False, sinks=[average]) as session:
        session.bus.subscribe(on_skip, StepSkipped, name="skips")
        for step in range(steps):
            x = torch.randn(16, 4)
            await session.training_step(
                x, x.sum(1, keepdim=True), nn.functional.mse_loss, step=step
            )
    print(
        f"average of the last {average.window} losses: {average.average:.4f} (closed={average.closed})"
    )
    return average.average


if __name__ == "__main__":
    anyio.run(main)
