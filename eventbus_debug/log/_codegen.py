"""The per-class generated encoders: one function per event class, written once with ``exec``.

Isolated here as attrs isolates its generator: the only ``exec`` of the log. The generated code
reads each field once, tests only the fields that can hold a float for NaN/±Inf (a cheap sum
stands in for an element-wise walk) and every field against the guard of its type's rule
(:mod:`eventbus_debug.events._checks`: one identity test for a scalar), and makes one
``orjson.dumps`` of a dict. Either test sends the event to the careful encoder, which checks
every field and refuses an event the reader would refuse. Field names are identifiers and the
guards expressions over them, so nothing else reaches the generated source.

Two functions per class: ``encode(ev)`` for one event, and a run encoder for a log batch that
loops over consecutive events of the class inside the generated code (:func:`make_run_encoder`).
"""

from __future__ import annotations

import collections.abc
import dataclasses
import enum
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final

import orjson

from ..events import Event
from ..events._checks import field_rule

__all__ = ("RunEncoder", "make_encoder", "make_run_encoder")

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


@dataclasses.dataclass(frozen=True, slots=True)
class _Plan:
    """What both generated encoders of one class do: read, test, then the dict's values."""

    closure: dict[str, object]
    names: list[str]  # the field names, in order
    tests: list[str]  # any true: the careful encoder writes the event
    values: list[str]  # the dict value of field i once the tests passed


_EXACT_CLASS_GUARD: Final = "{v}.__class__ is not {p}t"


def _plan(kind: str, fields: list[tuple[str, Any]], careful: Callable[[Event], bytes]) -> _Plan:
    """The closure, tests and dict values of one class's encoders (see :func:`make_encoder`)."""
    closure: dict[str, object] = {
        "_dumps": orjson.dumps,
        "_OPT": orjson.OPT_APPEND_NEWLINE,
        "_careful": careful,
        "_kind": kind,
    }
    tests: list[str] = []
    values: list[str] = []
    for i, (_, tp) in enumerate(fields):
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
        if isinstance(tp, type) and issubclass(tp, enum.Enum):
            # orjson reads an enum's value through Python-level descriptors, and a dict keyed
            # by member calls Enum.__hash__ (Python code): once the guard has proved the exact
            # class, the member's own _value_ (what .value returns) is one attribute read.
            exact = rule is not None and rule.exact is tp and rule.guard == _EXACT_CLASS_GUARD
            if exact and all(member.value is member._value_ for member in tp):
                values.append(f"v{i}._value_")
            else:
                closure[f"_values{i}"] = {member: member.value for member in tp}
                values.append(f"_values{i}.get(v{i}, v{i})")
        else:
            values.append(f"v{i}")
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
    return _Plan(closure, [name for name, _ in fields], tests, values)


def _build(plan: _Plan, lines: list[str], extra: Mapping[str, object]) -> Any:
    closure = {**plan.closure, **extra}
    source = [f"def __create__({', '.join(closure)}):", *lines, "  return encode"]
    namespace: dict[str, Any] = {}
    exec("\n".join(source), {}, namespace)  # field names (identifiers) only
    return namespace["__create__"](**closure)


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
            v0 = ev.seq; ...; v5 = ev.severity; v6 = ev.loss; ...
            if v0.__class__ is not _c0_t or ... or (v6 is not None and
                    (v6.__class__ is not float or v6 - v6 != 0.0)) or ...:
                return _careful(ev)
            return _dumps({"kind": "step_completed", "seq": v0, ...,
                           "severity": v5._value_, ...}, option=_OPT)
    """
    plan = _plan(kind, fields, careful)
    lines = ["  def encode(ev):"]
    lines += [f"      v{i} = ev.{name}" for i, name in enumerate(plan.names)]
    if plan.tests:
        lines.append(f"      if {' or '.join(plan.tests)}:")
        lines.append("          return _careful(ev)")
    items = ['"kind": _kind'] + [
        f"{name!r}: {value}" for name, value in zip(plan.names, plan.values, strict=True)
    ]
    lines.append(f"      return _dumps({{{', '.join(items)}}}, option=_OPT)")
    encode: Callable[[Event], bytes] = _build(plan, lines, {})
    return encode


RunEncoder = Callable[[Event, Iterator[Event], Callable[[bytes], None]], Any]
"""``run(first, rest, append) -> next``: see :func:`make_run_encoder`."""


def make_run_encoder(
    cls: type[Event],
    fields: list[tuple[str, Any]],
    careful: Callable[[Event], bytes],
    end: object,
) -> RunEncoder:
    """Generate the batch encoder of *cls*: the lines of a run of consecutive *cls* events.

    ``run(first, rest, append)`` encodes *first* (an instance of exactly *cls*) and the
    events that follow it in the iterator *rest* while they are of exactly *cls*, passing
    each line (the bytes :func:`make_encoder`'s function returns) to *append*; it returns the
    first event of another class, or *end* when *rest* is exhausted.

    A log batch is long runs of a few classes (per-step records), so the per-event work is
    the loop's: no call, and one dict per run rather than per event, its values replaced in
    place (the keys keep their order, so the bytes are those of a fresh dict; measured at
    about a third less time per event than one encoder call each). The dict is local to the
    call: two threads may encode at once.
    """
    plan = _plan(cls.kind, fields, careful)
    template = ", ".join(['"kind": _kind'] + [f"{name!r}: None" for name in plan.names])
    body: list[str] = []
    for i, (name, value) in enumerate(zip(plan.names, plan.values, strict=True)):
        if value == f"v{i}":  # stored before the tests: the careful path ignores the dict
            body.append(f"d[{name!r}] = v{i} = ev.{name}")
        else:
            body.append(f"v{i} = ev.{name}")
    later = [
        f"d[{name!r}] = {value}"
        for i, (name, value) in enumerate(zip(plan.names, plan.values, strict=True))
        if value != f"v{i}"
    ]
    if plan.tests:
        body.append(f"if {' or '.join(plan.tests)}:")
        body.append("    append(_careful(ev))")
        body.append("else:")
        body += ["    " + line for line in later]
        body.append("    append(_dumps(d, option=_OPT))")
    else:
        body += later
        body.append("append(_dumps(d, option=_OPT))")
    lines = ["  def encode(ev, rest, append):", f"      d = {{{template}}}"]
    lines += ["      " + line for line in body]
    lines.append("      for ev in rest:")
    lines.append("          if ev.__class__ is not _cls:")
    lines.append("              return ev")
    lines += ["          " + line for line in body]
    lines.append("      return _end")
    run: RunEncoder = _build(plan, lines, {"_cls": cls, "_end": end})
    return run
