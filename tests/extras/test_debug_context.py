"""extras.debug_context: a timed block or function publishes one OperationCompleted."""

from __future__ import annotations

import pytest
import torch

from eventbus_debug import EventBus
from eventbus_debug.events import OperationCompleted
from eventbus_debug.extras.debug_context import debug_context
from eventbus_debug.testing import RecordingSink


class TestDebugContext:
    async def test_block_decorator_and_async(self, bus: EventBus, recorder: RecordingSink) -> None:
        """with, async with and both decorator kinds each publish one OperationCompleted."""
        bus.subscribe(recorder)
        with debug_context("block", publish=bus.publish_nowait, step=3) as op:
            torch.ones(256, 256).sum()
        assert op.result is not None and op.result.duration_s >= 0

        @debug_context("sync_fn", publish=bus.publish_nowait)
        def f(x: int) -> int:
            return x + 1

        @debug_context("async_fn", publish=bus.publish_nowait, step=lambda: 9)
        async def g(x: int) -> int:
            return x * 2

        async with debug_context("async_block", publish=bus.publish_nowait):
            pass
        assert f(1) == 2 and await g(2) == 4
        await bus.drain()
        events = recorder.of_type(OperationCompleted)
        assert [(e.name, e.step) for e in events] == [
            ("block", 3),
            ("async_block", None),
            ("sync_fn", None),
            ("async_fn", 9),
        ]
        assert all(
            e.cuda_allocated_delta_bytes is None or torch.cuda.is_available() for e in events
        )

    def test_error_is_recorded_and_propagates(self) -> None:
        """An exception in the block is named in the event and not swallowed."""
        ctx = debug_context("boom")
        with pytest.raises(KeyError), ctx:
            raise KeyError("x")
        assert ctx.result is not None and ctx.result.error == "KeyError"

    def test_detect_anomaly_catches_nan_backward(self) -> None:
        """With detect_anomaly a NaN produced in backward raises inside the block."""
        x = torch.tensor([0.0], requires_grad=True)
        with (
            pytest.raises(RuntimeError, match="nan"),
            debug_context("anomaly", detect_anomaly=True),
        ):
            torch.autograd.backward((torch.sqrt(x) * 0).sum())  # d sqrt(0) = inf, times 0 = nan

    def test_empty_name(self) -> None:
        """An empty name is rejected."""
        with pytest.raises(ValueError, match="non-empty"):
            debug_context("")
