"""Seed 003's use case: a network-flow classifier with input validation, output anomaly
detection and resource alerts.

Synthetic "flows" (duration, bytes, packets, ports...) are labelled benign or malicious.
Batches are validated before they reach the model (a corrupt capture with NaN or absurd byte
counts is reported and dropped), outputs are checked for collapse, and the system sampler's
CPU/memory figures feed resource alerts.

Run: python examples/security_input_validation.py
"""

from __future__ import annotations

import math

import anyio
import torch
from torch import nn

from eventbus_debug import Session
from eventbus_debug.events import InputValidationFailed, OutputAnomalyDetected
from eventbus_debug.extras import InputSpec, InputValidationError, InputValidator, OutputChecker
from eventbus_debug.sinks import rules
from eventbus_debug.testing import RecordingSink

FEATURES = 10


def flows(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """*n* synthetic, standardized flow records and their labels (1 = malicious)."""
    labels = (torch.rand(n, generator=gen) < 0.3).float()
    x = torch.randn(n, FEATURES, generator=gen)
    x[:, 0] += 2.0 * labels  # malicious flows are longer ...
    x[:, 3] -= 1.5 * labels  # ... and use fewer distinct ports
    return x, labels.unsqueeze(1)


async def main(steps: int = 200, batch: int = 64) -> dict[str, int]:
    """Train the classifier; return how many batches were rejected and anomalies found."""
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    validator = InputValidator(
        InputSpec(ndim=2, shape=(None, FEATURES), dtype=torch.float32, max_abs=50.0)
    )
    checker = OutputChecker(expected_range=(0.0, 1.0), collapse_std=1e-4, name="p_malicious")
    recorder = RecordingSink()
    rejected = 0
    async with Session(model, optimizer, log_dir=None, report=False, sinks=[recorder]) as session:
        if session.alerts is not None:
            session.alerts.add_rule(
                rules.cpu_above(95.0), lambda alert: print("ALERT", alert.message)
            )
        for step in range(steps):
            x, y = flows(batch, gen)
            if step == steps // 4:
                x[3, 1] = math.nan  # a truncated capture
            if step == steps // 2:
                x[0, 2] = 1e9  # a byte counter that overflowed
            try:
                validator.check(x, publish=session.publish, step=step)
            except InputValidationError as exc:
                rejected += 1
                print(f"step {step}: batch rejected: {exc}")
                continue
            optimizer.zero_grad(set_to_none=True)
            logits = model(x)
            checker.check(torch.sigmoid(logits.detach()), publish=session.publish, step=step)
            loss = nn.functional.binary_cross_entropy_with_logits(logits, y)
            torch.autograd.backward(loss)
            if (await session.check_step(step, loss=loss)).should_step:
                optimizer.step()
            await session.step_completed(step, loss=loss, samples=batch)
        # A model whose last layer died predicts the same probability for every flow.
        with torch.no_grad():
            model[2].weight.zero_()
        checker.check(
            torch.sigmoid(model(flows(batch, gen)[0])), publish=session.publish, step=steps
        )
        await session.bus.drain()
    failed = recorder.of_type(InputValidationFailed)
    anomalies = recorder.of_type(OutputAnomalyDetected)
    print(
        f"rejected {rejected} batches ({[f.rule for f in failed]}), output anomalies: {[a.rule for a in anomalies]}"
    )
    return {
        "rejected": rejected,
        "validation_incidents": len(failed),
        "output_anomalies": len(anomalies),
    }


if __name__ == "__main__":
    anyio.run(main)
