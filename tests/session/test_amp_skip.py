"""The documented AMP loop (``scaler.update()`` on every step) survives a step the session
skips: ``scaler.step()`` does not run then, and the safe point records the scaler's inf check
so ``update()`` does not raise "No inf checks were recorded"."""

from __future__ import annotations

import logging
import math

import anyio
import pytest
import torch
from torch import nn

from eventbus_debug import Session
from eventbus_debug.events import StepSkipped, UsageWarning
from eventbus_debug.testing import RecordingSink


def _setup() -> tuple[
    nn.Module, torch.optim.Optimizer, torch.amp.GradScaler, torch.Tensor, torch.Tensor
]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(32, 8)
    return model, opt, torch.amp.GradScaler("cpu"), x, x.sum(1, keepdim=True)


async def test_a_skipped_step_leaves_the_scaler_updatable() -> None:
    model, opt, scaler, x, y = _setup()
    recorder = RecordingSink()
    scale = scaler.get_scale()
    async with Session(model, opt, scaler=scaler, log_dir=None, report=False, alerts=False) as s:
        s.bus.subscribe(recorder)
        for step in range(20):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.mse_loss(model(x), y)
            if step == 10:
                loss = loss * math.nan
            torch.autograd.backward(scaler.scale(loss))
            with anyio.fail_after(10):
                verdict = await s.check_step(step, loss=loss)
            assert verdict.should_step == (step != 10)
            if verdict.should_step:
                scaler.step(opt)
            scaler.update()  # raised AssertionError at step 10 before the fix
            await s.step_completed(step, loss=verdict.loss)
    assert [e.step for e in recorder.of_type(StepSkipped)] == [10]
    assert scaler.get_scale() == scale / 2  # the NaN gradients' inf check backed the scale off
    assert all(torch.isfinite(p).all() for p in model.parameters())


async def test_a_check_after_scaler_step_reads_the_true_norm_and_says_the_order_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Against the documented order (check, then ``scaler.step``): the gradients are already
    unscaled; dividing them by the scale again reported norms 65,536x too small (read as
    vanished gradients). The norm is the true one, and the log says the order once."""
    model, opt, scaler, x, y = _setup()
    norms: list[tuple[float, float]] = []
    recorder = RecordingSink()
    with caplog.at_level(logging.WARNING, logger="eventbus_debug"):
        async with Session(
            model, opt, scaler=scaler, log_dir=None, report=False, alerts=False, sinks=[recorder]
        ) as s:
            for step in range(5):
                opt.zero_grad(set_to_none=True)
                loss = nn.functional.mse_loss(model(x), y)
                torch.autograd.backward(scaler.scale(loss))
                scaler.step(opt)  # unscales the gradients, then steps: before the check
                grads = [p.grad for p in model.parameters() if p.grad is not None]
                true = float(torch.nn.utils.get_total_norm(grads))
                verdict = await s.check_step(step, loss=loss)
                scaler.update()
                await s.step_completed(step, loss=verdict.loss)
                assert verdict.grad_norm is not None
                norms.append((verdict.grad_norm, true))
    assert all(got == pytest.approx(true, rel=1e-5) for got, true in norms)
    said = [r for r in caplog.records if "checked_after_scaler_step" in r.getMessage()]
    assert len(said) == 1 and "before scaler.step(optimizer)" in said[0].getMessage()
    # on the bus too (the log file, the report); scaler.step() stepped the optimizer as well
    problems = sorted(e.problem for e in recorder.of_type(UsageWarning))
    assert problems == ["check_after_optimizer_step", "checked_after_scaler_step"]
