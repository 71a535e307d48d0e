"""Non-finite checks over what training loops produce: numbers, tensors, numpy arrays, nests.

:func:`non_finite_counts` takes a loss, an output, a metrics dict — Python numbers, tensors of
any dtype and layout, numpy arrays, and tuples, lists and mappings of them — and counts NaN and
infinite values. Every tensor is checked in its own precision (a float64 ``1e39`` is finite);
the narrow float formats (float8, float4) are widened to float32 first, which is exact. Tensor
counts are reduced on their device and moved to the host once per device.

:func:`stored_values` is the one place that knows how to read a tensor's values whatever its
layout (strided, sparse COO/CSR/CSC/BSR/BSC, nested, MKLDNN, quantized); the other checks of the
library use it too.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Final

import numpy as np
import torch

__all__ = ("MAX_NESTING", "NonFiniteCounts", "non_finite_counts", "stored_values")

MAX_NESTING: Final = 100
"""The deepest nesting of containers :func:`non_finite_counts` walks (``[[[x]]]`` is 3): a
training loop's outputs nest a few levels; a deeper structure is refused with a ValueError
rather than exhausting Python's recursion limit."""

_SPARSE_COMPRESSED: Final = (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)
_RAW_BITS: Final = frozenset(
    getattr(torch, n)
    for n in ("bits8", "bits16", "bits1x8", "bits2x4", "bits4x2")
    if hasattr(torch, n)
)
_FLOAT4: Final = getattr(torch, "float4_e2m1fn_x2", None)
# The 16 codes of float4 e2m1 (sign, 2 exponent bits, 1 mantissa bit): all finite.
_E2M1: Final = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)


def stored_values(tensor: torch.Tensor, *, name: str = "tensor") -> torch.Tensor:
    """The values *tensor* stores, as a dense 1-d tensor that reductions accept.

    Sparse tensors give their stored (specified) values, nested tensors the values of all their
    components, MKLDNN tensors their dense copy, quantized tensors their dequantized values.
    float8 and float4 values are widened to float32 (exactly); every other dtype is kept.

    Raises:
        TypeError: if *tensor* is not a tensor, or its dtype holds raw bits (``torch.bits8``...).
        ValueError: if *tensor* is a meta tensor (it has a shape and a dtype, but no values).
    """
    if not isinstance(tensor, torch.Tensor):
        msg = f"{name} must be a torch.Tensor, got {type(tensor).__qualname__}"
        raise TypeError(msg)
    t = tensor.detach()
    if t.is_meta:
        msg = f"{name} is a meta tensor: it has a shape and a dtype but no values to check; materialize it first (e.g. module.to_empty(device=...))"
        raise ValueError(msg)
    if t.dtype in _RAW_BITS:
        msg = f"{name} has dtype {t.dtype}, raw bits with no numeric meaning; view it as a numeric dtype first"
        raise TypeError(msg)
    if t.is_quantized:
        t = t.dequantize()
    layout = t.layout
    if t.is_nested:
        t = t.values()
    elif layout is torch.sparse_coo:
        t = t.coalesce().values()
    elif layout in _SPARSE_COMPRESSED:
        t = t.values()
        if t.is_complex():  # a complex view of CSR values has no strides for .real: copy it
            t = t.clone()
    elif layout is torch._mkldnn:  # type: ignore[attr-defined]
        t = t.to_dense()
    t = t.reshape(-1)
    if _FLOAT4 is not None and t.dtype == _FLOAT4:
        codes = t.view(torch.uint8)
        table = torch.tensor(_E2M1, dtype=torch.float32, device=t.device)
        # element i holds two values: the low nibble first, then the high one
        t = table[torch.stack([codes & 0xF, codes >> 4], dim=-1).reshape(-1).long()]
    elif t.is_floating_point() and t.dtype.itemsize == 1:
        t = t.float()
    return t


@dataclass(frozen=True, slots=True, kw_only=True)
class NonFiniteCounts:
    """What :func:`non_finite_counts` found.

    Attributes:
        name: the name given to :func:`non_finite_counts`.
        nan_count: NaN values (a complex value with a NaN part counts as NaN).
        inf_count: infinite values that are not NaN.
        checked: how many values were checked.
        non_finite: the paths of the leaves holding NaN or Inf (``"loss"``, ``"out['logits']"``,
            ``"metrics[1]"``), in traversal order.
        skipped: the paths of non-numeric leaves inside containers (strings, bytes, ``None``),
            which hold no numbers and are left out, as Ignite's ``TerminateOnNan`` does (with
            ``skip_unknown=True``, every leaf of a type that is not checked).
    """

    name: str
    nan_count: int
    inf_count: int
    checked: int
    non_finite: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()

    @property
    def finite(self) -> bool:
        """True when no value was NaN or infinite."""
        return not (self.nan_count or self.inf_count)


class _Walk:
    """One traversal: host-side counts of numbers and arrays, tensors kept for the device."""

    __slots__ = ("checked", "counts", "lenient", "on_path", "skipped", "tensors")

    def __init__(self, *, lenient: bool = False) -> None:
        self.lenient = lenient  # leaves of other types are skipped, not a TypeError
        self.counts: dict[str, tuple[int, int]] = {}  # path -> (nan, inf), in visit order
        self.tensors: list[tuple[str, torch.Tensor]] = []  # (path, stored values) to reduce
        self.checked = 0
        self.skipped: list[str] = []
        self.on_path: set[int] = set()

    def visit(self, value: object, path: str, *, top: bool) -> None:
        if isinstance(value, torch.Tensor):
            try:
                v = stored_values(value, name=path)
            except (TypeError, ValueError):  # raw bits, a meta tensor: no values to check
                if not self.lenient:
                    raise
                self.skipped.append(path)
                return
            self.checked += v.numel()
            if (v.is_floating_point() or v.is_complex()) and v.numel():
                self.counts[path] = (0, 0)
                self.tensors.append((path, v))
            return  # bool and integers hold no NaN/Inf
        if isinstance(value, np.ndarray | np.generic):
            self._numpy(np.asarray(value), path)
            return
        if isinstance(value, numbers.Number):
            self._number(value, path)
            return
        if isinstance(value, str | bytes | bytearray) or value is None:
            if top and not self.lenient:
                msg = f"{path} must be a number, a tensor, a numpy array or a tuple/list/mapping of them, got {type(value).__qualname__}"
                raise TypeError(msg)
            self.skipped.append(path)
            return
        if isinstance(value, range):  # integers only: finite, nothing to walk
            self.checked += len(value)
            return
        if isinstance(value, Sequence | Mapping):  # tuples, lists, deques, named tuples
            if id(value) in self.on_path:
                msg = f"{path} contains itself; a nested structure to check must be a tree"
                raise ValueError(msg)
            if len(self.on_path) >= MAX_NESTING:  # on_path holds the containers above value
                msg = (
                    f"containers nested more than {MAX_NESTING} deep (at {_head(path)}); "
                    f"non-finite checks walk at most {MAX_NESTING} levels: check the inner "
                    "values apart"
                )
                raise ValueError(msg)
            self.on_path.add(id(value))
            try:
                if isinstance(value, Mapping):
                    for key, item in value.items():
                        self.visit(item, f"{path}[{key!r}]", top=False)
                else:
                    for i, item in enumerate(value):
                        self.visit(item, f"{path}[{i}]", top=False)
            finally:
                self.on_path.discard(id(value))
            return
        if self.lenient:
            self.skipped.append(path)
            return
        msg = f"{path} is a {type(value).__qualname__}; non-finite checks take numbers, tensors, numpy arrays and tuples, lists and mappings of them"
        raise TypeError(msg)

    def _number(self, value: numbers.Number, path: str) -> None:
        self.checked += 1
        if isinstance(value, numbers.Rational):  # bool, int, Fraction: always finite
            return
        if isinstance(value, Decimal):
            nan, inf = int(value.is_nan()), int(value.is_infinite())
        elif isinstance(value, numbers.Real):
            f = float(value)
            nan, inf = int(math.isnan(f)), int(math.isinf(f))
        elif isinstance(value, numbers.Complex):
            z = complex(value)
            nan = int(math.isnan(z.real) or math.isnan(z.imag))
            inf = int(not nan and (math.isinf(z.real) or math.isinf(z.imag)))
        else:
            if self.lenient:
                self.checked -= 1
                self.skipped.append(path)
                return
            msg = f"{path} is a number of type {type(value).__qualname__} that is neither real nor complex"
            raise TypeError(msg)
        self.counts[path] = (nan, inf)

    def _numpy(self, a: np.ndarray, path: str) -> None:
        kind = a.dtype.kind
        self.checked += a.size
        if kind in "biu":  # bool, signed and unsigned integers
            return
        if kind not in "fc":
            if self.lenient:
                self.checked -= a.size
                self.skipped.append(path)
                return
            msg = f"{path} is a numpy array of dtype {a.dtype}; non-finite checks take bool, integer, floating or complex arrays"
            raise TypeError(msg)
        nan_mask = np.isnan(a)
        self.counts[path] = (int(nan_mask.sum()), int((np.isinf(a) & ~nan_mask).sum()))

    def reduce_tensors(self) -> None:
        """Count the tensors' NaN/Inf on their devices: one host transfer per device."""
        by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
        for path, v in self.tensors:
            by_device.setdefault(v.device, []).append((path, v))
        for items in by_device.values():
            with torch.no_grad():
                parts = []
                for _, v in items:
                    nan_mask = torch.isnan(v)
                    inf_mask = torch.isinf(v) & ~nan_mask
                    parts.append(torch.stack([nan_mask.sum(), inf_mask.sum()]))
                counts = torch.stack(parts).tolist()  # the one transfer for this device
            for (path, _), (nan, inf) in zip(items, counts, strict=True):
                self.counts[path] = (int(nan), int(inf))


def non_finite_counts(
    value: object, *, name: str = "value", skip_unknown: bool = False
) -> NonFiniteCounts:
    """Count the NaN and infinite values in *value*, whatever a training loop produced.

    Takes Python numbers (bool, int, float, complex, ``Decimal``, ``Fraction``), tensors of any
    dtype and layout (each checked in its own precision), numpy arrays and scalars, and tuples,
    lists (any sequence: a ``deque``, a named tuple) and mappings (dicts, ``OrderedDict``, Hugging Face ``ModelOutput``) of them, nested.
    Strings, bytes and ``None`` inside a container are left out (listed in ``skipped``).
    Tensor counts are reduced on the tensors' devices and moved to the host once per device.
    With ``skip_unknown=True`` nothing is refused for its type: a leaf of any other type (an
    object, ``None`` or a string at the top, an object-dtype array, a meta tensor) is left out
    and listed in ``skipped``, for callers that check whatever a loop hands them (the Ignite
    handler's output check).

    Example::

        counts = non_finite_counts({"loss": loss, "logits": logits}, name="outputs")
        if not counts.finite:
            print(counts.non_finite)  # ("outputs['loss']",)

    Raises:
        TypeError: if *value*, or a leaf inside it, is of another type (the path names it), or
            a tensor's dtype holds raw bits (neither with ``skip_unknown=True``).
        ValueError: if a tensor is a meta tensor (no values; not with ``skip_unknown=True``), a
            container contains itself, or containers are nested more than
            :data:`MAX_NESTING` (100) deep.
    """
    if not isinstance(name, str):
        msg = f"name must be a str, got {type(name).__qualname__}"
        raise TypeError(msg)
    walk = _Walk(lenient=bool(skip_unknown))
    walk.visit(value, name, top=True)
    walk.reduce_tensors()
    bad = [(p, n, i) for p, (n, i) in walk.counts.items() if n or i]
    return NonFiniteCounts(
        name=name,
        nan_count=sum(n for _, n, _ in bad),
        inf_count=sum(i for _, _, i in bad),
        checked=walk.checked,
        non_finite=tuple(p for p, _, _ in bad),
        skipped=tuple(walk.skipped),
    )


def _head(path: str) -> str:
    """*path* for a message: a deep one's first 60 characters (``value[0][0][0]...``)."""
    return path if len(path) <= 60 else path[:57] + "..."
