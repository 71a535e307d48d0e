"""The prose claims of docs/session.md, docs/probes.md and the README's session, level/mode,
step-probe and verdict sections, each checked by a test named after it."""

from __future__ import annotations

import dataclasses
import math
import threading
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import torch
from torch import nn

from eventbus_debug import (
    Cadence,
    DebugLevel,
    DebugMode,
    EventBus,
    Session,
    SessionOptions,
    StepProbe,
    SyncSession,
    Thresholds,
    read_events,
)
from eventbus_debug.events import (
    EventsUndelivered,
    GradientExploded,
    NonFiniteDetected,
    SessionEnded,
    SessionStarted,
    StepChecked,
    StepCompleted,
    TensorRole,
)
from eventbus_debug.exceptions import ArgumentTypeError, BusClosedError, SubscriptionError
from eventbus_debug.probes import StepVerdict, non_finite_counts
from eventbus_debug.session.modes import plan_for
from eventbus_debug.testing import RecordingSink
from tests._doubles import RecordingPublisher

pytestmark = pytest.mark.anyio

QUIET: dict[str, Any] = {
    "log_dir": None,
    "report": False,
    "alerts": False,
    "system_interval": None,
}


def _setup() -> tuple[Any, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model: Any = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def _backward(model: Any, *, nan: bool = False) -> torch.Tensor:
    x, y = torch.randn(6, 4), torch.randn(6, 1)
    if nan:
        x[0, 0] = math.nan
    loss = nn.functional.mse_loss(model(x), y)
    torch.autograd.backward(loss)
    return loss


# -- options: defaults, validation, unknown keywords ------------------------------------------------


def test_reference_table_defaults_hold() -> None:
    o = SessionOptions()
    assert o.log_dir == "debug_logs"
    assert o.plan.level is DebugLevel.BASIC
    assert o.console is False
    assert (o.report, o.alerts, o.recovery) == (True, True, True)
    assert tuple(o.sinks) == ()
    assert o.close_timeout is None
    assert (o.thresholds, o.cadence, o.input_spec, o.output_checker) == (None,) * 4
    assert o.skip_non_finite is True
    assert o.system_interval == 10.0
    assert o.leak_detector is None
    assert o.recovery_policy.value == "safe"
    assert (o.scheduler, o.scaler, o.distributed) == (None, None, None)
    assert o.overhead_budget is None


def test_session_bus_default_is_none() -> None:
    model, opt = _setup()
    assert Session(model, opt, **QUIET)._given_bus is None


def test_unknown_keyword_names_it_the_class_and_the_closest_option() -> None:
    model, _ = _setup()
    with pytest.raises(
        TypeError,
        match=r"SyncSession\(\) got unexpected keyword argument 'log_dri' \(did you mean 'log_dir'\?\)",
    ):
        SyncSession(model, log_dri="x")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"Session\(\) got unexpected keyword argument 'levle'"):
        Session(model, levle="basic")  # type: ignore[call-arg]


def test_sync_session_bus_keyword_is_a_type_error_saying_so() -> None:
    model, _ = _setup()
    with pytest.raises(TypeError, match="async Session only"):
        SyncSession(model, bus=object())  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("knob", "value", "error"),
    [
        ("level", 0, TypeError),
        ("level", "bogus", ValueError),
        ("mode", "bogus", ValueError),
        ("log_dir", "", ValueError),
        ("log_dir", 3, TypeError),
        ("name", 3, TypeError),
        ("console", 3, TypeError),
        ("report", 3, TypeError),
        ("alerts", "yes", TypeError),
        ("recovery", "yes", TypeError),
        ("thresholds", "x", TypeError),
        ("cadence", "x", TypeError),
        ("skip_non_finite", 1, TypeError),
        ("system_interval", "10", ArgumentTypeError),
        ("system_interval", -1.0, ValueError),
        ("system_interval", math.nan, ValueError),
        ("close_timeout", "1", ArgumentTypeError),
        ("close_timeout", -1.0, ValueError),
        ("close_timeout", 10**400, ValueError),
        ("overhead_budget", 2.0, ValueError),
        ("overhead_budget", "0.02", TypeError),
        ("leak_detector", "x", TypeError),
        ("policy", "bogus", ValueError),
        ("distributed", "x", TypeError),
        ("device_skip", "x", TypeError),
        ("scaler", "x", TypeError),
        ("input_spec", "x", TypeError),
        ("output_checker", "x", TypeError),
    ],
)
def test_each_option_is_checked_at_creation_naming_the_keyword(
    knob: str, value: object, error: type[Exception]
) -> None:
    model, opt = _setup()
    for cls in (Session, SyncSession):
        with pytest.raises(error, match=knob):
            kwargs: dict[str, Any] = {knob: value}
            cls(model, opt, **kwargs)


def test_level_and_mode_together_are_a_value_error() -> None:
    with pytest.raises(ValueError, match="level"):
        SessionOptions(level="basic", mode="full")


def test_sinks_is_checked_when_built_naming_the_index() -> None:
    model, _ = _setup()
    with pytest.raises(SubscriptionError, match=r"sinks\[0\]"):
        Session(model, sinks=[42])  # type: ignore[list-item]
    assert issubclass(SubscriptionError, TypeError)


def test_options_and_keywords_together_are_refused() -> None:
    model, _ = _setup()
    with pytest.raises(TypeError):
        Session(model, options=SessionOptions(log_dir=None), level="basic")


def test_argument_type_error_is_both_type_and_value_error() -> None:
    assert issubclass(ArgumentTypeError, TypeError)
    assert issubclass(ArgumentTypeError, ValueError)


# -- parts replaced or removed ----------------------------------------------------------------------


async def test_every_part_can_be_removed_with_false() -> None:
    model, opt = _setup()
    with anyio.fail_after(10):
        async with Session(model, opt, **QUIET, recovery=False) as s:
            assert s.report is None and s.alerts is None and s.recovery is None
            assert s.safe_point is None and s.system is None


async def test_every_part_can_be_replaced_by_an_instance() -> None:
    model, opt = _setup()
    mine = RecordingSink()
    with anyio.fail_after(10):
        async with Session(
            model, opt, log_dir=None, system_interval=None, report=mine, alerts=False
        ) as s:
            assert s.report is mine
            await s.step_completed(0, loss=1.0)
    assert any(isinstance(e, StepCompleted) for e in mine.events)


async def test_sinks_are_named_training_dot_name_and_dash_two_when_taken() -> None:
    async def hangs(event: object) -> None:
        return None

    class LossTracker:
        async def handle(self, event: object) -> None:
            return None

    model, opt = _setup()
    with anyio.fail_after(10):
        async with Session(model, opt, **QUIET, sinks=[hangs, LossTracker(), LossTracker()]) as s:
            names = {sub.name for sub in s.bus.subscriptions}
    assert {"training.hangs", "training.LossTracker", "training.LossTracker-2"} <= names


# -- entering, leaving, sharing a bus ---------------------------------------------------------------


async def test_entering_a_running_session_raises_runtime_error_and_changes_nothing() -> None:
    model, opt = _setup()
    session = Session(model, opt, **QUIET)
    with anyio.fail_after(10):
        async with session:
            bus = session.bus
            await session.check_step(0, loss=_backward(model))
            with pytest.raises(RuntimeError, match="session 'training' is already running"):
                await session.__aenter__()
            assert session.bus is bus and bus.running
            v = await session.check_step(1, loss=_backward(model))
            assert v.step == 1
            await session.step_completed(1)


def test_entering_a_running_sync_session_raises_runtime_error_and_changes_nothing() -> None:
    model, opt = _setup()
    session = SyncSession(model, opt, **QUIET)
    with session:
        bus = session.bus
        with pytest.raises(RuntimeError, match="session 'training' is already running"):
            session.__enter__()
        assert session.bus is bus
        session.check_step(0, loss=_backward(model))
        session.step_completed(0)
        assert session.steps_completed == 1


async def test_a_session_can_be_entered_again_after_exit_afresh() -> None:
    model, opt = _setup()
    session = Session(model, opt, **QUIET)
    with anyio.fail_after(10):
        async with session:
            first = session.bus
            await session.step_completed(0, loss=1.0)
            await session.step_completed(1, loss=1.0)
        async with session:
            assert session.bus is not first
            assert session.steps_completed == 0 and session.step is None
            await session.step_completed(0, loss=1.0)


def test_a_sync_session_can_be_entered_again_after_exit_afresh() -> None:
    model, opt = _setup()
    session = SyncSession(model, opt, **QUIET)
    with session:
        first = session.bus
        session.step_completed(0, loss=1.0)
    with session:
        assert session.bus is not first and session.steps_completed == 0
        session.step_completed(0, loss=1.0)


async def test_joining_a_bus_not_entered_raises_bus_closed_error() -> None:
    model, opt = _setup()
    with anyio.fail_after(10):
        with pytest.raises(BusClosedError):
            async with Session(model, opt, bus=EventBus(), **QUIET):
                pass


async def test_exit_takes_back_everything_subscribed_on_a_shared_bus() -> None:
    model, opt = _setup()
    with anyio.fail_after(20):
        async with EventBus() as bus:
            before = {sub.name for sub in bus.subscriptions}
            async with Session(model, opt, bus=bus, log_dir=None, system_interval=None) as s:
                first = {sub.name for sub in bus.subscriptions} - before
                assert first
                await s.step_completed(0, loss=1.0)
            assert {sub.name for sub in bus.subscriptions} == before
            async with Session(model, opt, bus=bus, log_dir=None, system_interval=None):
                second = {sub.name for sub in bus.subscriptions} - before
            assert second == first


async def test_a_recovery_engine_you_passed_stays_subscribed() -> None:
    from eventbus_debug import RecoveryEngine

    model, opt = _setup()
    with anyio.fail_after(20):
        async with EventBus() as bus:
            engine = RecoveryEngine(bus)
            async with Session(model, opt, bus=bus, recovery=engine, **QUIET) as s:
                assert s.recovery is engine
            assert engine.subscription in bus.subscriptions


async def test_sessions_on_one_bus_recover_only_from_their_own_incidents() -> None:
    torch.manual_seed(0)
    gen, disc = nn.Linear(4, 1), nn.Linear(4, 1)
    g_opt = torch.optim.SGD(gen.parameters(), lr=0.1)
    d_opt = torch.optim.SGD(disc.parameters(), lr=0.1)
    with anyio.fail_after(20):
        async with EventBus() as bus:
            async with (
                Session(gen, g_opt, bus=bus, name="gen", **QUIET) as g,
                Session(disc, d_opt, bus=bus, name="disc", **QUIET) as d,
            ):
                lg = gen(torch.randn(4, 4)).pow(2).mean() * math.nan
                lg.backward()
                vg = await g.check_step(0, loss=lg)
                ld = disc(torch.randn(4, 4)).pow(2).mean()
                ld.backward()
                vd = await d.check_step(0, loss=ld)
                assert not vg.should_step
                assert vd.should_step


async def test_close_timeout_with_bus_removes_a_hung_sink_and_publishes_events_undelivered() -> (
    None
):
    started = anyio.Event()

    async def hangs(event: object) -> None:
        started.set()
        await anyio.sleep(3600)

    model, opt = _setup()
    recorder = RecordingSink()
    with anyio.fail_after(20):
        async with EventBus() as bus:
            bus.subscribe(recorder, EventsUndelivered)
            before = {sub.name for sub in bus.subscriptions}
            async with Session(model, opt, bus=bus, sinks=[hangs], close_timeout=0.2, **QUIET) as s:
                await s.step_completed(0, loss=1.0)
                await s.step_completed(1, loss=1.0)
                await started.wait()
            assert {sub.name for sub in bus.subscriptions} == before
            await bus.drain()
    assert any(e.sink == "training.hangs" for e in recorder.events)  # type: ignore[attr-defined]


async def test_close_timeout_on_own_bus_bounds_the_exit_and_logs_events_undelivered(
    tmp_path: Path,
) -> None:
    async def hangs(event: object) -> None:
        await anyio.sleep(3600)

    model, opt = _setup()
    with anyio.fail_after(15):
        async with Session(
            model, opt, log_dir=tmp_path, sinks=[hangs], close_timeout=0.3, system_interval=None
        ) as s:
            await s.step_completed(0, loss=1.0)
    kinds = [e.kind for e in read_events(tmp_path)]
    assert "events_undelivered" in kinds and "sink_unresponsive" in kinds


def test_close_timeout_none_is_the_buses_default_of_30_s() -> None:
    model, opt = _setup()
    assert SyncSession(model, opt, close_timeout=2.5, **QUIET)._close_timeout == 2.5
    assert SyncSession(model, opt, **QUIET)._close_timeout == 30.0
    assert Session(model, opt, **QUIET)._close_timeout == 30.0


async def test_session_bus_batches_telemetry_at_most_0_1_s_old() -> None:
    model, opt = _setup()
    with anyio.fail_after(10):
        async with Session(model, opt, **QUIET) as s:
            assert s.bus._linger == 0.1
            assert s.bus._close_timeout == 30.0


# -- exit publishes SessionEnded --------------------------------------------------------------------


async def test_exit_publishes_session_ended_last_and_the_log_accounts_for_every_event(
    tmp_path: Path,
) -> None:
    model, opt = _setup()
    with anyio.fail_after(15):
        async with Session(model, opt, log_dir=tmp_path, system_interval=None) as s:
            for step in range(3):
                v = await s.check_step(step, loss=_backward(model))
                await s.step_completed(step, loss=v.loss)
    kinds = [e.kind for e in read_events(tmp_path)]
    assert kinds[0] == "session_started" and kinds[-1] == "session_ended"
    assert kinds.count("step_completed") == 3
    assert (tmp_path / "report.json").exists() and (tmp_path / "report.html").exists()


async def test_a_cancelled_session_logs_session_ended_reason_cancelled() -> None:
    model, opt = _setup()
    recorder = RecordingSink()
    with anyio.fail_after(15):
        with anyio.move_on_after(0.2):
            async with Session(model, opt, sinks=[recorder], **QUIET) as s:
                await s.step_completed(0, loss=1.0)
                await anyio.sleep(3600)
    ended = recorder.of_type(SessionEnded)
    assert [e.reason for e in ended] == ["cancelled"]


async def test_session_ended_records_the_overhead() -> None:
    model, opt = _setup()
    recorder = RecordingSink()
    with anyio.fail_after(15):
        async with Session(model, opt, sinks=[recorder], overhead_budget=0.5, **QUIET) as s:
            for step in range(4):
                v = await s.check_step(step, loss=_backward(model))
                await s.step_completed(step, loss=v.loss)
            live = s.overhead
    assert live is not None
    (ended,) = recorder.of_type(SessionEnded)
    assert ended.overhead is not None and ended.overhead_budget == 0.5


# -- step_completed's values ------------------------------------------------------------------------


async def _completed_events(**values: Any) -> list[StepCompleted]:
    model, opt = _setup()
    recorder = RecordingSink()
    with anyio.fail_after(10):
        async with Session(model, opt, sinks=[recorder], **QUIET) as s:
            await s.step_completed(0, **values)
    return recorder.of_type(StepCompleted)


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"step": -1}, ValueError, "step"),
        ({"step": 1.0}, TypeError, "step"),
        ({"step": np.int64(1)}, TypeError, r"int\(step\)"),
        ({"step": 2**63}, ValueError, "step"),
        ({"step": True}, TypeError, "step"),
        ({"loss": "1"}, TypeError, "loss"),
        ({"loss": True}, TypeError, "loss"),
        ({"loss": torch.ones(2)}, ValueError, "loss"),
        ({"loss": 1 + 2j}, TypeError, "loss"),
        ({"loss": torch.tensor(1 + 2j)}, TypeError, "loss"),
        ({"loss": 10**400}, ValueError, "loss"),
        ({"loss": torch.ones(1).to_sparse()}, TypeError, "loss"),
        ({"learning_rate": -0.1}, ValueError, "learning_rate"),
        ({"learning_rate": "0.1"}, TypeError, "learning_rate"),
        ({"learning_rate": 10**400}, ValueError, "learning_rate"),
        ({"learning_rate": torch.ones(2)}, ValueError, "learning_rate"),
        ({"samples": -1}, ValueError, "samples"),
        ({"samples": 1.0}, TypeError, "samples"),
        ({"samples": 2**63}, ValueError, "samples"),
    ],
)
async def test_step_completed_refuses_a_bad_value_naming_it_before_anything_is_recorded(
    kwargs: dict[str, Any], error: type[Exception], name: str
) -> None:
    model, opt = _setup()
    recorder = RecordingSink()
    step = kwargs.pop("step", 0)
    with anyio.fail_after(10):
        async with Session(model, opt, sinks=[recorder], **QUIET) as s:
            with pytest.raises(error, match=name):
                await s.step_completed(step, **kwargs)
            assert s.steps_completed == 0 and s.step is None
    assert recorder.of_type(StepCompleted) == []


def test_sync_step_completed_refuses_a_bad_value_naming_it() -> None:
    model, opt = _setup()
    recorder = RecordingSink()
    with SyncSession(model, opt, sinks=[recorder], **QUIET) as s:
        with pytest.raises(ValueError, match="learning_rate"):
            s.step_completed(0, learning_rate=-1.0)
        with pytest.raises(ValueError, match="samples"):
            s.step_completed(0, samples=-1)
    assert recorder.of_type(StepCompleted) == []


async def test_a_nan_or_infinite_loss_or_learning_rate_is_recorded_as_it_is(tmp_path: Path) -> None:
    model, opt = _setup()
    with anyio.fail_after(10):
        async with Session(
            model, opt, log_dir=tmp_path, system_interval=None, report=False, alerts=False
        ) as s:
            await s.step_completed(0, loss=math.nan, learning_rate=math.inf)
            await s.step_completed(1, loss=torch.tensor(math.inf), learning_rate=math.nan)
    done = [e for e in read_events(tmp_path) if isinstance(e, StepCompleted)]
    assert math.isnan(done[0].loss) and done[0].learning_rate == math.inf  # type: ignore[arg-type]
    assert done[1].loss == math.inf and math.isnan(done[1].learning_rate)  # type: ignore[arg-type]
    text = (tmp_path / "events.jsonl").read_text()
    assert '"NaN"' in text and '"Infinity"' in text


async def test_numpy_losses_and_one_element_tensors_are_recorded_as_floats() -> None:
    events = await _completed_events(loss=np.float32(0.5), learning_rate=torch.tensor([0.25]))
    assert events[0].loss == 0.5 and type(events[0].loss) is float
    assert events[0].learning_rate == 0.25
    events = await _completed_events(loss=np.mean(np.array([1.0, 2.0])), samples=np.int64(4))
    assert events[0].loss == 1.5


# -- check_step / training_step ---------------------------------------------------------------------


async def test_check_step_returns_a_verdict_and_skips_a_non_finite_step() -> None:
    model, opt = _setup()
    with anyio.fail_after(10):
        async with Session(model, opt, **QUIET) as s:
            v = await s.check_step(0, loss=_backward(model))
            assert v.should_step and v.finite and v.loss is not None and v.grad_norm is not None
            opt.zero_grad()
            bad = await s.check_step(1, loss=_backward(model, nan=True))
            assert not bad.should_step and not bad.finite and "skip_step" in bad.actions


async def test_check_step_refuses_a_bad_loss_naming_it() -> None:
    model, opt = _setup()
    with anyio.fail_after(10):
        async with Session(model, opt, **QUIET) as s:
            _backward(model)
            with pytest.raises(TypeError, match="loss"):
                await s.check_step(0, loss="x")  # type: ignore[arg-type]
            with pytest.raises(TypeError, match="loss"):
                await s.check_step(0, loss=torch.ones(1).to_sparse())
            with pytest.raises(ValueError, match="loss"):
                await s.check_step(0, loss=10**400)
            with pytest.raises(TypeError, match="step"):
                await s.check_step(np.int64(0), loss=1.0)  # type: ignore[arg-type]


async def test_training_step_names_a_loss_fn_that_is_not_callable_or_a_bad_result() -> None:
    model, opt = _setup()
    x, y = torch.randn(6, 4), torch.randn(6, 1)
    with anyio.fail_after(10):
        async with Session(model, opt, **QUIET) as s:
            with pytest.raises(TypeError, match="loss_fn"):
                await s.training_step(x, y, "mse")  # type: ignore[arg-type]
            with pytest.raises(ValueError, match="loss_fn"):
                await s.training_step(x, y, lambda o, t: (o - t).pow(2))
            with pytest.raises(ValueError, match="loss_fn"):
                await s.training_step(x, y, lambda o, t: (o - t).pow(2).mean().detach())
            with pytest.raises(TypeError, match="loss_fn"):
                await s.training_step(x, y, lambda o, t: 1.0)  # type: ignore[arg-type, return-value]
            result = await s.training_step(x, y, nn.functional.mse_loss)
            assert result.stepped


async def test_training_step_at_advanced_gives_a_grad_norm_and_level_changes_at_run_time() -> None:
    model, opt = _setup()
    with anyio.fail_after(10):
        async with Session(model, opt, level="advanced", **QUIET) as s:
            r = await s.training_step(torch.randn(8, 4), torch.randn(8, 1), nn.functional.mse_loss)
            assert r.stepped and r.verdict.grad_norm is not None
            s.set_level("extreme")
            assert s.level is DebugLevel.EXTREME and s.probe is not None
            assert s.probe.level is DebugLevel.EXTREME
            with pytest.raises(ValueError, match="level"):
                s.set_level("bogus")


def test_sync_session_has_the_sessions_methods_blocking() -> None:
    model, opt = _setup()
    with SyncSession(model, opt, **QUIET) as s:
        v = s.check_step(0, loss=_backward(model))
        assert v.should_step
        s.step_completed(0, loss=v.loss)
        r = s.training_step(torch.randn(6, 4), torch.randn(6, 1), nn.functional.mse_loss, step=1)
        assert r.step == 1 and r.stepped
        assert s.check_tensor(torch.ones(2), "x") is True


def test_a_sync_session_stepped_from_two_threads_refuses_the_second() -> None:
    model, opt = _setup()
    inside = threading.Event()
    release = threading.Event()
    errors: list[BaseException] = []

    def slow_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        inside.set()
        release.wait(10)
        return nn.functional.mse_loss(out, target)

    with SyncSession(model, opt, **QUIET) as s:

        def first() -> None:
            s.training_step(torch.randn(6, 4), torch.randn(6, 1), slow_loss, step=0)

        t = threading.Thread(target=first)
        t.start()
        try:
            assert inside.wait(10)
            for call in (
                lambda: s.check_step(1, loss=1.0),
                lambda: s.step_completed(1),
                lambda: s.training_step(
                    torch.randn(6, 4), torch.randn(6, 1), nn.functional.mse_loss
                ),
            ):
                try:
                    call()
                except RuntimeError as exc:
                    errors.append(exc)
        finally:
            release.set()
            t.join(10)
    assert len(errors) == 3


# -- modes and levels -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "level", "loc", "prof", "mem"),
    [
        (DebugMode.NONE, DebugLevel.OFF, False, False, False),
        (DebugMode.ANOMALY_DETECTION, DebugLevel.BASIC, True, False, False),
        (DebugMode.GRADIENT_CHECKING, DebugLevel.ADVANCED, False, False, False),
        (DebugMode.MEMORY_PROFILING, DebugLevel.OFF, False, False, True),
        (DebugMode.PROFILING, DebugLevel.OFF, False, True, False),
        (DebugMode.FULL, DebugLevel.EXTREME, True, True, True),
    ],
)
def test_debug_mode_maps_to_its_level_and_instruments(
    mode: DebugMode, level: DebugLevel, loc: bool, prof: bool, mem: bool
) -> None:
    plan = plan_for(mode)
    assert (plan.level, plan.anomaly_localization, plan.profiling, plan.memory_tracking) == (
        level,
        loc,
        prof,
        mem,
    )


def test_memory_profiling_mode_runs_a_leak_check_every_50_steps() -> None:
    model, opt = _setup()
    s = SyncSession(model, opt, mode="memory_profiling", **QUIET)
    assert s.leak_detector is not None and s.leak_detector.every == 50
    assert SyncSession(model, opt, **QUIET).leak_detector is None
    assert SyncSession(model, opt, leak_detector=False, mode="full", **QUIET).leak_detector is None


async def test_at_level_off_verdict_loss_is_none_and_step_completed_records_no_loss() -> None:
    model, opt = _setup()
    recorder = RecordingSink()
    with anyio.fail_after(10):
        async with Session(
            model, opt, mode="memory_profiling", sinks=[recorder], leak_detector=False, **QUIET
        ) as s:
            loss = _backward(model)
            v = await s.check_step(0, loss=loss)
            assert v.loss is None and v.should_step
            await s.step_completed(0, loss=v.loss)
            await s.step_completed(1, loss=loss.item())
    done = recorder.of_type(StepCompleted)
    assert done[0].loss is None and done[1].loss == pytest.approx(loss.item())


async def test_check_tensor_publishes_non_finite_detected_naming_the_bad_leaves() -> None:
    model, opt = _setup()
    recorder = RecordingSink()
    with anyio.fail_after(10):
        async with Session(model, opt, sinks=[recorder], **QUIET) as s:
            ok = await s.check_tensor(
                {"a": torch.ones(2, dtype=torch.int8), "b": [1.0, np.array([math.nan])]}, "out"
            )
            assert ok is False
            assert await s.check_tensor(torch.tensor(1e39, dtype=torch.float64), "x") is True
            deep: Any = 1.0
            for _ in range(150):
                deep = [deep]
            with pytest.raises(ValueError):
                await s.check_tensor(deep, "deep")
            with pytest.raises(TypeError):
                await s.check_tensor(object(), "obj")
    (bad,) = recorder.of_type(NonFiniteDetected)
    assert bad.names == ("out['b'][1]",) and bad.nan_count == 1


def test_session_log_dir_empty_is_a_value_error() -> None:
    model, _ = _setup()
    with pytest.raises(ValueError, match="log_dir"):
        Session(model, log_dir="")


@pytest.mark.parametrize(
    ("knobs", "what"),
    [
        ({"scaler": torch.amp.GradScaler("cpu")}, "scaler"),
        ({"skip_non_finite": False}, "skip_non_finite"),
        ({"distributed": True}, "distributed"),
        ({"mode": "anomaly_detection"}, "ANOMALY_DETECTION"),
        ({"mode": "full"}, "FULL"),
    ],
)
def test_device_skip_is_refused_with_a_clear_error(knobs: dict[str, Any], what: str) -> None:
    model = nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    with pytest.raises(ValueError, match=what):
        Session(model, opt, device_skip=True, **QUIET, **knobs)


def test_device_skip_with_a_non_fused_optimizer_is_refused_naming_it() -> None:
    model = nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises((ValueError, TypeError), match="AdamW"):
        Session(model, opt, device_skip=True, **QUIET)


def test_session_started_config_names_the_level() -> None:
    model, opt = _setup()
    recorder = RecordingSink()
    with SyncSession(model, opt, level="ADVANCED", sinks=[recorder], **QUIET):
        pass
    (started,) = recorder.of_type(SessionStarted)
    assert started.config["level"] == "advanced"


# -- probes.md: StepVerdict and StepProbe -----------------------------------------------------------


def test_step_verdict_has_the_documented_fields_and_is_frozen() -> None:
    names = {f.name for f in dataclasses.fields(StepVerdict)}
    assert {
        "step",
        "checked",
        "finite",
        "loss",
        "grad_norm",
        "param_norm",
        "fired",
        "deferred",
    } <= names
    v = StepVerdict(step=1)
    assert v.ok
    with pytest.raises(dataclasses.FrozenInstanceError):
        v.step = 2  # type: ignore[misc]
    assert not StepVerdict(step=1, fired=("loss_spiked",)).ok


async def test_probe_publishes_step_checked_and_loss_then_gradient_non_finite() -> None:
    model, _ = _setup()
    recorder = RecordingSink()
    with anyio.fail_after(10):
        async with EventBus() as bus:
            bus.subscribe(recorder)
            probe = StepProbe(model, bus)
            loss = _backward(model) * math.nan
            v = await probe.check_step(3, loss=loss)
            await bus.drain()
    assert not v.finite
    bad = recorder.of_type(NonFiniteDetected)
    assert [e.role.value for e in bad] == ["loss"]
    assert recorder.of_type(StepChecked)


def test_a_float64_loss_of_1e39_is_finite() -> None:
    model, _ = _setup()
    _backward(model)
    probe = StepProbe(model, None)
    v = probe.check_step_sync(0, loss=torch.tensor(1e39, dtype=torch.float64))
    assert v.finite


async def test_a_nan_batchnorm_buffer_is_reported_with_role_buffer() -> None:
    torch.manual_seed(0)
    model: Any = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    recorder = RecordingSink()
    with anyio.fail_after(10):
        async with EventBus() as bus:
            bus.subscribe(recorder, NonFiniteDetected)
            probe = StepProbe(model, bus, cadence=Cadence(param_every=1))
            model(torch.randn(8, 4)).sum().backward()
            model[1].running_mean[0] = math.nan
            v = await probe.check_step(0, loss=1.0)
            await bus.drain()
    assert not v.finite
    assert [e.role for e in recorder.events] == [TensorRole.BUFFER]  # type: ignore[attr-defined]


async def test_a_non_finite_gradient_checks_parameters_at_once_whatever_param_every_says() -> None:
    model, _ = _setup()
    recorder = RecordingSink()
    with anyio.fail_after(10):
        async with EventBus() as bus:
            bus.subscribe(recorder, NonFiniteDetected)
            probe = StepProbe(model, bus, cadence=Cadence(param_every=1000))
            _backward(model)
            assert (await probe.check_step(1)).param_norm is None  # parameters not due
            for p in model.parameters():
                p.grad = None
            with torch.no_grad():
                model[2].weight[0, 0] = math.nan
            _backward(model)
            v = await probe.check_step(3)
            await bus.drain()
    assert not v.finite
    roles = {(e.step, e.role) for e in recorder.events}  # type: ignore[attr-defined]
    assert {(3, TensorRole.GRADIENT), (3, TensorRole.PARAMETER)} <= roles


def test_gradient_explosion_cap_before_history_is_reported_once_with_rule_cap() -> None:
    model = nn.Linear(4, 1)
    published = RecordingPublisher()
    probe = StepProbe(model, published)
    for step in range(3):
        for p in model.parameters():
            p.grad = torch.full_like(p, 1e7)
        probe.check_step_sync(step)
    recorder = [e for e in published.events if isinstance(e, GradientExploded)]
    assert [e.rule for e in recorder] == ["cap"]
    assert Thresholds().explosion == 1e6


@pytest.mark.parametrize("loss", [1, 0.5, np.float32(0.5)])
def test_the_loss_may_be_a_real_number(loss: object) -> None:
    model, _ = _setup()
    _backward(model)
    v = StepProbe(model, None).check_step_sync(0, loss=loss)  # type: ignore[arg-type]
    assert v.loss == pytest.approx(float(loss))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("loss", "error"),
    [
        (True, TypeError),
        (torch.ones(1).to_sparse(), TypeError),
        (10**400, ValueError),
        (1j, TypeError),
    ],
)
def test_a_bool_sparse_or_huge_loss_is_refused(loss: object, error: type[Exception]) -> None:
    model, _ = _setup()
    _backward(model)
    with pytest.raises(error, match="loss"):
        StepProbe(model, None).check_step_sync(0, loss=loss)  # type: ignore[arg-type]


def test_level_takes_a_debug_level_or_its_name_anything_else_is_argument_type_error() -> None:
    model, _ = _setup()
    assert StepProbe(model, None, level="Advanced").level is DebugLevel.ADVANCED
    with pytest.raises(ArgumentTypeError, match="level"):
        StepProbe(model, None, level=0)  # type: ignore[arg-type]
    probe = StepProbe(model, None)
    with pytest.raises(ArgumentTypeError, match="level"):
        probe.level = 0  # type: ignore[assignment]
    assert probe.level is DebugLevel.BASIC


def test_level_off_checks_nothing() -> None:
    model, _ = _setup()
    _backward(model)
    probe = StepProbe(model, None, level=DebugLevel.OFF)
    v = probe.check_step_sync(0, loss=1.0)
    assert not v.checked and v.loss is None


def test_basic_cadence_defaults_param_every_and_vanishing_every_are_10() -> None:
    c = Cadence()
    assert (c.param_every, c.vanishing_every) == (10, 10)
    assert c.grad_every == 1 and c.loss_every == 1


def test_check_inline_returns_the_verdict() -> None:
    model, _ = _setup()
    _backward(model)
    probe = StepProbe(model, None)
    v = probe.check_inline(0, 1.0)
    assert v is not None and v.checked and v.loss == 1.0


async def test_deferred_mode_returns_an_earlier_steps_verdict_and_flush_reads_the_rest() -> None:
    model, _ = _setup()
    with anyio.fail_after(10):
        async with EventBus() as bus:
            recorder = RecordingSink()
            bus.subscribe(recorder, NonFiniteDetected)
            probe = StepProbe(model, bus, deferred=True)
            _backward(model)
            first = await probe.check_step(0, loss=1.0)
            assert not first.checked
            _backward(model, nan=True)
            second = await probe.check_step(1, loss=2.0)
            assert second.step == 0 and second.deferred
            rest = await probe.flush()
            await bus.drain()
    assert rest is not None and rest.step == 1 and not rest.finite
    assert recorder.events and all(e.nan_count is None for e in recorder.events)  # type: ignore[attr-defined]


def test_extreme_hooks_are_removed_when_the_level_drops() -> None:
    model, _ = _setup()
    probe = StepProbe(model, None, level=DebugLevel.EXTREME)
    _backward(model)
    probe.check_step_sync(0, loss=1.0)
    assert model[1]._forward_hooks
    probe.level = DebugLevel.BASIC
    assert not model[1]._forward_hooks


def test_non_finite_counts_skips_strings_and_none_and_names_a_bad_leaf_path() -> None:
    counts = non_finite_counts({"a": "text", "b": None, "c": 1.0}, name="out")
    assert counts.finite
    with pytest.raises(TypeError, match=r"out\['c'\]"):
        non_finite_counts({"c": object()}, name="out")


# -- more session claims ----------------------------------------------------------------------------


async def test_an_incident_of_no_session_is_every_sessions() -> None:
    torch.manual_seed(0)
    gen, disc = nn.Linear(4, 1), nn.Linear(4, 1)
    g_opt = torch.optim.SGD(gen.parameters(), lr=0.1)
    d_opt = torch.optim.SGD(disc.parameters(), lr=0.1)
    with anyio.fail_after(20):
        async with EventBus() as bus:
            async with (
                Session(gen, g_opt, bus=bus, name="gen", **QUIET) as g,
                Session(disc, d_opt, bus=bus, name="disc", **QUIET) as d,
            ):
                assert g.recovery is not None and g.recovery.ignore is not None
                bus.publish_nowait(
                    NonFiniteDetected(
                        step=0, source="my_check", role=TensorRole.GRADIENT, names=("x",)
                    )
                )
                await bus.drain()
                gen(torch.randn(4, 4)).pow(2).mean().backward()
                disc(torch.randn(4, 4)).pow(2).mean().backward()
                vg = await g.check_step(0, loss=1.0)
                vd = await d.check_step(0, loss=1.0)
                assert not vg.should_step and not vd.should_step


async def test_a_recovery_engine_you_pass_has_no_ignore_predicate() -> None:
    from eventbus_debug import RecoveryEngine

    model, opt = _setup()
    with anyio.fail_after(20):
        async with EventBus() as bus:
            engine = RecoveryEngine(bus)
            async with Session(model, opt, bus=bus, recovery=engine, **QUIET):
                assert engine.ignore is None


async def test_leaving_a_shared_bus_closes_the_sessions_sinks_so_the_report_is_written(
    tmp_path: Path,
) -> None:
    model, opt = _setup()
    with anyio.fail_after(20):
        async with EventBus() as bus:
            async with Session(model, opt, bus=bus, log_dir=tmp_path, system_interval=None) as s:
                await s.step_completed(0, loss=1.0)
            assert (tmp_path / "report.json").exists() and (tmp_path / "report.html").exists()
            kinds = [e.kind for e in read_events(tmp_path)]
            assert kinds[-1] == "session_ended"


async def test_validation_policy_skip_rejects_a_batch_before_the_forward_pass() -> None:
    from eventbus_debug.events import InputValidationFailed, StepSkipped
    from eventbus_debug.extras import InputSpec, InputValidator, ValidationPolicy

    torch.manual_seed(0)
    model: Any = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    recorder = RecordingSink()
    x = torch.randn(8, 4)
    x[0, 0] = math.nan
    with anyio.fail_after(10):
        async with Session(model, opt, sinks=[recorder], **QUIET) as s:
            s.validator = InputValidator(InputSpec(ndim=2), policy=ValidationPolicy.SKIP)
            stats = model[1].running_mean.clone()
            result = await s.training_step(x, torch.randn(8, 1), nn.functional.mse_loss, step=5)
            assert torch.equal(model[1].running_mean, stats)
            assert not result.stepped and "reject_batch" in result.verdict.actions
    assert [e.step for e in recorder.of_type(StepSkipped)] == [5]
    assert recorder.of_type(InputValidationFailed)


def test_a_sync_session_has_no_profiler_an_async_one_writes_traces_under_log_dir() -> None:
    model, opt = _setup()
    with SyncSession(model, opt, mode="profiling", **QUIET) as s:
        assert s.profiler is None


async def test_profiling_mode_profiles_a_window_at_the_start(tmp_path: Path) -> None:
    model, opt = _setup()
    with anyio.fail_after(60):
        async with Session(
            model,
            opt,
            mode="profiling",
            log_dir=tmp_path,
            system_interval=None,
            report=False,
            alerts=False,
        ) as s:
            assert s.profiler is not None
            for step in range(6):
                await s.training_step(
                    torch.randn(6, 4), torch.randn(6, 1), nn.functional.mse_loss, step=step
                )
    assert list((tmp_path / "traces").glob("*.pt.trace.json.gz"))


def test_session_system_summary_reads_the_sampler() -> None:
    model, opt = _setup()
    with SyncSession(
        model, opt, log_dir=None, report=False, alerts=False, system_interval=5.0
    ) as s:
        assert s.system is not None
        assert s.system.summary() is not None


def test_overhead_budget_doubles_costly_periods_up_to_64x_keeps_loss_and_grad_then_unreachable() -> (
    None
):
    from eventbus_debug.session.budget import OverheadMeter

    model, _ = _setup()
    probe = StepProbe(model, None)
    base = probe.cadence
    now = [0.0]
    meter = OverheadMeter(probe, 0.02, window=2, clock=lambda: now[0])
    meter.step_finished(0.0)
    t = 0.0
    for _ in range(20000):
        meter.add(0.5)
        t += 1.0
        meter.step_finished(t)
        if meter.unreachable:
            break
    assert meter.stretch == 64 and meter.unreachable
    c = probe.cadence
    assert c.param_every == base.param_every * 64
    assert c.vanishing_every == base.vanishing_every * 64
    assert (c.loss_every, c.grad_every) == (base.loss_every, base.grad_every)
    for _ in range(20000):  # far under a quarter of the budget: halved again
        t += 1.0
        meter.step_finished(t)
    assert meter.stretch == 1 and probe.cadence.param_every == base.param_every


async def test_training_step_under_anomaly_detection_publishes_anomaly_localized_with_the_step() -> (
    None
):
    from eventbus_debug.events import AnomalyLocalized

    torch.manual_seed(0)
    model: Any = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    recorder = RecordingSink()
    x = torch.randn(6, 4)
    x[0, 0] = math.nan
    with anyio.fail_after(20):
        async with Session(
            model, opt, mode=DebugMode.ANOMALY_DETECTION, sinks=[recorder], **QUIET
        ) as s:
            r = await s.training_step(x, torch.randn(6, 1), nn.functional.mse_loss, step=4)
            assert not r.stepped
    found = recorder.of_type(AnomalyLocalized)
    assert found and found[0].step == 4


def test_anomaly_arming_defaults_are_3_passes_and_a_50_pass_cooldown() -> None:
    from eventbus_debug.probes import anomaly_arming

    assert (anomaly_arming.DEFAULT_PASSES, anomaly_arming.DEFAULT_COOLDOWN) == (3, 50)


# -- more probe claims ------------------------------------------------------------------------------


async def test_advanced_publishes_per_layer_norms_and_update_ratios_extreme_fractions() -> None:
    torch.manual_seed(0)
    model: Any = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    recorder = RecordingSink()
    with anyio.fail_after(10):
        async with EventBus() as bus:
            bus.subscribe(recorder, StepChecked)
            probe = StepProbe(model, bus, level="basic")
            _backward(model)
            await probe.check_step(0, loss=1.0)
            probe.level = DebugLevel.ADVANCED
            for step in (100, 101):  # a step divisible by update_every, then the next
                opt.zero_grad()
                _backward(model)
                await probe.check_step(step, loss=1.0)
                opt.step()
            probe.level = DebugLevel.EXTREME
            opt.zero_grad()
            _backward(model)
            await probe.check_step(102, loss=1.0)
            await bus.drain()
    basic, adv0, adv1, ext = recorder.events
    assert not basic.layer_grad_norms  # type: ignore[attr-defined]
    assert "0.weight" in adv0.layer_grad_norms  # type: ignore[attr-defined]
    assert adv0.update_ratios or adv1.update_ratios  # type: ignore[attr-defined]
    assert ext.dead_fractions and "1" in ext.dead_fractions  # type: ignore[attr-defined]


def test_rebaseline_restarts_the_loss_spike_and_explosion_baselines() -> None:
    model, _ = _setup()
    probe = StepProbe(model, None)
    for step in range(5):
        _backward(model)
        probe.check_step_sync(step, loss=1.0)
    probe.rebaseline()
    _backward(model)
    assert not probe.check_step_sync(5, loss=1000.0).fired  # no baseline to spike against


def test_a_drop_is_never_a_loss_spike_and_a_jump_is() -> None:
    model, _ = _setup()
    probe = StepProbe(model, None, level="basic")
    fired: list[tuple[str, ...]] = []
    losses = [1.0, 1.01, 0.99, 1.0, 1.02, 0.98, 1.0, 0.001, 1.0, 1.0, 50.0]
    for step, loss in enumerate(losses):
        model.zero_grad()
        _backward(model)
        fired.append(probe.check_step_sync(step, loss=loss).fired)
    assert all("loss_spiked" not in f for f in fired[:-1])
    assert "loss_spiked" in fired[-1]


def test_a_frozen_parameter_with_a_stale_zero_grad_is_never_a_dead_layer() -> None:
    torch.manual_seed(0)
    model: Any = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    model[0].bias.requires_grad_(False)
    model[0].bias.grad = torch.zeros(8)
    probe = StepProbe(model, None, cadence=Cadence(vanishing_every=1))
    for step in range(30):
        model[2].zero_grad()
        model[0].weight.grad = None
        _backward(model)
        assert "gradient_vanished" not in probe.check_step_sync(step, loss=1.0).fired


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan])
def test_one_shot_thresholds_zero_negative_or_nan_are_value_errors(bad: float) -> None:
    from eventbus_debug.compat import check_gradient_explosion, check_gradients

    model = nn.Linear(4, 2)
    model(torch.randn(3, 4)).sum().backward()
    with pytest.raises(ValueError, match="threshold"):
        check_gradients(model, gradient_threshold=bad)
    with pytest.raises(ValueError, match="threshold"):
        check_gradient_explosion(model, threshold=bad)


def test_one_shot_threshold_not_a_number_is_a_type_error_and_a_meta_model_a_value_error() -> None:
    from eventbus_debug.compat import check_gradients

    model = nn.Linear(4, 2)
    model(torch.randn(3, 4)).sum().backward()
    with pytest.raises(TypeError, match="threshold"):
        check_gradients(model, gradient_threshold="10")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"meta|parameter"):
        check_gradients(nn.Linear(4, 2, device="meta"))


def test_a_finite_gradient_of_1e20_is_finite_and_above_the_threshold() -> None:
    from eventbus_debug.compat import check_gradient_explosion, check_gradients

    model = nn.Linear(4, 2)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e20)
    assert check_gradients(model, gradient_threshold=10.0).finite
    assert check_gradient_explosion(model, threshold=10.0)


def test_analyze_tensor_refuses_raw_bits_and_non_tensors_and_reports_meta() -> None:
    from eventbus_debug.probes import analyze_tensor

    with pytest.raises(TypeError):
        analyze_tensor(torch.zeros(2, dtype=torch.uint8).view(torch.bits8), "b")
    with pytest.raises(TypeError):
        analyze_tensor([1.0], "x")  # type: ignore[arg-type]
    assert analyze_tensor(torch.zeros(2, device="meta"), "m").is_meta
    big = torch.full((4,), 60000.0, dtype=torch.float16)
    stats = analyze_tensor(big, "h")
    assert stats.mean == pytest.approx(60000.0, rel=1e-3) and math.isfinite(stats.std)  # type: ignore[arg-type]


def test_system_sampler_thresholds_must_be_resource_thresholds_with_finite_percentages() -> None:
    from eventbus_debug.probes import ResourceThresholds, SystemSampler

    with pytest.raises(TypeError, match="thresholds"):
        SystemSampler(None, thresholds={"cpu_percent": 90})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cpu_percent"):
        ResourceThresholds(cpu_percent=-1)
    with pytest.raises(ValueError, match="memory_percent"):
        ResourceThresholds(memory_percent=math.nan)
    r = ResourceThresholds()
    assert (r.cpu_percent, r.memory_percent, r.disk_percent, r.gpu_memory_percent) == (
        None,
        90.0,
        95.0,
        95.0,
    )
    assert (r.gpu_utilization, r.sustain, r.hysteresis) == (None, 3, 5.0)


def test_leak_detector_thresholds_must_be_leak_thresholds_with_growths_at_least_zero() -> None:
    from eventbus_debug.probes import LeakDetector, LeakThresholds

    assert LeakDetector().every == 50
    with pytest.raises(TypeError, match="thresholds"):
        LeakDetector(thresholds={"window": 5})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rss_bytes"):
        LeakThresholds(rss_bytes=-1)
    LeakThresholds(live_tensors=math.inf)  # type: ignore[arg-type]  # never a leak


def test_trace_store_and_profile_schedule_defaults(tmp_path: Path) -> None:
    from eventbus_debug.probes import ProfileSchedule
    from eventbus_debug.probes.profiler import TraceStore

    store = TraceStore(tmp_path)
    assert (store.max_traces, store.max_bytes) == (5, 256 * 2**20)
    s = ProfileSchedule()
    assert (s.wait, s.warmup, s.active) == (1, 1, 3)


@pytest.mark.parametrize(
    ("knob", "value"),
    [("max_traces", "5"), ("max_traces", 0), ("max_bytes", math.nan), ("max_bytes", 1.5)],
)
def test_trace_store_refuses_a_bad_cap_naming_it(tmp_path: Path, knob: str, value: object) -> None:
    from eventbus_debug.probes.profiler import TraceStore

    with pytest.raises((TypeError, ValueError), match=knob):
        kwargs: dict[str, Any] = {knob: value}
        TraceStore(tmp_path, **kwargs)


def test_cuda_memory_history_without_cuda_records_nothing(tmp_path: Path) -> None:
    from eventbus_debug.probes import cuda_memory_history

    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with cuda_memory_history(tmp_path / "snap.pickle"):  # type: ignore[arg-type]
        torch.ones(4)
    assert not (tmp_path / "snap.pickle").exists()


# -- third batch ------------------------------------------------------------------------------------


async def test_a_sink_with_a_name_is_subscribed_under_it() -> None:
    class Named:
        name = "webhook"

        async def handle(self, event: object) -> None:
            return None

    model, opt = _setup()
    with anyio.fail_after(10):
        async with Session(model, opt, sinks=[Named()], **QUIET) as s:
            assert "training.webhook" in {sub.name for sub in s.bus.subscriptions}


def test_console_takes_a_stream_and_shows_an_incident() -> None:
    import io

    model, opt = _setup()
    out = io.StringIO()
    with SyncSession(model, opt, console=out, **QUIET) as s:
        s.check_step(0, loss=_backward(model, nan=True))
        s.step_completed(0)
    assert "non" in out.getvalue().lower() or "nan" in out.getvalue().lower()


def test_modes_combine_level_is_the_highest_instruments_the_union() -> None:
    model, opt = _setup()
    s = SyncSession(model, opt, mode={DebugMode.ANOMALY_DETECTION, "memory_profiling"}, **QUIET)
    assert s.plan.level is DebugLevel.BASIC
    assert s.plan.anomaly_localization and s.plan.memory_tracking and not s.plan.profiling
    assert s.leak_detector is not None


async def test_samples_are_recorded_as_samples_per_s_over_the_time_since_the_last_step() -> None:
    model, opt = _setup()
    recorder = RecordingSink()
    with anyio.fail_after(10):
        async with Session(model, opt, sinks=[recorder], **QUIET) as s:
            await s.step_completed(0, samples=16)
            await anyio.sleep(0.01)
            await s.step_completed(1, samples=16)
    first, second = recorder.of_type(StepCompleted)
    assert first.samples_per_s is None
    assert second.samples_per_s is not None and second.samples_per_s > 0


async def test_without_recovery_skip_non_finite_advises_skipping_a_non_finite_step() -> None:
    model, opt = _setup()
    with anyio.fail_after(10):
        async with Session(model, opt, recovery=False, **QUIET) as s:
            v = await s.check_step(0, loss=_backward(model, nan=True))
            assert not v.should_step and v.decision is None and not v.finite
        model.zero_grad()
        async with Session(model, opt, recovery=False, skip_non_finite=False, **QUIET) as s:
            v = await s.check_step(0, loss=_backward(model, nan=True))
            assert v.should_step and not v.finite


async def test_verdict_holds_step_probe_loss_grad_norm_and_the_decision() -> None:
    model, opt = _setup()
    with anyio.fail_after(10):
        async with Session(model, opt, **QUIET) as s:
            loss = _backward(model)
            v = await s.check_step(7, loss=loss)
    assert v.step == 7 and v.probe.step == 7
    assert v.loss == pytest.approx(loss.item()) and v.loss == v.probe.loss
    assert v.grad_norm == v.probe.grad_norm and v.finite
    assert v.decision is not None and v.actions == ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        v.should_step = False  # type: ignore[misc]


async def test_check_step_refuses_a_bad_loss_and_the_step_stays_the_sessions() -> None:
    model, opt = _setup()
    with anyio.fail_after(10):
        async with Session(model, opt, **QUIET) as s:
            v = await s.check_step(0, loss=_backward(model))
            await s.step_completed(0, loss=v.loss)
            with pytest.raises(ValueError, match="loss"):
                await s.check_step(5, loss=torch.ones(3))
            with pytest.raises(TypeError, match="loss"):
                await s.check_step(6, loss="x")  # type: ignore[arg-type]
            assert s.step == 0
    with SyncSession(model, opt, **QUIET) as ss:
        ss.step_completed(0)
        with pytest.raises(ValueError, match="loss"):
            ss.check_step(5, loss=torch.ones(3))
        assert ss.step == 0


def test_gradient_explosion_with_history_is_growth_with_baseline_and_largest() -> None:
    model = nn.Linear(4, 1)
    published = RecordingPublisher()
    probe = StepProbe(model, published)
    torch.manual_seed(0)
    for step in range(20):
        for p in model.parameters():
            p.grad = torch.randn_like(p) * (1 + 0.05 * step % 3)
        probe.check_step_sync(step)
    assert not [e for e in published.events if isinstance(e, GradientExploded)]
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e4)
    probe.check_step_sync(20)
    (event,) = [e for e in published.events if isinstance(e, GradientExploded)]
    assert event.rule == "growth" and event.baseline is not None and event.largest is not None
    assert event.total_norm > 10 * event.baseline


def test_step_probe_refuses_wrong_thresholds_or_cadence_and_meta_models() -> None:
    model, _ = _setup()
    with pytest.raises(TypeError, match="thresholds"):
        StepProbe(model, None, thresholds="x")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="cadence"):
        StepProbe(model, None, cadence="x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="meta"):
        StepProbe(nn.Linear(2, 2, device="meta"), None)


def test_thresholds_of_the_wrong_type_are_argument_type_errors_naming_them() -> None:
    with pytest.raises(ArgumentTypeError, match="explosion"):
        Thresholds(explosion="10")  # type: ignore[arg-type]
    t = Thresholds()
    assert (t.explosion_factor, t.explosion_window, t.vanishing_relative, t.vanishing_patience) == (
        10.0,
        50,
        1e-4,
        10,
    )
    assert (t.spike_warmup, t.spike_window, t.spike_patience) == (1, 50, 5)


# -- fourth batch -----------------------------------------------------------------------------------


async def test_a_session_whose_entry_failed_can_be_entered_later() -> None:
    model, opt = _setup()
    bus = EventBus()
    session = Session(model, opt, bus=bus, **QUIET)
    with anyio.fail_after(10):
        with pytest.raises(BusClosedError):
            await session.__aenter__()
        async with bus, session:
            await session.step_completed(0, loss=1.0)


async def test_your_exception_leaves_the_session_as_itself_and_is_logged_in_session_ended() -> None:
    model, opt = _setup()
    recorder = RecordingSink()
    with anyio.fail_after(10):
        with pytest.raises(KeyError):
            async with Session(model, opt, sinks=[recorder], **QUIET):
                raise KeyError("boom")
    (ended,) = recorder.of_type(SessionEnded)
    assert ended.reason.startswith("error: KeyError")


def test_a_sync_sessions_exception_leaves_as_itself() -> None:
    model, opt = _setup()
    recorder = RecordingSink()
    with pytest.raises(KeyError), SyncSession(model, opt, sinks=[recorder], **QUIET):
        raise KeyError("boom")
    (ended,) = recorder.of_type(SessionEnded)
    assert ended.reason.startswith("error: KeyError")


def test_check_inline_is_none_when_the_reductions_go_to_a_worker_thread() -> None:
    from eventbus_debug.probes.step import probe as probe_module

    assert probe_module.MAX_IN_FLIGHT == 4
    assert probe_module.OFFLOAD_NUMEL in (16 * 2**20, 16_000_000)
    model, _ = _setup()
    _backward(model)
    assert StepProbe(model, None, offload_numel=1).check_inline(0, 1.0) is None


async def test_at_level_off_a_bad_loss_is_still_refused_naming_it() -> None:
    model, opt = _setup()
    with anyio.fail_after(10):
        async with Session(model, opt, level="off", **QUIET) as s:
            with pytest.raises(TypeError, match="loss"):
                await s.check_step(0, loss="x")  # type: ignore[arg-type]
            v = await s.check_step(0, loss=1.0)
            assert not v.probe.checked and v.loss is None


def test_a_sessions_validator_reports_by_default() -> None:
    from eventbus_debug.extras import InputSpec, ValidationPolicy

    model, opt = _setup()
    with SyncSession(model, opt, input_spec=InputSpec(ndim=2, max_abs=1.0), **QUIET) as s:
        assert s.validator is not None and s.validator.policy is ValidationPolicy.REPORT
        r = s.training_step(torch.full((6, 4), 5.0), torch.randn(6, 1), nn.functional.mse_loss)
        assert r.stepped
        with pytest.raises(TypeError, match="validator"):
            s.validator = "x"  # type: ignore[assignment]


async def test_compat_async_training_logger_wraps_a_session() -> None:
    from eventbus_debug.compat import AsyncTrainingLogger

    model, opt = _setup()
    with anyio.fail_after(10):
        async with Session(model, opt, **QUIET) as s:
            assert AsyncTrainingLogger(s) is not None


@pytest.mark.parametrize(
    ("value", "nan", "inf"),
    [
        (complex(math.nan, 0), 1, 0),
        (__import__("decimal").Decimal("Infinity"), 0, 1),
        (__import__("fractions").Fraction(1, 3), 0, 0),
        (np.float16(np.inf), 0, 1),
        (torch.tensor([1, 2], dtype=torch.int64), 0, 0),
    ],
)
def test_non_finite_counts_takes_numbers_of_every_kind(value: object, nan: int, inf: int) -> None:
    c = non_finite_counts(value)
    assert (c.nan_count, c.inf_count) == (nan, inf)


def test_non_finite_counts_nested_over_100_deep_is_a_value_error() -> None:
    deep: Any = 1.0
    for _ in range(101):
        deep = [deep]
    with pytest.raises(ValueError):
        non_finite_counts(deep)
    shallow: Any = 1.0
    for _ in range(99):
        shallow = [shallow]
    assert non_finite_counts(shallow).finite


async def test_observe_policy_takes_no_action_the_loop_reads_verdict_finite() -> None:
    model, opt = _setup()
    with anyio.fail_after(10):
        async with Session(model, opt, policy="observe", **QUIET) as s:
            v = await s.check_step(0, loss=_backward(model, nan=True))
    assert not v.finite and v.actions == ()


async def test_safe_policy_restores_a_non_finite_parameter_from_the_last_good_state() -> None:
    model, opt = _setup()
    with anyio.fail_after(10):
        async with Session(model, opt, **QUIET) as s:
            v = await s.check_step(0, loss=_backward(model))
            opt.step()
            opt.zero_grad()
            await s.step_completed(0, loss=v.loss)
            with torch.no_grad():
                model[2].weight[0, 0] = math.nan
            v = await s.check_step(1, loss=_backward(model))
            assert not v.should_step and v.actions
            assert all(torch.isfinite(p).all() for p in model.parameters())


def test_leak_detector_true_builds_a_default_one_and_an_instance_is_used_as_is() -> None:
    from eventbus_debug.probes import LeakDetector

    model, opt = _setup()
    assert SyncSession(model, opt, leak_detector=True, **QUIET).leak_detector is not None
    mine = LeakDetector(every=7)
    assert SyncSession(model, opt, leak_detector=mine, **QUIET).leak_detector is mine


def test_a_bool_or_complex_learning_rate_tensor_is_a_type_error_as_the_number_is() -> None:
    model, opt = _setup()
    with SyncSession(model, opt, **QUIET) as s:
        for bad in (True, 1j, torch.tensor(True), torch.tensor(1j)):
            with pytest.raises(TypeError, match="learning_rate"):
                s.step_completed(0, learning_rate=bad)  # type: ignore[arg-type]
        assert s.steps_completed == 0


async def test_the_loss_rule_is_one_in_check_step_step_completed_and_the_probe() -> None:
    model, opt = _setup()
    cases: list[object] = [
        True,
        1j,
        "1",
        np.array([0.5]),
        torch.tensor(True),
        torch.tensor(1j),
        torch.ones(2),
        torch.ones(1).to_sparse(),
        10**400,
    ]
    with anyio.fail_after(10):
        async with Session(model, opt, **QUIET) as s:
            probe = StepProbe(model, None)
            for loss in cases:
                errors: list[type[Exception]] = []
                for call in (
                    lambda: s.check_step(0, loss=loss),  # type: ignore[arg-type]  # noqa: B023
                    lambda: s.step_completed(0, loss=loss),  # type: ignore[arg-type]  # noqa: B023
                ):
                    with pytest.raises((TypeError, ValueError), match="loss") as info:
                        await call()
                    errors.append(type(info.value))
                with pytest.raises((TypeError, ValueError), match="loss") as info:
                    probe.check_step_sync(0, loss=loss)  # type: ignore[arg-type]
                errors.append(type(info.value))
                assert len(set(errors)) == 1, (loss, errors)


def test_basic_checks_parameters_every_10th_step_extreme_every_step() -> None:
    model, _ = _setup()
    basic = StepProbe(model, None)
    extreme = StepProbe(model, None, level="extreme")
    _backward(model)
    assert basic.check_step_sync(0).param_norm is not None
    assert basic.check_step_sync(1).param_norm is None
    assert basic.check_step_sync(10).param_norm is not None
    assert extreme.check_step_sync(1).param_norm is not None


def test_all_zero_gradients_are_reported_once_as_vanished_with_all_zero() -> None:
    published = RecordingPublisher()
    events = published.events
    model, _ = _setup()
    probe = StepProbe(model, published)
    for step in range(30):
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        probe.check_step_sync(step, loss=1.0)
    from eventbus_debug.events import GradientVanished

    vanished = [e for e in events if isinstance(e, GradientVanished)]
    assert len(vanished) == 1 and vanished[0].all_zero


def test_tiny_gradients_vanish_after_10_vanishing_checks() -> None:
    from eventbus_debug.events import GradientVanished

    published = RecordingPublisher()
    events = published.events
    model, _ = _setup()
    probe = StepProbe(model, published)
    for step in range(100):
        for p in model.parameters():
            p.grad = torch.full_like(p, 1e-9)
        probe.check_step_sync(step, loss=1.0)
    vanished = [e for e in events if isinstance(e, GradientVanished)]
    assert [e.step for e in vanished] == [90]  # the 10th check at vanishing_every=10
    assert not vanished[0].all_zero and vanished[0].mean_abs is not None


async def test_device_skip_reports_the_incident_and_step_skipped_one_step_later() -> None:
    from eventbus_debug.events import StepSkipped

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    recorder = RecordingSink()
    with anyio.fail_after(20):
        async with Session(model, opt, device_skip=True, sinks=[recorder], **QUIET) as s:
            for step in range(3):
                loss = model(torch.randn(8, 4)).pow(2).mean() * (math.nan if step == 1 else 1.0)
                loss.backward()
                v = await s.check_step(step, loss=loss)
                assert v.should_step
                if step == 2:
                    assert v.probe.step == 1
                opt.step()
                opt.zero_grad()
                await s.step_completed(step)
    assert [e.step for e in recorder.of_type(NonFiniteDetected)] == [1, 1] or all(
        e.step == 1 for e in recorder.of_type(NonFiniteDetected)
    )
    assert [e.step for e in recorder.of_type(StepSkipped)] == [1]


# -- fifth batch ------------------------------------------------------------------------------------


def test_a_level_set_before_entry_is_the_level_the_session_runs_and_announces() -> None:
    model, opt = _setup()
    recorder = RecordingSink()
    session = SyncSession(model, opt, sinks=[recorder], **QUIET)
    session.set_level("advanced")
    assert session.level is DebugLevel.ADVANCED
    with session:
        assert session.probe is not None and session.probe.level is DebugLevel.ADVANCED
        session.set_level("extreme")
    with session:  # the level the session reads is the level it runs
        assert session.probe is not None and session.probe.level is session.level
    configs = [e.config["level"] for e in recorder.of_type(SessionStarted)]
    assert configs[0] == "advanced"


async def test_a_level_set_before_entry_holds_in_the_async_session() -> None:
    model, opt = _setup()
    session = Session(model, opt, **QUIET)
    session.level = "off"
    with anyio.fail_after(10):
        async with session:
            v = await session.check_step(0, loss=_backward(model))
            assert not v.probe.checked and v.loss is None


@pytest.mark.parametrize("bad", [5, [5], [None]])
def test_a_mode_of_the_wrong_type_is_an_argument_type_error_naming_mode(bad: object) -> None:
    with pytest.raises(ArgumentTypeError, match="mode"):
        SessionOptions(mode=bad)  # type: ignore[arg-type]


def test_mode_names_are_taken_in_any_case_as_level_names_are() -> None:
    assert SessionOptions(mode="FULL").plan.level is DebugLevel.EXTREME
    assert SessionOptions(level="EXTREME").plan.level is DebugLevel.EXTREME
    with pytest.raises(ValueError, match="anomaly_detection"):
        SessionOptions(mode="bogus")


async def test_a_sessions_step_probe_incidents_are_sourced_name_dot_step_probe() -> None:
    model, opt = _setup()
    recorder = RecordingSink()
    with anyio.fail_after(10):
        async with Session(model, opt, name="gen", sinks=[recorder], **QUIET) as s:
            await s.check_step(0, loss=_backward(model, nan=True))
            assert "gen.webhook" not in {sub.name for sub in s.bus.subscriptions}
    assert {e.source for e in recorder.of_type(NonFiniteDetected)} == {"gen.step_probe"}


async def test_session_overhead_is_none_before_two_steps_finished() -> None:
    model, opt = _setup()
    with anyio.fail_after(10):
        async with Session(model, opt, **QUIET) as s:
            assert s.overhead is None
            await s.step_completed(0, loss=1.0)
            assert s.overhead is None
            await s.step_completed(1, loss=1.0)
            assert s.overhead is not None


def test_a_compiled_model_is_announced_as_compiled() -> None:
    model, opt = _setup()
    recorder = RecordingSink()
    compiled: Any = torch.compile(model)
    with SyncSession(compiled, opt, sinks=[recorder], **QUIET):
        pass
    (started,) = recorder.of_type(SessionStarted)
    assert started.config["model"] == "Sequential (compiled)"


# -- sixth batch ------------------------------------------------------------------------------------


async def test_a_model_that_cannot_be_brought_back_raises_training_stopped() -> None:
    from eventbus_debug.exceptions import TrainingStopped

    model, opt = _setup()
    with torch.no_grad():
        model[2].weight[0, 0] = math.nan
    recorder = RecordingSink()
    with anyio.fail_after(10):
        with pytest.raises(TrainingStopped):
            async with Session(model, opt, sinks=[recorder], **QUIET) as s:
                await s.check_step(0, loss=_backward(model))
    (ended,) = recorder.of_type(SessionEnded)
    assert ended.reason == "stopped"


def test_both_sessions_take_the_fields_of_session_options() -> None:
    from eventbus_debug.session.options import SessionKnobs

    assert set(SessionKnobs.__annotations__) == SessionOptions.knobs()


def test_a_sync_sessions_sinks_may_be_subscribed_to_session_bus_inside_the_with_block() -> None:
    model, opt = _setup()
    recorder = RecordingSink()
    with SyncSession(model, opt, **QUIET) as s:
        s.bus.subscribe(recorder)
        s.step_completed(0, loss=1.0)
    assert [e.step for e in recorder.of_type(StepCompleted)] == [0]


def test_console_true_writes_incidents_to_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    model, opt = _setup()
    with SyncSession(model, opt, console=True, **QUIET) as s:
        s.check_step(0, loss=_backward(model, nan=True))
    captured = capsys.readouterr()
    assert captured.err and not captured.out


async def test_the_default_parts_are_the_built_in_ones(tmp_path: Path) -> None:
    from eventbus_debug import RecoveryEngine
    from eventbus_debug.sinks import AlertSink, ReportWriter

    model, opt = _setup()
    with anyio.fail_after(15):
        async with Session(model, opt, log_dir=None, system_interval=None) as s:
            assert s.report is None  # log_dir=None: neither log nor report
            assert isinstance(s.alerts, AlertSink) and isinstance(s.recovery, RecoveryEngine)
    with anyio.fail_after(15):
        async with Session(model, opt, log_dir=tmp_path, system_interval=None) as s:
            assert isinstance(s.report, ReportWriter)


async def test_output_checker_checks_outputs_in_training_step() -> None:
    from eventbus_debug.events import OutputAnomalyDetected
    from eventbus_debug.extras import OutputChecker

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    with torch.no_grad():
        model.weight.zero_()
        model.bias.fill_(0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    recorder = RecordingSink()
    with anyio.fail_after(10):
        async with Session(
            model, opt, output_checker=OutputChecker(), sinks=[recorder], **QUIET
        ) as s:
            await s.training_step(
                torch.randn(4, 4), torch.randn(4, 2), nn.functional.mse_loss, step=2
            )
    found = recorder.of_type(OutputAnomalyDetected)
    assert found and found[0].step == 2


async def test_leaving_a_shared_bus_removes_the_localization_hooks() -> None:
    model, opt = _setup()

    def hooks() -> int:
        return sum(
            len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
            for m in model.modules()
        )

    before = hooks()
    with anyio.fail_after(20):
        async with EventBus() as bus:
            subs = {sub.name for sub in bus.subscriptions}
            async with Session(model, opt, bus=bus, mode="anomaly_detection", **QUIET) as s:
                await s.check_step(0, loss=_backward(model, nan=True))
                opt.zero_grad()
                model(torch.randn(2, 4))  # a watched pass
            assert {sub.name for sub in bus.subscriptions} == subs
    assert hooks() == before


async def test_localization_names_input_when_the_models_own_inputs_held_nan() -> None:
    from eventbus_debug.probes import FirstNonFiniteLocator

    model, _ = _setup()
    x = torch.randn(4, 4)
    x[0, 0] = math.nan
    found = await FirstNonFiniteLocator(model).localize(lambda: model(x).sum().backward())
    assert found is not None and found.role == TensorRole.INPUT


async def test_localization_names_a_parameter_whose_gradient_alone_is_non_finite() -> None:
    from eventbus_debug.probes import FirstNonFiniteLocator

    model, _ = _setup()
    model[2].weight.register_hook(lambda g: torch.full_like(g, math.nan))

    def replay() -> None:
        torch.autograd.backward(model(torch.randn(4, 4)).sum())

    found = await FirstNonFiniteLocator(model).localize(replay)
    assert found is not None and found.phase == "backward" and found.parameter == "2.weight"


async def test_memory_tracking_works_as_an_async_with_block() -> None:
    from eventbus_debug.probes import memory_tracking

    async with memory_tracking("block", count_tensors=True) as tracked:
        kept = torch.ones(1024)
    assert tracked.delta is not None and tracked.delta.live_tensors is not None
    assert kept.numel() == 1024


async def test_the_step_entries_raise_runtime_error_when_the_session_is_not_running() -> None:
    model, opt = _setup()
    session = Session(model, opt, **QUIET)
    with pytest.raises(RuntimeError, match="not running"):
        await session.check_step(0, loss=1.0)
    with anyio.fail_after(10):
        async with session:
            pass
    with pytest.raises(RuntimeError, match="not running"):
        await session.step_completed(0, loss=1.0)
    with pytest.raises(RuntimeError, match="not running"):
        _ = session.bus


async def test_training_step_without_an_optimizer_is_a_runtime_error() -> None:
    model, _ = _setup()
    with anyio.fail_after(10):
        async with Session(model, **QUIET) as s:
            with pytest.raises(RuntimeError, match="optimizer"):
                await s.training_step(torch.randn(2, 4), torch.randn(2, 1), nn.functional.mse_loss)
            v = await s.check_step(0, loss=_backward(model))
            assert v.should_step


async def test_a_non_finite_gradient_event_names_the_parameters_and_counts_nans() -> None:
    model, _ = _setup()
    recorder = RecordingSink()
    with anyio.fail_after(10):
        async with EventBus() as bus:
            bus.subscribe(recorder, NonFiniteDetected)
            probe = StepProbe(model, bus)
            loss = _backward(model, nan=True)
            await probe.check_step(0, loss=loss)
            await bus.drain()
    by_role = {e.role: e for e in recorder.of_type(NonFiniteDetected)}
    grad = by_role[TensorRole.GRADIENT]
    assert "0.weight" in grad.names and grad.nan_count
    assert by_role[TensorRole.LOSS].names == ("loss",)


async def test_a_cancelled_session_on_a_shared_bus_still_logs_session_ended_and_leaves() -> None:
    model, opt = _setup()
    recorder = RecordingSink()
    with anyio.fail_after(15):
        async with EventBus() as bus:
            bus.subscribe(recorder, SessionEnded)
            subs = {sub.name for sub in bus.subscriptions}
            with anyio.move_on_after(0.2):
                async with Session(model, opt, bus=bus, log_dir=None, system_interval=None) as s:
                    await s.step_completed(0, loss=1.0)
                    await anyio.sleep(3600)
            assert {sub.name for sub in bus.subscriptions} == subs
            await bus.drain()
    assert [e.reason for e in recorder.of_type(SessionEnded)] == ["cancelled"]


def test_an_overlapped_agreement_follows_a_level_set_at_run_time() -> None:
    from eventbus_debug.session._wiring import _overlap_agreement

    model, _ = _setup()
    probe = StepProbe(model, None)
    attached: dict[str, Any] = {}

    class Agreement:
        def attach(self, model: object, engine: object, **kw: Any) -> None:
            attached.update(kw)

    _overlap_agreement(SessionOptions(log_dir=None), model, object(), Agreement(), probe)  # type: ignore[arg-type]
    blocking_at = attached["blocking_at"]
    assert blocking_at(0) and not blocking_at(1)  # parameters every 10th step at BASIC
    probe.level = DebugLevel.EXTREME  # session.set_level("extreme") on every rank
    assert blocking_at(1)


async def test_a_recovery_engine_on_another_bus_is_refused_when_the_session_is_created() -> None:
    from eventbus_debug import RecoveryEngine

    model, opt = _setup()
    with anyio.fail_after(10):
        async with EventBus() as other, EventBus() as bus:
            engine = RecoveryEngine(other)
            with pytest.raises(ValueError, match="recovery"):
                Session(model, opt, recovery=engine, **QUIET)  # its own bus: never on it
            with pytest.raises(ValueError, match="recovery"):
                Session(model, opt, bus=bus, recovery=engine, **QUIET)
            with pytest.raises(ValueError, match="recovery"):
                SyncSession(model, opt, recovery=engine, **QUIET)
            async with Session(model, opt, bus=other, recovery=engine, **QUIET) as s:
                v = await s.check_step(0, loss=_backward(model, nan=True))
                assert not v.should_step  # the engine hears the session: the NaN step skipped


@pytest.mark.parametrize(
    ("knob", "value"),
    [("deferred", "yes"), ("global_spikes", 1), ("source", 3), ("optimizer", "x")],
)
def test_step_probe_refuses_a_wrong_type_naming_the_argument(knob: str, value: object) -> None:
    model, _ = _setup()
    kwargs: dict[str, Any] = {knob: value}
    with pytest.raises(TypeError, match=knob):
        StepProbe(model, None, **kwargs)


def test_leak_detector_and_profile_schedule_refuse_a_wrong_type_naming_the_argument() -> None:
    from eventbus_debug.probes import LeakDetector, ProfileSchedule

    with pytest.raises(TypeError, match="count_tensors"):
        LeakDetector(count_tensors="x")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="source"):
        LeakDetector(source=3)  # type: ignore[arg-type]
    with pytest.raises(ArgumentTypeError, match="wait"):
        ProfileSchedule(wait="1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="active"):
        ProfileSchedule(active=0)


def test_sync_session_close_timeout_bounds_the_exit_when_a_sink_hangs(tmp_path: Path) -> None:
    async def hangs(event: object) -> None:
        await anyio.sleep(3600)

    model, opt = _setup()

    def run() -> None:
        with SyncSession(
            model, opt, log_dir=tmp_path, sinks=[hangs], close_timeout=0.3, system_interval=None
        ) as s:
            s.step_completed(0, loss=1.0)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(20)
    assert not worker.is_alive()
    assert "events_undelivered" in [e.kind for e in read_events(tmp_path)]
