"""Subscribing alerting handlers: decorator and method forms, cooldown, a ready-made rule.

Run: python examples/alert_handlers.py
"""

from __future__ import annotations

import math
import sys

import anyio
import torch
from torch import nn

from eventbus_debug import Session, Severity
from eventbus_debug.events import GradientExploded, NonFiniteDetected
from eventbus_debug.sinks import Alert, AlertSink, StderrAlert, rules


async def main(steps: int = 120) -> list[str]:
    """Train with an injected NaN and an explosion; return what the handlers received."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    received: list[str] = []
    async with Session(
        model,
        optimizer,
        log_dir=None,
        report=False,
        alerts=False,
    ) as session:
        alerts = AlertSink(session.bus)

        @alerts.on(NonFiniteDetected, min_severity=Severity.ERROR, cooldown=60.0)
        async def page_on_call(alert: Alert) -> None:
            received.append(f"page: {alert.message}")

        @alerts.on(GradientExploded, when=lambda e: e.total_norm > 100.0)
        def note(alert: Alert) -> None:  # sync handlers run in a worker thread
            received.append(f"note: {alert.message}")

        alerts.add_rule(rules.memory_above(95.0), StderrAlert(sys.stderr))
        session.bus.subscribe(alerts, name="my_alerts")
        for step in range(steps):
            x = torch.randn(16, 4)
            if step == steps // 2:
                x[:, 0] = math.nan
            if step == steps - 10:
                x = x * 1e5
            await session.training_step(
                x, x.sum(1, keepdim=True), nn.functional.mse_loss, step=step
            )
        await session.bus.drain()
    for line in received:
        print(line)
    return received


if __name__ == "__main__":
    anyio.run(main)
