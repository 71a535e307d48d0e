"""eventbus_debug.compat.session: the seeds' factories and logger over the Session."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from eventbus_debug import DebugLevel, DebugMode, Session
from eventbus_debug.compat import (
    AsyncTrainingLogger,
    create_pytorch_debugger,
    debug_training_session,
    debug_training_step,
)
from eventbus_debug.events import NonFiniteDetected, StepCompleted
from eventbus_debug.testing import RecordingSink

from ..session._helpers import batch, setup


class TestSeedFactories:
    async def test_seed_factory_and_one_shot_step(self) -> None:
        """create_pytorch_debugger maps the seed switches; debug_training_step runs one step."""
        model, opt = setup()
        dbg = create_pytorch_debugger(model, opt, enable_gradient_checking=True, log_dir=None)
        assert dbg.level is DebugLevel.ADVANCED
        r = await debug_training_step(model, *batch(), nn.functional.mse_loss, opt)
        assert r.stepped and r.verdict.finite

    def test_switches_become_modes(self) -> None:
        """Every switch off means DebugMode.NONE (the probe is off); profiling is a mode."""
        model, opt = setup()
        off = debug_training_session(
            model,
            opt,
            enable_anomaly_detection=False,
            enable_gradient_checking=False,
            log_dir=None,
        )
        assert off.level is DebugLevel.OFF
        prof = create_pytorch_debugger(model, enable_profiling=True, log_dir=None)
        assert prof.plan.profiling and DebugMode.PROFILING.value == "profiling"

    async def test_foreign_session_refused(self) -> None:
        """debug_training_step refuses a session built for another model."""
        model, opt = setup()
        other, _ = setup()
        session = create_pytorch_debugger(other, opt, log_dir=None)
        with pytest.raises(ValueError, match="another model"):
            await debug_training_step(model, *batch(), nn.functional.mse_loss, opt, session=session)


class TestAsyncTrainingLogger:
    async def test_seed_logger_calls_are_the_sessions_own(self) -> None:
        """Each *_async call publishes what the session's own call publishes."""
        model, opt = setup()
        recorder = RecordingSink()
        async with Session(model, opt, log_dir=None, report=False, alerts=False) as s:
            s.bus.subscribe(recorder)
            logger = AsyncTrainingLogger(s)
            assert await logger.check_tensor_anomalies_async(torch.tensor([1.0]), "ok")
            assert not await logger.check_tensor_anomalies_async(torch.tensor([math.nan]), "bad")
            x, y = batch()
            torch.autograd.backward(nn.functional.mse_loss(model(x), y))
            verdict = await logger.check_gradient_anomalies_async()
            assert verdict.step == 0 and verdict.should_step
            await logger.update_progress_async(step=0, loss=0.5, epoch=3)
            await s.bus.drain()
        assert [e.names for e in recorder.of_type(NonFiniteDetected)] == [("bad",)]
        assert recorder.of_type(StepCompleted)[-1].step == 0

    def test_refuses_what_is_not_a_session(self) -> None:
        """A logger needs an async Session: anything else is a TypeError naming it."""
        with pytest.raises(TypeError, match=r"must be an eventbus_debug\.Session"):
            AsyncTrainingLogger(object())  # type: ignore[arg-type]
