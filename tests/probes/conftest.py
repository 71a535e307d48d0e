from __future__ import annotations

import pytest
import torch
from torch import nn


def make_mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


@pytest.fixture(name="mlp")
def _mlp() -> nn.Sequential:
    return make_mlp()


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
