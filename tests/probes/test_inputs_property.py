"""Property-based tests: every public check gives a correct answer or a clear error for any
tensor (dtypes, shapes, layouts, values with NaN/Inf), checked against a float64 reference."""

from __future__ import annotations

import math
import warnings
from typing import Final

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from eventbus_debug.compat import (
    check_gradient_explosion,
    check_gradient_vanishing,
    check_gradients,
    check_model_parameters,
)
from eventbus_debug.extras.validation import InputSpec, OutputChecker, validate_input
from eventbus_debug.probes import analyze_tensor
from eventbus_debug.probes.finite import non_finite_counts

SETTINGS: Final = settings(max_examples=60, deadline=None, derandomize=True)

FLOATS: Final = (
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
)
COMPLEX: Final = (torch.complex64, torch.complex128)
INTS: Final = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool)
LAYOUTS: Final = ("strided", "coo", "csr", "csc", "jagged", "mkldnn", "transposed")

values = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=64),
    st.sampled_from([0.0, -0.0, 1e38, -3e38, 1e-40, 65504.0, 448.0, 1e300]),
)


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    """A tensor of any dtype, a small shape (empty ones too), a layout, NaN/Inf included."""
    kind = draw(st.sampled_from(("float", "complex", "int")))
    rows = draw(st.integers(0, 4))
    cols = draw(st.integers(1, 4))
    n = rows * cols
    if kind == "int":
        dtype = draw(st.sampled_from(INTS))
        ints = draw(st.lists(st.integers(0, 100), min_size=n, max_size=n))
        t = torch.tensor(ints, dtype=torch.int64).to(dtype).reshape(rows, cols)
    else:
        real = draw(st.lists(values, min_size=n, max_size=n))
        t64 = torch.tensor(real, dtype=torch.float64).reshape(rows, cols)
        if kind == "complex":
            imag = torch.tensor(draw(st.lists(values, min_size=n, max_size=n)), dtype=torch.float64)
            t = torch.complex(t64, imag.reshape(rows, cols)).to(draw(st.sampled_from(COMPLEX)))
        else:
            t = t64.to(draw(st.sampled_from(FLOATS)))
    layout = draw(st.sampled_from(LAYOUTS))
    return _with_layout(t, layout)


def _with_layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    floatish = t.is_floating_point() and t.dtype.itemsize > 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CSR is "beta"
        if layout == "transposed":
            return t.t()
        if layout == "coo" and t.dtype.itemsize > 1:
            return t.to_sparse()
        if layout == "csr" and t.dtype.itemsize > 1:
            return t.to_sparse_csr()
        if layout == "csc" and t.dtype.itemsize > 1:
            return t.to_sparse_csc()
        if layout == "jagged" and t.shape[0] >= 1 and floatish:
            return torch.nested.nested_tensor(list(t.unbind(0)), layout=torch.jagged)
        if (
            layout == "mkldnn"
            and t.dtype == torch.float32
            and t.numel()
            and torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
        ):
            return t.to_mkldnn()
    return t


def _reference(t: torch.Tensor) -> tuple[np.ndarray, int, int]:
    """The stored values in float64/complex128 numpy, and their NaN and Inf counts."""
    if t.is_nested:
        d = t.values()
    elif t.layout is torch.sparse_coo:
        d = t.coalesce().values()
    elif t.layout in (torch.sparse_csr, torch.sparse_csc):
        d = t.values()
    elif t.layout is torch._mkldnn:  # type: ignore[attr-defined]
        d = t.to_dense()
    else:
        d = t
    d = d.reshape(-1)
    a = d.to(torch.complex128 if d.is_complex() else torch.float64).numpy()
    nan = np.isnan(a)
    return a, int(nan.sum()), int((np.isinf(a) & ~nan).sum())


class TestEveryPublicCheck:
    @SETTINGS
    @given(t=tensors())
    def test_non_finite_counts(self, t: torch.Tensor) -> None:
        """Counts equal the float64 reference for every dtype and layout."""
        _, nan, inf = _reference(t)
        c = non_finite_counts(t)
        assert (c.nan_count, c.inf_count, c.finite) == (nan, inf, nan + inf == 0)

    @SETTINGS
    @given(t=tensors())
    def test_analyze_tensor(self, t: torch.Tensor) -> None:
        """Counts match; min/max are the finite extremes; mean and std are finite and ordered."""
        a, nan, inf = _reference(t)
        s = analyze_tensor(t)
        assert (s.nan_count, s.inf_count) == (nan, inf)
        mags = np.abs(a) if np.iscomplexobj(a) else a
        finite = mags[np.isfinite(mags)].astype(np.float64)
        if finite.size == 0:
            assert s.min is None and s.mean is None
            return
        exact = 1e-12 if np.iscomplexobj(a) else 0.0  # |z| differs by an ulp between libraries
        assert s.min == pytest.approx(finite.min(), rel=exact, abs=0)
        assert s.max == pytest.approx(finite.max(), rel=exact, abs=0)
        assert s.mean is not None and s.std is not None and s.min is not None and s.max is not None
        assert math.isfinite(s.mean) and math.isfinite(s.std) and s.std >= 0
        tol = 1e-9 * max(abs(s.min), abs(s.max))
        assert s.min - tol <= s.mean <= s.max + tol
        assert s.mean == pytest.approx(math.fsum(finite) / finite.size, rel=1e-9, abs=tol)

    @SETTINGS
    @given(t=tensors())
    def test_validate_input(self, t: torch.Tensor) -> None:
        """A non_finite violation exactly when the reference holds NaN/Inf; never a crash."""
        _, nan, inf = _reference(t)
        rules = [v.rule for v in validate_input(t, InputSpec(max_abs=1e30))]
        assert ("non_finite" in rules) == (nan + inf > 0)
        assert rules.count("non_finite") <= 1

    @SETTINGS
    @given(t=tensors())
    def test_output_checker(self, t: torch.Tensor) -> None:
        """A non_finite incident exactly when the reference holds NaN/Inf; never a crash."""
        _, nan, inf = _reference(t)
        events = OutputChecker(collapse_std=None).check(t)
        bad = [e for e in events if e.rule == "non_finite"]
        assert bool(bad) == (nan + inf > 0)
        if bad:
            assert bad[0].nonfinite_count == nan + inf


@st.composite
def gradients(draw: st.DrawFn) -> list[torch.Tensor]:
    dtype = draw(st.sampled_from((torch.float32, torch.float64, torch.bfloat16, torch.float16)))
    grads = []
    for _ in range(draw(st.integers(1, 3))):
        n = draw(st.integers(1, 6))
        grads.append(torch.tensor(draw(st.lists(values, min_size=n, max_size=n))).to(dtype))
    return grads


def _model(grads: list[torch.Tensor]) -> nn.Module:
    model = nn.Module()
    for i, g in enumerate(grads):
        p = nn.Parameter(torch.zeros_like(g))
        p.grad = g
        model.register_parameter(f"p{i}", p)
    return model


class TestGradientFunctions:
    @SETTINGS
    @given(grads=gradients())
    def test_check_gradients(self, grads: list[torch.Tensor]) -> None:
        """Non-finite names match isfinite; finite totals match an exact float64 reference
        (no overflow from huge finite values); explosion/vanishing are consistent with it."""
        model = _model(grads)
        report = check_gradients(model, gradient_threshold=1e3, vanishing_threshold=1e-6)
        expected_bad = tuple(f"p{i}" for i, g in enumerate(grads) if not torch.isfinite(g).all())
        assert report.non_finite == expected_bad
        if not expected_bad:
            sq = math.fsum(float(x) ** 2 for g in grads for x in g.double().tolist())
            assert report.total_norm == pytest.approx(math.sqrt(sq), rel=1e-9)
        exploded = check_gradient_explosion(model, threshold=1e3)
        assert set(expected_bad) <= set(exploded)
        assert set(report.above) - set(expected_bad) <= set(exploded)
        vanished = check_gradient_vanishing(model, threshold=1e-6)
        assert set(vanished) == set(report.below)

    @SETTINGS
    @given(grads=gradients())
    def test_check_model_parameters(self, grads: list[torch.Tensor]) -> None:
        """Parameters holding the drawn values: non-finite names match isfinite."""
        model = nn.Module()
        for i, g in enumerate(grads):
            model.register_parameter(f"p{i}", nn.Parameter(g.clone()))
        expected = tuple(f"p{i}" for i, g in enumerate(grads) if not torch.isfinite(g).all())
        assert check_model_parameters(model).non_finite == expected

    @SETTINGS
    @given(bad=st.one_of(st.floats(max_value=0.0), st.just(math.nan)))
    def test_non_positive_thresholds_are_rejected(self, bad: float) -> None:
        """Every threshold <= 0 or NaN is a ValueError at the boundary."""
        model = _model([torch.ones(2)])
        with pytest.raises(ValueError, match="threshold"):
            check_gradients(model, gradient_threshold=bad)
        with pytest.raises(ValueError, match="threshold"):
            check_gradient_vanishing(model, threshold=bad)
        with pytest.raises(ValueError, match="threshold"):
            check_gradient_explosion(model, threshold=bad)
