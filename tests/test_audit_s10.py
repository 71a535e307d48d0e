"""The sinks' own knobs: a wrong type is an ArgumentTypeError, a wrong value a ValueError.

Every number-valued argument of the public sinks (``eventbus_debug.sinks`` and the debug
server) is swept with strings, floats where an int goes, bools, None and other non-numbers;
each error names the argument.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from eventbus_debug.events import StepCompleted
from eventbus_debug.exceptions import ArgumentTypeError
from eventbus_debug.sinks import (
    AlertRule,
    AlertSink,
    ConsoleSink,
    ReportWriter,
    RotatingFileSink,
    RunAggregator,
)
from eventbus_debug.sinks.http import DebugServer

Make = Callable[[Path, dict[str, Any]], object]


class _Publisher:
    def publish_nowait(self, event: object, /) -> None:
        pass

    def publish_many_nowait(self, events: object, /) -> None:
        pass


class _WandbRun:
    """Enough of a wandb run for the constructor (its checks come before any call)."""

    def define_metric(self, *args: Any, **kwargs: Any) -> None:
        pass


def _tensorboard(tmp_path: Path, knobs: dict[str, Any]) -> object:
    from eventbus_debug.sinks.tensorboard import TensorBoardSink

    return TensorBoardSink(tmp_path, **knobs)


def _wandb(tmp_path: Path, knobs: dict[str, Any]) -> object:
    pytest.importorskip("wandb")
    from eventbus_debug.sinks.wandb import WandbSink

    return WandbSink(_WandbRun(), **knobs)


MAKERS: dict[str, Make] = {
    "ReportWriter": lambda d, k: ReportWriter(d, **k),
    "RunAggregator": lambda d, k: RunAggregator(**k),
    "DebugServer": lambda d, k: DebugServer(**k),
    "RotatingFileSink": lambda d, k: RotatingFileSink(d, **k),
    "ConsoleSink": lambda d, k: ConsoleSink(**k),
    "AlertSink": lambda d, k: AlertSink(_Publisher(), **k),
    "AlertRule": lambda d, k: AlertRule(event_types=(StepCompleted,), **k),
    "TensorBoardSink": _tensorboard,
    "WandbSink": _wandb,
}

INT_KNOBS = [
    ("ReportWriter", "max_points"),
    ("ReportWriter", "max_incidents"),
    ("RunAggregator", "max_points"),
    ("RunAggregator", "max_incidents"),
    ("RunAggregator", "max_markers"),
    ("RunAggregator", "max_layers"),
    ("RunAggregator", "layer_points"),
    ("DebugServer", "ring_size"),
    ("DebugServer", "port"),
    ("RotatingFileSink", "max_bytes"),
    ("RotatingFileSink", "backup_count"),
    ("RotatingFileSink", "buffer_size"),
    ("RotatingFileSink", "queue_capacity"),
    ("RotatingFileSink", "max_pending_bytes"),
    ("RotatingFileSink", "high_water"),
    ("RotatingFileSink", "rank"),
    ("ConsoleSink", "step_every"),
    ("AlertRule", "rate_limit"),
]
SECONDS_KNOBS = [
    ("ReportWriter", "interval"),
    ("RotatingFileSink", "wake_interval"),
    ("RotatingFileSink", "flush_interval"),
    ("AlertSink", "timeout"),
    ("AlertSink", "flush_interval"),
    ("AlertRule", "cooldown"),
    ("AlertRule", "rate_window"),
    ("TensorBoardSink", "flush_secs"),
    ("WandbSink", "alert_cooldown"),
]
NONE_ALLOWED = {
    ("ReportWriter", "interval"),
    ("AlertSink", "flush_interval"),
    ("AlertRule", "rate_limit"),
    ("RotatingFileSink", "rank"),
}
NOT_NUMBERS: list[object] = ["5", b"5", True, False, None, [5], 5 + 0j]


def _wrong_types() -> list[Any]:
    cases = []
    for kind, knobs in (("int", INT_KNOBS), ("seconds", SECONDS_KNOBS)):
        values = [*NOT_NUMBERS, 1.5, 2.0] if kind == "int" else NOT_NUMBERS
        for sink, knob in knobs:
            for value in values:
                if value is None and (sink, knob) in NONE_ALLOWED:
                    continue
                cases.append(pytest.param(sink, knob, value, id=f"{sink}-{knob}-{value!r}"))
    return cases


@pytest.mark.parametrize(("sink", "knob", "value"), _wrong_types())
def test_a_wrong_type_is_an_argument_type_error(
    tmp_path: Path, sink: str, knob: str, value: object
) -> None:
    """A string, bytes, bool, None, list, complex (or a float for an int) where a number
    goes: an ArgumentTypeError (a TypeError and a ValueError) naming the argument."""
    with pytest.raises(ArgumentTypeError, match=rf"^{knob} must be"):
        MAKERS[sink](tmp_path, {knob: value})


def _wrong_values() -> list[Any]:
    cases = []
    for sink, knob in INT_KNOBS:
        low = 0 if knob not in {"max_bytes", "backup_count", "rank", "port"} else -1
        cases.append(pytest.param(sink, knob, low, id=f"{sink}-{knob}-{low}"))
    for sink, knob in SECONDS_KNOBS:
        for value in (-1.0, math.nan, 10**400):
            cases.append(pytest.param(sink, knob, value, id=f"{sink}-{knob}-{value!r:.8}"))
    return cases


@pytest.mark.parametrize(("sink", "knob", "value"), _wrong_values())
def test_a_wrong_value_stays_a_value_error(
    tmp_path: Path, sink: str, knob: str, value: object
) -> None:
    """A number out of range (NaN and an int beyond a float's range included) is a plain
    ValueError naming the argument, never an ArgumentTypeError nor an OverflowError."""
    with pytest.raises(ValueError, match=rf"^{knob} must be") as info:
        MAKERS[sink](tmp_path, {knob: value})
    assert not isinstance(info.value, ArgumentTypeError)


def test_the_reported_cases(tmp_path: Path) -> None:
    """The cases of the bug report, one by one."""
    with pytest.raises(ArgumentTypeError, match=r"^interval must be"):
        ReportWriter(tmp_path, interval="30")  # type: ignore[arg-type]
    with pytest.raises(ArgumentTypeError, match=r"^max_points must be"):
        ReportWriter(tmp_path, max_points="5")  # type: ignore[arg-type]
    with pytest.raises(ArgumentTypeError, match=r"^max_incidents must be"):
        ReportWriter(tmp_path, max_incidents=1.5)  # type: ignore[arg-type]
    with pytest.raises(ArgumentTypeError, match=r"^ring_size must be"):
        DebugServer(ring_size="5")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^max_points must be an integer >= 2, got 1"):
        ReportWriter(tmp_path, max_points=1)


def test_debug_server_host_lists_hold_strings() -> None:
    """allowed_hosts/allowed_origins: a non-string entry or None is a wrong type, an empty
    name a wrong value."""
    with pytest.raises(ArgumentTypeError, match=r"^allowed_hosts must hold non-empty strings"):
        DebugServer(allowed_hosts=[5])  # type: ignore[list-item]
    with pytest.raises(ArgumentTypeError, match=r"^allowed_origins must be a sequence"):
        DebugServer(allowed_origins=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^allowed_hosts must hold non-empty strings") as info:
        DebugServer(allowed_hosts=[" "])
    assert not isinstance(info.value, ArgumentTypeError)


def test_valid_values_still_work(tmp_path: Path) -> None:
    """The checks keep what was accepted: ints as floats, math.inf where it means never."""
    assert ReportWriter(tmp_path, interval=None, max_points=2, max_incidents=2).writes == 0
    ReportWriter(tmp_path, interval=math.inf)
    ReportWriter(tmp_path, interval=1)
    assert DebugServer(ring_size=1, port=0).port == 0
    _wandb(tmp_path, {"alert_cooldown": 0})
