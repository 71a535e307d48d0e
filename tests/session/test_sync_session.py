"""eventbus_debug.session.sync_session: the blocking SyncSession, end to end."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from eventbus_debug import Session, SessionOptions, SyncSession, read_events
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


class TestSessionKeywords:
    def test_sync_session_refuses_bus_and_says_what_to_do(self) -> None:
        """bus= is the async Session's: a SyncSession names it, and sinks=/session.bus."""
        model, opt = setup()
        with pytest.raises(TypeError, match=r"^bus= is an option of the async Session") as info:
            SyncSession(model, opt, bus=object())  # type: ignore[call-arg]
        message = str(info.value)
        assert "SyncEventBus" in message and "sinks=" in message and "session.bus" in message
        assert "SessionOptions.__init__" not in message

    @pytest.mark.parametrize("cls", [Session, SyncSession])
    def test_unknown_keyword_names_it_and_the_class_called(self, cls: type[Any]) -> None:
        """A misspelt keyword names itself, the class called and the closest option."""
        model, opt = setup()
        with pytest.raises(TypeError) as info:
            cls(model, opt, log_dri="x")
        message = str(info.value)
        assert message.startswith(f"{cls.__name__}() got unexpected keyword argument 'log_dri'")
        assert "did you mean 'log_dir'?" in message and "SessionOptions.__init__" not in message

    @pytest.mark.parametrize("cls", [Session, SyncSession])
    def test_unknown_keyword_is_named_with_options_too(self, cls: type[Any]) -> None:
        """With options= as well, the unknown keyword is still what the error names."""
        model, opt = setup()
        with pytest.raises(TypeError, match=r"got unexpected keyword arguments 'a', 'b'"):
            cls(model, opt, options=SessionOptions(log_dir=None), a=1, b=2)
