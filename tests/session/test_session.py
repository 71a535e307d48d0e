from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from eventbus_debug import DebugLevel, DebugMode, EventBus, Session, SyncSession, read_events
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
from eventbus_debug.modes import plan_for
from eventbus_debug.session import create_pytorch_debugger, debug_training_step
from eventbus_debug.testing import RecordingSink


def _setup() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def _batch(bad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = torch.randn(6, 4), torch.randn(6, 1)
    if bad:
        x[0, 0] = math.nan
    return x, y


class TestPlan:
    def test_modes_map_to_levels_and_instruments(self) -> None:
        """Modes combine: the highest level wins, instruments are the union."""
        plan = plan_for(DebugMode.ANOMALY_DETECTION, "memory_profiling")
        assert plan.level is DebugLevel.BASIC and plan.anomaly_localization and plan.memory_tracking
        assert plan_for(DebugMode.GRADIENT_CHECKING).level is DebugLevel.ADVANCED
        assert plan_for(DebugMode.FULL).level is DebugLevel.EXTREME
        assert plan_for(DebugMode.NONE).level is DebugLevel.OFF

    def test_unknown_mode_lists_valid_ones(self) -> None:
        """A bad mode name lists the valid ones."""
        with pytest.raises(ValueError, match="anomaly_detection"):
            plan_for("fast")


class TestSession:
    async def test_full_run_writes_log_and_report_and_skips_bad_step(self, tmp_path: Path) -> None:
        """A NaN batch is detected, its step skipped by recovery; log and report hold everything."""
        model, opt = _setup()
        recorder = RecordingSink()
        async with Session(model, opt, log_dir=tmp_path, sinks=[recorder]) as session:
            results = [
                await session.training_step(*_batch(bad=i == 2), loss_fn=nn.functional.mse_loss)
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
        model, opt = _setup()
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
            x, y = _batch()
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
        model, opt = _setup()
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
            x, y = _batch()
            x[0, 0] = 50.0
            await session.training_step(x, y, nn.functional.mse_loss)
            with session.debug_context("eval"):
                model(x)
            assert (
                await session.check_tensor_anomalies_async(torch.tensor([1.0, math.inf]), "acts")
                is False
            )
            await session.update_progress_async(step=5, loss=0.1, epoch=0)
        assert recorder.of_type(InputValidationFailed)[0].rule == "range"
        assert recorder.of_type(OperationCompleted)[0].step == 0
        assert recorder.of_type(NonFiniteDetected)[-1].names == ("acts",)
        assert recorder.of_type(StepCompleted)[-1].step == 5

    async def test_seed_factory_and_one_shot_step(self) -> None:
        """create_pytorch_debugger maps the seed switches; debug_training_step runs one step."""
        model, opt = _setup()
        dbg = create_pytorch_debugger(model, opt, enable_gradient_checking=True, log_dir=None)
        assert dbg.level is DebugLevel.ADVANCED
        r = await debug_training_step(model, *_batch(), nn.functional.mse_loss, opt)
        assert r.stepped and r.verdict.finite

    def test_bad_arguments(self) -> None:
        """Bad model, optimizer, or both level and mode are rejected with clear messages."""
        model, opt = _setup()
        with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module"):
            Session("model", opt)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="either level= or mode="):
            Session(model, opt, level="basic", mode="full")


class TestSyncSession:
    def test_plain_loop(self, tmp_path: Path) -> None:
        """The sync form checks, skips the NaN step and writes the same log."""
        model, opt = _setup()
        with SyncSession(model, opt, log_dir=tmp_path, alerts=False) as session:
            stepped = [
                session.training_step(*_batch(bad=i == 1), loss_fn=nn.functional.mse_loss).stepped
                for i in range(3)
            ]
        assert stepped == [True, False, True]
        kinds = [e.kind for e in read_events(tmp_path)]
        assert kinds.count(StepCompleted.kind) == 3 and StepSkipped.kind in kinds
        assert (tmp_path / "report.json").exists()
