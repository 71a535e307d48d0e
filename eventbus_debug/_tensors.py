"""Small tensor helpers the probes and recovery share (no other import from the library)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ("batch_size", "copy_all", "non_finite")


def batch_size(batch: Any) -> int | None:
    """The leading dimension of the first tensor found in *batch* (a tensor, or a mapping,
    list or tuple of them, nested); None when there is none."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() > 0 else None
    if isinstance(batch, Mapping):
        batch = batch.values()
    elif not isinstance(batch, list | tuple):
        return None
    for value in batch:
        size = batch_size(value)
        if size is not None:
            return size
    return None


def copy_all(
    dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor], *, non_blocking: bool = False
) -> None:
    """``dst[i].copy_(src[i])`` for every *i*, in place.

    The plain tensors go through one fused ``torch._foreach_copy_``; tensor subclasses (FSDP2's
    DTensor shards, which have no sharding rule for ``_foreach_copy_``) are copied one by one.
    *non_blocking*: a copy from an accelerator into pinned host memory returns at once (the
    caller waits on an event before reading the host copies).
    """
    if not dst:
        return
    if all(t.__class__ is torch.Tensor for t in dst):
        torch._foreach_copy_(list(dst), list(src), non_blocking=non_blocking)
        return
    plain = [(d, s) for d, s in zip(dst, src, strict=True) if d.__class__ is torch.Tensor]
    if plain:
        torch._foreach_copy_(
            [d for d, _ in plain], [s for _, s in plain], non_blocking=non_blocking
        )
    for d, s in zip(dst, src, strict=True):
        if d.__class__ is not torch.Tensor:
            d.copy_(s)


def non_finite(t: torch.Tensor) -> bool:
    """Whether floating or complex *t* holds a NaN or an infinity (one host read; a sparse
    tensor's stored values are judged). Other dtypes never do."""
    if not (t.is_floating_point() or t.is_complex()):
        return False
    values = t.coalesce().values() if t.is_sparse else t
    return not bool(torch.isfinite(values).all())
