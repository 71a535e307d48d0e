"""What each event field may hold: the rule the constructor checks and the log writer keeps.

Every event can be written to the log and read back (the log is the canonical record; reports
are rebuilt from it), and the reader checks each field against its declared type. These rules
check the same thing on the object side:

- building an event with a wrong-typed field raises a :class:`TypeError` naming the field
  (``StepCompleted.loss must be a float or None, got str '0.5'``), so a bad value is refused
  where it is made, not when a report is rebuilt;
- the log writer checks again, as a backstop, and counts an event it could not write readably
  (mutated after construction, or built by :func:`~eventbus_debug.events._base.unchecked`)
  instead of writing a line its own reader refuses.

The rules are the reader's: a ``float`` field takes a float or an int (not a bool, not a
float subclass such as NumPy's ``float64``, which JSON cannot carry); an ``int`` field an int
(not a bool) within the 64-bit range; ``str``, ``bool`` and enum fields instances of their
type; ``tuple[...]`` fields a tuple or a list of valid items; ``Mapping[K, V]`` fields a dict
with valid keys and values; a dataclass field an instance whose own fields are valid. ``Any``,
``object`` and annotations the reader does not interpret are not checked (the writer still
refuses what JSON cannot carry).

Each rule has a *guard*: a Python expression, one identity test for a scalar, that is true
whenever the value may break the rule; the full check runs only then. Ints pass their guard
whatever their size: one beyond 64 bits is refused by the full check when another guard
tripped, else by the writer's JSON encoder (counted, named).

This module imports only the standard library, as the rest of the package.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import enum
import functools
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

__all__ = (
    "FieldRule",
    "check_fields",
    "field_error",
    "field_rule",
    "field_rules",
    "invalid_field",
)

_INT_MIN: Final = -(2**63)
_INT_MAX: Final = 2**64 - 1

_Check = Callable[[Any], "str | None"]
"""``check(value)``: ``None`` when *value* is valid, else what is wrong (``"got str '0.5'"``)."""


@dataclass(frozen=True, slots=True)
class FieldRule:
    """The rule of one declared type.

    Attributes:
        what: what a valid value is, in words (``"a float or None"``).
        check: ``check(value) -> None`` when valid, else the problem (``"got str '0.5'"``).
        guard: a Python expression over ``{v}`` (the value) and ``{p}``-prefixed *names*, true
            whenever *check* may fail; ``"True"`` when no cheap test exists.
        names: the objects the guard refers to, by their unprefixed names.
        exact: the one class a valid value almost always has (``float`` for ``float``), or
            None: lets an enclosing container test all its items at once.
    """

    what: str
    check: _Check
    guard: str = "True"
    names: Mapping[str, object] = dataclasses.field(default_factory=dict)
    exact: type | None = None


def _short(value: Any) -> str:
    try:
        text = repr(value)
    except Exception:  # a broken __repr__ must not hide the real problem
        text = f"<{type(value).__name__} object>"
    return text if len(text) <= 60 else text[:57] + "..."


def _got(value: Any) -> str:
    text = f"got {type(value).__name__} {_short(value)}"
    if hasattr(value, "dtype") and hasattr(value, "item"):
        text += " (convert tensors and NumPy values with .item() or .tolist())"
    return text


def _scalar(what: str, cls: type, accept: Callable[[Any], bool]) -> FieldRule:
    def check(value: Any) -> str | None:
        return None if accept(value) else _got(value)

    return FieldRule(what, check, "{v}.__class__ is not {p}t", {"t": cls}, cls)


def _check_int(value: Any) -> str | None:
    if not isinstance(value, int) or isinstance(value, bool):
        return _got(value)
    if not _INT_MIN <= value <= _INT_MAX:
        return f"got {value}, outside the 64-bit range"
    return None


def _check_float(value: Any) -> str | None:
    if value.__class__ is float:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return _check_int(value)
    return _got(value)


_FLOAT: Final = FieldRule("a float", _check_float, "{v}.__class__ is not {p}t", {"t": float}, float)
_INT: Final = FieldRule("an int", _check_int, "{v}.__class__ is not {p}t", {"t": int}, int)
_STR: Final = _scalar("a str", str, lambda v: isinstance(v, str))
_BOOL: Final = _scalar("a bool", bool, lambda v: v.__class__ is bool)
_NONE: Final = FieldRule("None", lambda v: None if v is None else _got(v), "{v} is not None")


def _article(name: str) -> str:
    return f"an {name}" if name[:1].lower() in "aeiou" else f"a {name}"


def _name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


@functools.cache
def field_rule(tp: Any) -> FieldRule | None:
    """The rule of a field declared as *tp*; None when such a field is not checked."""
    if tp is float:
        return _FLOAT
    if tp is int:
        return _INT
    if tp is str:
        return _STR
    if tp is bool:
        return _BOOL
    if tp is type(None) or tp is None:
        return _NONE
    if tp is Any or tp is object:
        return None
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return _scalar(_article(tp.__name__), tp, lambda v: isinstance(v, tp))
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _dataclass_rule(tp)
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return _union_rule(args)
    if origin is typing.Literal:
        allowed = args

        def literal(value: Any) -> str | None:
            if value in allowed and (
                not isinstance(value, bool) or any(a is value for a in allowed)
            ):
                return None
            return _got(value)

        return FieldRule(f"one of {list(allowed)}", literal)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return _sequence_rule(args[0], "tuple")
        return _fixed_tuple_rule(args)
    if origin in (list, collections.abc.Sequence):
        return _sequence_rule(args[0] if args else Any, "list" if origin is list else "sequence")
    if origin in (dict, collections.abc.Mapping):
        key, val = args if len(args) == 2 else (str, Any)
        return _mapping_rule(key, val)
    return None  # an annotation the reader does not interpret: not checked


def _union_rule(args: tuple[Any, ...]) -> FieldRule | None:
    optional = type(None) in args
    arms = [a for a in args if a is not type(None)]
    rules = [field_rule(a) for a in arms]
    if any(r is None for r in rules):
        return None  # an arm takes anything: so does the union
    checked = [r for r in rules if r is not None]
    if len(checked) > 3:
        what = "one of " + ", ".join(_plural(r) for r in checked) + (" or None" if optional else "")
    else:
        what = " or ".join(r.what for r in checked) + (" or None" if optional else "")

    def check(value: Any) -> str | None:
        if value is None and optional:
            return None
        problems = []
        for arm, rule in zip(arms, checked, strict=True):
            problem = rule.check(value)
            if problem is None:
                return None
            problems.append((arm, problem))
        for arm, problem in problems:  # a value of one arm's class: that arm's own problem
            if isinstance(arm, type) and value.__class__ is arm:
                return problem
        return problems[0][1] if len(problems) == 1 else _got(value)

    exact = [r.exact for r in checked]
    if len(checked) == 1 and exact[0] is not None:
        guard = "({v}.__class__ is not {p}t and {v} is not None)" if optional else checked[0].guard
        return FieldRule(what, check, guard, {"t": exact[0]})
    if all(e is not None for e in exact):
        classes = frozenset(e for e in exact if e is not None)
        if optional:
            classes |= {type(None)}
        return FieldRule(what, check, "{v}.__class__ not in {p}ts", {"ts": classes})
    if optional:  # None, the usual default, needs no check
        return FieldRule(what, check, "{v} is not None")
    return FieldRule(what, check)


def _sequence_rule(item_tp: Any, name: str) -> FieldRule:
    item = field_rule(item_tp)
    what = f"a {name} of {_plural(item)}"
    item_check = item.check if item is not None else None
    item_exact = item.exact if item is not None else None

    def check(value: Any) -> str | None:
        if value.__class__ is not tuple and not isinstance(value, list):
            return _got(value)
        if item_check is None:
            return None
        i = 0
        for x in value:
            if x.__class__ is not item_exact and (problem := item_check(x)) is not None:
                return f"item {i}: {problem}"
            i += 1
        return None

    if item is None:
        return FieldRule(what, check, "{v}.__class__ is not {p}tuple", {"tuple": tuple})
    if item.exact is not None:
        guard = "({v}.__class__ is not {p}tuple or ({v} and not {p}ok.issuperset(map(type, {v}))))"
        return FieldRule(what, check, guard, {"tuple": tuple, "ok": frozenset({item.exact})})
    # an empty tuple (the usual default) needs no walk
    return FieldRule(what, check, "({v}.__class__ is not {p}tuple or {v})", {"tuple": tuple})


def _fixed_tuple_rule(args: tuple[Any, ...]) -> FieldRule:
    items = [field_rule(a) for a in args]
    what = f"a tuple of {len(args)} ({', '.join(_name(a) for a in args)})"
    size = len(items)
    exacts = tuple(r.exact if r is not None else None for r in items)

    def check(value: Any) -> str | None:
        if value.__class__ is not tuple and not isinstance(value, list):
            return _got(value)
        if len(value) != size:
            return f"got {len(value)} items"
        if tuple(map(type, value)) == exacts:  # the usual case, tested in C
            return None
        for i in range(size):
            rule = items[i]
            if rule is not None and (problem := rule.check(value[i])) is not None:
                return f"item {i}: {problem}"
        return None

    return FieldRule(what, check)


def _mapping_rule(key_tp: Any, val_tp: Any) -> FieldRule:
    key = field_rule(key_tp)
    val = field_rule(val_tp)
    what = f"a dict of {_name(key_tp)} to {_name(val_tp) if val is not None else 'anything'}"
    val_check = val.check if val is not None else None
    val_exact = val.exact if val is not None else None
    key_check = key.check if key is not None and key is not _STR else None

    def check(value: Any) -> str | None:
        if not isinstance(value, dict):
            return _got(value)
        for k, x in value.items():
            # JSON keys are strings: orjson writes a str key only (not a subclass)
            if k.__class__ is not str:
                return f"key {_short(k)}: got {type(k).__name__}, keys must be str"
            if key_check is not None and (problem := key_check(k)) is not None:
                return f"key {_short(k)}: {problem}"
            if x.__class__ is not val_exact and val_check is not None:
                if (problem := val_check(x)) is not None:
                    return f"value of {_short(k)}: {problem}"
        return None

    if key is _STR and val is not None and val.exact is not None:
        guard = (
            "({v}.__class__ is not {p}dict or ({v} and not ("
            "{p}vals.issuperset(map(type, {v}.values())) and {p}keys.issuperset(map(type, {v})))))"
        )
        names = {"dict": dict, "vals": frozenset({val.exact}), "keys": frozenset({str})}
        return FieldRule(what, check, guard, names)
    return FieldRule(what, check, "({v}.__class__ is not {p}dict or {v})", {"dict": dict})


def _dataclass_rule(tp: type) -> FieldRule:
    what = _article(tp.__name__)

    def check(value: Any) -> str | None:
        if not isinstance(value, tp):
            return _got(value)
        for name, rule in field_rules(tp).items():
            problem = rule.check(getattr(value, name))
            if problem is not None:
                return f"its {name} must be {rule.what}, {problem}"
        return None

    return FieldRule(what, check)


def _plural(rule: FieldRule | None) -> str:
    if rule is None:
        return "anything"
    what = rule.what
    for article in ("an ", "a "):
        if what.startswith(article):
            return what[len(article) :]
    return what


_RULES: dict[type, Mapping[str, FieldRule]] = {}


def field_rules(cls: type) -> Mapping[str, FieldRule]:
    """The rules of the dataclass *cls*'s init fields, by name (unchecked fields left out).

    Raises:
        NameError: if an annotation cannot be resolved yet (a forward reference).
    """
    rules = _RULES.get(cls)
    if rules is None:
        hints = typing.get_type_hints(cls)
        found = {f.name: field_rule(hints[f.name]) for f in dataclasses.fields(cls) if f.init}
        rules = _RULES[cls] = {name: r for name, r in found.items() if r is not None}
    return rules


def invalid_field(obj: Any) -> tuple[str, str] | None:
    """The first field of the dataclass instance *obj* that breaks its rule, as
    ``(name, "must be a float or None, got str '0.5'")``; None when every field is valid."""
    for name, rule in field_rules(type(obj)).items():
        problem = rule.check(getattr(obj, name))
        if problem is not None:
            return name, f"must be {rule.what}, {problem}"
    return None


def field_error(cls: type, name: str, message: str) -> TypeError | ValueError:
    """The error for field *name* of *cls*: a ValueError for an int out of range, else a
    TypeError (``StepCompleted.loss must be a float or None, got str '0.5'``)."""
    text = f"{cls.__name__}.{name} {message}"
    return ValueError(text) if message.endswith("outside the 64-bit range") else TypeError(text)


def check_fields(obj: Any) -> None:
    """Raise the error of the first invalid field of *obj*, if any (see :func:`invalid_field`).

    Raises:
        TypeError: a field holds a value of the wrong type (the message names it).
        ValueError: an int field holds an int beyond the 64-bit range.
    """
    found = invalid_field(obj)
    if found is not None:
        raise field_error(type(obj), *found)
