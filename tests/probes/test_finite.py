"""Checks take what training loops produce: numbers, tensors of any dtype and layout, numpy
arrays and nests of them (Ignite's TerminateOnNan table is the minimum); the rest is a clear
error. Also the dtype/layout robustness of analyze_tensor (check_gradients & co.: tests/compat)."""

from __future__ import annotations

import math
import warnings
from collections import OrderedDict
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
import torch
from torch import nn

from eventbus_debug import EventBus, Session
from eventbus_debug.events import NonFiniteDetected
from eventbus_debug.probes import analyze_tensor
from eventbus_debug.probes.finite import NonFiniteCounts, non_finite_counts, stored_values
from eventbus_debug.testing import RecordingSink
from tests._doubles import ignite_terminate_on_nan_table

_MKLDNN: bool = bool(torch.backends.mkldnn.is_available())  # type: ignore[no-untyped-call]


def _quiet(make: object) -> torch.Tensor:
    """Build a tensor whose constructor warns (CSR beta, strided nested prototype)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert callable(make)
        t = make()
    assert isinstance(t, torch.Tensor)
    return t


class TestNonFiniteCounts:
    @pytest.mark.parametrize(("value", "bad"), ignite_terminate_on_nan_table())
    def test_ignite_terminate_on_nan_table(self, value: object, bad: bool) -> None:
        """Every row of Ignite's TerminateOnNan table gets Ignite's answer."""
        assert non_finite_counts(value).finite is not bad

    def test_float64_is_checked_in_its_own_precision(self) -> None:
        """A finite float64 loss of 1e39 (inf in float32) is finite; numpy's too."""
        assert non_finite_counts(torch.tensor(1e39, dtype=torch.float64)).finite
        assert non_finite_counts(np.float64(1e39)).finite
        assert non_finite_counts(1e308).finite

    def test_nested_paths_counts_and_skipped(self) -> None:
        """Paths name each bad leaf in visit order; strings inside containers are skipped."""
        value = {
            "loss": torch.tensor([1.0, math.nan, math.inf]),
            "parts": [1, 2.5, (math.inf, "note", None)],
            "np": np.array([np.nan, 1.0], dtype=np.float16),
        }
        c = non_finite_counts(value, name="out")
        assert c == NonFiniteCounts(
            name="out",
            nan_count=2,
            inf_count=2,
            checked=3 + 2 + 1 + 2,
            non_finite=("out['loss']", "out['parts'][2][0]", "out['np']"),
            skipped=("out['parts'][2][1]", "out['parts'][2][2]"),
        )

    @pytest.mark.parametrize(
        ("value", "nan", "inf"),
        [
            (True, 0, 0),
            (10**400, 0, 0),
            (Fraction(1, 3), 0, 0),
            (Decimal("NaN"), 1, 0),
            (Decimal("-Infinity"), 0, 1),
            (complex(1.0, math.inf), 0, 1),
            (complex(math.nan, math.inf), 1, 0),
            (np.complex64(complex(0, math.nan)), 1, 0),
            (torch.tensor([1, 2], dtype=torch.int64), 0, 0),
            (torch.tensor([True]), 0, 0),
            (torch.tensor([complex(math.nan, 1), complex(1, math.inf)]), 1, 1),
            (torch.tensor([1.0, math.nan]).to(torch.float8_e4m3fn), 1, 0),
            (torch.tensor([math.inf, math.nan]).to(torch.float8_e5m2), 1, 1),
            (torch.tensor([1e38, -1e38], dtype=torch.bfloat16), 0, 0),
            (torch.tensor([[0.0, math.nan], [math.inf, 0.0]]).to_sparse(), 1, 1),
            (
                _quiet(lambda: torch.tensor([[0.0, math.nan], [math.inf, 0.0]]).to_sparse_csr()),
                1,
                1,
            ),
            (torch.tensor([[0.0, math.nan], [math.inf, 0.0]]).to_sparse_csc(), 1, 1),
            (torch.tensor([[math.nan, 0.0], [0.0, 1.0]]).to_sparse_bsr((1, 1)), 1, 0),
            (
                torch.nested.nested_tensor(
                    [torch.tensor([1.0, math.nan]), torch.ones(3)], layout=torch.jagged
                ),
                1,
                0,
            ),
            (
                _quiet(
                    lambda: torch.nested.nested_tensor([torch.tensor([math.inf]), torch.ones(2)])
                ),
                0,
                1,
            ),
            (_quiet(lambda: torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)), 0, 0),
        ],
    )
    def test_every_number_dtype_and_layout(self, value: object, nan: int, inf: int) -> None:
        """Numbers, every dtype (float8, bf16, complex, quantized) and layout are counted."""
        c = non_finite_counts(value)
        assert (c.nan_count, c.inf_count) == (nan, inf)

    @pytest.mark.skipif(not _MKLDNN, reason="no MKLDNN in this build")
    def test_mkldnn(self) -> None:
        """An MKLDNN tensor is read through its dense values."""
        c = non_finite_counts(torch.tensor([[1.0, math.nan]]).to_mkldnn())
        assert (c.nan_count, c.checked) == (1, 2)

    @pytest.mark.skipif(
        not hasattr(torch, "float4_e2m1fn_x2"), reason=f"torch {torch.__version__} has no float4"
    )
    def test_float4_is_decoded_and_always_finite(self) -> None:
        """float4 e2m1 has no NaN/Inf: its two values per byte are decoded exactly."""
        packed = torch.tensor([0x21, 0xF7], dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
        assert stored_values(packed).tolist() == [0.5, 1.0, 6.0, -6.0]
        assert non_finite_counts(packed).finite

    @pytest.mark.parametrize(
        ("value", "error", "match"),
        [
            ("nan", TypeError, r"value must be a number, a tensor"),
            (None, TypeError, r"got NoneType"),
            (object(), TypeError, r"value is a object"),
            ({"a": [1.0, object()]}, TypeError, r"value\['a'\]\[1\] is a object"),
            (np.array(["a"]), TypeError, r"numpy array of dtype <U1"),
            (torch.zeros(2, dtype=torch.bits8), TypeError, r"raw bits"),
            (torch.empty(3, device="meta"), ValueError, r"meta tensor"),
            ({1, 2}, TypeError, r"is a set"),
        ],
    )
    def test_anything_else_is_a_clear_error(
        self, value: object, error: type[Exception], match: str
    ) -> None:
        """Unsupported values raise, naming the path and the type."""
        with pytest.raises(error, match=match):
            non_finite_counts(value)

    def test_a_container_holding_itself_is_a_value_error(self) -> None:
        """A cycle is reported, not a RecursionError."""
        loop: list[object] = [1.0]
        loop.append(loop)
        with pytest.raises(ValueError, match=r"value\[1\] contains itself"):
            non_finite_counts(loop)


class TestSessionTensorCheck:
    async def test_session_check_takes_dicts_numbers_and_float64(
        self, recorder: RecordingSink
    ) -> None:
        """Session.check_tensor: a dict of outputs names the bad leaf; 1e39 in float64
        is finite; a string is a TypeError."""
        model = nn.Linear(2, 2)
        async with EventBus() as bus:
            bus.subscribe(recorder)
            async with Session(model, log_dir=None, bus=bus, recovery=False) as s:
                assert await s.check_tensor(torch.tensor(1e39, dtype=torch.float64), "loss")
                assert not await s.check_tensor(
                    {"logits": torch.tensor([1.0, math.nan]), "aux": 0.5}, "out"
                )
                assert await s.check_tensor(3, "count")
                with pytest.raises(TypeError, match="got str"):
                    await s.check_tensor("loss", "x")
            await bus.drain()
        (event,) = recorder.of_type(NonFiniteDetected)
        assert event.names == ("out['logits']",) and event.nan_count == 1


class TestAnalyzeTensorInputs:
    @pytest.mark.parametrize(
        "dtype",
        [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz],
    )
    def test_float8(self, dtype: torch.dtype) -> None:
        """float8 tensors get statistics and NaN counts (no NotImplementedError)."""
        s = analyze_tensor(torch.tensor([1.0, 2.0, math.nan]).to(dtype))
        assert (s.nan_count, s.min, s.max, s.mean) == (1, 1.0, 2.0, 1.5)

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
    def test_statistics_do_not_overflow(self, dtype: torch.dtype) -> None:
        """1000 values near the dtype's max: mean and std are finite and right."""
        big = torch.finfo(dtype).max / 2
        s = analyze_tensor(torch.full((1000,), big, dtype=dtype))
        assert s.mean == pytest.approx(float(torch.tensor(big, dtype=dtype)), rel=1e-6)
        assert s.std == 0.0 and s.finite

    def test_complex64_magnitude_does_not_overflow(self) -> None:
        """|3e38 + 3e38j| exceeds float32's max: the magnitude is taken in float64."""
        s = analyze_tensor(torch.tensor([complex(3e38, 3e38)], dtype=torch.complex64))
        assert s.max == pytest.approx(math.hypot(3e38, 3e38), rel=1e-6) and s.finite

    def test_nested_jagged_and_strided(self) -> None:
        """Nested tensors: ragged dimensions are -1; values of all components are summarized."""
        jag = torch.nested.nested_tensor([torch.ones(2, 3), torch.zeros(4, 3)], layout=torch.jagged)
        s = analyze_tensor(jag)
        assert s.shape == (2, -1, 3) and s.numel == 18 and s.mean == pytest.approx(6 / 18)
        strided = _quiet(lambda: torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(4, 3)]))
        s2 = analyze_tensor(strided)
        assert s2.shape == (2, -1, 3) and s2.min == 1.0 and s2.max == 1.0

    @pytest.mark.skipif(not _MKLDNN, reason="no MKLDNN in this build")
    def test_mkldnn_tensor(self) -> None:
        """An MKLDNN tensor is summarized from its dense values."""
        s = analyze_tensor(torch.arange(6.0).reshape(2, 3).to_mkldnn())
        assert (s.min, s.max, s.layout, s.contiguous) == (0.0, 5.0, "torch._mkldnn", True)

    def test_sparse_compressed(self) -> None:
        """CSR and CSC: the stored values, and the bytes of values and indices."""
        dense = torch.tensor([[0.0, 2.0], [3.0, 0.0]])
        for t in (_quiet(dense.to_sparse_csr), dense.to_sparse_csc()):
            s = analyze_tensor(t)
            assert (s.min, s.max, s.numel) == (2.0, 3.0, 4) and s.bytes > 0

    def test_raw_bits_are_a_type_error(self) -> None:
        """A bits8 tensor has no numeric meaning: a clear TypeError."""
        with pytest.raises(TypeError, match="raw bits"):
            analyze_tensor(torch.zeros(2, dtype=torch.bits8))


def test_ordered_dict_and_model_output_like_mappings() -> None:
    """Any Mapping (OrderedDict, a ModelOutput) is walked."""
    out = OrderedDict(loss=torch.tensor(math.nan), logits=torch.zeros(2))
    assert non_finite_counts(out, name="o").non_finite == ("o['loss']",)
