"""Faster construction of the frozen, slotted records built on every training step.

A frozen dataclass sets each field with ``object.__setattr__(self, name, value)``: a generic
attribute lookup per field, about 0.15 µs each. The records a session builds on every step
(events, the probe's and the session's verdicts, the safe point's decision) pay it a dozen
times per step, and inside a training loop every line of Python costs about three times what
it costs alone. :func:`fast_init` gives such a class an ``__init__`` that calls each slot's
descriptor directly instead: same signature, same defaults and factories, same immutability
afterwards, about twice as fast.

With *checks* (events pass their field rules) the ``__init__`` also tests each field with a
cheap guard (one identity test for a scalar, about 10 ns) and calls the field's ``reject``
only when the guard trips.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any, Final, NamedTuple, TypeVar

__all__ = ("FieldCheck", "fast_init")

T = TypeVar("T", bound=type)


class _Factory:
    """Default marker of a field built by a ``default_factory`` (shown as ``<factory>``)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<factory>"


_FACTORY: Final = _Factory()


class FieldCheck(NamedTuple):
    """How the generated ``__init__`` checks one field.

    Attributes:
        guard: a Python expression over ``{v}`` (the value) and ``{p}``-prefixed *names*, true
            whenever the value may be invalid (it must hold identifiers and those names only).
        names: the objects the guard refers to, by their unprefixed names.
        reject: called with the value when the guard is true; raises if it is invalid.
    """

    guard: str
    names: Mapping[str, object]
    reject: Callable[[Any], None]


def fast_init(
    cls: T,
    *,
    live: Mapping[Callable[[], object], str] | None = None,
    namespace: dict[str, Any] | None = None,
    checks: Mapping[str, FieldCheck] | None = None,
) -> T:
    """Give the frozen, slotted, keyword-only dataclass *cls* a faster ``__init__``; return it.

    Usable as a decorator below ``@dataclass(frozen=True, slots=True, kw_only=True)``.
    Classes it cannot speed up keep the dataclass ``__init__`` (a ``__post_init__``, an
    ``InitVar`` or ``init=False`` field, a positional field, a field that is not a plain slot).

    Args:
        cls: the dataclass.
        live: default factories replaced by reading a global of *namespace* (its name), e.g.
            a cached value that a factory function would only return.
        namespace: the globals the generated ``__init__`` reads *live* names from.
        checks: per field name, how ``__init__`` checks it (a field left out is not checked;
            a default factory's value is not checked).
    """
    if hasattr(cls, "__post_init__") or not dataclasses.is_dataclass(cls):
        return cls
    fields = dataclasses.fields(cls)
    params = list(inspect.signature(cls.__init__).parameters)[1:]
    if params != [f.name for f in fields] or not all(f.init and f.kw_only for f in fields):
        return cls
    live = live or {}
    checks = checks or {}
    closure: dict[str, object] = {"_FACTORY": _FACTORY}
    args: list[str] = []
    body: list[str] = []
    for i, f in enumerate(fields):
        descriptor = getattr(cls, f.name, None)
        if type(descriptor).__name__ != "member_descriptor":
            return cls  # not a plain slot: keep the dataclass __init__
        closure[f"_set{i}"] = descriptor.__set__  # type: ignore[union-attr]
        name = f.name
        check = checks.get(name)
        test = ""
        if check is not None:
            prefix = f"_c{i}_"
            for key, obj in check.names.items():
                closure[prefix + key] = obj
            closure[f"_reject{i}"] = check.reject
            test = check.guard.format(v=name, p=prefix)
        if f.default is not dataclasses.MISSING:
            closure[f"_default{i}"] = f.default
            args.append(f"{name}=_default{i}")
            if test:
                body.append(f"    if {test}: _reject{i}({name})")
            body.append(f"    _set{i}(self, {name})")
        elif f.default_factory is not dataclasses.MISSING:
            args.append(f"{name}=_FACTORY")
            factory = f.default_factory
            if factory in live:
                make = live[factory]  # a global of *namespace*, read live
            else:
                closure[f"_factory{i}"] = factory
                make = f"_factory{i}()"
            value = f"{make} if {name} is _FACTORY else {name}"
            if test:  # a factory's value is trusted; a value passed in is checked
                body.append(f"    if {name} is _FACTORY: {name} = {make}")
                body.append(f"    elif {test}: _reject{i}({name})")
                body.append(f"    _set{i}(self, {name})")
            else:
                body.append(f"    _set{i}(self, {value})")
        else:
            args.append(name)
            if test:
                body.append(f"    if {test}: _reject{i}({name})")
            body.append(f"    _set{i}(self, {name})")
    names = ", ".join(closure)
    lines = [f"def __create_init__({names}):", f"  def __init__(self, *, {', '.join(args)}):"]
    lines += ["  " + line for line in body]
    lines.append("  return __init__")
    scope: dict[str, Any] = {}
    # The source holds field names (identifiers), the guards of *checks* (expressions over
    # those names and the closure's) and the given global names only.
    exec("\n".join(lines) + "\n", namespace if namespace is not None else {}, scope)
    init = scope["__create_init__"](**closure)
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    init.__doc__ = cls.__init__.__doc__
    init.__annotations__ = dict(cls.__init__.__annotations__)
    setattr(cls, "__init__", init)  # noqa: B010 - a class attribute, not an instance one
    return cls
