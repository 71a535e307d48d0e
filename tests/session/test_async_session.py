"""eventbus_debug.session.async_session: the async Session, end to end."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from eventbus_debug import DebugLevel, EventBus, Session, SessionOptions, read_events
from eventbus_debug.events import (
    InputValidationFailed,
    NonFiniteDetected,
    OperationCompleted,
    SessionEnded,
    SessionStarted,
    StepChecked,
    StepCompleted,
    StepSkipped,
)
from eventbus_debug.extras import InputSpec, OutputChecker
from eventbus_debug.testing import RecordingSink

from ._helpers import batch, setup


class TestSession:
    async def test_full_run_writes_log_and_report_and_skips_bad_step(self, tmp_path: Path) -> None:
        """A NaN batch is detected, its step skipped by recovery; log and report hold everything."""
        model, opt = setup()
        recorder = RecordingSink()
        async with Session(model, opt, log_dir=tmp_path, sinks=[recorder]) as session:
            results = [
                await session.training_step(*batch(bad=i == 2), loss_fn=nn.functional.mse_loss)
                for i in range(4)
            ]
        assert [r.stepped for r in results] == [True, True, False, True]
        assert [r.step for r in results] == [0, 1, 2, 3]
        assert "skip_step" in results[2].verdict.actions
        assert math.isnan(results[2].loss)
        kinds = [e.kind for e in read_events(tmp_path)]
        assert kinds[0] == SessionStarted.kind and kinds[-1] == SessionEnded.kind
        assert kinds.count(StepCompleted.kind) == 4 and kinds.count(StepSkipped.kind) == 1
        assert (tmp_path / "report.html").exists() and (tmp_path / "report.json").exists()
        assert len(recorder.of_type(NonFiniteDetected)) >= 1
        assert recorder.of_type(SessionEnded)[0].steps == 4

    async def test_parts_removable_and_level_changeable(self, bus: EventBus) -> None:
        """With log, report, alerts and recovery removed, only the probe runs; level changes live."""
        model, opt = setup()
        recorder = RecordingSink()
        async with Session(
            model,
            opt,
            log_dir=None,
            report=False,
            alerts=False,
            recovery=False,
            bus=bus,
            sinks=[recorder],
            level="off",
        ) as session:
            assert session.report is None and session.alerts is None and session.recovery is None
            x, y = batch()
            await session.training_step(x, y, nn.functional.mse_loss)
            session.set_level("advanced")
            assert session.probe is not None and session.probe.level is DebugLevel.ADVANCED
            r = await session.training_step(x, y, nn.functional.mse_loss)
            assert r.verdict.grad_norm is not None
            with pytest.raises(ValueError, match="basic"):
                session.set_level("loud")
        checks = recorder.of_type(StepChecked)
        assert [c.step for c in checks] == [1] and checks[0].layer_grad_norms
        assert not bus.closed  # a given bus stays open

    async def test_validation_output_checks_and_debug_context(self, tmp_path: Path) -> None:
        """input_spec and output_checker publish incidents; debug_context is stamped with the step."""
        model, opt = setup()
        recorder = RecordingSink()
        async with Session(
            model,
            opt,
            log_dir=None,
            report=False,
            alerts=False,
            sinks=[recorder],
            input_spec=InputSpec(ndim=2, max_abs=3.0),
            output_checker=OutputChecker(expected_range=(-1e-3, 1e-3)),
        ) as session:
            x, y = batch()
            x[0, 0] = 50.0
            await session.training_step(x, y, nn.functional.mse_loss)
            with session.debug_context("eval"):
                model(x)
            assert await session.check_tensor(torch.tensor([1.0, math.inf]), "acts") is False
            await session.step_completed(5, loss=0.1)
        assert recorder.of_type(InputValidationFailed)[0].rule == "range"
        assert recorder.of_type(OperationCompleted)[0].step == 0
        assert recorder.of_type(NonFiniteDetected)[-1].names == ("acts",)
        assert recorder.of_type(StepCompleted)[-1].step == 5

    def test_bad_arguments(self) -> None:
        """Bad model, optimizer, or both level and mode are rejected with clear messages."""
        model, opt = setup()
        with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module"):
            Session("model", opt)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="either level= or mode="):
            Session(model, opt, level="basic", mode="full")

    async def test_options_object_and_not_running(self) -> None:
        """A SessionOptions configures the session; the step API refuses to run outside it."""
        model, opt = setup()
        recorder = RecordingSink()
        options = SessionOptions(
            log_dir=None, report=False, alerts=False, recovery=False, sinks=[recorder]
        )
        session = Session(model, opt, options=options)
        assert session.options is options and session.step is None
        with pytest.raises(RuntimeError, match="not running"):
            await session.check_step(0)
        async with session:
            x, y = batch(bad=True)
            torch.autograd.backward(nn.functional.mse_loss(model(x), y))
            verdict = await session.check_step(0, loss=math.nan)
            assert not verdict.should_step and verdict.actions == ("skip_step",)
            await session.step_completed(0, loss=verdict.loss)
        assert session.steps_completed == 1 and session.step == 0
        assert recorder.of_type(SessionEnded)[0].reason == "completed"
        with pytest.raises(RuntimeError, match=r"async with Session"):
            session.publish(StepCompleted(step=1, source="x"))

    async def test_next_step_numbers_calls_that_name_none(self) -> None:
        """next_step: 0 at first, then one after the last step; a given step wins; not running refused."""
        model, opt = setup()
        session = Session(model, opt, log_dir=None, report=False, alerts=False)
        with pytest.raises(RuntimeError, match="not running"):
            session.next_step()
        async with session:
            assert session.next_step() == 0
            await session.step_completed(4, loss=0.5)
            assert session.next_step() == 5 and session.next_step(9) == 9

    async def test_training_step_needs_an_optimizer(self) -> None:
        """training_step without an optimizer fails with a message saying what is missing."""
        model, _ = setup()
        async with Session(model, log_dir=None, report=False, alerts=False) as session:
            with pytest.raises(RuntimeError, match="needs an optimizer"):
                await session.training_step(*batch(), loss_fn=nn.functional.mse_loss)

    def test_options_and_keywords_refused_together(self) -> None:
        """options= and keywords are one or the other; options= must be a SessionOptions."""
        model, opt = setup()
        with pytest.raises(TypeError, match="either options= or keywords"):
            Session(model, opt, options=SessionOptions(), log_dir=None)
        with pytest.raises(TypeError, match="options must be a SessionOptions"):
            Session(model, opt, options={"log_dir": None})  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="bus must be an EventBus"):
            Session(model, opt, bus=object())  # type: ignore[arg-type]
