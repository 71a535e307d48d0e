"""``analyze_tensor``: a typed summary of any tensor, computed in one device-to-host transfer."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ("TensorStats", "analyze_tensor")


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorStats:
    """What :func:`analyze_tensor` found.

    Statistics cover the finite values only (NaN and Inf are counted, not averaged). Booleans
    count as 0/1, integers are widened to float64, complex values are summarized by magnitude,
    sparse tensors by their stored values, quantized tensors by their dequantized values.

    Attributes:
        name: the name given to :func:`analyze_tensor`.
        shape: the (dense) shape.
        dtype: e.g. ``"torch.float16"``.
        device: e.g. ``"cpu"``, ``"cuda:0"``, ``"meta"``.
        layout: e.g. ``"torch.strided"``, ``"torch.sparse_coo"``.
        numel: the number of (dense) elements.
        bytes: the memory its stored values (and sparse indices) take.
        contiguous: whether a strided tensor is contiguous (True for other layouts).
        requires_grad: as the tensor says.
        nan_count, inf_count: non-finite elements (``None`` for meta tensors).
        min, max, mean, std: over the finite values (``None`` when there are none, or for meta
            tensors, which hold no values).
        is_meta: True for a meta tensor (shape and dtype only).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    device: str
    layout: str
    numel: int
    bytes: int
    contiguous: bool
    requires_grad: bool
    nan_count: int | None
    inf_count: int | None
    min: float | None
    max: float | None
    mean: float | None
    std: float | None
    is_meta: bool = False

    @property
    def finite(self) -> bool:
        """True when no element is NaN or infinite (meta tensors count as finite)."""
        return not self.nan_count and not self.inf_count


def _values(t: torch.Tensor) -> torch.Tensor:
    """The stored values of *t* as a dense 1-d tensor of a type reductions accept."""
    if t.is_quantized:
        t = t.dequantize()
    if t.layout is torch.sparse_coo:
        t = t.coalesce().values()
    elif t.layout is not torch.strided:
        t = t.values()
    return t.reshape(-1)


def _nbytes(t: torch.Tensor) -> int:
    if t.layout is torch.sparse_coo:
        c = t.coalesce()
        return int(c.values().nbytes + c.indices().nbytes)
    if t.layout is not torch.strided:
        parts = [t.values()]
        if t.layout in (torch.sparse_csr, torch.sparse_bsr):
            parts += [t.crow_indices(), t.col_indices()]
        else:
            parts += [t.ccol_indices(), t.row_indices()]
        return int(sum(p.nbytes for p in parts))
    return int(t.numel() * t.element_size())


def analyze_tensor(tensor: torch.Tensor, name: str = "tensor") -> TensorStats:
    """Summarize *tensor*: shape, dtype, device, bytes, NaN/Inf counts, min, max, mean, std.

    Every number is reduced on the tensor's device and moved to the host in one transfer.
    Works for every dtype and layout; meta tensors are reported as such, with no values.

    Args:
        tensor: the tensor to summarize (it is not modified).
        name: a label carried into the result.

    Raises:
        TypeError: if *tensor* is not a ``torch.Tensor``.
    """
    if not isinstance(tensor, torch.Tensor):
        msg = f"analyze_tensor needs a torch.Tensor, got {type(tensor).__qualname__}"
        raise TypeError(msg)
    t = tensor.detach()
    common = {
        "name": name,
        "shape": tuple(t.shape),
        "dtype": str(t.dtype),
        "device": str(t.device),
        "layout": str(t.layout),
        "numel": t.numel(),
        "contiguous": t.is_contiguous() if t.layout is torch.strided else True,
        "requires_grad": tensor.requires_grad,
    }
    if t.is_meta:
        return TensorStats(
            **common,  # type: ignore[arg-type]
            bytes=t.numel() * t.element_size(),
            nan_count=None,
            inf_count=None,
            min=None,
            max=None,
            mean=None,
            std=None,
            is_meta=True,
        )
    v = _values(t)
    nbytes = _nbytes(t)
    if v.numel() == 0:
        return TensorStats(
            **common,  # type: ignore[arg-type]
            bytes=nbytes,
            nan_count=0,
            inf_count=0,
            min=None,
            max=None,
            mean=None,
            std=None,
        )
    with torch.no_grad():
        if v.is_complex() or v.is_floating_point():
            nan, inf = v.isnan().sum(), v.isinf().sum()
            if v.is_complex():
                v = v.abs()
            x = v.to(torch.float64 if v.dtype == torch.float64 else torch.float32)
            x = x[torch.isfinite(x)]
        else:  # bool and integers hold no NaN/Inf
            nan = inf = torch.zeros((), dtype=torch.int64, device=v.device)
            x = v.to(torch.float64)
        n = x.numel()
        if n:
            std = x.std() if n > 1 else torch.zeros((), dtype=torch.float64, device=x.device)
            stats = torch.stack([x.min(), x.max(), x.mean(), std]).to(torch.float64)
        else:
            stats = torch.full((4,), math.nan, dtype=torch.float64, device=v.device)
        packed = torch.cat([torch.stack([nan, inf]).to(torch.float64), stats])
    nan_c, inf_c, lo, hi, mean, sd = packed.tolist()  # the one transfer
    has = n > 0
    return TensorStats(
        **common,  # type: ignore[arg-type]
        bytes=nbytes,
        nan_count=int(nan_c),
        inf_count=int(inf_c),
        min=lo if has else None,
        max=hi if has else None,
        mean=mean if has else None,
        std=sd if has else None,
    )
