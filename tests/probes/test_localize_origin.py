"""Localization names the origin: the module that made the NaN, the parameter of a gradient-only
NaN, and DebugMode.ANOMALY_DETECTION arms it after an incident (replay or the next passes)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from eventbus_debug import DebugMode, EventBus, Session, SyncSession
from eventbus_debug.events import AnomalyLocalized, NonFiniteDetected, TensorRole
from eventbus_debug.probes import FirstNonFiniteLocator, debug_forward_pass
from eventbus_debug.probes.anomaly_arming import AnomalyArming, RngState
from eventbus_debug.testing import RecordingSink


class HandWrittenAttention(nn.Module):
    """Attention as people write it: qkv, a masked softmax in forward, then an output proj."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, h: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(pad[:, None, :], -math.inf)
        out: torch.Tensor = self.proj(scores.softmax(-1) @ v)  # a fully masked row: NaN
        return out


class AttnModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.attn = HandWrittenAttention(8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.attn(self.embed(x), pad))
        return out


class GPTBlock(nn.Module):
    """A pre-norm GPT block: ln -> attention (additive causal+padding mask) -> ln -> MLP."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), mask=mask)
        out: torch.Tensor = x + self.mlp(self.ln_2(x))
        return out


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(x).split(x.shape[-1], dim=-1)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.shape[-1]) + mask  # mask holds -inf
        out: torch.Tensor = self.c_proj(att.softmax(dim=-1) @ v)
        return out


class GPT(nn.Module):
    def __init__(self, dim: int = 16, layers: int = 3) -> None:
        super().__init__()
        self.wte = nn.Embedding(50, dim)
        self.h = nn.ModuleList(GPTBlock(dim) for _ in range(layers))
        self.lm_head = nn.Linear(dim, 50)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pad = idx == 0  # token 0 pads; a sequence of padding only has no key to attend to
        t = idx.shape[1]
        causal = torch.full((t, t), -math.inf).triu(1)
        mask = (
            causal
            + torch.zeros_like(pad, dtype=torch.float).masked_fill(pad, -math.inf)[:, None, :]
        )
        x = self.wte(idx)
        for block in self.h:
            x = block(x, mask)
        out: torch.Tensor = self.lm_head(x)
        return out


class _NaNWeightGrad(torch.autograd.Function):
    """y = x * w; the backward gives a correct input gradient and a NaN weight gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _x, w = ctx.saved_tensors
        return grad * w, torch.full_like(w, math.nan)


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = _NaNWeightGrad.apply(x, self.w)  # type: ignore[no-untyped-call]
        return out


def gpt_batch() -> torch.Tensor:
    idx = torch.randint(1, 50, (2, 6))
    idx[1] = 0  # the second sequence is all padding
    return idx


def attn_batch() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(2, 5, 4)
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[1] = True  # every key of the second sample masked
    return x, pad


class TestOrigin:
    async def test_nan_made_in_parent_code_names_the_parent_not_its_proj(self) -> None:
        """A masked softmax inside Attention.forward, before proj: `attn`, never `attn.proj`."""
        model = AttnModel()
        x, pad = attn_batch()
        found = await FirstNonFiniteLocator(model).localize(lambda: model(x, pad).sum().backward())
        assert found is not None
        assert (found.module, found.phase, found.role) == ("attn", "forward", TensorRole.OUTPUT)
        assert found.input_min is not None and math.isfinite(found.input_min)

    async def test_gpt_block_with_additive_inf_mask_names_the_attention(self) -> None:
        """A padded sequence in a GPT: the first block's attention makes the NaN, despite its
        -inf mask input (an additive mask does not excuse a NaN)."""
        model = GPT()
        idx = gpt_batch()
        found = await FirstNonFiniteLocator(model).localize(lambda: model(idx).sum().backward())
        assert found is not None and (found.module, found.phase) == ("h.0.attn", "forward")

    async def test_child_that_makes_the_nan_is_named(self) -> None:
        """A NaN weight in `attn.proj` (finite inputs, NaN output): the child is the origin."""
        model = AttnModel()
        with torch.no_grad():
            model.attn.proj.weight[0, 0] = math.nan
        x = torch.randn(2, 5, 4)
        pad = torch.zeros(2, 5, dtype=torch.bool)
        found = await FirstNonFiniteLocator(model).localize(lambda: model(x, pad))
        assert found is not None and found.module == "attn.proj"

    async def test_gradient_only_nan_names_the_parameter(self) -> None:
        """A custom Function whose backward gives NaN only for the weight: the parameter."""
        model = nn.Sequential(nn.Linear(8, 8), Scale(), nn.Linear(8, 1))
        found = await FirstNonFiniteLocator(model).localize(
            lambda: model(torch.randn(4, 8)).sum().backward()
        )
        assert found is not None
        assert (found.phase, found.role, found.parameter, found.module) == (
            "backward",
            TensorRole.GRADIENT,
            "1.w",
            "1",
        )

    async def test_nan_injected_by_a_grad_hook_names_the_parameter(self) -> None:
        """A user hook that corrupts one parameter's gradient is found on that parameter."""
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
        first = model[0]
        assert isinstance(first, nn.Linear)
        first.bias.register_hook(lambda g: g * math.nan)  # type: ignore[no-untyped-call]
        found = await FirstNonFiniteLocator(model).localize(
            lambda: model(torch.randn(4, 8)).sum().backward()
        )
        assert found is not None and found.parameter == "0.bias" and found.module == "0"

    async def test_nan_in_the_inputs_is_reported_as_input(self) -> None:
        """A NaN batch: no module made it; the root is named with the INPUT role."""
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
        x = torch.randn(3, 4)
        x[0, 0] = math.nan
        found = await FirstNonFiniteLocator(model).localize(lambda: model(x))
        assert found is not None and (found.module, found.role) == ("", TensorRole.INPUT)

    def test_debug_forward_pass_names_the_origin(self) -> None:
        """debug_forward_pass's first_non_finite follows the same rule: `attn`, not `attn.proj`."""
        model = AttnModel()
        x, pad = attn_batch()
        _, report = debug_forward_pass(model, (x, pad))
        assert report.first_non_finite == "attn"


def nan_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = AttnModel()
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out.squeeze(-1), y)


class TestArmedByAnomalyDetection:
    async def test_training_step_replays_the_failed_batch(self, recorder: RecordingSink) -> None:
        """ANOMALY_DETECTION: a NaN step is replayed with the hooks armed; `attn` is published."""
        model = GPT()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        async with EventBus() as bus:
            bus.subscribe(recorder)
            async with Session(
                model, opt, bus=bus, log_dir=None, mode=DebugMode.ANOMALY_DETECTION, recovery=False
            ) as s:
                result = await s.training_step(gpt_batch(), None, lambda out, _: out.sum(), step=7)
                assert s._anomaly is not None and not s._anomaly.locator.is_armed
            await bus.drain()
        (found,) = recorder.of_type(AnomalyLocalized)
        assert (found.step, found.module, found.phase) == (7, "h.0.attn", "forward")
        assert not result.stepped and not result.verdict.finite
        assert all(p.grad is None for p in model.parameters())  # the replay's grads cleared

    def test_sync_training_step_replays_without_touching_buffers(self) -> None:
        """SyncSession too; the replay restores BatchNorm running stats and the RNG state."""
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        recorder = RecordingSink()
        with SyncSession(
            model, opt, log_dir=None, mode=DebugMode.ANOMALY_DETECTION, recovery=False
        ) as s:
            s.bus.subscribe(recorder)
            first = model[0]
            assert isinstance(first, nn.Linear)
            with torch.no_grad():
                first.weight[0, 0] = math.inf
            bn = model[1]
            assert isinstance(bn, nn.BatchNorm1d)
            x, y = torch.randn(8, 4), torch.randn(8)
            seen: list[torch.Tensor] = []
            model.register_forward_hook(lambda m, a, o: seen.append(o.detach().clone()))
            before = torch.random.get_rng_state()
            s.training_step(x, y, _loss, step=3)
            assert bn.running_mean is not None
            stats_after_step = bn.running_mean.clone()
            s.bus.drain()
        (found,) = recorder.of_type(AnomalyLocalized)
        assert (found.step, found.module) == (3, "0")
        assert len(seen) == 2 and torch.equal(seen[0].isnan(), seen[1].isnan())  # same dropout
        torch.testing.assert_close(  # the replay left no trace (the step itself made the NaN)
            bn.running_mean, stats_after_step, rtol=0, atol=0, equal_nan=True
        )
        assert not torch.equal(torch.random.get_rng_state(), before)  # advanced once, by the step

    async def test_check_step_loops_get_the_next_passes_watched(
        self, recorder: RecordingSink
    ) -> None:
        """A loop calling check_step: after the incident the next passes are watched, the origin
        published with its step, and the hooks removed after (bounded)."""
        model, opt = nan_model()
        async with EventBus() as bus:
            bus.subscribe(recorder)
            async with Session(
                model, opt, bus=bus, log_dir=None, mode=DebugMode.ANOMALY_DETECTION, recovery=False
            ) as s:
                arming = s._anomaly
                assert arming is not None
                for step in range(6):
                    x, pad = attn_batch()
                    if step < 2:
                        pad[1] = False  # healthy first steps
                    loss = model(x, pad).sum()
                    loss.backward()
                    verdict = await s.check_step(step, loss=loss)
                    if verdict.should_step:
                        opt.step()
                    opt.zero_grad()
                    await s.step_completed(step)
                    await bus.drain()
                assert not arming.locator.is_armed
                hooks = sum(len(m._forward_hooks) for m in model.modules())
                assert hooks == 0  # only the root pre-hook stays
            await bus.drain()
        found = recorder.of_type(AnomalyLocalized)
        assert [(f.step, f.module) for f in found] == [(3, "attn")]
        assert recorder.of_type(NonFiniteDetected)[0].step == 2
        assert not model._forward_pre_hooks  # removed at the end of the session

    def test_window_is_bounded_and_cools_down(self) -> None:
        """Without a finding, hooks stay armed for `passes` passes, then not for `cooldown`."""
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
        step = {"now": 0}
        arming = AnomalyArming(
            FirstNonFiniteLocator(model), step=lambda: step["now"], passes=2, cooldown=3
        )
        arming.install()
        armed: list[bool] = []
        for i in range(10):
            step["now"] = i
            if i in (1, 4):
                arming.request(i)
            model(torch.randn(2, 4)).sum().backward()
            armed.append(arming.locator.is_armed)
        arming.close()
        # armed at the forward of 2 and 3 (request at 1), judged twice, cool-down 3 passes
        # (4, 5, 6 ignore the request of 4), armed again at 7 and 8.
        assert armed == [False, True, True, False, False, False, False, True, True, False]
        assert arming.windows == 2 and not model._forward_pre_hooks

    def test_bad_arguments(self) -> None:
        """passes < 1, a negative cooldown and a non-callable step are clear errors."""
        loc = FirstNonFiniteLocator(nn.Linear(2, 2))
        with pytest.raises(ValueError, match="passes"):
            AnomalyArming(loc, step=lambda: 0, passes=0)
        with pytest.raises(ValueError, match="cooldown"):
            AnomalyArming(loc, step=lambda: 0, cooldown=-1)
        with pytest.raises(TypeError, match="step"):
            AnomalyArming(loc, step=3)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="FirstNonFiniteLocator"):
            AnomalyArming(object(), step=lambda: 0)  # type: ignore[arg-type]

    def test_rng_capture_restores_dropout(self) -> None:
        """RngState.capture then a replay draws the same dropout mask as the original pass."""
        drop = nn.Dropout(0.5)
        rng = RngState.capture(drop)
        a = drop(torch.ones(64))
        torch.random.set_rng_state(rng.cpu)
        assert torch.equal(drop(torch.ones(64)), a)
