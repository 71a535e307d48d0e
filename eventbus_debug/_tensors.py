"""Small tensor helpers the probes and recovery share (no other import from the library)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ("copy_all",)


def copy_all(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for every *i*, in place.

    The plain tensors go through one fused ``torch._foreach_copy_``; tensor subclasses (FSDP2's
    DTensor shards, which have no sharding rule for ``_foreach_copy_``) are copied one by one.
    """
    if not dst:
        return
    if all(t.__class__ is torch.Tensor for t in dst):
        torch._foreach_copy_(list(dst), list(src))
        return
    plain = [(d, s) for d, s in zip(dst, src, strict=True) if d.__class__ is torch.Tensor]
    if plain:
        torch._foreach_copy_([d for d, _ in plain], [s for _, s in plain])
    for d, s in zip(dst, src, strict=True):
        if d.__class__ is not torch.Tensor:
            d.copy_(s)
