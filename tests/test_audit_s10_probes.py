"""Regressions found by the probes / sessions / extras / compat audit (session 10).

Each test pins one fixed bug: a bool loss tensor taken as a loss, an integer loss read back as
an int, a finite gradient whose float32 norm overflows left out of the total norm (and called
non-finite by ``debug_backward_pass``), a re-entered ``SystemSampler`` that sampled nothing,
concurrent calls of a ``debug_context``-decorated coroutine timing each other, and an
``OptimizationMode`` name refused one character at a time.
"""

from __future__ import annotations

import anyio
import pytest
import torch
from torch import nn

from eventbus_debug import StepProbe, SyncSession
from eventbus_debug.extras import OptimizedStep, debug_context, optimize_model
from eventbus_debug.probes import SystemReading, SystemSampler, debug_backward_pass


def _model() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(4, 1)


class TestLossTensorsOfOtherDtypes:
    def test_a_bool_tensor_is_not_a_loss(self) -> None:
        model = _model()
        with pytest.raises(TypeError, match="bool"):
            StepProbe(model, None).check_step_sync(0, loss=torch.tensor(True))

    def test_session_entries_refuse_a_bool_tensor_loss(self) -> None:
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with SyncSession(model, opt, log_dir=None, system_interval=None) as session:
            with pytest.raises(TypeError, match="bool"):
                session.check_step(0, loss=torch.tensor(True))
            with pytest.raises(TypeError, match="bool"):
                session.step_completed(0, loss=torch.tensor(False))

    @pytest.mark.parametrize("dtype", [torch.int64, torch.uint8])
    def test_an_integer_loss_tensor_is_read_as_a_float(self, dtype: torch.dtype) -> None:
        probe = StepProbe(_model(), None)  # no gradients: the loss is the vector's only piece
        verdict = probe.check_step_sync(0, loss=torch.tensor(3, dtype=dtype))
        assert verdict.loss == 3.0 and type(verdict.loss) is float


class TestFiniteGradientsBeyondFloat32Norms:
    @staticmethod
    def _huge_weight_gradient(model: nn.Linear) -> None:
        model.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        assert model.weight.grad is not None
        model.weight.grad.fill_(3e38)  # finite, but its float32 norm (6e38) overflows

    def test_the_total_norm_counts_the_overflowing_gradient(self) -> None:
        model = _model()
        probe = StepProbe(model, None)
        for step in range(5):  # a history of ordinary norms
            model.zero_grad()
            model(torch.randn(8, 4)).pow(2).mean().backward()
            assert probe.check_step_sync(step, loss=1.0).fired == ()
        self._huge_weight_gradient(model)
        verdict = probe.check_step_sync(5, loss=1.0)
        assert verdict.finite
        assert verdict.grad_norm is not None and verdict.grad_norm > 5e38
        assert "gradient_exploded" in verdict.fired

    def test_debug_backward_pass_calls_it_finite(self) -> None:
        model = _model()
        loss = (model(torch.full((2, 4), 1e20)) * 1e18).sum()  # weight gradient 2e38 each
        report = debug_backward_pass(loss, model)
        assert report.non_finite == ()
        assert report.total_norm is not None and 3e38 < report.total_norm < float("inf")


async def test_a_system_sampler_samples_again_when_entered_again() -> None:
    sampler = SystemSampler(
        None,
        interval=0.001,
        sample=lambda: SystemReading(cpu_percent=1.0, memory_percent=2.0, disk_percent=3.0),
    )
    async with sampler:
        await anyio.sleep(0.02)
    first = sampler.summary().samples
    async with sampler:
        await anyio.sleep(0.02)
        with pytest.raises(RuntimeError, match="already running"):
            async with sampler:
                pass
    assert sampler.summary().samples > first


async def test_concurrent_calls_of_a_decorated_coroutine_are_timed_apart() -> None:
    events: list[object] = []

    @debug_context("fetch", publish=events.append, cuda=False)
    async def fetch(delay: float) -> float:
        await anyio.sleep(delay)
        return delay

    async with anyio.create_task_group() as tg:
        tg.start_soon(fetch, 0.3)  # started first, ends first
        await anyio.sleep(0.1)
        tg.start_soon(fetch, 0.4)  # started second, ends last
    durations = [e.duration_s for e in events]  # type: ignore[attr-defined]
    assert durations[0] == pytest.approx(0.3, abs=0.08)
    assert durations[1] == pytest.approx(0.4, abs=0.08)


class TestOptimizationModeNames:
    def test_a_name_is_refused_whole_with_the_member_to_use(self) -> None:
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(TypeError, match=r"got 'amp' \(use OptimizationMode.AMP\)"):
            OptimizedStep(model, opt, nn.functional.mse_loss, "amp")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="got 'turbo'; valid"):
            optimize_model(model, "turbo")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="got 3; valid"):
            optimize_model(model, 3)  # type: ignore[arg-type]
