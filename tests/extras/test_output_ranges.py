"""OutputChecker gives the same verdict to a value whatever form the model returns it in."""

from __future__ import annotations

import math
from decimal import Decimal
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
import torch

from eventbus_debug.events import OutputAnomalyDetected
from eventbus_debug.extras.validation import OutputChecker


def rules(events: tuple[OutputAnomalyDetected, ...]) -> list[str]:
    return [e.rule for e in events]


OUT_OF_RANGE: list[Any] = [
    3,
    3.0,
    np.float32(3.0),
    np.float64(3.0),
    Decimal("3"),
    Fraction(3, 1),
    [3.0],
    (0.5, 3.0),
    {"p": 3.0},
    {"p": [0.5, {"q": 3}]},
    np.array([3.0]),
    np.array(3.0),
    np.array([3, 0], dtype=np.int8),
    np.array([3, 0], dtype=np.uint64),
    np.array([3.0, 0.5], dtype=np.float16),
    np.array([3.0, 0.5], dtype=np.longdouble),
    torch.tensor(3.0),
    torch.tensor([3.0]),
    {"p": np.array([3.0])},
    [torch.tensor([0.5]), 3.0],
]
IN_RANGE: list[Any] = [
    0,
    1,
    0.5,
    True,
    np.float32(0.5),
    [0.5, 1.0],
    {"p": 0.5, "label": "cat", "extra": None},
    np.array([0.25, 0.75]),
    torch.tensor([0.25, 0.75]),
]


@pytest.mark.parametrize("value", OUT_OF_RANGE, ids=repr)
def test_out_of_range_in_every_form(value: Any) -> None:
    """3 is outside (0, 1) as a number, a numpy scalar or array, a tensor, or nested."""
    events = OutputChecker(expected_range=(0, 1), collapse_std=None).check(value)
    assert rules(events) == ["range"]
    (e,) = events
    assert e.max_value == 3.0 and e.min_value is not None and e.min_value <= 3.0
    assert "outside the expected [0, 1]" in e.message


@pytest.mark.parametrize("value", IN_RANGE, ids=repr)
def test_in_range_in_every_form(value: Any) -> None:
    """Values inside the range give no incident, whatever their form."""
    assert OutputChecker(expected_range=(0, 1), collapse_std=None).check(value) == ()


def test_below_the_range_too() -> None:
    """The low bound counts as much as the high one, for numbers and arrays alike."""
    checker = OutputChecker(expected_range=(0, 1), collapse_std=None)
    for value in (-1, [-1.0], np.array([-1.0]), torch.tensor([-1.0])):
        (e,) = checker.check(value)
        assert (e.rule, e.min_value) == ("range", -1.0)


def test_without_a_range_numbers_are_not_range_checked() -> None:
    """expected_range=None: any finite number passes."""
    assert OutputChecker(collapse_std=None).check([1e30, np.array([-1e30])]) == ()


def test_plain_numbers_make_one_incident_naming_their_paths() -> None:
    """The plain numbers of a structure are judged together: one range incident, its paths."""
    checker = OutputChecker(expected_range=(0, 1), name="out")
    (e,) = checker.check({"a": [0.5, 2.0], "b": 7, "c": 0.1})
    assert (e.name, e.rule, e.min_value, e.max_value) == ("out", "range", 0.1, 7.0)
    assert e.message.endswith("at out['a'][1], out['b']")
    (bare,) = checker.check(2.5)
    assert bare.message == "out span [2.5, 2.5], outside the expected [0, 1]"


def test_many_paths_are_cut() -> None:
    """A long list names its first paths and how many more."""
    (e,) = OutputChecker(expected_range=(0, 1)).check([5.0] * 20)
    assert e.message.endswith("outputs[7] (and 12 more)")


def test_non_finite_numbers_and_range_are_separate() -> None:
    """NaN among plain numbers is one non_finite incident; the finite ones are range-checked."""
    events = OutputChecker(expected_range=(0, 1)).check([math.nan, 3.0, 0.5, Decimal("sNaN")])
    assert rules(events) == ["non_finite", "range"]
    assert events[0].nonfinite_count == 2 and "outputs[0], outputs[3]" in events[0].message
    assert (events[1].min_value, events[1].max_value) == (0.5, 3.0)


def test_numpy_arrays_are_checked_like_tensors() -> None:
    """A numpy array gets the tensor's checks: non-finite count and collapse included."""
    checker = OutputChecker(expected_range=(0, 1))
    batch = [[0.2, 0.8]] * 5
    assert rules(checker.check(np.array(batch))) == rules(checker.check(torch.tensor(batch)))
    assert rules(checker.check(np.array(batch))) == ["collapsed"]
    (nan,) = checker.check({"x": np.array([math.nan, 0.5, 0.1])})
    assert (nan.rule, nan.name, nan.nonfinite_count) == ("non_finite", "outputs['x']", 1)
    complex_out = np.array([3j, 0.1], dtype=np.clongdouble)
    assert rules(checker.check(complex_out)) == rules(checker.check(torch.tensor([3j, 0.1])))


def test_huge_integers_are_finite_and_out_of_range() -> None:
    """An int beyond the float range is not NaN/Inf, and lies outside any finite range."""
    checker = OutputChecker(expected_range=(0, 1))
    assert rules(checker.check(10**400)) == ["range"]
    assert rules(checker.check([-(10**400), 0.5])) == ["range"]
    assert OutputChecker(expected_range=(0, math.inf)).check(10**400) == ()


def test_read_only_and_strided_arrays() -> None:
    """A read-only or reversed view is copied, not refused (and nothing warns)."""
    a = np.arange(6.0)[::-2] / 10
    a.setflags(write=False)
    assert OutputChecker(expected_range=(0, 1), collapse_std=None).check(a) == ()
    assert rules(OutputChecker(expected_range=(0, 0.3), collapse_std=None).check(a)) == ["range"]


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ("logits", TypeError),
        (np.array(["a"]), TypeError),
        ([object()], TypeError),
        (np.array(["2024-01-01"], dtype="datetime64[D]"), TypeError),
    ],
    ids=["str", "str-array", "object", "datetime-array"],
)
def test_unknown_outputs_are_refused(value: Any, error: type[Exception]) -> None:
    """Outputs holding no numbers are a TypeError naming the path, as before."""
    with pytest.raises(error, match="outputs"):
        OutputChecker(expected_range=(0, 1)).check(value)


def test_a_structure_that_contains_itself_is_refused() -> None:
    """A cycle is a ValueError, never an endless walk."""
    loop: list[Any] = [0.5]
    loop.append(loop)
    with pytest.raises(ValueError, match="contains itself"):
        OutputChecker(expected_range=(0, 1)).check(loop)
