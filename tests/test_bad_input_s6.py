"""Bad input found by a new user's audit: each is refused where the docs say, naming the argument.

A negative float learning rate on ``step_completed``'s fast path, numpy real scalars as a loss,
``sinks=`` checked when the session is created, wrong types as ``ArgumentTypeError`` (a
``TypeError`` that is also the ``ValueError`` earlier releases raised), ``drain`` arguments,
detector thresholds, ``scale_learning_rate``'s factor, and the compat checks on meta models.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np
import pytest
import torch
from torch import nn

from eventbus_debug import (
    Cadence,
    EventBus,
    Session,
    SessionOptions,
    SyncEventBus,
    SyncSession,
    Thresholds,
    _validate as v,
)
from eventbus_debug.compat import (
    analyze_gradients,
    analyze_model_parameters,
    check_gradient_explosion,
    check_gradient_vanishing,
    check_gradients,
    check_model_parameters,
    monitor_training_step,
)
from eventbus_debug.events import Event, StepCompleted
from eventbus_debug.exceptions import ArgumentTypeError, EventBusError, SubscriptionError
from eventbus_debug.probes import LeakDetector, SystemSampler
from eventbus_debug.probes.memory.leaks import LeakThresholds
from eventbus_debug.probes.system import ResourceThresholds
from eventbus_debug.recovery import scale_learning_rate
from eventbus_debug.testing import RecordingSink
from tests._doubles import backward_once, quiet, small_model

# -- 1. step_completed's learning rate: the fast path refuses what the slow path refuses -----


NEGATIVE_RATES = [-0.1, -1e-300, -math.inf]


class TestLearningRate:
    @pytest.mark.parametrize("rate", NEGATIVE_RATES)
    async def test_negative_float_refused(self, rate: float) -> None:
        """A negative float (the fast path's type) is a ValueError naming learning_rate, and
        nothing is recorded."""
        model, opt = small_model()
        recorder = RecordingSink()
        async with Session(model, opt, **quiet(sinks=[recorder])) as session:
            with pytest.raises(ValueError, match=r"learning_rate must be >= 0, got -"):
                await session.step_completed(0, loss=1.0, learning_rate=rate)
            assert session.steps_completed == 0
        assert recorder.of_type(StepCompleted) == []

    @pytest.mark.parametrize("rate", NEGATIVE_RATES)
    def test_negative_float_refused_sync(self, rate: float) -> None:
        """SyncSession's blocking entry runs the same check."""
        model, opt = small_model()
        recorder = RecordingSink()
        with SyncSession(model, opt, **quiet(sinks=[recorder])) as session:
            with pytest.raises(ValueError, match=r"learning_rate must be >= 0, got -"):
                session.step_completed(0, loss=1.0, learning_rate=rate)
            with pytest.raises(ValueError, match=r"learning_rate must be >= 0"):
                session.step_completed(1, learning_rate=rate)  # no loss, no samples
            assert session.steps_completed == 0
        assert recorder.of_type(StepCompleted) == []

    async def test_nan_infinity_and_zero_kept(self) -> None:
        """As documented: NaN and Infinity are facts worth logging, and 0 (or -0.0) is a rate."""
        model, opt = small_model()
        recorder = RecordingSink()
        async with Session(model, opt, **quiet(sinks=[recorder])) as session:
            for step, rate in enumerate((math.nan, math.inf, 0.0, -0.0, 0.1)):
                await session.step_completed(step, loss=1.0, learning_rate=rate)
        rates = [e.learning_rate for e in recorder.of_type(StepCompleted)]
        assert rates[0] is not None and math.isnan(rates[0])
        assert rates[1:] == [math.inf, 0.0, 0.0, 0.1]


# -- 2. numpy real scalars are real numbers ------------------------------------------------------

NUMPY_LOSSES = [
    np.float32(0.5),
    np.float16(0.5),
    np.int64(1),
    np.int32(2),
    np.float64(0.5),
    np.array(0.5),  # a 0-d array: its one value, as for a one-element tensor
]


class TestNumpyLoss:
    @pytest.mark.parametrize("loss", NUMPY_LOSSES, ids=lambda x: type(x).__name__)
    async def test_check_step_and_step_completed_accept(self, loss: Any) -> None:
        """check_step judges a numpy scalar loss; step_completed records it as a float."""
        model, opt = small_model()
        recorder = RecordingSink()
        async with Session(model, opt, **quiet(sinks=[recorder])) as session:
            backward_once(model)
            verdict = await session.check_step(0, loss=loss)
            assert verdict.should_step and verdict.finite
            rate: Any = np.float32(0.25)
            await session.step_completed(0, loss=loss, learning_rate=rate)
        (event,) = recorder.of_type(StepCompleted)
        assert type(event.loss) is float and event.loss == float(loss)
        assert type(event.learning_rate) is float and event.learning_rate == 0.25

    @pytest.mark.parametrize("loss", NUMPY_LOSSES, ids=lambda x: type(x).__name__)
    def test_sync_session_accepts(self, loss: Any) -> None:
        model, opt = small_model()
        recorder = RecordingSink()
        with SyncSession(model, opt, **quiet(sinks=[recorder])) as session:
            backward_once(model)
            assert session.check_step(0, loss=loss).should_step
            session.step_completed(0, loss=loss)
        (event,) = recorder.of_type(StepCompleted)
        assert type(event.loss) is float and event.loss == float(loss)

    def test_numpy_nan_loss_is_not_finite(self) -> None:
        """A NaN numpy loss is judged like a NaN float: not finite, the step is skipped."""
        model, opt = small_model()
        with SyncSession(model, opt, **quiet(recovery=False)) as session:
            backward_once(model)
            nan: Any = np.float32("nan")
            verdict = session.check_step(0, loss=nan)
            assert not verdict.finite and not verdict.should_step

    @pytest.mark.parametrize(
        "loss",
        [np.bool_(True), np.complex64(1 + 1j), np.array([0.5, 1.0]), "0.5", True],
        ids=["np.bool_", "np.complex64", "ndarray", "str", "bool"],
    )
    async def test_non_real_refused(self, loss: Any) -> None:
        """Bools, complex numbers, arrays of several values and strings stay a TypeError
        naming the loss."""
        model, opt = small_model()
        async with Session(model, opt, **quiet()) as session:
            backward_once(model)
            with pytest.raises(TypeError, match=r"loss must be"):
                await session.check_step(0, loss=loss)
            with pytest.raises(TypeError, match=r"loss must be"):
                await session.step_completed(0, loss=loss)
            assert session.steps_completed == 0


# -- 3. sinks= is checked when the session is created --------------------------------------------


class _SyncHandle:
    def handle(self, event: Event) -> None:
        pass


class _AsyncHandle:
    async def handle(self, event: Event) -> None:
        pass


def _blocking(event: Event) -> None:
    pass


async def _handler(event: Event) -> None:
    pass


SESSION_KINDS: list[Callable[..., object]] = [Session, SyncSession, SessionOptions]


class TestSinksOption:
    @pytest.mark.parametrize("make", SESSION_KINDS, ids=lambda c: c.__name__)
    @pytest.mark.parametrize(
        ("sinks", "match"),
        [
            ([42], r"sinks\[0\]: 42 is not a sink"),
            (
                [_handler, _SyncHandle()],
                r"sinks\[1\]: sink '_SyncHandle': handle must be an `async",
            ),
            ([_AsyncHandle], r"sinks\[0\]: sink '_AsyncHandle' is a class"),
            ([_blocking], r"sinks\[0\]: .*is not an async function"),
        ],
    )
    def test_bad_sink_refused_at_construction(
        self, make: Callable[..., object], sinks: list[Any], match: str
    ) -> None:
        """A SubscriptionError (a TypeError) naming sinks[i], before anything starts."""
        model, opt = small_model()
        args = () if make is SessionOptions else (model, opt)
        with pytest.raises(SubscriptionError, match=match) as info:
            make(*args, **quiet(sinks=sinks))
        assert isinstance(info.value, TypeError)

    @pytest.mark.parametrize("sinks", [_AsyncHandle(), "ab", None, 3])
    def test_not_a_sequence_refused(self, sinks: Any) -> None:
        """One sink instead of a list (or a string, None, a number): a TypeError naming sinks."""
        with pytest.raises(TypeError, match=r"sinks must be a sequence of sinks"):
            SessionOptions(**quiet(sinks=sinks))

    @pytest.mark.parametrize("knob", ["report", "alerts", "console"])
    def test_bad_sink_object_knobs_refused(self, knob: str) -> None:
        """report=, alerts= and console= given a sink whose handle is blocking: named now."""
        with pytest.raises(SubscriptionError, match=rf"^{knob}: sink '_SyncHandle': handle"):
            SessionOptions(**{**quiet(), knob: _SyncHandle()})

    def test_good_sinks_accepted(self) -> None:
        """Async functions, sink objects, tuples and generators pass; kept as a tuple."""
        recorder, other = RecordingSink(), _AsyncHandle()
        options = SessionOptions(**quiet(sinks=(s for s in (recorder, _handler, other))))
        assert options.sinks == (recorder, _handler, other)


# -- 4. a wrong type is an ArgumentTypeError (TypeError and ValueError) -------------------------


def test_argument_type_error_is_both() -> None:
    """Code catching TypeError, ValueError or EventBusError catches it."""
    assert issubclass(ArgumentTypeError, TypeError)
    assert issubclass(ArgumentTypeError, ValueError)
    assert issubclass(ArgumentTypeError, EventBusError)


HELPERS: list[tuple[Callable[[str, object], object], str]] = [
    (v.positive_int, "an int >= 1"),
    (v.positive_number, "a finite number > 0"),
    (v.positive_seconds, "a finite number of seconds > 0"),
    (v.non_negative, "a finite number >= 0"),
    (v.fraction, "a number in [0, 1]"),
]


@pytest.mark.parametrize(("helper", "rule"), HELPERS, ids=lambda x: getattr(x, "__name__", ""))
@pytest.mark.parametrize("value", ["1", None, True, [1], b"1", 1j])
def test_helpers_wrong_type(
    helper: Callable[[str, object], object], rule: str, value: object
) -> None:
    """Not a number: an ArgumentTypeError with the argument's name, the rule and the value."""
    with pytest.raises(ArgumentTypeError) as info:
        helper("arg", value)
    assert str(info.value) == f"arg must be {rule}, got {value!r}"


@pytest.mark.parametrize(("helper", "rule"), HELPERS, ids=lambda x: getattr(x, "__name__", ""))
@pytest.mark.parametrize("value", [-1, -0.5, math.nan, -math.inf])
def test_helpers_wrong_value(
    helper: Callable[[str, object], object], rule: str, value: object
) -> None:
    """A number out of range stays a plain ValueError (not a TypeError); for positive_int a
    float is the wrong type."""
    wrong_type = helper is v.positive_int and isinstance(value, float)
    with pytest.raises(ValueError, match=rf"^arg must be {re.escape(rule)}, got") as info:
        helper("arg", value)
    assert isinstance(info.value, TypeError) is wrong_type


def _session(**knobs: Any) -> Session:
    return Session(nn.Linear(2, 1), **quiet(**knobs))


def _sync_session(**knobs: Any) -> SyncSession:
    return SyncSession(nn.Linear(2, 1), **quiet(**knobs))


def _scale(**knobs: Any) -> str:
    return scale_learning_rate(small_model()[1], **knobs)


# (what is built, with which keywords, the argument the message starts with)
WRONG_TYPES: list[tuple[Callable[..., object], dict[str, Any], str]] = [
    (Thresholds, {"explosion": "big"}, "explosion"),
    (Thresholds, {"spike_window": None}, "spike_window"),
    (Cadence, {"grad_every": "1"}, "grad_every"),
    (EventBus, {"close_timeout": "1"}, "close_timeout"),
    (EventBus, {"capacity": [8]}, "capacity"),
    (SyncEventBus, {"max_pending": "1"}, "max_pending"),
    (LeakDetector, {"every": "10"}, "every"),
    (LeakThresholds, {"window": 5.0}, "window"),
    (LeakThresholds, {"rss_bytes": "64M"}, "rss_bytes"),
    (SystemSampler, {"interval": "10"}, "interval"),
    (ResourceThresholds, {"cpu_percent": "95"}, "cpu_percent"),
    (ResourceThresholds, {"hysteresis": None}, "hysteresis"),
    (ResourceThresholds, {"sustain": 2.0}, "sustain"),
    (_session, {"system_interval": "10"}, "system_interval"),
    (_session, {"close_timeout": "1"}, "close_timeout"),
    (_sync_session, {"overhead_budget": "2%"}, "overhead_budget"),
    (_scale, {"factor": "0.5"}, "factor"),
]


def _id(case: tuple[Callable[..., object], dict[str, Any], str]) -> str:
    make, kwargs, _ = case
    return f"{make.__name__.strip('_')}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})"


@pytest.mark.parametrize(("make", "kwargs", "name"), WRONG_TYPES, ids=map(_id, WRONG_TYPES))
def test_wrong_type_is_argument_type_error(
    make: Callable[..., object], kwargs: dict[str, Any], name: str
) -> None:
    """Each constructor the audit named: a wrong type is a TypeError (and, as before, a
    ValueError) whose message starts with the argument's name."""
    with pytest.raises(ArgumentTypeError, match=rf"^{name} must be"):
        make(**kwargs)


WRONG_VALUES: list[tuple[Callable[..., object], dict[str, Any], str]] = [
    (_session, {"system_interval": -1}, "system_interval"),
    (SystemSampler, {"interval": 0}, "interval"),
    (ResourceThresholds, {"memory_percent": -5}, "memory_percent"),
    (ResourceThresholds, {"disk_percent": math.nan}, "disk_percent"),
    (ResourceThresholds, {"sustain": 0}, "sustain"),
    (LeakThresholds, {"graph_tensors": math.nan}, "graph_tensors"),
    (LeakThresholds, {"live_tensors": -1}, "live_tensors"),
    (LeakThresholds, {"window": 2}, "window"),
]


@pytest.mark.parametrize(("make", "kwargs", "name"), WRONG_VALUES, ids=map(_id, WRONG_VALUES))
def test_wrong_value_is_value_error(
    make: Callable[..., object], kwargs: dict[str, Any], name: str
) -> None:
    """A value of the right type out of range: a plain ValueError naming the argument."""
    with pytest.raises(ValueError, match=rf"^{name} must be") as info:
        make(**kwargs)
    assert not isinstance(info.value, TypeError)


def test_thresholds_still_accept_their_values() -> None:
    """None disables a resource threshold; an infinite minimum growth never flags a leak."""
    assert ResourceThresholds(memory_percent=None, cpu_percent=95, sustain=1).cpu_percent == 95
    never: Any = math.inf
    assert LeakThresholds(rss_bytes=never, live_tensors=0).rss_bytes == math.inf


# -- 5. drain's subscriptions and the detectors' thresholds --------------------------------------


class TestDrainArguments:
    async def test_not_a_subscription(self) -> None:
        """A name or a sink instead of the Subscription: a TypeError naming the argument."""
        async with EventBus() as bus:
            bus.subscribe(_handler)
            for bad in ("x", _handler, None):
                with pytest.raises(TypeError, match=r"drain\(\)'s subscriptions must be Sub"):
                    await bus.drain(bad)  # type: ignore[arg-type]

    async def test_another_bus_subscription(self) -> None:
        """Another bus's subscription would be waited for against this bus's count: refused."""
        async with EventBus() as bus, EventBus() as other:
            mine = bus.subscribe(_handler, name="mine")
            theirs = other.subscribe(_handler, name="theirs")
            with pytest.raises(ValueError, match=r"subscription 'theirs' of another bus"):
                await bus.drain(mine, theirs)
            with anyio.fail_after(5):
                await bus.drain(mine)  # its own still drains

    def test_sync_bus(self) -> None:
        """SyncEventBus.drain checks on the caller's thread, before crossing to the bus's."""
        with SyncEventBus() as bus, SyncEventBus() as other:
            mine = bus.subscribe(_handler)
            theirs = other.subscribe(_handler, name="theirs")
            with pytest.raises(TypeError, match=r"subscriptions must be Subscriptions"):
                bus.drain("x")  # type: ignore[arg-type]
            with pytest.raises(ValueError, match=r"'theirs' of another bus"):
                bus.drain(theirs)
            bus.drain(mine, timeout=5)


@pytest.mark.parametrize("bad", ["x", 0, ResourceThresholds()])
def test_leak_detector_thresholds_type(bad: object) -> None:
    """Not a LeakThresholds (a falsy 0 included): a TypeError naming thresholds."""
    with pytest.raises(TypeError, match=r"thresholds must be a LeakThresholds or None"):
        LeakDetector(thresholds=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["x", 0, LeakThresholds()])
def test_system_sampler_thresholds_type(bad: object) -> None:
    """Not a ResourceThresholds: a TypeError naming thresholds, at construction."""
    with pytest.raises(TypeError, match=r"thresholds must be a ResourceThresholds or None"):
        SystemSampler(thresholds=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("knob", ["sample", "step"])
def test_system_sampler_callables(knob: str) -> None:
    """sample= and step= must be callables: named at construction, not in the sampler's task."""
    with pytest.raises(TypeError, match=rf"{knob} must be a callable or None, got 'x'"):
        bad: dict[str, Any] = {knob: "x"}
        SystemSampler(**bad)


# -- 6. scale_learning_rate's factor -------------------------------------------------------------


@pytest.mark.parametrize("factor", [0, 0.0, -1.0, math.nan, math.inf, -math.inf])
def test_scale_learning_rate_refuses_bad_factors(factor: float) -> None:
    """As ScaleLR: a finite factor > 0, else a ValueError naming factor; nothing is written."""
    _, opt = small_model()
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    with pytest.raises(ValueError, match=r"factor must be a finite number > 0"):
        scale_learning_rate(opt, factor, [scheduler])
    assert opt.param_groups[0]["lr"] == 0.05 and scheduler.base_lrs == [0.05]


def test_scale_learning_rate_still_scales() -> None:
    _, opt = small_model()
    assert scale_learning_rate(opt, 0.5).startswith("lr x0.5: 0.05 -> 0.025")
    assert opt.param_groups[0]["lr"] == 0.025


# -- 7. the compat checks refuse a meta model, gradients or not ---------------------------------

COMPAT_CHECKS: list[Callable[[nn.Module], object]] = [
    check_gradients,
    check_model_parameters,
    check_gradient_explosion,
    check_gradient_vanishing,
    analyze_gradients,
    analyze_model_parameters,
    lambda m: monitor_training_step(m, 1.0, 0),
]


@pytest.mark.parametrize("check", COMPAT_CHECKS, ids=lambda c: c.__name__)
def test_compat_checks_refuse_meta_models(check: Callable[[nn.Module], object]) -> None:
    """A meta model has no gradients: an empty report would read as "all fine"."""
    with torch.device("meta"):
        model = nn.Linear(4, 2)
    with pytest.raises(ValueError, match=r"parameter 'weight' is on the meta device"):
        check(model)


@pytest.mark.parametrize("check", COMPAT_CHECKS, ids=lambda c: c.__name__)
def test_compat_checks_refuse_a_partly_meta_model(check: Callable[[nn.Module], object]) -> None:
    """One meta layer among real ones (with gradients) is named too."""
    model = nn.Sequential(nn.Linear(4, 4))
    _backward_real = model(torch.randn(2, 4)).sum()
    _backward_real.backward()
    with torch.device("meta"):
        model.append(nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"parameter '1\.weight' is on the meta device"):
        check(model)
