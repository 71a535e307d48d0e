"""The per-class generated encoders: one function per event class, written once with ``exec``.

Isolated here as attrs isolates its generator: the only ``exec`` of the log. The generated code
reads each field once, tests only the fields that can hold a float for NaN/±Inf (a cheap sum
stands in for an element-wise walk) and every field against the guard of its type's rule
(:mod:`eventbus_debug.events._checks`: one identity test for a scalar), and makes one
``orjson.dumps`` of a dict. Either test sends the event to the careful encoder, which checks
every field and refuses an event the reader would refuse. Field names are identifiers and the
guards expressions over them, so nothing else reaches the generated source.
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
from ..events._checks import field_rule

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


_FLOAT_ONLY = frozenset({float})


def _check_float_map(value: Any) -> bool:
    """A ``Mapping[str, float]`` field, in one pass over the values: anything but a dict of
    exact floats (the careful encoder then checks it) or a non-finite value. Keys need no
    test here: orjson refuses any key but a str."""
    if value.__class__ is not dict:
        return True
    if not value:
        return False
    values = value.values()
    if not _FLOAT_ONLY.issuperset(map(type, values)):
        return True
    total = sum(values, 0.0)
    return bool(total - total != 0.0)


def _check_float_tuple(value: Any) -> bool:
    """A ``tuple[float, ...]`` field, as :func:`_check_float_map`."""
    if value.__class__ is not tuple:
        return True
    if not value:
        return False
    if not _FLOAT_ONLY.issuperset(map(type, value)):
        return True
    total = sum(value, 0.0)
    return bool(total - total != 0.0)


def make_encoder(
    kind: str, fields: list[tuple[str, Any]], careful: Callable[[Event], bytes]
) -> Callable[[Event], bytes]:
    """Generate the encoder of one event class: read each field once, check, one dumps.

    *kind* is the class's ``kind``, *fields* its ``(name, type)`` pairs in order, and
    *careful* the slow encoder called when a field may hold a non-finite float or a value
    its type does not allow (it checks every field and raises ``TypeError`` naming one).

    orjson serializes a dict faster than a slotted dataclass, and a generated function avoids
    a loop over field names per event. The generated code is, for ``StepCompleted``::

        def encode(ev):
            v0 = ev.seq; ...; v6 = ev.loss; ...
            if v0.__class__ is not _c0_t or ... or (v6 is not None and
                    (v6.__class__ is not float or v6 - v6 != 0.0)) or ...:
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
        rule = field_rule(tp)
        guard = ""
        if rule is not None and rule.guard != "True":
            prefix = f"_c{i}_"
            for key, obj in rule.names.items():
                closure[prefix + key] = obj
            guard = rule.guard.format(v=f"v{i}", p=prefix)
        elif rule is not None:
            guard = "True"  # no cheap test: the careful encoder checks this class's events
        # The type test and the NaN/Inf test in one, for the float-holding types of the
        # per-step records; any other field: its rule's guard, then the NaN/Inf test.
        if check is _check_float:
            tests.append(f"(v{i}.__class__ is not float or v{i} - v{i} != 0.0)")
        elif check is _check_optional_float:
            tests.append(
                f"(v{i} is not None and (v{i}.__class__ is not float or v{i} - v{i} != 0.0))"
            )
        elif check is _check_mapping_sum and typing.get_args(tp)[0] is str:
            closure[f"_check{i}"] = _check_float_map
            tests.append(f"_check{i}(v{i})")
        elif check is _check_float_sum:
            closure[f"_check{i}"] = _check_float_tuple
            tests.append(f"_check{i}(v{i})")
        else:
            if guard:
                tests.append(f"({guard})")
            if check is not None:
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
