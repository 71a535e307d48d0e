from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from eventbus_debug import EventBus
from eventbus_debug.compat import (
    check_gradient_explosion,
    check_gradient_vanishing,
    check_gradients,
    monitor_training_step,
)
from eventbus_debug.events import AnomalyLocalized, AutogradAnomalyDetected, TensorRole
from eventbus_debug.probes import (
    FirstNonFiniteLocator,
    analyze_tensor,
    capture_autograd_anomaly,
    debug_backward_pass,
    debug_forward_pass,
    replay_with_anomaly_detection,
)
from eventbus_debug.testing import capture_events

from .conftest import grads_of, linear_at


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.norm(self.lin(x)))


class MaskedAttention(nn.Module):
    """Single-head attention that masks keys with -inf, as hand-written attention often does."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        qkv: torch.Tensor = self.qkv(h)
        q, k, v = qkv.chunk(3, dim=-1)
        scores = (q @ k.transpose(-1, -2)).masked_fill(mask[:, None, :], -math.inf)
        return scores.softmax(-1) @ v  # a fully masked row: softmax of all -inf is NaN


class Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.attn = MaskedAttention(8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.attn(self.embed(x), mask))
        return out


class SqrtAct(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x * x)  # |x|: finite forward, NaN backward at 0 (inf * 0)


class TestLocalization:
    async def test_fully_masked_attention_row(self, bus: EventBus) -> None:
        """A batch row with every key masked makes attention NaN: localized to `attn`."""
        model = Attn()
        x = torch.randn(2, 5, 4)
        mask = torch.zeros(2, 5, dtype=torch.bool)
        mask[1] = True
        locator = FirstNonFiniteLocator(model, bus)
        async with capture_events(bus, AnomalyLocalized) as events:
            found = await locator.localize(lambda: model(x, mask).sum().backward(), step=4)
        assert found is not None and found.module == "attn" and found.phase == "forward"
        assert found.role is TensorRole.OUTPUT and found.shapes == ((2, 5, 8),)
        assert found.input_min is not None and math.isfinite(found.input_min)
        assert events == [found] and not locator.is_armed

    async def test_nan_weight_in_block_k(self) -> None:
        """A NaN in block 3's weight is blamed on `3.lin`, the first module to output NaN."""
        model = nn.Sequential(*[Block() for _ in range(6)])
        with torch.no_grad():
            block = model[3]
            assert isinstance(block, Block)
            block.lin.weight[0, 0] = math.nan
        locator = FirstNonFiniteLocator(model)
        found = await locator.localize(lambda: model(torch.randn(4, 8)))
        assert found is not None and found.module == "3.lin"

    async def test_backward_only_nan(self) -> None:
        """sqrt(x * x) is finite forward but not backward: the backward phase names it."""
        model = nn.Sequential(nn.Linear(8, 8), SqrtAct(), nn.Linear(8, 1))
        with torch.no_grad():
            linear_at(model, 0).weight.zero_()
            linear_at(model, 0).bias.zero_()
        locator = FirstNonFiniteLocator(model)
        found = await locator.localize(lambda: model(torch.randn(4, 8)).sum().backward())
        assert found is not None and found.phase == "backward" and found.module == "1"

    async def test_disarmed_adds_no_hooks_and_finite_returns_none(self) -> None:
        """Construction installs nothing; a finite replay finds nothing."""
        model = nn.Sequential(Block(), Block())
        locator = FirstNonFiniteLocator(model)
        assert all(not m._forward_hooks for m in model.modules())
        assert await locator.localize(lambda: model(torch.randn(2, 8)).sum().backward()) is None
        assert all(not m._forward_hooks for m in model.modules())

    def test_debug_forward_and_backward_pass(self) -> None:
        """Per-layer shapes and statistics in completion order; backward reports gradient norms."""
        model = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 1))
        out, report = debug_forward_pass(model, torch.randn(3, 8))
        assert [r.module for r in report.layers] == ["0", "1", "2", ""]
        assert report.layers[0].shapes == ((3, 4),) and report.layers[1].min >= 0.0
        assert report.finite
        assert isinstance(out, torch.Tensor)
        back = debug_backward_pass(out.sum(), model)
        assert set(back.grad_norms) == {"0.weight", "0.bias", "2.weight", "2.bias"}
        assert back.non_finite == () and back.total_norm is not None and back.total_norm > 0


class TestAutogradAnomaly:
    def test_captures_backward_fn_and_forward_stack(self) -> None:
        """sqrt(x*x) at 0: inf * 0 makes MulBackward0 return NaN; its forward stack is captured."""
        x = torch.zeros(3, requires_grad=True)
        with pytest.raises(RuntimeError), capture_autograd_anomaly() as cap:
            torch.autograd.backward(torch.sqrt(x * x).sum())
        assert cap.event is not None and cap.event.backward_fn == "MulBackward0"
        assert "test_localize_autograd_tensor.py" in cap.event.forward_stack

    async def test_replay_publishes_without_raising(self, bus: EventBus) -> None:
        """The replay pattern publishes the incident and returns it."""
        x = torch.zeros(3, requires_grad=True)
        async with capture_events(bus, AutogradAnomalyDetected) as events:
            found = replay_with_anomaly_detection(
                lambda: torch.autograd.backward(torch.sqrt(x * x).sum()), bus, step=9
            )
        assert found is not None and found.step == 9 and events == [found]


class TestAnalyzeTensor:
    @pytest.mark.parametrize(
        ("tensor", "nan", "inf", "lo", "hi"),
        [
            (torch.tensor([1.0, math.nan, math.inf, 3.0]), 1, 1, 1.0, 3.0),
            (torch.tensor([True, False]), 0, 0, 0.0, 1.0),
            (torch.arange(5), 0, 0, 0.0, 4.0),
            (torch.tensor([3 + 4j, 0j]), 0, 0, 0.0, 5.0),
            (torch.tensor([65504.0, -1.0], dtype=torch.float16) * 2, 0, 1, -2.0, -2.0),
            (torch.tensor([1.0, 2.0], dtype=torch.bfloat16), 0, 0, 1.0, 2.0),
            (torch.tensor([[0.0, 2.0], [0.0, 0.0]]).to_sparse(), 0, 0, 2.0, 2.0),
            (torch.arange(6.0).reshape(2, 3).t(), 0, 0, 0.0, 5.0),
            (torch.tensor(7.0), 0, 0, 7.0, 7.0),
        ],
    )
    def test_dtypes_and_layouts(
        self, tensor: torch.Tensor, nan: int, inf: int, lo: float, hi: float
    ) -> None:
        """Counts and ranges for every dtype and layout (finite values only)."""
        stats = analyze_tensor(tensor, "t")
        assert (stats.nan_count, stats.inf_count, stats.min, stats.max) == (nan, inf, lo, hi)
        assert stats.shape == tuple(tensor.shape)

    def test_empty_meta_and_non_tensor(self) -> None:
        """Empty and meta tensors have no statistics; a non-tensor is a TypeError."""
        assert analyze_tensor(torch.empty(0, 3)).mean is None
        meta = analyze_tensor(torch.empty(2, 2, device="meta"))
        assert meta.is_meta and meta.nan_count is None and meta.bytes == 16
        with pytest.raises(TypeError, match=r"needs a torch\.Tensor"):
            analyze_tensor([1.0])  # type: ignore[arg-type]


class TestSeedFunctions:
    def test_thin_functions(self) -> None:
        """The seeds' one-shot checks agree with the fused reductions."""
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
        model(torch.randn(2, 4)).sum().mul(1e3).backward()
        report = check_gradients(model, gradient_threshold=10.0)
        assert report.finite and report.total_norm == pytest.approx(
            torch.nn.utils.get_total_norm(grads_of(model)).item(), rel=1e-5
        )
        assert set(check_gradient_explosion(model, threshold=10.0)) == set(report.above)
        assert check_gradient_vanishing(model, threshold=1e-7) == ()
        verdict = monitor_training_step(model, torch.tensor(1.0), 0)
        assert verdict.finite and verdict.param_norm is not None
