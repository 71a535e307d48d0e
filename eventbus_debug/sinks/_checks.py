"""The argument checks of the sinks (the alert sink, its rules and handlers, the console, the log).

Sinks use only the library's public API, so these mirror its rules here: a value of the wrong
type (a string, a bool, None where a number goes) is an
:class:`~eventbus_debug.exceptions.ArgumentTypeError` (a ``TypeError`` that is also the
``ValueError`` earlier releases raised); a number out of range, an int too large for a float
(``10**400``) among them, is a ``ValueError``. Each message names the argument and its value.
"""

from __future__ import annotations

import math

from eventbus_debug.exceptions import ArgumentTypeError

__all__ = ("brief", "count", "seconds")


def brief(value: object) -> str:
    """``repr(value)`` for a message, at most 80 characters; an int of more than 64 bits by its
    size (its digits would not help)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an int of about {int(value.bit_length() * 0.30103) + 1} digits"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def seconds(
    name: str, value: object, *, rule: str, zero: bool = False, infinite: bool = False
) -> float:
    """*value* as a float number of seconds: > 0 (>= 0 with *zero*), finite unless *infinite*.

    Raises:
        ArgumentTypeError: if *value* is not an int or a float (bools refused).
        ValueError: if it is NaN, out of range, or an int too large for a float.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        msg = f"{name} must be {rule}, got {brief(value)}"
        raise ArgumentTypeError(msg)
    try:
        number = float(value)
    except OverflowError:  # 10**400: refused below
        number = math.nan
    if not (number >= 0.0 if zero else number > 0.0) or (
        not infinite and not math.isfinite(number)
    ):
        msg = f"{name} must be {rule}, got {brief(value)}"
        raise ValueError(msg)
    return number


def count(name: str, value: object, *, rule: str, minimum: int = 1) -> int:
    """*value* as an int >= *minimum*.

    Raises:
        ArgumentTypeError: if *value* is not an int (bools and floats refused).
        ValueError: if it is below *minimum*.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        msg = f"{name} must be {rule}, got {brief(value)}"
        raise ArgumentTypeError(msg)
    if value < minimum:
        msg = f"{name} must be {rule}, got {value!r}"
        raise ValueError(msg)
    return value
