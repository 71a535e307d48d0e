"""Seed 000's use case: OOM, data-loading and NaN recovery, with custom strategies.

- a training step that runs out of memory above a batch size: the built-in strategy halves the
  batch and the step is retried;
- a flaky data source: a custom strategy registered for ``ConnectionError`` retries with
  backoff (the seeds' ``register_recovery_strategy("connection timeout", fn)``);
- NaN parameters after a bad update: the built-in strategies skip the step and roll back.

Run: python examples/error_recovery.py
"""

from __future__ import annotations

import math

import anyio
import torch
from torch import nn

from eventbus_debug import Anomaly, Session
from eventbus_debug.events import RecoveryAction, RecoveryApplied, StepSkipped
from eventbus_debug.recovery import Decision, Retry, StrategyHistory
from eventbus_debug.recovery.retry import CallState, Retrying
from eventbus_debug.testing import RecordingSink

DEVICE_CAPACITY = 32


class FlakySource:
    """A data source whose first *failures* reads time out."""

    def __init__(self, failures: int) -> None:
        self.failures = failures

    def read(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.failures > 0:
            self.failures -= 1
            raise ConnectionError("connection timeout while reading shard 7")
        x = torch.randn(n, 6)
        return x, x.mean(1, keepdim=True)


def retry_connection(incident: Anomaly, history: StrategyHistory) -> Decision | None:
    """A custom strategy: retry a timed-out read, at most 3 times in a row."""
    if history.consecutive >= 3:
        return None
    return Decision(action=Retry(), reason="connection timeout: retry with backoff")


async def main(steps: int = 60) -> dict[str, int]:
    """Train under OOM, data-loading and NaN faults; return how often each recovery acted."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    source = FlakySource(failures=2)
    recorder = RecordingSink()
    async with Session(model, optimizer, log_dir=None, report=False, sinks=[recorder]) as session:
        engine = session.recovery
        assert engine is not None
        engine.register(retry_connection, on=ConnectionError, name="retry_connection")
        loading = Retrying(engine, operation="data_loading", initial_delay=0.001)
        training = Retrying(engine, state=CallState(batch_size=64), operation="train_step")
        for step in range(steps):
            async for attempt in training:
                async with attempt:
                    size = attempt.state.batch_size or 64
                    async for read in loading:
                        async with read:
                            x, y = source.read(size)
                    if x.shape[0] > DEVICE_CAPACITY:
                        raise torch.OutOfMemoryError(f"CUDA out of memory at batch {x.shape[0]}")
                    if step == steps // 2:
                        y[:] = math.inf  # a corrupt label batch
                    optimizer.zero_grad(set_to_none=True)
                    loss = nn.functional.mse_loss(model(x), y)
                    torch.autograd.backward(loss)
            verdict = await session.check_step(step, loss=loss)
            if verdict.should_step:
                optimizer.step()
            await session.step_completed(step, loss=loss)
        await session.bus.drain()
    applied = recorder.of_type(RecoveryApplied)
    counts = {
        "batch_size": training.state.batch_size or 0,
        "shrink_batch": sum(a.action is RecoveryAction.SHRINK_BATCH for a in applied),
        "retries": sum(a.action is RecoveryAction.RETRY for a in applied),
        "skipped_steps": len(recorder.of_type(StepSkipped)),
    }
    print(counts)
    return counts


if __name__ == "__main__":
    anyio.run(main)
