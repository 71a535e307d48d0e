"""compat.checks: the seeds' one-shot gradient and parameter checks take what models hold
(huge, NaN, complex and sparse gradients) and refuse bad thresholds and meta models clearly."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from eventbus_debug.compat import (
    check_gradient_explosion,
    check_gradient_vanishing,
    check_gradients,
    check_model_parameters,
    monitor_training_step,
)


def _model_with_grads(value: float) -> nn.Linear:
    model = nn.Linear(4, 4)
    for p in model.parameters():
        p.grad = torch.full_like(p, value)
    return model


class TestGradientFunctionInputs:
    def test_huge_finite_gradients_are_finite(self) -> None:
        """1e20 gradients: the fp32 sum of squares overflows, yet nothing is non-finite."""
        report = check_gradients(_model_with_grads(1e20), gradient_threshold=1.0)
        assert report.finite and report.non_finite == ()
        assert report.above == ("weight", "bias")
        g = float(torch.tensor(1e20))  # 1e20 rounded to float32
        assert report.total_norm == pytest.approx(g * math.sqrt(20), rel=1e-12)
        assert check_gradient_explosion(_model_with_grads(1e20), threshold=1e30) == ()

    def test_nan_gradients_are_non_finite(self) -> None:
        """A NaN gradient is reported by name and counted as exploded."""
        model = _model_with_grads(1.0)
        assert model.bias.grad is not None
        model.bias.grad[0] = math.nan
        assert check_gradients(model).non_finite == ("bias",)
        assert "bias" in check_gradient_explosion(model, threshold=1e30)

    @pytest.mark.parametrize("bad", [-1.0, 0.0, math.nan])
    def test_bad_thresholds_are_rejected(self, bad: float) -> None:
        """Negative, zero and NaN thresholds are ValueErrors naming the argument."""
        model = _model_with_grads(1.0)
        with pytest.raises(ValueError, match="gradient_threshold"):
            check_gradients(model, gradient_threshold=bad)
        with pytest.raises(ValueError, match="vanishing_threshold"):
            check_gradients(model, vanishing_threshold=bad)
        with pytest.raises(ValueError, match="threshold"):
            check_gradient_explosion(model, threshold=bad)
        with pytest.raises(ValueError, match="threshold"):
            check_gradient_vanishing(model, threshold=bad)

    def test_non_number_thresholds_are_type_errors(self) -> None:
        """A string or a bool threshold is a TypeError."""
        model = _model_with_grads(1.0)
        with pytest.raises(TypeError, match="gradient_threshold"):
            check_gradients(model, gradient_threshold="1")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="threshold"):
            check_gradient_vanishing(model, threshold=True)

    def test_meta_models_are_a_clear_error(self) -> None:
        """A model on the meta device: ValueError naming the parameter, for every function."""
        with torch.device("meta"):
            model = nn.Linear(4, 4)
        with pytest.raises(ValueError, match=r"parameter 'weight' is on the meta device"):
            check_model_parameters(model)
        with pytest.raises(ValueError, match="meta device"):
            monitor_training_step(model, 1.0, 0)
        with pytest.raises(ValueError, match=r"parameter 'weight' is on the meta device"):
            check_gradients(model)  # no gradients at all: still refused, not an empty report
        model.weight.grad = torch.empty_like(model.weight)
        with pytest.raises(ValueError, match=r"parameter 'weight' is on the meta device"):
            check_gradients(model)

    def test_complex_and_sparse_gradients(self) -> None:
        """Complex gradients count by magnitude; a sparse embedding gradient is read."""
        emb = nn.Embedding(10, 3, sparse=True)
        emb(torch.tensor([1, 2])).sum().backward()
        report = check_gradients(emb)
        assert report.finite and report.total_norm == pytest.approx(math.sqrt(6))
        holder = nn.Module()
        holder.w = nn.Parameter(torch.zeros(6, dtype=torch.complex64))
        holder.w.grad = torch.full_like(holder.w, complex(3.0, 4.0))
        assert check_gradients(holder, gradient_threshold=100).total_norm == pytest.approx(
            5.0 * math.sqrt(6)
        )
