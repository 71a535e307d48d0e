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


def linear_at(model: nn.Sequential, index: int) -> nn.Linear:
    """The ``nn.Linear`` at *index* of *model*, typed (indexing a Sequential gives a Module)."""
    layer = model[index]
    assert isinstance(layer, nn.Linear), layer
    return layer


def grad_of(tensor: torch.Tensor) -> torch.Tensor:
    """The gradient of *tensor*, which a backward pass must have filled in."""
    assert tensor.grad is not None, "no gradient: did the backward pass reach this tensor?"
    return tensor.grad


def grads_of(model: nn.Module) -> list[torch.Tensor]:
    """The gradient of every parameter of *model*, in ``parameters()`` order; all must exist."""
    return [grad_of(p) for p in model.parameters()]
