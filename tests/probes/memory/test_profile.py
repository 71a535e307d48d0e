"""A model's memory profile around one forward pass."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from eventbus_debug.probes import profile_memory

from ..conftest import make_mlp


def test_profile_memory_reports_initial_forward_final() -> None:
    """The profile holds the three snapshots, the peak and the output shapes."""
    model = make_mlp()
    profile = profile_memory(model, torch.randn(4, 8))
    assert profile.output_shapes == ((4, 1),)
    assert profile.peak_rss_bytes >= max(profile.initial.rss_bytes, profile.final.rss_bytes)
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        profile_memory("model", torch.randn(1))  # type: ignore[arg-type]


def test_profile_memory_peak_sees_a_transient_allocation() -> None:
    """A forward that allocates and frees 128 MiB inside shows it in the peak, not after."""

    class Transient(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            scratch = torch.ones(32 << 20)  # 128 MiB, touched, freed before returning
            total = scratch.sum()
            for _ in range(10):  # keep it alive long enough for the 1 ms poller
                total = total + scratch.sum()
            del scratch
            return x * (total > 0)

    profile = profile_memory(Transient(), torch.ones(2))
    assert profile.peak_rss_bytes - profile.initial.rss_bytes >= 64 << 20
