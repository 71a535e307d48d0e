"""The one home of argument rules: each check raises a clear error naming what was wrong.

A bool is never a number here (``True`` is not a capacity). Messages read
``"<name> must be ..., got <value!r>"`` so a user sees both the rule and their value (an int
too large for a float, ``10**400``, is named by its size, and refused as out of range). A value
of the wrong type (a string, None, a bool, a list where a number goes) is an
:class:`~eventbus_debug.exceptions.ArgumentTypeError`: a ``TypeError`` that is also the
``ValueError`` earlier releases raised; a number out of range is a ``ValueError``.
"""

from __future__ import annotations

import math
import numbers
import operator
import os
from typing import Final, TypeGuard

from .exceptions import ArgumentTypeError
from .typing import Publisher

__all__ = (
    "INT64_MAX",
    "brief",
    "fraction",
    "int64_count",
    "log_dir",
    "non_negative",
    "non_negative_int",
    "positive_int",
    "positive_number",
    "positive_seconds",
    "publisher",
    "real_number",
    "sample_count",
)


INT64_MAX: Final = 2**63 - 1
"""The largest step or count the events may hold: the log (orjson) and every reader of it
store integers in 64 bits, so a larger one could not be written."""


def int64_count(name: str, value: int) -> int:
    """*value* (an int: a step, a number of samples) if it is in ``[0, 2**63 - 1]``.

    Raises:
        ValueError: if *value* is negative, or too large for the log's 64-bit integers.
    """
    if 0 <= value <= INT64_MAX:
        return value
    if value < 0:
        msg = f"{name} must be >= 0, got {brief(value)}"
    else:
        msg = f"{name} must fit in 64 bits (<= 2**63 - 1, as the log stores it), got {brief(value)}"
    raise ValueError(msg)


def sample_count(samples: object) -> int:
    """*samples* (how many samples a step took) as an int >= 0.

    Raises:
        TypeError: if it is not an integer (a bool, a float).
        ValueError: if it is negative or too large for the log.
    """
    if isinstance(samples, bool | float) or not hasattr(samples, "__index__"):
        msg = (
            "samples must be an int (the step's number of samples), got "
            f"{type(samples).__qualname__} {samples!r}"
        )
        raise TypeError(msg)
    return int64_count("samples", operator.index(samples))


def brief(value: object) -> str:
    """``repr(value)`` for an error message, at most 80 characters; an int of more than 64
    bits by its size (``"an int of about 401 digits"``: its digits would not help)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an int of about {int(value.bit_length() * 0.30103) + 1} digits"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def real_number(name: str, value: object, *, expected: str = "a number") -> float:
    """*value*, a real number that may not be a float (an int, ``numpy.float32(0.5)``, a
    ``Fraction``), as a float.

    Raises:
        TypeError: if *value* is not a real number (a bool, a complex, a string, a list...);
            the message says *name* must be *expected*.
        ValueError: if *value* is too large for a float (``10**400``).
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        msg = f"{name} must be {expected}, got {type(value).__qualname__} {brief(value)}"
        raise TypeError(msg)
    try:
        return float(value)
    except OverflowError:
        msg = f"{name} must be a number a float can hold (|{name}| <= 1.8e308), got {brief(value)}"
        raise ValueError(msg) from None


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _refuse(name: str, value: object, rule: str, *, wrong_type: bool) -> ValueError:
    """The error for *value*: an ArgumentTypeError for a wrong type, else a ValueError."""
    msg = f"{name} must be {rule}, got {brief(value)}"
    return ArgumentTypeError(msg) if wrong_type else ValueError(msg)


def _finite(name: str, value: object, *, strict: bool, rule: str) -> float:
    """*value* as a finite float above 0 (*strict*) or at least 0; else an error with *rule*."""
    if value.__class__ is float:
        number: float = value
    elif _is_number(value):
        try:
            number = float(value)
        except OverflowError:  # an int beyond a float's range (10**400): not finite
            raise _refuse(name, value, rule, wrong_type=False) from None
    else:
        raise _refuse(name, value, rule, wrong_type=True)
    if not math.isfinite(number) or (number <= 0 if strict else number < 0):
        raise _refuse(name, value, rule, wrong_type=False)
    return number


def positive_int(name: str, value: object) -> int:
    """*value* as an int >= 1.

    Raises:
        ArgumentTypeError: if *value* is not an int (bools and floats refused).
        ValueError: if *value* is below 1.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise _refuse(name, value, "an int >= 1", wrong_type=True)
    if value < 1:
        raise _refuse(name, value, "an int >= 1", wrong_type=False)
    return value


def non_negative_int(name: str, value: object) -> int:
    """*value* as an int >= 0.

    Raises:
        ArgumentTypeError: if *value* is not an int (bools and floats refused).
        ValueError: if *value* is negative.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise _refuse(name, value, "an int >= 0", wrong_type=True)
    if value < 0:
        raise _refuse(name, value, "an int >= 0", wrong_type=False)
    return value


def positive_number(name: str, value: object) -> float:
    """*value* as a finite float > 0.

    Raises:
        ArgumentTypeError: if *value* is not a number (an int or a float; bools refused).
        ValueError: if *value* is not finite or not > 0.
    """
    return _finite(name, value, strict=True, rule="a finite number > 0")


def positive_seconds(name: str, value: object) -> float:
    """*value* as a duration in seconds: a finite number > 0.

    Raises:
        ArgumentTypeError: if *value* is not a number (an int or a float; bools refused).
        ValueError: if *value* is not finite or not > 0.
    """
    return _finite(name, value, strict=True, rule="a finite number of seconds > 0")


def non_negative(name: str, value: object) -> float:
    """*value* as a finite float >= 0.

    Raises:
        ArgumentTypeError: if *value* is not a number (an int or a float; bools refused).
        ValueError: if *value* is not finite or is negative.
    """
    return _finite(name, value, strict=False, rule="a finite number >= 0")


def fraction(name: str, value: object, *, inclusive: bool = True) -> float:
    """*value* as a float in [0, 1] (``inclusive``) or in (0, 1).

    Raises:
        ArgumentTypeError: if *value* is not a number (an int or a float; bools refused).
        ValueError: if *value* is outside the range (NaN included).
    """
    rule = "a number in [0, 1]" if inclusive else "a number in (0, 1)"
    if not _is_number(value):
        raise _refuse(name, value, rule, wrong_type=True)
    if not (0.0 <= value <= 1.0 if inclusive else 0.0 < value < 1.0):
        raise _refuse(name, value, rule, wrong_type=False)
    return float(value)


def flags_and_source(source: object, **flags: object) -> None:
    """Check a component's bool *flags* and its ``source`` str (the shared constructor rule).

    Raises:
        TypeError: naming the first argument of the wrong type.
    """
    for flag, value in flags.items():
        if not isinstance(value, bool):
            msg = f"{flag} must be a bool, got {type(value).__qualname__} {value!r}"
            raise TypeError(msg)
    if not isinstance(source, str):
        msg = f"source must be a str, got {type(source).__qualname__} {source!r}"
        raise TypeError(msg)


def log_dir(value: object) -> None:
    """Check a ``log_dir=`` argument: ``None`` (no log), or a path that is not empty.

    Raises:
        TypeError: if *value* is neither ``None`` nor a ``str``/``os.PathLike``.
        ValueError: if it is empty (an unset environment variable, most likely).
    """
    if value is None:
        return
    if not isinstance(value, str | os.PathLike):
        msg = f"log_dir must be a path (str or os.PathLike) or None, got {value!r}"
        raise TypeError(msg)
    if not os.fspath(value):
        msg = (
            "log_dir must not be empty (an unset variable?): pass None for no log, "
            "or '.' for the current directory"
        )
        raise ValueError(msg)


def publisher(name: str, value: object) -> Publisher | None:
    """*value* as a :class:`~eventbus_debug.typing.Publisher` (either bus, or a test double), or None.

    Raises:
        TypeError: if *value* is neither None nor has ``publish_nowait`` and
            ``publish_many_nowait``.
    """
    if value is None or isinstance(value, Publisher):
        return value
    msg = (
        f"{name} must be an EventBus, a SyncEventBus, another Publisher "
        f"(publish_nowait/publish_many_nowait) or None, got {value!r}"
    )
    raise TypeError(msg)
