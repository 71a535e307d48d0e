"""extras.optimization: AMP, compilation, gradient checkpointing and accumulation."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from eventbus_debug.extras.optimization import (
    OptimizationMode,
    OptimizedStep,
    default_amp_dtype,
    disable_gradient_checkpointing,
    enable_gradient_checkpointing,
    is_gradient_checkpointing,
    optimize_model,
)


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(12, 8), torch.randn(12, 1)


class TestOptimizationMode:
    def test_full_expands_to_every_concrete_mode(self) -> None:
        """FULL stands for every mode except NONE and FULL."""
        assert OptimizationMode.FULL.expand() == {
            OptimizationMode.AMP,
            OptimizationMode.COMPILE,
            OptimizationMode.GRADIENT_CHECKPOINTING,
            OptimizationMode.GRADIENT_ACCUMULATION,
        }
        assert OptimizationMode.NONE.expand() == frozenset()

    def test_bad_mode_is_rejected_with_the_valid_ones(self) -> None:
        """A string instead of a mode names the valid modes."""
        with pytest.raises(TypeError, match="GRADIENT_ACCUMULATION"):
            optimize_model(_model(), ["amp"])  # type: ignore[list-item]


class TestGradientCheckpointing:
    def test_enable_disable_round_trip_keeps_gradients_equal(self) -> None:
        """Checkpointed blocks give the same gradients, and disabling restores the module."""
        model = _model()
        x, y = _data()
        torch.autograd.backward(nn.functional.mse_loss(model(x), y))
        plain = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        model.zero_grad()
        assert enable_gradient_checkpointing(model) == 3
        assert is_gradient_checkpointing(model)
        torch.autograd.backward(nn.functional.mse_loss(model(x), y))
        checked = [p.grad for p in model.parameters() if p.grad is not None]
        for a, b in zip(plain, checked, strict=True):
            torch.testing.assert_close(a, b)
        assert disable_gradient_checkpointing(model) == 3
        assert not is_gradient_checkpointing(model)
        first = next(iter(model.children()))
        assert "forward" not in first.__dict__

    def test_enable_twice_is_idempotent(self) -> None:
        """Enabling again does not wrap a wrapper."""
        model = _model()
        enable_gradient_checkpointing(model)
        enable_gradient_checkpointing(model)
        assert disable_gradient_checkpointing(model) == 3

    def test_native_switch_is_used_when_present(self) -> None:
        """Models with gradient_checkpointing_enable() (Hugging Face) use their own switch."""

        class HF(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.lin = nn.Linear(2, 2)
                self.is_gradient_checkpointing = False

            def gradient_checkpointing_enable(self) -> None:
                self.is_gradient_checkpointing = True

            def gradient_checkpointing_disable(self) -> None:
                self.is_gradient_checkpointing = False

        m = HF()
        assert enable_gradient_checkpointing(m) == 0
        assert is_gradient_checkpointing(m)
        disable_gradient_checkpointing(m)
        assert not is_gradient_checkpointing(m)


class TestOptimizedStep:
    def test_accumulation_steps_every_n_micro_batches(self) -> None:
        """Under GRADIENT_ACCUMULATION the optimizer steps on every Nth call only."""
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        step = OptimizedStep(
            model,
            opt,
            nn.functional.mse_loss,
            OptimizationMode.GRADIENT_ACCUMULATION,
            accumulation_steps=3,
        )
        x, y = _data()
        stepped = [step.run(x, y).stepped for _ in range(6)]
        assert stepped == [False, False, True, False, False, True]

    def test_accumulated_gradient_equals_mean_of_micro_batches(self) -> None:
        """Accumulating N micro-batches gives the gradient of their mean loss."""
        torch.manual_seed(1)
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        x, y = _data()
        step = OptimizedStep(
            model,
            opt,
            nn.functional.mse_loss,
            OptimizationMode.GRADIENT_ACCUMULATION,
            accumulation_steps=2,
        )
        step.forward_backward(x[:6], y[:6])
        step.forward_backward(x[6:], y[6:])
        acc = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        model.zero_grad()
        torch.autograd.backward(nn.functional.mse_loss(model(x), y))
        for a, b in zip(acc, (p.grad for p in model.parameters()), strict=True):
            torch.testing.assert_close(a, b)

    def test_amp_on_cpu_uses_bfloat16_without_scaler(self) -> None:
        """AMP on CPU autocasts to bfloat16; no GradScaler is needed for bfloat16."""
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        step = OptimizedStep(model, opt, nn.functional.mse_loss, OptimizationMode.AMP)
        assert step.amp_dtype is torch.bfloat16 == default_amp_dtype("cpu")
        assert step.scaler is None and step.loss_scale is None
        with step.autocast():
            out = model(torch.randn(2, 8))
        assert out.dtype is torch.bfloat16
        x, y = _data()
        first = float(step.run(x, y).loss)
        for _ in range(20):
            last = float(step.run(x, y).loss)
        assert last < first

    def test_skip_step_drops_gradients(self) -> None:
        """skip_step leaves the parameters unchanged and clears the gradients."""
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        step = OptimizedStep(model, opt, nn.functional.mse_loss)
        before = [p.detach().clone() for p in model.parameters()]
        step.forward_backward(*_data())
        assert step.should_step
        step.skip_step()
        assert all(p.grad is None for p in model.parameters())
        for a, b in zip(before, model.parameters(), strict=True):
            assert torch.equal(a, b)

    @pytest.mark.parametrize("bad", [0, -1, 2.5, True])
    def test_bad_accumulation_steps(self, bad: object) -> None:
        """accumulation_steps must be an int >= 1 (no fractions, no bools); the value is named."""
        model = _model()
        with pytest.raises(ValueError, match=f"accumulation_steps must be an int >= 1, got {bad}"):
            OptimizedStep(
                model,
                torch.optim.SGD(model.parameters(), lr=0.1),
                nn.functional.mse_loss,
                accumulation_steps=bad,  # type: ignore[arg-type]
            )

    def test_compile_returns_module_sharing_parameters(self) -> None:
        """COMPILE wraps the model lazily; the wrapper shares the original's parameters."""
        model = _model()
        compiled = optimize_model(model, OptimizationMode.COMPILE)
        assert compiled is not model
        assert {id(p) for p in compiled.parameters()} == {id(p) for p in model.parameters()}
