"""The one home of argument rules: each check raises a clear error naming what was wrong.

A bool is never a number here (``True`` is not a capacity). Messages read
``"<name> must be ..., got <value!r>"`` so a user sees both the rule and their value.
"""

from __future__ import annotations

import math
from typing import Final, TypeGuard

from .typing import Publisher

__all__ = (
    "INT64_MAX",
    "fraction",
    "int64_count",
    "non_negative",
    "positive_int",
    "positive_number",
    "positive_seconds",
    "publisher",
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
        msg = f"{name} must be >= 0, got {value}"
    else:
        msg = f"{name} must fit in 64 bits (<= 2**63 - 1, as the log stores it), got {value}"
    raise ValueError(msg)


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _finite(name: str, value: object, *, strict: bool, rule: str) -> float:
    """*value* as a finite float above 0 (*strict*) or at least 0; else a ValueError with *rule*."""
    if not _is_number(value) or not math.isfinite(value) or (value <= 0 if strict else value < 0):
        msg = f"{name} must be {rule}, got {value!r}"
        raise ValueError(msg)
    return float(value)


def positive_int(name: str, value: object) -> int:
    """*value* as an int >= 1.

    Raises:
        ValueError: if *value* is not an int >= 1 (bools refused).
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        msg = f"{name} must be an int >= 1, got {value!r}"
        raise ValueError(msg)
    return value


def positive_number(name: str, value: object) -> float:
    """*value* as a finite float > 0.

    Raises:
        ValueError: if *value* is not a finite number > 0.
    """
    return _finite(name, value, strict=True, rule="a finite number > 0")


def positive_seconds(name: str, value: object) -> float:
    """*value* as a duration in seconds: a finite number > 0.

    Raises:
        ValueError: if *value* is not a finite number of seconds > 0.
    """
    return _finite(name, value, strict=True, rule="a finite number of seconds > 0")


def non_negative(name: str, value: object) -> float:
    """*value* as a finite float >= 0.

    Raises:
        ValueError: if *value* is not a finite number >= 0.
    """
    return _finite(name, value, strict=False, rule="a finite number >= 0")


def fraction(name: str, value: object, *, inclusive: bool = True) -> float:
    """*value* as a float in [0, 1] (``inclusive``) or in (0, 1).

    Raises:
        ValueError: if *value* is not a number in the range.
    """
    if not _is_number(value) or not (0.0 <= value <= 1.0 if inclusive else 0.0 < value < 1.0):
        bounds = "in [0, 1]" if inclusive else "in (0, 1)"
        msg = f"{name} must be a number {bounds}, got {value!r}"
        raise ValueError(msg)
    return float(value)


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
