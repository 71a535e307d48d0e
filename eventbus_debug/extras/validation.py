"""Input validation and model-output checks, reported as incidents or raised.

Each check does its math on the tensor's device and moves a handful of numbers to the host in
one transfer, whatever the tensor's size.

Example::

    validator = InputValidator(InputSpec(ndim=2, dtype=torch.float32, max_abs=1e3))
    violations = validator.check(batch, publish=bus.publish_nowait, step=step)
"""

from __future__ import annotations

import functools
import math
import numbers
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from enum import Enum
from typing import Final

import numpy as np
import torch

from ..events import Event, InputValidationFailed, OutputAnomalyDetected, Severity
from ..exceptions import EventBusError
from ..probes.finite import non_finite_counts, stored_values
from ..probes.tensor import dense_shape

__all__ = (
    "InputSpec",
    "InputValidationError",
    "InputValidator",
    "OutputChecker",
    "ValidationPolicy",
    "Violation",
    "validate_input",
)

Publish = Callable[[Event], object]

_RULES: Final = ("non_finite", "range", "shape", "dtype")
_OUTPUT_SOURCE: Final = "output_checker"


class InputValidationError(EventBusError, ValueError):
    """Raised by :class:`InputValidator` under :attr:`ValidationPolicy.RAISE` when a batch is invalid."""

    def __init__(self, violations: Sequence[Violation]) -> None:
        self.violations = tuple(violations)
        super().__init__("; ".join(v.message for v in self.violations))


class ValidationPolicy(Enum):
    """What an invalid batch causes.

    Attributes:
        RAISE: publish the incidents (when a publisher is given), then raise
            :class:`InputValidationError`.
        REPORT: publish the incidents and return the violations; training goes on with the
            batch.
        SKIP: publish the incidents and return the violations; a session's ``training_step``
            rejects the batch before the forward pass (no forward, no backward, no optimizer
            step: BatchNorm running statistics and every other buffer stay untouched) and
            publishes a :class:`~eventbus_debug.recovery.StepSkipped`.
    """

    RAISE = "raise"
    REPORT = "report"
    SKIP = "skip"

    @property
    def rejects(self) -> bool:
        """True when an invalid batch must not reach the model (RAISE and SKIP)."""
        return self is not ValidationPolicy.REPORT


@dataclass(frozen=True, slots=True, kw_only=True)
class InputSpec:
    """What a valid batch looks like; ``None`` leaves a property unchecked.

    Attributes:
        ndim: the number of dimensions.
        shape: the expected shape; ``None`` in a position matches any size (the batch axis).
        dtype: the expected dtype.
        min_value: the smallest allowed value.
        max_value: the largest allowed value.
        max_abs: the largest allowed absolute value (a "values too large" rule).
        allow_non_finite: accept NaN and infinite values.
    """

    ndim: int | None = None
    shape: tuple[int | None, ...] | None = None
    dtype: torch.dtype | None = None
    min_value: float | None = None
    max_value: float | None = None
    max_abs: float | None = None
    allow_non_finite: bool = False

    def __post_init__(self) -> None:
        for field_name in ("min_value", "max_value", "max_abs"):
            bound = getattr(self, field_name)
            if bound is None:
                continue
            if not _is_number(bound):
                msg = f"{field_name} must be a number or None, got {bound!r}"
                raise TypeError(msg)
            if math.isnan(bound):
                msg = f"{field_name} must not be NaN"
                raise ValueError(msg)
        if self.ndim is not None and self.ndim < 0:
            msg = f"ndim must be >= 0, got {self.ndim!r}"
            raise ValueError(msg)
        if (
            self.min_value is not None
            and self.max_value is not None
            and self.min_value > self.max_value
        ):
            msg = f"min_value ({self.min_value!r}) must not exceed max_value ({self.max_value!r})"
            raise ValueError(msg)
        if self.max_abs is not None and self.max_abs < 0:
            msg = f"max_abs must be >= 0, got {self.max_abs!r}"
            raise ValueError(msg)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True, kw_only=True)
class Violation:
    """One broken rule: which, and the numbers behind it."""

    rule: str
    message: str
    nan_count: int = 0
    inf_count: int = 0
    min_value: float | None = None
    max_value: float | None = None


def _real_values(t: torch.Tensor) -> torch.Tensor:
    """The stored values of *t*, as real numbers a range can be taken of (complex: ``|z|``)."""
    v = stored_values(t)
    if v.is_complex():
        return v.to(torch.complex128).abs()
    if not v.is_floating_point():
        return v.to(torch.float64)
    return v


def _stats(t: torch.Tensor) -> tuple[int, int, float | None, float | None]:
    """(nan count, inf count, finite min, finite max) with one device-to-host transfer.

    Sparse tensors are read through their stored values, complex ones by magnitude (a complex
    value with a NaN part counts as NaN); integers and bools are widened to float64, so the
    range of an int64 tensor is exact up to 2**53.
    """
    v = stored_values(t)
    if v.numel() == 0:
        return 0, 0, None, None
    with torch.no_grad():
        if v.is_floating_point() or v.is_complex():
            nan_mask = torch.isnan(v)
            inf_mask = torch.isinf(v) & ~nan_mask
        else:
            nan_mask = inf_mask = torch.zeros(v.shape, dtype=torch.bool, device=v.device)
        x = _real_values(t).to(torch.float64)
        finite = torch.isfinite(x)
        lo = torch.where(finite, x, torch.full_like(x, math.inf)).amin()
        hi = torch.where(finite, x, torch.full_like(x, -math.inf)).amax()
        values = torch.stack(
            [nan_mask.sum().double(), inf_mask.sum().double(), finite.sum().double(), lo, hi]
        ).tolist()
    n_nan, n_inf, n_finite = int(values[0]), int(values[1]), int(values[2])
    has_finite = n_finite > 0
    return (
        n_nan,
        n_inf,
        float(values[3]) if has_finite else None,
        float(values[4]) if has_finite else None,
    )


def validate_input(
    tensor: torch.Tensor, spec: InputSpec, *, name: str = "inputs"
) -> tuple[Violation, ...]:
    """Every rule of *spec* that *tensor* breaks (empty when it is valid); never raises for data.

    Any dtype and layout is accepted: sparse tensors are judged by their stored values, nested
    tensors by their components' values, complex tensors hold NaN or Inf when a part does and
    are range-checked by magnitude (``max_abs``; ``min_value``/``max_value`` need real values
    and are a ``dtype`` violation on complex data).

    Raises:
        TypeError: if *tensor* is not a tensor (or holds raw bits, ``torch.bits8``...).
        ValueError: if *tensor* is a meta tensor (it holds no values to validate).
    """
    if not isinstance(tensor, torch.Tensor):
        msg = f"{name} must be a torch.Tensor, got {type(tensor).__name__}"
        raise TypeError(msg)
    if tensor.is_meta:
        msg = f"{name} is a meta tensor: it has a shape and a dtype but no values to validate"
        raise ValueError(msg)
    out: list[Violation] = []
    shape = dense_shape(tensor)
    if spec.dtype is not None and tensor.dtype != spec.dtype:
        out.append(
            Violation(
                rule="dtype", message=f"{name} has dtype {tensor.dtype}, expected {spec.dtype}"
            )
        )
    if spec.ndim is not None and tensor.dim() != spec.ndim:
        out.append(
            Violation(
                rule="shape",
                message=f"{name} has {tensor.dim()} dimensions {shape}, expected {spec.ndim}",
            )
        )
    if spec.shape is not None:
        ok = len(shape) == len(spec.shape) and all(
            want is None or want == got for want, got in zip(spec.shape, shape, strict=False)
        )
        if not ok:
            want_s = "(" + ", ".join("*" if s is None else str(s) for s in spec.shape) + ")"
            out.append(
                Violation(rule="shape", message=f"{name} has shape {shape}, expected {want_s}")
            )
    complex_data = tensor.is_complex()
    if complex_data and (spec.min_value is not None or spec.max_value is not None):
        out.append(
            Violation(
                rule="dtype",
                message=f"{name} is complex ({tensor.dtype}): min_value/max_value need real values (use max_abs for a bound on |z|)",
            )
        )
    n_nan, n_inf, lo, hi = _stats(tensor)
    if (n_nan or n_inf) and not spec.allow_non_finite:
        out.append(
            Violation(
                rule="non_finite",
                message=f"{name} contains {n_nan} NaN and {n_inf} infinite values",
                nan_count=n_nan,
                inf_count=n_inf,
                min_value=lo,
                max_value=hi,
            )
        )
    if lo is not None and hi is not None:
        problems: list[str] = []
        if spec.min_value is not None and not complex_data and lo < spec.min_value:
            problems.append(f"minimum {lo:g} < {spec.min_value:g}")
        if spec.max_value is not None and not complex_data and hi > spec.max_value:
            problems.append(f"maximum {hi:g} > {spec.max_value:g}")
        if spec.max_abs is not None and max(abs(lo), abs(hi)) > spec.max_abs:
            problems.append(f"largest |value| {max(abs(lo), abs(hi)):g} > {spec.max_abs:g}")
        if problems:
            out.append(
                Violation(
                    rule="range",
                    message=f"{name} out of range: " + ", ".join(problems),
                    min_value=lo,
                    max_value=hi,
                )
            )
    return tuple(out)


class InputValidator:
    """Validates batches against an :class:`InputSpec`, reporting or raising by policy.

    Args:
        spec: what a valid batch looks like.
        policy: what an invalid batch causes.
        name: the name used in messages and events.
    """

    def __init__(
        self,
        spec: InputSpec,
        *,
        policy: ValidationPolicy = ValidationPolicy.RAISE,
        name: str = "inputs",
    ) -> None:
        if not isinstance(spec, InputSpec):
            msg = f"spec must be an InputSpec, got {type(spec).__name__}"
            raise TypeError(msg)
        if not isinstance(policy, ValidationPolicy):
            msg = f"policy must be a ValidationPolicy, got {policy!r}"
            raise TypeError(msg)
        self.spec = spec
        self.policy = policy
        self.name = name

    def events(
        self, tensor: torch.Tensor, violations: Sequence[Violation], *, step: int | None = None
    ) -> tuple[InputValidationFailed, ...]:
        """The incidents describing *violations* of *tensor*."""
        return tuple(
            InputValidationFailed(
                step=step,
                source="input_validator",
                name=self.name,
                rule=v.rule,
                message=v.message,
                nan_count=v.nan_count,
                inf_count=v.inf_count,
                min_value=v.min_value,
                max_value=v.max_value,
                shape=dense_shape(tensor),
                dtype=str(tensor.dtype).removeprefix("torch."),
            )
            for v in violations
        )

    def check(
        self, tensor: torch.Tensor, *, publish: Publish | None = None, step: int | None = None
    ) -> tuple[Violation, ...]:
        """Validate *tensor*; publish one :class:`InputValidationFailed` per broken rule.

        Returns:
            The violations (empty when the batch is valid).

        Raises:
            InputValidationError: under :attr:`ValidationPolicy.RAISE`, when the batch is invalid.
        """
        violations = validate_input(tensor, self.spec, name=self.name)
        if violations:
            if publish is not None:
                for ev in self.events(tensor, violations, step=step):
                    publish(ev)
            if self.policy is ValidationPolicy.RAISE:
                raise InputValidationError(violations)
        return violations


class OutputChecker:
    """Detects anomalous model outputs: non-finite values, out-of-range values, collapse.

    Args:
        expected_range: ``(low, high)`` outputs must stay in (e.g. ``(0, 1)`` for probabilities).
        collapse_std: outputs whose standard deviation over the batch is below this are
            "collapsed" (the model predicts the same thing for everything); ``None`` disables it.
        name: the name used in events.
    """

    def __init__(
        self,
        *,
        expected_range: tuple[float, float] | None = None,
        collapse_std: float | None = 1e-6,
        name: str = "outputs",
    ) -> None:
        if expected_range is not None:
            if (
                not isinstance(expected_range, tuple | list)
                or len(expected_range) != 2
                or not all(_is_number(b) for b in expected_range)
            ):
                msg = (
                    f"expected_range must be a (low, high) pair of numbers, got {expected_range!r}"
                )
                raise TypeError(msg)
            if any(math.isnan(b) for b in expected_range) or expected_range[0] > expected_range[1]:
                msg = f"expected_range must be (low, high) with low <= high and no NaN, got {expected_range!r}"
                raise ValueError(msg)
        if collapse_std is not None:
            if not _is_number(collapse_std):
                msg = f"collapse_std must be a number >= 0 or None, got {collapse_std!r}"
                raise TypeError(msg)
            if math.isnan(collapse_std) or collapse_std < 0:
                msg = f"collapse_std must be >= 0, got {collapse_std!r}"
                raise ValueError(msg)
        self.expected_range = expected_range
        self.collapse_std = collapse_std
        self.name = name

    def check(
        self, outputs: object, *, publish: Publish | None = None, step: int | None = None
    ) -> tuple[OutputAnomalyDetected, ...]:
        """Check *outputs* and publish an incident per anomaly.

        *outputs* is what a model returns: a tensor (any dtype or layout), a numpy array, a
        number, or a tuple, list or mapping of them (a Hugging Face ``ModelOutput`` included).
        Each tensor or numpy array is checked on its own (NaN/Inf, range, collapse), named by
        its path (``outputs['logits']``, ``outputs[0]``); the plain numbers of an output
        (Python or numpy scalars, or a bare number) are checked together for NaN/Inf and
        range, with one incident per rule naming their paths. A value gets the same range
        verdict whatever its form: ``3.0``, ``[3.0]``, ``{"p": 3.0}``, ``np.array([3.0])``
        and ``torch.tensor(3.0)`` are all out of ``expected_range=(0, 1)``. Each tensor
        costs one device-to-host transfer.

        Collapse is measured per output feature across the batch (dimension 0): a classifier
        that gives every sample the same scores is collapsed even if its scores differ
        between classes. Sparse and nested tensors are checked for NaN/Inf and range only
        (their features are not aligned across the batch).

        Returns:
            The incidents (empty when the outputs look healthy).

        Raises:
            TypeError: if *outputs* (or a leaf inside it) is neither a tensor, a number, a
                numpy array, a string/``None`` inside a structure, nor a tuple/list/mapping.
            ValueError: if an output tensor is a meta tensor (it holds no values).
        """
        if isinstance(outputs, torch.Tensor):
            found = self._tensor(self.name, outputs, step)
        else:
            non_finite_counts(outputs, name=self.name)  # TypeError / ValueError for the unknown
            found = []
            loose: list[tuple[str, float]] = []
            tensors: list[tuple[str, torch.Tensor]] = []
            for path, leaf in _output_leaves(outputs, self.name):
                if isinstance(leaf, torch.Tensor):
                    tensors.append((path, leaf))
                else:
                    loose.append((path, leaf))
            found.extend(self._numbers(loose, step))
            for path, t in tensors:
                found.extend(self._tensor(path, t, step))
        events = tuple(found)
        if publish is not None:
            for ev in events:
                publish(ev)
        return events

    def _numbers(
        self, values: Sequence[tuple[str, float]], step: int | None
    ) -> list[OutputAnomalyDetected]:
        """The anomalies of an output's plain numbers: one incident per broken rule."""
        if not values:
            return []
        bad = [path for path, v in values if not math.isfinite(v)]
        finite = [(path, v) for path, v in values if math.isfinite(v)]
        lo = min((v for _, v in finite), default=None)
        hi = max((v for _, v in finite), default=None)
        return self._findings(
            self.name,
            step,
            lo=lo,
            hi=hi,
            nonfinite_count=len(bad),
            non_finite=f"{self.name} hold NaN or infinite numbers{_at(bad, self.name)}",
            located=lambda low, high: _at(
                [path for path, v in finite if v < low or v > high], self.name
            ),
        )

    def _tensor(
        self, name: str, outputs: torch.Tensor, step: int | None
    ) -> list[OutputAnomalyDetected]:
        """The anomalies of one output tensor (one device-to-host transfer)."""
        if outputs.is_meta:
            msg = f"{name} is a meta tensor: it has a shape and a dtype but no values to check"
            raise ValueError(msg)
        v = stored_values(outputs, name=name)
        if v.numel() == 0:
            return []
        with torch.no_grad():
            if v.is_floating_point() or v.is_complex():
                nonfinite = (~torch.isfinite(v)).sum().double()
            else:
                nonfinite = torch.zeros((), dtype=torch.float64, device=v.device)
            x = _real_values(outputs).to(torch.float64)
            finite = torch.isfinite(x)
            lo = torch.where(finite, x, torch.full_like(x, math.inf)).amin()
            hi = torch.where(finite, x, torch.full_like(x, -math.inf)).amax()
            dense = outputs.layout is torch.strided and not outputs.is_nested
            if dense and outputs.dim() >= 1 and outputs.shape[0] > 1:
                d = outputs.detach()
                d = d.to(torch.complex128).abs() if d.is_complex() else d.to(torch.float64)
                d = torch.where(torch.isfinite(d), d, torch.zeros_like(d))
                spread = d.std(dim=0).amax()
            else:
                spread = torch.tensor(math.nan, dtype=torch.float64, device=v.device)
            n_bad, lo_v, hi_v, std_v = torch.stack([nonfinite, lo, hi, spread]).tolist()
        n_bad = int(n_bad)
        has_finite = n_bad < v.numel()
        lo_f = float(lo_v) if has_finite else None
        hi_f = float(hi_v) if has_finite else None
        std_f = float(std_v) if has_finite and math.isfinite(std_v) else None
        return self._findings(
            name,
            step,
            lo=lo_f,
            hi=hi_f,
            nonfinite_count=n_bad,
            non_finite=f"{name} contain {n_bad} NaN or infinite values",
            std=std_f,
        )

    def _findings(
        self,
        name: str,
        step: int | None,
        *,
        lo: float | None,
        hi: float | None,
        nonfinite_count: int,
        non_finite: str,
        located: Callable[[float, float], str] | None = None,
        std: float | None = None,
    ) -> list[OutputAnomalyDetected]:
        """The incidents of one checked output, one per broken rule, each carrying its numbers.

        ``non_finite`` (message *non_finite*) when *nonfinite_count* is not 0; ``range`` when
        the finite values *lo*..*hi* leave ``expected_range`` (*located(low, high)* ends its
        message: where the values outside are); ``collapsed`` when *std* is below
        ``collapse_std``.
        """
        finding = functools.partial(
            OutputAnomalyDetected,
            step=step,
            source=_OUTPUT_SOURCE,
            name=name,
            min_value=lo,
            max_value=hi,
            std=std,
            nonfinite_count=nonfinite_count,
        )
        found: list[OutputAnomalyDetected] = []
        if nonfinite_count:
            found.append(finding(rule="non_finite", message=non_finite, severity=Severity.ERROR))
        if self.expected_range is not None and lo is not None and hi is not None:
            low, high = self.expected_range
            if lo < low or hi > high:
                where = located(low, high) if located is not None else ""
                found.append(
                    finding(
                        rule="range",
                        message=f"{name} span [{lo:g}, {hi:g}], outside the expected "
                        f"[{low:g}, {high:g}]{where}",
                        severity=Severity.WARNING,
                    )
                )
        if self.collapse_std is not None and std is not None and std < self.collapse_std:
            found.append(
                finding(
                    rule="collapsed",
                    message=f"{name} are uniform across the batch (std {std:.3g} < {self.collapse_std:g})",
                    severity=Severity.WARNING,
                )
            )
        return found


_MAX_PATHS: Final = 8  # the paths an incident about plain numbers names


def _at(paths: Sequence[str], name: str) -> str:
    """`` at PATHS`` for an incident about plain numbers (nothing for one bare number)."""
    if list(paths) == [name]:
        return ""
    shown = ", ".join(paths[:_MAX_PATHS])
    more = len(paths) - _MAX_PATHS
    return f" at {shown}" if more <= 0 else f" at {shown} (and {more} more)"


def _number_value(value: object) -> float:
    """A plain number as the real value a range is taken of (complex: ``|z|``)."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, Decimal) and value.is_nan():  # a signalling NaN refuses float()
        return math.nan
    if isinstance(value, numbers.Complex) and not isinstance(value, numbers.Real):
        return abs(complex(value))
    try:
        return float(value)  # type: ignore[arg-type]
    except OverflowError:  # an int beyond the float range: finite, and as far out as a float goes
        return sys.float_info.max if value > 0 else -sys.float_info.max  # type: ignore[operator]


def _array_tensor(array: np.ndarray) -> torch.Tensor:
    """A numpy array as a CPU tensor of the dtype torch checks it in (a writable copy)."""
    kind = array.dtype.kind
    if kind == "b":
        dtype: type[np.generic] | np.dtype[np.generic] = np.dtype(np.bool_)
    elif kind in "iu":
        dtype = np.dtype(np.int64) if array.dtype.itemsize < 8 or kind == "i" else np.float64
    elif kind == "f":
        dtype = array.dtype if array.dtype.itemsize <= 8 else np.dtype(np.float64)
    else:  # "c": non_finite_counts refused every other kind
        dtype = array.dtype if array.dtype.itemsize <= 16 else np.dtype(np.complex128)
    return torch.from_numpy(np.array(array, dtype=dtype, copy=True))


def _output_leaves(value: object, path: str) -> Iterator[tuple[str, torch.Tensor | float]]:
    """The tensors (numpy arrays as tensors) and plain numbers inside an output, with the
    paths :func:`non_finite_counts` gives them; strings, bytes and ``None`` are left out.

    Only called after :func:`non_finite_counts` accepted *value* (every leaf's type is known
    and the structure is a tree).
    """
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, np.ndarray):
        yield path, _array_tensor(value)
    elif isinstance(value, numbers.Number | np.generic):
        yield path, _number_value(value)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _output_leaves(item, f"{path}[{key!r}]")
    elif isinstance(value, tuple | list):
        for i, item in enumerate(value):
            yield from _output_leaves(item, f"{path}[{i}]")
