from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from eventbus_debug import EventBus
from eventbus_debug.extras.debug_context import OperationCompleted, debug_context
from eventbus_debug.extras.diffusion import (
    LatentAnomalyDetected,
    LatentChecked,
    LatentMonitor,
    analyze_pipeline,
)
from eventbus_debug.testing import RecordingSink


class TestAnalyzePipeline:
    def test_mapping_counts_dtypes_and_shared_parameters(self) -> None:
        """Per-component counts, dtypes and devices; a shared module is counted once in total."""
        shared = nn.Linear(4, 4)
        analysis = analyze_pipeline(
            {
                "unet": nn.Sequential(shared, nn.ReLU()),
                "enc": shared,
                "vae": nn.Linear(2, 2).double(),
            }
        )
        by = {c.name: c for c in analysis.components}
        assert by["unet"].parameters == by["enc"].parameters == 20
        assert by["vae"].dtypes == ("float64",)
        assert analysis.total_parameters == 26
        assert analysis.mixed_dtypes and not analysis.mixed_devices

    def test_object_attributes(self) -> None:
        """An object whose attributes are modules is a pipeline (as diffusers' are)."""

        class Pipe:
            def __init__(self) -> None:
                self.unet = nn.Linear(3, 3)
                self.scheduler = object()

        (c,) = analyze_pipeline(Pipe()).components
        assert c.name == "unet" and c.size_bytes == 12 * 4

    def test_no_module(self) -> None:
        """Something holding no module is rejected with the type's name."""
        with pytest.raises(TypeError, match=r"int holds no nn\.Module"):
            analyze_pipeline(3)


class TestLatentMonitor:
    async def test_drift_and_non_finite(self, bus: EventBus, recorder: RecordingSink) -> None:
        """A 10x RMS jump is norm drift; NaN latents are non-finite; both are incidents."""
        bus.subscribe(recorder)
        monitor = LatentMonitor(max_norm_ratio=4.0)
        latents = torch.randn(1, 4, 8, 8)
        await monitor.acheck(latents, denoising_step=0, publish=bus.publish_nowait)
        await monitor.acheck(latents * 1.1, denoising_step=1, publish=bus.publish_nowait)
        await monitor.acheck(
            latents * 11, denoising_step=2, timestep=500, publish=bus.publish_nowait
        )
        bad = latents.clone()
        bad[0, 0, 0, 0] = math.nan
        await monitor.acheck(bad, denoising_step=3, publish=bus.publish_nowait)
        await bus.drain()
        checked = recorder.of_type(LatentChecked)
        assert [c.finite for c in checked] == [True, True, True, False]
        assert checked[1].norm_ratio == pytest.approx(1.1, rel=1e-4)
        incidents = recorder.of_type(LatentAnomalyDetected)
        assert [(i.denoising_step, i.rule) for i in incidents] == [
            (2, "norm_drift"),
            (3, "non_finite"),
        ]
        assert incidents[0].timestep == 500 and incidents[1].nonfinite_count == 1
        assert len(monitor.norms) == 4
        monitor.reset()
        assert not monitor.norms

    def test_bad_ratio(self) -> None:
        """max_norm_ratio must be above 1."""
        with pytest.raises(ValueError, match="max_norm_ratio must be > 1"):
            LatentMonitor(max_norm_ratio=1.0)


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
