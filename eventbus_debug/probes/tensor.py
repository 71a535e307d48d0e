"""``analyze_tensor``: a typed summary of any tensor, computed in one device-to-host transfer."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .finite import _RAW_BITS, stored_values

__all__ = ("TensorStats", "analyze_tensor", "dense_shape")


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorStats:
    """What :func:`analyze_tensor` found.

    Statistics cover the finite values only (NaN and Inf are counted, not averaged). Booleans
    count as 0/1; every statistic is computed in float64 from values scaled by their largest
    magnitude, so bf16/fp16/fp32 values near their dtype's limit never overflow the mean or
    std. Complex values are summarized by magnitude, sparse tensors (COO, CSR, CSC, BSR, BSC)
    by their stored values, nested tensors by the values of all their components, MKLDNN
    tensors by their dense values, quantized tensors by their dequantized values, float8 and
    float4 tensors by their exact float32 values.

    Attributes:
        name: the name given to :func:`analyze_tensor`.
        shape: the (dense) shape; ``-1`` for the ragged dimensions of a nested tensor.
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


def _nbytes(t: torch.Tensor) -> int:
    """The memory a (non-meta) tensor's stored values, and its index tensors, take."""
    if t.is_nested:
        parts = [t.values()]
        offsets = t.offsets() if t.layout is torch.jagged else None  # type: ignore[attr-defined]
        if offsets is not None:
            parts.append(offsets)
        return int(sum(p.numel() * p.element_size() for p in parts))
    if t.layout is torch.sparse_coo:
        c = t.coalesce()
        return int(c.values().nbytes + c.indices().nbytes)
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        parts = [t.values(), t.crow_indices(), t.col_indices()]
        return int(sum(p.nbytes for p in parts))
    if t.layout in (torch.sparse_csc, torch.sparse_bsc):
        parts = [t.values(), t.ccol_indices(), t.row_indices()]
        return int(sum(p.nbytes for p in parts))
    return int(t.numel() * t.element_size())


def dense_shape(t: torch.Tensor) -> tuple[int, ...]:
    """The shape, with ``-1`` for the ragged dimensions of a nested tensor."""
    if not t.is_nested:
        return tuple(int(s) for s in t.shape)
    if t.layout is torch.jagged:
        return tuple(s if isinstance(s, int) else -1 for s in t.shape)
    sizes = t._nested_tensor_size()  # strided nested: one row of sizes per component
    if sizes.numel() == 0:
        return (t.size(0),)
    cols = sizes.T.tolist()
    return (int(sizes.shape[0]), *(c[0] if len(set(c)) == 1 else -1 for c in cols))


def _contiguous(t: torch.Tensor) -> bool:
    if t.layout is not torch.strided or t.is_nested:
        return True
    return t.is_contiguous()


def _moments(x: torch.Tensor) -> torch.Tensor:
    """min, max, mean and std of finite float64 values, computed without overflow.

    The values are divided by their largest magnitude first, so the sum and the sum of squares
    stay below the number of elements whatever the values are (``1e300`` included).
    """
    scale = x.abs().amax()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = x / safe
    std = y.std() if x.numel() > 1 else torch.zeros((), dtype=torch.float64, device=x.device)
    return torch.stack([x.min(), x.max(), y.mean() * safe, std * safe])


def analyze_tensor(tensor: torch.Tensor, name: str = "tensor") -> TensorStats:
    """Summarize *tensor*: shape, dtype, device, bytes, NaN/Inf counts, min, max, mean, std.

    Every number is reduced on the tensor's device and moved to the host in one transfer.
    Works for every dtype and layout; meta tensors are reported as such, with no values.

    Args:
        tensor: the tensor to summarize (it is not modified).
        name: a label carried into the result.

    Raises:
        TypeError: if *tensor* is not a ``torch.Tensor``, or its dtype holds raw bits
            (``torch.bits8``...), which have no numeric meaning.
    """
    if not isinstance(tensor, torch.Tensor):
        msg = f"analyze_tensor needs a torch.Tensor, got {type(tensor).__qualname__}"
        raise TypeError(msg)
    t = tensor.detach()
    if t.dtype in _RAW_BITS:
        msg = f"{name} has dtype {t.dtype}, raw bits with no numeric meaning; view it as a numeric dtype first"
        raise TypeError(msg)
    common = {
        "name": name,
        "shape": dense_shape(t),
        "dtype": str(t.dtype),
        "device": str(t.device),
        "layout": str(t.layout),
        "numel": t.numel(),
        "contiguous": _contiguous(t),
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
    v = stored_values(t, name=name)
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
            nan_mask = v.isnan()
            nan, inf = nan_mask.sum(), (v.isinf() & ~nan_mask).sum()
            # |z| of a finite complex64 z can overflow float32: take it in float64
            x = v.to(torch.complex128).abs() if v.is_complex() else v.to(torch.float64)
            x = x[torch.isfinite(x)]
        else:  # bool and integers hold no NaN/Inf
            nan = inf = torch.zeros((), dtype=torch.int64, device=v.device)
            x = v.to(torch.float64)
        n = x.numel()
        if n:
            stats = _moments(x)
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
