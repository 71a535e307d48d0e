"""At ADVANCED the probe measures each parameter's weight update ‖Δw‖/‖w‖ across one step.
Across a step the loop did not take (a skipped NaN batch, an AMP overflow the scaler skips)
no weight moved: every ratio read 0 and the log said that every parameter had stalled
(``weight_update_ratio_out_of_bounds``), a false lead after every skip. No update is measured
across such a step now."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from eventbus_debug import Session, read_events
from eventbus_debug.events import StepChecked

from .._doubles import quiet


def _ratios(log_dir: Path) -> dict[int, dict[str, float]]:
    return {
        e.step: dict(e.update_ratios)
        for e in read_events(log_dir)
        if isinstance(e, StepChecked) and e.step is not None and e.update_ratios
    }


async def test_no_update_is_measured_across_a_skipped_step(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    async with Session(model, opt, **quiet(log_dir=tmp_path, level="advanced")) as session:
        for step in range(60):
            x = torch.randn(16, 8)
            if step == 40:
                x[0, 0] = math.nan
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model(x), torch.randint(0, 2, (16,)))
            torch.autograd.backward(loss)
            verdict = await session.check_step(step, loss=loss)
            if verdict.should_step:
                opt.step()
            await session.step_completed(step, loss=verdict.loss)
    ratios = _ratios(tmp_path)
    assert 41 not in ratios and 51 in ratios  # measured again at the next due step (every 10)
    assert all(r > 0 for step_ratios in ratios.values() for r in step_ratios.values())
    assert "weight_update_ratio_out_of_bounds" not in caplog.text


async def test_no_update_is_measured_across_an_amp_overflow(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A scale of 2**40 overflows fp16 for the first steps: the scaler skips them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    overflowed = []
    opts = quiet(log_dir=tmp_path, level="advanced", scaler=scaler)
    async with Session(model, opt, **opts) as session:
        for step in range(60):
            x = torch.randn(16, 8)
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x), torch.randint(0, 2, (16,)))
            torch.autograd.backward(scaler.scale(loss))
            verdict = await session.check_step(step, loss=loss)
            overflowed.append(verdict.probe.overflow)
            if verdict.should_step:
                scaler.step(opt)
                scaler.update()
            await session.step_completed(step, loss=verdict.loss)
    assert any(overflowed) and not all(overflowed)
    ratios = _ratios(tmp_path)
    assert ratios and not any(overflowed[step - 1] for step in ratios)
    assert all(r > 0 for step_ratios in ratios.values() for r in step_ratios.values())
    assert "weight_update_ratio_out_of_bounds" not in caplog.text
