"""A small model and batches shared by the session tests."""

from __future__ import annotations

import math

import torch
from torch import nn


def setup() -> tuple[nn.Module, torch.optim.Optimizer]:
    """A seeded 4-8-1 MLP and its SGD optimizer."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def batch(bad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Six samples; with *bad*, the first input is NaN."""
    x, y = torch.randn(6, 4), torch.randn(6, 1)
    if bad:
        x[0, 0] = math.nan
    return x, y
