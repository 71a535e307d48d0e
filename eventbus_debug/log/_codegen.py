"""The per-class generated encoders: one function per event class, written once with ``exec``.

Isolated here as attrs isolates its generator: the only ``exec`` of the log. The generated code
reads each field once, tests only the fields that can hold a float for NaN/±Inf (a cheap sum
stands in for an element-wise walk), and makes one ``orjson.dumps`` of a dict. Field names are
identifiers, so nothing but names from the event classes reaches the generated source.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import enum
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

import orjson

from ..events import Event

__all__ = ("make_encoder",)

_Check = Callable[[Any], bool]


def _has_nonfinite(value: Any) -> bool:
    if isinstance(value, float):
        return value - value != 0.0
    if isinstance(value, (tuple, list)):
        return any(_has_nonfinite(v) for v in value)
    if isinstance(value, Mapping):
        return any(_has_nonfinite(v) for v in value.values())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return any(_has_nonfinite(getattr(value, f.name)) for f in dataclasses.fields(value))
    return False


def _may_hold_float(tp: Any) -> bool:
    if tp is float or tp is Any or tp is object:
        return True
    origin = typing.get_origin(tp)
    if origin is not None:
        return any(_may_hold_float(a) for a in typing.get_args(tp) if a is not Ellipsis)
    if dataclasses.is_dataclass(tp):
        return any(_may_hold_float(t) for t in typing.get_type_hints(tp).values())
    return False


def _nonfinite_check(tp: Any) -> _Check | None:
    """A cheap test "may this value hold NaN/±Inf?" for a field of type *tp* (None: never).

    Sums stand in for element-wise checks: a sum of floats is non-finite when any term is (or
    when finite terms overflow, a false alarm that only costs the careful path). Anything the
    sum cannot handle falls back to the exact recursive walk.
    """
    if not _may_hold_float(tp):
        return None
    if tp is float:
        return _check_float
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        non_none = [a for a in args if a is not type(None)]
        if non_none == [float]:
            return _check_optional_float
    elif origin is tuple and len(args) == 2 and args[1] is Ellipsis and args[0] is float:
        return _check_float_sum
    elif origin in (dict, collections.abc.Mapping) and len(args) == 2 and args[1] is float:
        return _check_mapping_sum
    return _has_nonfinite


def _check_float(value: Any) -> bool:
    return bool(value - value != 0.0) if isinstance(value, float) else _has_nonfinite(value)


def _check_optional_float(value: Any) -> bool:
    return value is not None and _check_float(value)


def _check_float_sum(value: Any) -> bool:
    try:
        total = sum(value, 0.0)
    except TypeError:
        return _has_nonfinite(value)
    return bool(total - total != 0.0)


def _check_mapping_sum(value: Any) -> bool:
    try:
        total = sum(value.values(), 0.0)
    except (TypeError, AttributeError):
        return _has_nonfinite(value)
    return bool(total - total != 0.0)


def make_encoder(
    kind: str, fields: list[tuple[str, Any]], careful: Callable[[Event], bytes]
) -> Callable[[Event], bytes]:
    """Generate the encoder of one event class: read each field once, check, one dumps.

    *kind* is the class's ``kind``, *fields* its ``(name, type)`` pairs in order, and
    *careful* the slow encoder called when a field may hold a non-finite float.

    orjson serializes a dict faster than a slotted dataclass, and a generated function avoids
    a loop over field names per event. The generated code is, for ``StepCompleted``::

        def encode(ev):
            v0 = ev.seq; ...; v6 = ev.loss; ...
            if (v6 is not None and v6 - v6 != 0.0) or ...:
                return _careful(ev)
            return _dumps({"kind": "step_completed", "seq": v0, ...}, option=_OPT)
    """
    closure: dict[str, object] = {
        "_dumps": orjson.dumps,
        "_OPT": orjson.OPT_APPEND_NEWLINE,
        "_careful": careful,
        "_kind": kind,
    }
    reads: list[str] = []
    tests: list[str] = []
    items: list[str] = ['"kind": _kind']
    for i, (name, tp) in enumerate(fields):
        reads.append(f"    v{i} = ev.{name}")
        if isinstance(tp, type) and issubclass(tp, enum.Enum):
            # orjson reads an enum's value through Python-level descriptors: a dict is faster.
            closure[f"_values{i}"] = {member: member.value for member in tp}
            items.append(f"{name!r}: _values{i}.get(v{i}, v{i})")
        else:
            items.append(f"{name!r}: v{i}")
        check = _nonfinite_check(tp)
        if check is _check_float:
            tests.append(f"(v{i}.__class__ is float and v{i} - v{i} != 0.0)")
        elif check is _check_optional_float:
            tests.append(f"(v{i}.__class__ is float and v{i} - v{i} != 0.0)")
        elif check is not None:
            closure[f"_check{i}"] = check
            tests.append(f"_check{i}(v{i})")
    lines = [f"def __create__({', '.join(closure)}):", "  def encode(ev):"]
    lines += ["  " + r for r in reads]
    if tests:
        lines.append(f"      if {' or '.join(tests)}:")
        lines.append("          return _careful(ev)")
    lines.append(f"      return _dumps({{{', '.join(items)}}}, option=_OPT)")
    lines.append("  return encode")
    namespace: dict[str, Any] = {}
    exec("\n".join(lines), {}, namespace)  # field names (identifiers) only
    encode: Callable[[Event], bytes] = namespace["__create__"](**closure)
    return encode
