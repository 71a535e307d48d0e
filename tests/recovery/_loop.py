"""A tiny seeded regression loop with a fault injected at a known step."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from eventbus_debug import EventBus, SafePoint, StepProbe, Thresholds
from eventbus_debug.recovery import StateSnapshots

Fault = Callable[[int, torch.Tensor, nn.Module], torch.Tensor]

STEPS = 40


def make() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(64, 4)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    return model, opt, x, y


def final_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float(nn.functional.mse_loss(model(x), y))


async def run(
    bus: EventBus | None,
    fault: Fault | None = None,
    *,
    engine: object = None,
    snapshot_every: int = 5,
    thresholds: Thresholds | None = None,
) -> tuple[nn.Module, float, list[int]]:
    """Train STEPS steps; returns the model, its final loss and the steps that were skipped."""
    model, opt, x, y = make()
    probe = StepProbe(model, bus, thresholds=thresholds or Thresholds(explosion=1e3))
    safe = (
        SafePoint(engine, model, opt, snapshots=StateSnapshots(every=snapshot_every))  # type: ignore[arg-type]
        if engine is not None
        else None
    )
    skipped: list[int] = []
    for step in range(STEPS):
        i = (step * 16) % 64
        xb, yb = x[i : i + 16], y[i : i + 16]
        loss = nn.functional.mse_loss(model(xb), yb)
        if fault is not None:
            loss = fault(step, loss, model)
        loss.backward()  # type: ignore[no-untyped-call]
        await probe.check_step(step, loss=loss)
        if safe is None or (await safe.before_optimizer_step(step)).should_step:
            opt.step()
        else:
            skipped.append(step)
        opt.zero_grad()
    return model, final_loss(model, x, y), skipped


def all_finite(model: nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def nan_at(*steps: int) -> Fault:
    def fault(step: int, loss: torch.Tensor, model: nn.Module) -> torch.Tensor:
        return loss * math.nan if step in steps else loss

    return fault
