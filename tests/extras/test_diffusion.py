"""extras.diffusion: a pipeline's components and the per-denoising-step latent checks."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from eventbus_debug import EventBus
from eventbus_debug.events import LatentAnomalyDetected, LatentChecked
from eventbus_debug.extras.diffusion import LatentMonitor, analyze_pipeline
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
        await monitor.check(latents, denoising_step=0, publish=bus.publish_nowait)
        await monitor.check(latents * 1.1, denoising_step=1, publish=bus.publish_nowait)
        await monitor.check(
            latents * 11, denoising_step=2, timestep=500, publish=bus.publish_nowait
        )
        bad = latents.clone()
        bad[0, 0, 0, 0] = math.nan
        await monitor.check(bad, denoising_step=3, publish=bus.publish_nowait)
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

    @pytest.mark.parametrize("bad", [0.0, -2.0, math.nan, math.inf])
    def test_bad_ceiling(self, bad: float) -> None:
        """max_norm must be a finite number > 0, named with the value."""
        with pytest.raises(ValueError, match="max_norm must be a finite number > 0"):
            LatentMonitor(max_norm=bad)

    def test_ceiling_alone_is_an_incident(self) -> None:
        """With a ceiling, an RMS above it is norm drift even when the ratio is normal."""
        monitor = LatentMonitor(max_norm=0.5)
        (checked, incident) = monitor.check_sync(torch.ones(2, 4), denoising_step=0)
        assert isinstance(checked, LatentChecked) and checked.norm == pytest.approx(1.0)
        assert isinstance(incident, LatentAnomalyDetected) and incident.rule == "norm_drift"
        assert "exceeds 0.5" in incident.message
