"""Fused per-tensor norms over many tensors, planned once and reused every step.

Tensors are grouped by device, dtype and shape. A group of many small tensors of one shape is
stacked and reduced along one dimension (two kernels for the whole group, instead of one per
tensor: on CPU ``torch._foreach_norm`` loops over tensors, which dominates models made of many
small layers). Large or unique tensors go through ``torch._foreach_norm``. Everything is
accumulated in fp32 and the results of every group end on one device, so the caller moves a
step's numbers to the host in one transfer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import torch

__all__ = ("NormPlan",)

STACK_MAX_NUMEL: Final = 1 << 16
"""Tensors up to this many elements, sharing a shape with another, are stacked (copied once)."""

_F32: Final = torch.float32


@dataclass(frozen=True, slots=True)
class _Group:
    indices: tuple[int, ...]
    stacked: bool
    sparse: bool


class NormPlan:
    """The grouping of a fixed list of tensor slots, and the fused reductions over it.

    Args:
        tensors: one representative tensor per slot (its device, dtype, shape and layout decide
            the grouping; later calls must pass tensors with the same properties per slot).
    """

    __slots__ = ("_groups", "home", "numels", "order", "size")

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        buckets: dict[tuple[object, ...], list[int]] = {}
        for i, t in enumerate(tensors):
            sparse = t.layout is not torch.strided
            small = 0 < t.numel() <= STACK_MAX_NUMEL and not sparse
            key: tuple[object, ...] = (t.device, t.dtype, sparse, tuple(t.shape) if small else i)
            buckets.setdefault(key, []).append(i)
        groups: list[_Group] = []
        singles: dict[tuple[object, ...], list[int]] = {}
        for key, idx in buckets.items():
            sparse = bool(key[2])
            if sparse:
                groups.append(_Group(tuple(idx), stacked=False, sparse=True))
            elif len(idx) >= 2:
                groups.append(_Group(tuple(idx), stacked=True, sparse=False))
            else:
                singles.setdefault(key[:2], []).extend(idx)
        groups.extend(_Group(tuple(idx), stacked=False, sparse=False) for idx in singles.values())
        self._groups: tuple[_Group, ...] = tuple(groups)
        self.order: tuple[int, ...] = tuple(i for g in groups for i in g.indices)
        """Slot index of each position of the result vectors."""
        self.numels: tuple[int, ...] = tuple(tensors[i].numel() for i in self.order)
        """Element count of each position of the result vectors."""
        self.size = len(self.order)
        self.home: torch.device = tensors[self.order[0]].device if tensors else torch.device("cpu")
        """The device the result vectors live on."""

    def reduce(
        self, tensors: Sequence[torch.Tensor], *, l1: bool, l2: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-tensor 2-norms (and sums of absolute values when *l1*), in :attr:`order`.

        Returns fp32 vectors on :attr:`home` (an empty 2-norm vector when not *l2*). Nothing is
        synchronized.
        """
        want_l2 = l2
        l2_parts: list[torch.Tensor] = []
        l1_parts: list[torch.Tensor] = []
        for g in self._groups:
            ts = [tensors[i] for i in g.indices]
            if g.sparse:
                values = [t.coalesce().values() for t in ts]
                if want_l2:
                    l2_parts.append(torch.stack([_vnorm(v) for v in values]))
                if l1:
                    l1_parts.append(torch.stack([_abs_sum(v) for v in values]))
            elif g.stacked:
                s = torch.stack(ts).reshape(len(ts), -1)
                if s.is_complex():
                    s = s.abs()
                if want_l2:
                    l2_parts.append(torch.linalg.vector_norm(s, 2, dim=1, dtype=_acc(s)).to(_F32))
                if l1:
                    l1_parts.append(s.abs().sum(dim=1, dtype=_acc(s)).to(_F32))
            else:
                if ts[0].is_complex():
                    ts = [t.abs() for t in ts]
                if want_l2:
                    l2_parts.append(
                        torch.stack(torch._foreach_norm(ts, 2, dtype=_acc(ts[0]))).to(_F32)
                    )
                if l1:
                    l1_parts.append(torch.stack([_abs_sum(t) for t in ts]))
        return _cat_on(l2_parts, self.home), (_cat_on(l1_parts, self.home) if l1 else None)


def _vnorm(t: torch.Tensor) -> torch.Tensor:
    if t.is_complex():
        t = t.abs()
    norm: torch.Tensor = torch.linalg.vector_norm(t, 2, dtype=_acc(t))
    return norm.to(_F32)


def _abs_sum(t: torch.Tensor) -> torch.Tensor:
    # abs().sum() is about 3x faster on CPU than vector_norm(ord=1) or _foreach_norm(ord=1).
    return t.abs().sum(dtype=_acc(t)).to(_F32)


def _acc(t: torch.Tensor) -> torch.dtype:
    """fp32 accumulation, except fp64 stays fp64 (torch refuses to narrow in a reduction)."""
    return torch.float64 if t.dtype in (torch.float64, torch.complex128) else _F32


def _cat_on(parts: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not parts:
        return torch.zeros(0, dtype=_F32, device=device)
    moved = [p if p.device == device else p.to(device, non_blocking=True) for p in parts]
    return moved[0] if len(moved) == 1 else torch.cat(moved)
