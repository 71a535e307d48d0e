"""Bad input found by the session-6 audits, second round: each refused with an error naming it.

Constructors that did their own checks raise :class:`ArgumentTypeError` for a wrong type; an int
too large for a float (``10**400``) is a ``ValueError`` naming the argument, never a bare
``OverflowError``; a loss is a dense one-element real tensor or a real number, by the same rule
in ``check_step``, ``step_completed`` and ``StepProbe.check_step``; level names are accepted by
the step probe; a structure nested too deep for ``check_tensor`` is a ``ValueError``; one
session driven from two threads at once is a ``RuntimeError``.
"""

from __future__ import annotations

import fractions
import io
import math
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from eventbus_debug import (
    DebugLevel,
    EventBus,
    Session,
    SessionOptions,
    SyncSession,
    _validate as v,
)
from eventbus_debug.events import Event, GradientExploded, Severity, StepCompleted
from eventbus_debug.exceptions import ArgumentTypeError
from eventbus_debug.probes import StepProbe
from eventbus_debug.probes.finite import MAX_NESTING, non_finite_counts
from eventbus_debug.probes.levels import level_of
from eventbus_debug.recovery import StrategySpec
from eventbus_debug.recovery.registry import Registration
from eventbus_debug.recovery.safepoint.snapshot import StateSnapshots
from eventbus_debug.session import options
from eventbus_debug.sinks import ConsoleSink
from eventbus_debug.sinks.alerts import AlertRule, AlertSink, WebhookAlert, rules
from eventbus_debug.testing import RecordingSink
from tests._doubles import backward_once, quiet, small_model

HUGE = 10**400
"""An int no float can hold: ``float(HUGE)`` is an OverflowError."""


# -- constructors with their own checks -----------------------------------------------------------


class _Publisher:
    def publish_nowait(self, event: Event, /) -> None:
        pass

    def publish_many_nowait(self, events: Iterable[Event], /) -> None:
        pass


def _rule(**kw: Any) -> AlertRule:
    return AlertRule(event_types=(GradientExploded,), **kw)


_WRONG_TYPES: list[tuple[str, Any]] = [
    ("every", lambda x: StateSnapshots(every=x)),
    ("step_every", lambda x: ConsoleSink(io.StringIO(), step_every=x)),
    ("min_severity", lambda x: ConsoleSink(io.StringIO(), min_severity=x)),
    ("timeout", lambda x: AlertSink(_Publisher(), timeout=x)),
    ("flush_interval", lambda x: AlertSink(_Publisher(), flush_interval=x)),
    ("timeout", lambda x: WebhookAlert("http://127.0.0.1:9/hook", timeout=x)),
    ("url", lambda x: WebhookAlert(x)),
    ("cooldown", lambda x: _rule(cooldown=x)),
    ("rate_limit", lambda x: _rule(rate_limit=x)),
    ("rate_window", lambda x: _rule(rate_window=x)),
    ("percent", lambda x: rules.cpu_above(x)),
    ("sustain", lambda x: rules.memory_above(90.0, sustain=x)),
    ("max_attempts", lambda x: Registration(_spec(max_attempts=x), 0)),
    (
        "max_consecutive",
        lambda x: Registration(_spec(max_consecutive=x), 0),
    ),
]


def _spec(**kw: Any) -> StrategySpec:
    return StrategySpec(on=GradientExploded, strategy=lambda incident, history: None, **kw)


@pytest.mark.parametrize(("name", "build"), _WRONG_TYPES, ids=[n for n, _ in _WRONG_TYPES])
@pytest.mark.parametrize("bad", ["1", True, [1], b"x"], ids=["str", "bool", "list", "bytes"])
def test_constructor_wrong_type(name: str, build: Any, bad: object) -> None:
    """A wrong type is an ArgumentTypeError naming the argument: a TypeError, and the
    ValueError these constructors raised before."""
    if name == "url" and isinstance(bad, str | bool):
        bad = 1.5  # any str is a URL's type
    with pytest.raises(ArgumentTypeError, match=rf"{name} must be") as err:
        build(bad)
    assert isinstance(err.value, TypeError) and isinstance(err.value, ValueError)


_OUT_OF_RANGE: list[tuple[str, Any, object]] = [
    ("every", lambda x: StateSnapshots(every=x), 0),
    ("step_every", lambda x: ConsoleSink(io.StringIO(), step_every=x), 0),
    ("timeout", lambda x: AlertSink(_Publisher(), timeout=x), 0),
    ("timeout", lambda x: AlertSink(_Publisher(), timeout=x), HUGE),
    ("flush_interval", lambda x: AlertSink(_Publisher(), flush_interval=x), -1.0),
    ("timeout", lambda x: WebhookAlert("http://127.0.0.1:9/hook", timeout=x), HUGE),
    ("url", lambda x: WebhookAlert(x), "ftp://host"),
    ("cooldown", lambda x: _rule(cooldown=x), -1),
    ("cooldown", lambda x: _rule(cooldown=x), HUGE),
    ("cooldown", lambda x: _rule(cooldown=x), float("nan")),
    ("rate_limit", lambda x: _rule(rate_limit=x), 0),
    ("rate_window", lambda x: _rule(rate_window=x), HUGE),
    ("percent", lambda x: rules.cpu_above(x), 101),
    ("sustain", lambda x: rules.memory_above(90.0, sustain=x), 0),
    ("max_attempts", lambda x: Registration(_spec(max_attempts=x), 0), 0),
]


@pytest.mark.parametrize(
    ("name", "build", "bad"), _OUT_OF_RANGE, ids=[f"{n}={b!r:.10}" for n, _, b in _OUT_OF_RANGE]
)
def test_constructor_out_of_range(name: str, build: Any, bad: object) -> None:
    with pytest.raises(ValueError, match=rf"{name} must be") as err:
        build(bad)
    assert not isinstance(err.value, TypeError)


def test_constructors_keep_their_values() -> None:
    assert StateSnapshots(every=3).every == 3
    assert _rule(cooldown=math.inf).cooldown == math.inf  # each key delivered once
    assert _rule(cooldown=2, rate_window=1).rate_window == 1.0
    assert WebhookAlert("https://example.invalid/hook", timeout=2).timeout == 2.0
    assert ConsoleSink(io.StringIO(), step_every=5, min_severity=Severity.WARNING) is not None


# -- numbers too large for a float -----------------------------------------------------------------


class TestHugeNumbers:
    @pytest.mark.parametrize("helper", [v.positive_number, v.positive_seconds, v.non_negative])
    @pytest.mark.parametrize("value", [HUGE, -HUGE])
    def test_helpers(self, helper: Any, value: int) -> None:
        with pytest.raises(ValueError, match=r"knob must be .*got an int of about 401 digits"):
            helper("knob", value)

    def test_helpers_still_take_large_ints(self) -> None:
        assert v.positive_seconds("knob", 2**64) == float(2**64)
        assert v.fraction("knob", 1) == 1.0

    def test_fraction_and_int64(self) -> None:
        with pytest.raises(ValueError, match=r"knob must be a number in \[0, 1\], got an int of"):
            v.fraction("knob", HUGE)
        with pytest.raises(ValueError, match=r"knob must fit in 64 bits.*an int of about"):
            v.int64_count("knob", 10**5000)  # beyond str()'s 4300-digit limit too

    @pytest.mark.parametrize("knob", ["close_timeout", "system_interval"])
    def test_session_seconds(self, knob: str) -> None:
        with pytest.raises(ValueError, match=rf"{knob} must be .*an int of about 401 digits"):
            SessionOptions(**{knob: HUGE})  # type: ignore[arg-type]

    @pytest.mark.parametrize(
        "knob", ["close_timeout", "drop_report_interval", "stall_threshold", "telemetry_latency"]
    )
    def test_bus_seconds(self, knob: str) -> None:
        with pytest.raises(ValueError, match=rf"{knob} must be"):
            EventBus(**{knob: HUGE})

    @pytest.mark.parametrize("meth", ["check_step", "step_completed"])
    def test_loss(self, meth: str) -> None:
        model, opt = small_model()
        with SyncSession(model, opt, **quiet()) as session:
            backward_once(model)
            for loss in (HUGE, -HUGE, fractions.Fraction(HUGE)):
                with pytest.raises(ValueError, match=r"loss must be a number a float can hold"):
                    getattr(session, meth)(0, loss=loss)
            assert session.steps_completed == 0

    async def test_loss_async(self) -> None:
        model, opt = small_model()
        async with Session(model, opt, **quiet()) as session:
            backward_once(model)
            with pytest.raises(ValueError, match=r"loss must be a number a float can hold"):
                await session.check_step(0, loss=HUGE)
            with pytest.raises(ValueError, match=r"loss must be a number a float can hold"):
                await session.step_completed(0, loss=HUGE)

    def test_learning_rate(self) -> None:
        model, opt = small_model()
        with SyncSession(model, opt, **quiet()) as session:
            with pytest.raises(ValueError, match=r"learning_rate must be a number a float can"):
                session.step_completed(0, learning_rate=HUGE)
            session.step_completed(0, loss=2**70, learning_rate=2**70)  # large, but a float
            assert session.steps_completed == 1


# -- the loss: dense, one element, real ------------------------------------------------------------


def _sparse() -> torch.Tensor:
    return torch.tensor([[0.5]]).to_sparse()


class TestSparseLoss:
    @pytest.mark.parametrize("meth", ["check_step", "step_completed"])
    def test_sync_session_refuses(self, meth: str) -> None:
        model, opt = small_model()
        sink = RecordingSink()
        with SyncSession(model, opt, **quiet(sinks=[sink])) as session:
            backward_once(model)
            with pytest.raises(TypeError, match=r"loss must be a dense tensor.*sparse_coo"):
                getattr(session, meth)(0, loss=_sparse())
            assert session.steps_completed == 0
        assert not [e for e in sink.events if isinstance(e, StepCompleted)]

    async def test_async_session_refuses(self) -> None:
        model, opt = small_model()
        async with Session(model, opt, **quiet()) as session:
            backward_once(model)
            with pytest.raises(TypeError, match=r"loss must be a dense tensor"):
                await session.check_step(0, loss=_sparse())
            with pytest.raises(TypeError, match=r"loss must be a dense tensor"):
                await session.step_completed(0, loss=_sparse())

    @pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
    def test_probe_refuses_csr_too(self) -> None:
        model, _ = small_model()
        probe = StepProbe(model)
        csr = torch.tensor([[0.5]]).to_sparse_csr()
        with pytest.raises(TypeError, match=r"loss must be a dense tensor.*sparse_csr"):
            probe.check_step_sync(0, loss=csr)

    def test_learning_rate_refuses_sparse(self) -> None:
        model, opt = small_model()
        with SyncSession(model, opt, **quiet()) as session:
            with pytest.raises(ValueError, match=r"learning_rate must be a number or a one-elem"):
                session.step_completed(0, learning_rate=_sparse())  # type: ignore[arg-type]

    def test_dense_still_accepted(self) -> None:
        model, opt = small_model()
        with SyncSession(model, opt, **quiet()) as session:
            backward_once(model)
            losses: tuple[torch.Tensor | float, ...] = (
                torch.tensor(0.5),
                torch.tensor([[0.5]]),
                0.5,
            )
            for step, loss in enumerate(losses):
                assert session.check_step(step, loss=loss).loss == 0.5
                session.step_completed(step, loss=loss)


class TestProbeNumbers:
    """StepProbe.check_step takes any real number, as the sessions do (not a bool)."""

    @pytest.mark.parametrize(
        "loss", [np.float32(0.5), np.float64(0.5), np.int64(3), fractions.Fraction(1, 2), 3]
    )
    def test_real_scalars(self, loss: Any) -> None:
        model, _ = small_model()
        backward_once(model)
        verdict = StepProbe(model).check_step_sync(0, loss=loss)
        assert verdict.loss == float(loss)
        assert type(verdict.loss) is float

    async def test_real_scalar_async(self) -> None:
        model, _ = small_model()
        backward_once(model)
        verdict = await StepProbe(model).check_step(0, loss=np.float32(0.5))  # type: ignore[arg-type]
        assert verdict.loss == 0.5

    def test_numpy_nan_not_finite(self) -> None:
        model, _ = small_model()
        backward_once(model)
        probe = StepProbe(model)
        assert not probe.check_step_sync(0, loss=np.float32("nan")).finite  # type: ignore[arg-type]

    @pytest.mark.parametrize("loss", [True, np.bool_(True), 1 + 2j, "0.5", [0.5], np.array([0.5])])
    def test_not_real_refused(self, loss: Any) -> None:
        model, _ = small_model()
        with pytest.raises(TypeError, match=r"loss must be a one-element tensor or a number"):
            StepProbe(model).check_step_sync(0, loss=loss)


# -- level names -----------------------------------------------------------------------------------


class TestLevelNames:
    def test_constructor_takes_names(self) -> None:
        model, _ = small_model()
        assert StepProbe(model, level="advanced").level is DebugLevel.ADVANCED
        assert StepProbe(model, level=" EXTREME ").level is DebugLevel.EXTREME

    def test_setter_takes_names(self) -> None:
        model, _ = small_model()
        probe = StepProbe(model, level=DebugLevel.EXTREME)
        assert probe.activation_hooks_armed
        probe.level = "off"
        assert probe.level is DebugLevel.OFF
        assert not probe.activation_hooks_armed

    @pytest.mark.parametrize("bad", [1, None, True, 0.5, DebugLevel])
    def test_wrong_type(self, bad: object) -> None:
        model, _ = small_model()
        with pytest.raises(ArgumentTypeError, match=r"level must be a DebugLevel or one of"):
            StepProbe(model, level=bad)  # type: ignore[arg-type]
        probe = StepProbe(model)
        with pytest.raises(ArgumentTypeError, match=r"level must be a DebugLevel"):
            probe.level = bad  # type: ignore[assignment]
        assert probe.level is DebugLevel.BASIC

    @pytest.mark.parametrize("bad", ["loud", "", "basic2"])
    def test_unknown_name(self, bad: str) -> None:
        model, _ = small_model()
        with pytest.raises(ValueError, match=r"level must be one of 'off', 'basic'") as err:
            StepProbe(model, level=bad)
        assert not isinstance(err.value, TypeError)

    def test_one_conversion(self) -> None:
        """The session's level_of is the probes' (dependencies point down)."""
        assert options.level_of is level_of
        assert level_of("Advanced") is DebugLevel.ADVANCED
        with pytest.raises(ValueError, match=r"^mode must be one of"):
            level_of("x", "mode")

    @pytest.mark.parametrize("bad", [0, 1, True])
    def test_session_level_wrong_type(self, bad: object) -> None:
        """level=0 was BASIC (a falsy value taken for "not given"): now refused."""
        with pytest.raises(ArgumentTypeError, match=r"level must be a DebugLevel"):
            SessionOptions(level=bad)  # type: ignore[arg-type]

    def test_session_set_level(self) -> None:
        model, opt = small_model()
        with SyncSession(model, opt, **quiet(level="advanced")) as session:
            assert session.level is DebugLevel.ADVANCED
            session.set_level("Off")
            levels = [session.level]
            with pytest.raises(ArgumentTypeError, match=r"level must be"):
                session.set_level(3)  # type: ignore[arg-type]
            levels.append(session.level)
        assert levels == [DebugLevel.OFF, DebugLevel.OFF]


# -- deep nesting ----------------------------------------------------------------------------------


def _nested(depth: int, leaf: object) -> object:
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


class TestDeepNesting:
    def test_at_the_limit_checked(self) -> None:
        counts = non_finite_counts(_nested(MAX_NESTING, torch.tensor([math.nan])), name="out")
        assert counts.nan_count == 1

    @pytest.mark.parametrize("depth", [MAX_NESTING + 1, 5000])
    def test_deeper_refused(self, depth: int) -> None:
        with pytest.raises(ValueError, match=r"containers nested more than 100 deep \(at out\[0\]"):
            non_finite_counts(_nested(depth, 1.0), name="out")

    def test_mappings_count_too(self) -> None:
        value: object = {"x": 1.0}
        for _ in range(MAX_NESTING):
            value = {"x": value}
        with pytest.raises(ValueError, match=r"nested more than 100 deep"):
            non_finite_counts(value)

    def test_session_check_tensor(self) -> None:
        model, opt = small_model()
        with SyncSession(model, opt, **quiet()) as session:
            with pytest.raises(ValueError, match=r"nested more than 100 deep \(at deep\[0\]"):
                session.check_tensor(_nested(5000, torch.zeros(1)), "deep")
            assert session.check_tensor(_nested(50, torch.zeros(1)), "shallow")


# -- one session, two threads ----------------------------------------------------------------------

GUARD_S = 60.0
"""A bound on every wait below (never reached when the code is right)."""


class TestTwoThreads:
    def test_overlapping_calls_refused(self) -> None:
        """While one thread is inside training_step, another thread's step calls are refused;
        once it finished, the other thread may go on."""
        model, opt = small_model()
        inside, release = threading.Event(), threading.Event()

        def slow_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            inside.set()
            assert release.wait(GUARD_S)
            return nn.functional.mse_loss(out, target)

        errors: list[BaseException] = []
        sink = RecordingSink()
        with SyncSession(model, opt, **quiet(sinks=[sink])) as session:

            def first() -> None:
                try:
                    session.training_step(torch.randn(3, 4), torch.randn(3, 1), slow_loss, step=0)
                except BaseException as exc:  # reported by the assert below
                    errors.append(exc)

            thread = threading.Thread(target=first, name="first-loop")
            thread.start()
            try:
                assert inside.wait(GUARD_S)
                x, y = torch.randn(3, 4), torch.randn(3, 1)
                with pytest.raises(RuntimeError, match=r"training_step was called from thread"):
                    session.training_step(x, y, nn.functional.mse_loss, step=1)
                with pytest.raises(RuntimeError, match=r"check_step was called .* same session"):
                    session.check_step(1, loss=0.5)
                with pytest.raises(RuntimeError, match=r"step_completed was called"):
                    session.step_completed(1, loss=0.5)
            finally:
                release.set()
                thread.join(GUARD_S)
            assert not thread.is_alive() and not errors
            # the first thread finished: this one may use the session now
            session.training_step(torch.randn(3, 4), torch.randn(3, 1), nn.functional.mse_loss)
            session.check_step(2, loss=0.5)
            session.step_completed(2, loss=0.5)
            assert session.steps_completed == 3
        steps = [e.step for e in sink.events if isinstance(e, StepCompleted)]
        assert steps == [0, 1, 2]

    def test_same_thread_nesting_is_not_concurrency(self) -> None:
        """A call made inside a step on the same thread (a loss function that records a
        sub-step) is not refused as another thread's."""
        model, opt = small_model()
        with SyncSession(model, opt, **quiet()) as session:

            def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
                session.step_completed(100, loss=0.25)
                return nn.functional.mse_loss(out, target)

            session.training_step(torch.randn(3, 4), torch.randn(3, 1), loss_fn, step=0)
            assert session.steps_completed == 2


@pytest.mark.parametrize("bad", [-5, True, "3", 2**63])
def test_refused_step_is_not_the_sessions_step(bad: object) -> None:
    """A check_step refused for its step leaves the session's step as it was: the next
    auto-numbered training_step goes on from the last good one."""
    model, opt = small_model()
    with SyncSession(model, opt, **quiet()) as session:
        session.training_step(torch.randn(3, 4), torch.randn(3, 1), nn.functional.mse_loss)
        with pytest.raises((TypeError, ValueError), match=r"step must"):
            session.check_step(bad, loss=0.5)  # type: ignore[arg-type]
        assert session.step == 0
        result = session.training_step(torch.randn(3, 4), torch.randn(3, 1), nn.functional.mse_loss)
        assert result.step == 1


@pytest.mark.parametrize("name", ["flush_interval", "wake_interval"])
def test_rotating_file_sink_seconds_too_large_or_wrong_type(tmp_path: Path, name: str) -> None:
    """A log sink's seconds: an int too large for a float is a ValueError naming the argument
    (never a bare OverflowError from the writer later), a string an ArgumentTypeError."""
    from eventbus_debug.exceptions import ArgumentTypeError
    from eventbus_debug.sinks import RotatingFileSink

    too_large: dict[str, Any] = {name: 10**400}
    wrong_type: dict[str, Any] = {name: "1"}
    with pytest.raises(ValueError, match=f"{name} must be a finite number of seconds"):
        RotatingFileSink(tmp_path, **too_large)
    with pytest.raises(ArgumentTypeError, match=name):
        RotatingFileSink(tmp_path, **wrong_type)


def test_rotating_file_sink_directory_and_flags(tmp_path: Path) -> None:
    """An empty directory is a ValueError (not the current directory by accident, as
    ``Session(log_dir="")`` refuses it too), a non-path an ArgumentTypeError naming
    ``directory``, and ``compress``/``fsync`` take bools only."""
    from eventbus_debug.exceptions import ArgumentTypeError
    from eventbus_debug.sinks import RotatingFileSink

    with pytest.raises(ValueError, match="directory must not be empty"):
        RotatingFileSink("")
    not_a_path: Any = 5
    with pytest.raises(ArgumentTypeError, match="directory must be a str or a path"):
        RotatingFileSink(not_a_path)
    for flag in ("compress", "fsync"):
        knobs: dict[str, Any] = {flag: "yes"}
        with pytest.raises(ArgumentTypeError, match=f"{flag} must be a bool"):
            RotatingFileSink(tmp_path, **knobs)
    assert not list(tmp_path.iterdir())  # refused before anything was created
    sink = RotatingFileSink(tmp_path, compress=True, fsync=False)  # bools are fine
    assert sink.name == "rotating_file"
