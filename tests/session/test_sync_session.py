"""eventbus_debug.session.sync_session: the blocking SyncSession, end to end."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from eventbus_debug import SyncSession, read_events
from eventbus_debug.events import SessionEnded, StepCompleted, StepSkipped
from eventbus_debug.testing import RecordingSink

from ._helpers import batch, setup


class TestSyncSession:
    def test_plain_loop(self, tmp_path: Path) -> None:
        """The sync form checks, skips the NaN step and writes the same log."""
        model, opt = setup()
        with SyncSession(model, opt, log_dir=tmp_path, alerts=False) as session:
            stepped = [
                session.training_step(*batch(bad=i == 1), loss_fn=nn.functional.mse_loss).stepped
                for i in range(3)
            ]
        assert stepped == [True, False, True]
        kinds = [e.kind for e in read_events(tmp_path)]
        assert kinds.count(StepCompleted.kind) == 3 and StepSkipped.kind in kinds
        assert (tmp_path / "report.json").exists()

    def test_check_step_blocks_and_skips_non_finite(self) -> None:
        """check_step (blocking) advises skipping a NaN step; step_completed records it."""
        model, opt = setup()
        recorder = RecordingSink()
        with SyncSession(
            model, opt, log_dir=None, report=False, alerts=False, recovery=False, sinks=[recorder]
        ) as session:
            x, y = batch(bad=True)
            torch.autograd.backward(nn.functional.mse_loss(model(x), y))
            verdict = session.check_step(0, loss=math.nan)
            assert not verdict.should_step and not verdict.finite
            session.step_completed(0, loss=verdict.loss)
            assert session.steps_completed == 1
        assert [e.step for e in recorder.of_type(StepCompleted)] == [0]
        assert recorder.of_type(SessionEnded)[0].steps == 1

    def test_not_running(self) -> None:
        """Outside its with block the session says how to start it."""
        model, opt = setup()
        session = SyncSession(model, opt, log_dir=None)
        with pytest.raises(RuntimeError, match=r"with SyncSession"):
            session.check_step(0)
        with pytest.raises(RuntimeError, match=r"with SyncSession"):
            _ = session.bus
