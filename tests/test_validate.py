"""The argument rules: every bad value is refused with its name and the value in the message."""

from __future__ import annotations

import math

import pytest

from eventbus_debug import EventBus, SyncEventBus, _validate as v
from eventbus_debug.testing import RecordingSink


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "3", None])
def test_positive_int_refuses(value: object) -> None:
    """Zero, negatives, floats, bools, strings and None are not positive ints."""
    with pytest.raises(ValueError, match=r"capacity must be an int >= 1, got"):
        v.positive_int("capacity", value)


def test_positive_int_accepts() -> None:
    """A positive int comes back unchanged."""
    assert v.positive_int("capacity", 3) == 3


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (-1, r"step must be >= 0, got -1"),
        (2**63, r"step must fit in 64 bits .*got 9223372036854775808$"),
    ],
)
def test_int64_count_refuses(value: int, match: str) -> None:
    """Negative counts, and counts the log's 64-bit integers cannot hold, are refused."""
    with pytest.raises(ValueError, match=match):
        v.int64_count("step", value)


def test_int64_count_accepts() -> None:
    """0 and 2**63 - 1 come back unchanged."""
    assert [v.int64_count("step", n) for n in (0, 2**63 - 1)] == [0, 2**63 - 1]


@pytest.mark.parametrize("value", [0, -0.5, math.nan, math.inf, False, "1"])
def test_positive_numbers_refuse(value: object) -> None:
    """Numbers and durations must be finite and > 0; bools and strings are refused."""
    with pytest.raises(ValueError, match="x must be a finite number > 0"):
        v.positive_number("x", value)
    with pytest.raises(ValueError, match="timeout must be a finite number of seconds > 0"):
        v.positive_seconds("timeout", value)


def test_positive_numbers_accept() -> None:
    """Ints and floats come back as floats."""
    assert v.positive_number("x", 2) == 2.0
    assert v.positive_seconds("timeout", 0.25) == 0.25


@pytest.mark.parametrize("value", [-1e-9, math.nan, math.inf, True])
def test_non_negative_refuses(value: object) -> None:
    """Negative, non-finite and bool values are refused."""
    with pytest.raises(ValueError, match="n must be a finite number >= 0"):
        v.non_negative("n", value)


def test_non_negative_accepts_zero() -> None:
    """Zero is allowed."""
    assert v.non_negative("n", 0) == 0.0


def test_fraction_bounds() -> None:
    """[0, 1] inclusive by default; (0, 1) when exclusive; outside is refused."""
    assert v.fraction("p", 0) == 0.0 and v.fraction("p", 1) == 1.0
    assert v.fraction("p", 0.5, inclusive=False) == 0.5
    for bad in (1.01, -0.1, math.nan, True):
        with pytest.raises(ValueError, match=r"p must be a number in \[0, 1\]"):
            v.fraction("p", bad)
    with pytest.raises(ValueError, match=r"p must be a number in \(0, 1\)"):
        v.fraction("p", 1, inclusive=False)


async def test_publisher_accepts_either_bus_a_double_and_none() -> None:
    """Both buses, anything with the two ``_nowait`` methods, and None come back unchanged."""

    class Double:
        def publish_nowait(self, event: object, /) -> None:
            return None

        def publish_many_nowait(self, events: object, /) -> None:
            return None

    bus, sync_bus, double = EventBus(), SyncEventBus(), Double()
    for value in (bus, sync_bus, double, None):
        assert v.publisher("bus", value) is value
    with pytest.raises(TypeError, match=r"bus must be an EventBus, a SyncEventBus, .* got"):
        v.publisher("bus", RecordingSink())


@pytest.mark.parametrize("value", [object(), "bus", print])
def test_publisher_refuses_what_cannot_publish(value: object) -> None:
    """An object without publish_nowait/publish_many_nowait is a TypeError naming the argument."""
    with pytest.raises(TypeError, match="publish must be an EventBus"):
        v.publisher("publish", value)
