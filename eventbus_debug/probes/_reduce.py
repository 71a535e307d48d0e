"""Fused per-tensor norms over many tensors, planned once and reused every step.

A plan groups a fixed list of tensor slots by device and accumulation dtype and reduces each
group with one ``torch._foreach_norm`` call (on CUDA, one multi-tensor kernel for the whole
group). The results come back as *pieces*: 0-d tensors (one per slot) or, for stacked groups,
1-d vectors, in :attr:`NormPlan.order`; the caller stacks every piece of a step into its one
result vector (one kernel), so nothing here synchronizes or copies what it does not have to.

On CPU ``torch._foreach_norm`` loops over the tensors, which dominates models made of many
small layers (800 tensors of 32x32: about 2 ms). There, a group of at least
:data:`STACK_MIN` small same-shape tensors is stacked (copied once) and reduced along one
dimension instead (about 0.2 ms). Smaller groups are not stacked: the copy would cost more than
it saves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import torch

__all__ = ("NormPlan", "assemble", "sharded")

STACK_MAX_NUMEL: Final = 1 << 16
"""Tensors up to this many elements, sharing a shape with others, may be stacked (CPU only)."""
STACK_MIN: Final = 8
"""How many same-shape small tensors a CPU group needs before stacking pays for its copy."""

_F32: Final = torch.float32


@dataclass(frozen=True, slots=True)
class _Group:
    indices: tuple[int, ...]
    kind: str  # "foreach" | "stacked" | "sparse"
    acc: torch.dtype
    complex: bool
    away: bool  # not on the plan's home device: its results are moved there


def sharded(t: torch.Tensor) -> bool:
    """True for a DTensor shard (FSDP2): its norms need a collective to be global."""
    return callable(getattr(t, "full_tensor", None))


class NormPlan:
    """The grouping of a fixed list of tensor slots, and the fused reductions over it.

    Args:
        tensors: one representative tensor per slot (its device, dtype, shape and layout decide
            the grouping; later calls must pass tensors with the same properties per slot).
    """

    __slots__ = ("_groups", "_whole", "flat", "home", "numels", "order", "size")

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        buckets: dict[tuple[object, ...], list[int]] = {}
        for i, t in enumerate(tensors):
            sparse = t.layout is not torch.strided
            stackable = (
                t.device.type == "cpu"
                and 0 < t.numel() <= STACK_MAX_NUMEL
                and not sparse
                and not t.is_complex()
            )
            shape: object = tuple(t.shape) if stackable else None
            key: tuple[object, ...] = (t.device, t.dtype, sparse, shape)
            buckets.setdefault(key, []).append(i)
        home = tensors[0].device if tensors else torch.device("cpu")
        self.home: torch.device = home
        """The device the result pieces live on (the first tensor's)."""
        groups: list[_Group] = []
        rest: dict[tuple[object, ...], list[int]] = {}
        for key, idx in buckets.items():
            dtype, away = key[1], key[0] != home
            assert isinstance(dtype, torch.dtype)
            if key[2]:
                groups.extend(
                    _Group((i,), "sparse", _acc(dtype), dtype.is_complex, away) for i in idx
                )
            elif key[3] is not None and len(idx) >= STACK_MIN:
                groups.append(_Group(tuple(idx), "stacked", _acc(dtype), False, away))
            else:
                rest.setdefault(key[:2], []).extend(idx)
        for (device, dtype), idx in rest.items():
            assert isinstance(dtype, torch.dtype)
            groups.append(
                _Group(tuple(sorted(idx)), "foreach", _acc(dtype), dtype.is_complex, device != home)
            )
        self._groups: tuple[_Group, ...] = tuple(groups)
        self.order: tuple[int, ...] = tuple(i for g in groups for i in g.indices)
        """Slot index of each position of the result vectors."""
        self.numels: tuple[int, ...] = tuple(tensors[i].numel() for i in self.order)
        """Element count of each position of the result vectors."""
        self.size = len(self.order)
        self.flat = all(g.kind != "stacked" for g in groups)
        """True when every piece is a 0-d tensor (no stacked group)."""
        # one group over every slot in order: reduce() passes the caller's list as it is
        self._whole = len(groups) == 1 and self.order == tuple(range(len(tensors)))

    def reduce(self, tensors: Sequence[torch.Tensor], *, ord: float = 2.0) -> list[torch.Tensor]:
        """Per-tensor *ord*-norms (2, or 1: sums of absolute values), as pieces in :attr:`order`.

        The pieces are 0-d tensors or 1-d vectors, on :attr:`home`, accumulated in fp32 (fp64
        for fp64 tensors). Nothing is synchronized.
        """
        home = self.home
        pieces: list[torch.Tensor] = []
        for g in self._groups:
            if g.kind == "foreach":
                if self._whole:
                    ts = tensors if isinstance(tensors, list) else list(tensors)
                else:
                    ts = [tensors[i] for i in g.indices]
                if g.complex:
                    ts = [t.abs() for t in ts]
                if ord == 1.0 and ts[0].device.type == "cpu":
                    # abs then sum is about 3x faster on CPU than a 1-norm (whose kernel is
                    # not vectorized); one fused abs over the group saves a call per tensor.
                    norms = [t.sum(dtype=g.acc) for t in torch._foreach_abs(ts)]
                else:
                    norms = list(torch._foreach_norm(ts, ord, dtype=g.acc))
            elif g.kind == "stacked":
                s = torch.stack([tensors[i] for i in g.indices]).reshape(len(g.indices), -1)
                if ord == 1.0:
                    norms = [s.abs().sum(dim=1, dtype=g.acc)]
                else:
                    norms = [torch.linalg.vector_norm(s, ord, dim=1, dtype=g.acc)]
            else:
                v = tensors[g.indices[0]].coalesce().values()
                if g.complex:
                    v = v.abs()
                norms = [torch.linalg.vector_norm(v, ord, dtype=g.acc)]
            if g.away:
                norms = [n.to(home, non_blocking=True) for n in norms]
            pieces += norms
        return pieces


def assemble(pieces: Sequence[torch.Tensor], *, flat: bool = False) -> torch.Tensor:
    """One 1-d vector of *pieces* (0-d tensors and 1-d vectors, on one device), in order.

    All 0-d pieces (*flat*: the caller knows it), the common case, take one ``torch.stack``
    (one kernel); dtypes promote (an fp64 piece makes the vector fp64).
    """
    if not pieces:
        return torch.zeros(0, dtype=_F32)
    if flat or all(p.dim() == 0 for p in pieces):
        return torch.stack(list(pieces))
    parts: list[torch.Tensor] = []
    run: list[torch.Tensor] = []
    for p in pieces:
        if p.dim() == 0:
            run.append(p)
            continue
        if run:
            parts.append(torch.stack(run))
            run = []
        parts.append(p)
    if run:
        parts.append(torch.stack(run))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _acc(dtype: torch.dtype) -> torch.dtype:
    """fp32 accumulation, except fp64 stays fp64 (torch refuses to narrow in a reduction)."""
    return torch.float64 if dtype in (torch.float64, torch.complex128) else _F32
