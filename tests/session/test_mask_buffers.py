"""A buffer holding ``-inf`` by design (a causal attention mask) is the model's own, not a
fault; a NaN in a buffer still is. Flagged, the mask stopped a healthy run at step 0."""

from __future__ import annotations

import math

import anyio
import pytest
import torch
from torch import nn

from eventbus_debug import DebugLevel, Session
from eventbus_debug.events import Anomaly, NonFiniteDetected, RecoveryApplied, TensorRole
from eventbus_debug.testing import RecordingSink


class MaskedAttention(nn.Module):
    """One causal self-attention layer with its mask as a buffer, as GPT-style models keep it."""

    def __init__(self, width: int = 16, length: int = 8) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, 1)
        mask = torch.full((length, length), -math.inf).triu(1)
        self.register_buffer("mask", mask)
        self.norm = nn.BatchNorm1d(length)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + self.mask
        out: torch.Tensor = self.out(scores.softmax(-1) @ v).mean(dim=(1, 2))
        return out


@pytest.mark.parametrize("level", [DebugLevel.BASIC, DebugLevel.EXTREME])
async def test_an_infinite_mask_is_not_a_fault_and_a_nan_buffer_is(level: DebugLevel) -> None:
    torch.manual_seed(0)
    model = MaskedAttention()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 8, 16), torch.randn(64)
    recorder = RecordingSink()
    async with Session(model, opt, log_dir=None, report=False, alerts=False, level=level) as s:
        s.bus.subscribe(recorder)
        for step in range(60):
            if step == 45:
                running_mean = model.norm.running_mean
                assert running_mean is not None
                with torch.no_grad():
                    running_mean[3] = math.nan  # a real fault in a buffer
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(model(x), y)
            torch.autograd.backward(loss)
            with anyio.fail_after(10):
                verdict = await s.check_step(step, loss=loss)
            if verdict.should_step:
                opt.step()
            await s.step_completed(step, loss=verdict.loss)
    before = [e for e in recorder.of_type(Anomaly) if e.step is not None and e.step < 45]
    assert before == []  # 45 healthy steps, parameter checks among them: nothing fired
    assert not [e for e in recorder.of_type(RecoveryApplied) if e.step is not None and e.step < 45]
    faults = [e for e in recorder.of_type(NonFiniteDetected) if e.role is TensorRole.BUFFER]
    assert faults and faults[0].names == ("norm.running_mean",)
    assert "mask" not in {n for e in faults for n in e.names}


def test_a_refused_snapshot_is_logged_once_a_streak(caplog: pytest.LogCaptureFixture) -> None:
    """A state that stays non-finite is retried at every good step, and said once."""
    from eventbus_debug.recovery import StateSnapshots

    model = nn.Linear(2, 1)
    snapshots = StateSnapshots(every=1)
    with torch.no_grad():
        model.weight[0, 0] = math.nan
    with caplog.at_level("INFO"):
        for step in range(5):
            assert not snapshots.maybe_capture(step, model, None)
        with torch.no_grad():
            model.weight.zero_()
        assert snapshots.maybe_capture(5, model, None)
    refused = [r for r in caplog.records if "snapshot_refused" in r.getMessage()]
    resumed = [r for r in caplog.records if "snapshot_resumed" in r.getMessage()]
    assert len(refused) == 1 and len(resumed) == 1
    assert snapshots.refusals == 5 and snapshots.captures == 1
