"""Fused norms: one plan per pattern of tensors, pieces in the plan's order, one vector."""

from __future__ import annotations

import pytest
import torch

from eventbus_debug.probes._reduce import STACK_MIN, NormPlan, assemble


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    same = [torch.randn(4, 4, generator=g) for _ in range(STACK_MIN)]  # stacked on CPU
    return [
        *same,
        torch.randn(7, generator=g),
        torch.randn(3, generator=g, dtype=torch.float64),
        torch.randn(5, generator=g, dtype=torch.complex64),
        torch.tensor([3.0, 0.0, -4.0, 0.0, 0.0]).to_sparse(),
        torch.randn(2, 3, generator=g).half(),
    ]


@pytest.mark.parametrize("ord", [2.0, 1.0])
def test_every_kind_of_tensor_matches_its_own_norm(ord: float) -> None:
    """Stacked, single, fp64, complex, sparse and fp16 slots: each position's norm is right."""
    tensors = _tensors()
    plan = NormPlan(tensors)
    vector = assemble(plan.reduce(tensors, ord=ord))
    assert sorted(plan.order) == list(range(len(tensors))) and vector.shape == (plan.size,)
    assert not plan.flat  # a stacked group gives a 1-d piece
    for pos, slot in enumerate(plan.order):
        t = tensors[slot]
        dense = (t.to_dense() if t.is_sparse else t).abs().double()
        want = torch.linalg.vector_norm(dense, ord).item()
        assert vector[pos].item() == pytest.approx(want, rel=1e-3), (slot, t.dtype)
    assert plan.numels == tuple(tensors[i].numel() for i in plan.order)


def test_a_small_same_shape_group_is_not_stacked() -> None:
    """Fewer than STACK_MIN same-shape tensors go through one foreach call: all 0-d pieces."""
    tensors = [torch.ones(3) for _ in range(STACK_MIN - 1)]
    plan = NormPlan(tensors)
    pieces = plan.reduce(tensors)
    assert plan.flat and all(p.dim() == 0 for p in pieces)
    assert assemble(pieces).tolist() == pytest.approx([3**0.5] * (STACK_MIN - 1))


def test_assemble_keeps_the_order_of_scalars_and_vectors() -> None:
    """0-d and 1-d pieces come out in order, promoted to the widest dtype; none is empty."""
    pieces = [
        torch.tensor(1.0),
        torch.tensor([2.0, 3.0]),
        torch.tensor(4.0, dtype=torch.float64),
        torch.tensor(5.0),
    ]
    vector = assemble(pieces)
    assert vector.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0] and vector.dtype == torch.float64
    assert assemble([]).shape == (0,)
