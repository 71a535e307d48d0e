"""Reading a saved state back (a detector's, the safe point's): each field checked, each error
naming its path.

Saved states are plain Python values (dicts, lists, floats, ints, bools, strings and
``None``) so that ``torch.save`` (with ``torch.load(weights_only=True)``), any JSON encoder
(``json``, orjson, a Hugging Face ``trainer_state.json``) and ``pickle`` all carry them. An
infinite float (a window that is empty) is written as the string ``"inf"`` or ``"-inf"``
(:func:`portable`), which strict JSON carries and the readers here take back.

What is read back is checked here, field by field, with the argument rules of
:mod:`eventbus_debug._validate` where one fits: a checkpoint from another program, or one
edited by hand, gets a clear error naming the field (``state['probe']['judge']['spikes']
['window'][3] must be a number, got 'x'``), never a traceback from deep inside a detector at
some later step. Every error is a ``ValueError`` (a wrong type is an
:class:`~eventbus_debug.exceptions.ArgumentTypeError`, which is one too).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Final

from ._validate import non_negative_int

__all__ = ("StateReader", "check_format", "portable")


class StateReader:
    """The fields of one saved mapping, at *path* (for the error messages).

    Raises (from every reader):
        ValueError: if the mapping is not a dict, a field is missing, or a value has the wrong
            type or is out of range; the message names the field's path.
    """

    __slots__ = ("_path", "_state")

    def __init__(self, state: object, path: str) -> None:
        if not isinstance(state, Mapping):
            msg = f"{path} must be a dict (a saved state), got {type(state).__qualname__}"
            raise ValueError(msg)
        self._state: Mapping[Any, Any] = state
        self._path = path

    @property
    def path(self) -> str:
        """Where this mapping is (``state['probe']``), for messages."""
        return self._path

    def at(self, key: str) -> str:
        """The path of *key* (``state['probe']['judge']``), for messages."""
        return f"{self._path}[{key!r}]"

    def _get(self, key: str) -> object:
        try:
            return self._state[key]
        except KeyError:
            msg = f"{self.at(key)} is missing: the state is incomplete (saved by another version?)"
            raise ValueError(msg) from None

    def raw(self, key: str) -> object:
        """The value at *key*, unchecked (the caller checks it)."""
        return self._get(key)

    def child(self, key: str) -> StateReader:
        """The nested mapping at *key*."""
        return StateReader(self._get(key), self.at(key))

    def checked(self, key: str, check: Callable[[str, object], Any]) -> Any:
        """The value at *key*, through *check* (a rule of :mod:`eventbus_debug._validate`:
        ``check(path, value)``)."""
        return check(self.at(key), self._get(key))

    def number(self, key: str) -> float:
        """A float (``inf`` allowed, never NaN)."""
        return _number(self.at(key), self._get(key))

    def count(self, key: str) -> int:
        """An int >= 0."""
        return non_negative_int(self.at(key), self._get(key))

    def optional_count(self, key: str) -> int | None:
        """An int >= 0, or ``None``."""
        value = self._get(key)
        return None if value is None else non_negative_int(self.at(key), value)

    def optional_integer(self, key: str) -> int | None:
        """Any int (an octave may be negative), or ``None``."""
        value = self._get(key)
        return None if value is None else _integer(self.at(key), value)

    def flag(self, key: str) -> bool:
        """A bool."""
        value = self._get(key)
        if not isinstance(value, bool):
            msg = f"{self.at(key)} must be a bool, got {value!r}"
            raise ValueError(msg)
        return value

    def numbers(self, key: str) -> list[float]:
        """A list of floats."""
        path = self.at(key)
        return [_number(f"{path}[{i}]", v) for i, v in enumerate(_list(self._get(key), path))]

    def counted_numbers(self, key: str, *, signed: bool = False) -> list[tuple[int, float]]:
        """A list of ``[count, number]`` pairs (*signed*: the first may be negative)."""
        path = self.at(key)
        pairs: list[tuple[int, float]] = []
        for i, item in enumerate(_list(self._get(key), path)):
            here = f"{path}[{i}]"
            if not isinstance(item, list | tuple) or len(item) != 2:
                msg = f"{here} must be a [count, number] pair, got {item!r}"
                raise ValueError(msg)
            first = (_integer if signed else non_negative_int)(f"{here}[0]", item[0])
            pairs.append((first, _number(f"{here}[1]", item[1])))
        return pairs

    def named(self, key: str, check: Callable[[str, object], Any]) -> dict[str, Any]:
        """A dict of str (parameter names) -> values, each through *check* (a rule of
        :mod:`eventbus_debug._validate`, or :meth:`number`'s)."""
        value = self._get(key)
        path = self.at(key)
        if not isinstance(value, Mapping):
            msg = f"{path} must be a dict of parameter names, got {type(value).__qualname__}"
            raise ValueError(msg)
        out: dict[str, Any] = {}
        for name, v in value.items():
            if not isinstance(name, str):
                msg = f"{path} must have str keys (parameter names), got {name!r}"
                raise ValueError(msg)
            out[name] = check(f"{path}[{name!r}]", v)
        return out

    def text(self, key: str) -> str:
        """A str."""
        value = self._get(key)
        if not isinstance(value, str):
            msg = f"{self.at(key)} must be a str, got {value!r}"
            raise ValueError(msg)
        return value

    def children(self, key: str) -> list[StateReader]:
        """A list of nested mappings."""
        path = self.at(key)
        return [StateReader(v, f"{path}[{i}]") for i, v in enumerate(_list(self._get(key), path))]

    def counts(self, key: str) -> list[int]:
        """A list of ints >= 0."""
        path = self.at(key)
        return [
            non_negative_int(f"{path}[{i}]", v) for i, v in enumerate(_list(self._get(key), path))
        ]

    def optional_text(self, key: str) -> str | None:
        """A non-empty str, or ``None``."""
        value = self._get(key)
        if value is None:
            return None
        if not isinstance(value, str) or not value.strip():
            msg = f"{self.at(key)} must be a non-empty str or None, got {value!r}"
            raise ValueError(msg)
        return value

    def names(self, key: str) -> list[str]:
        """A list of str."""
        path = self.at(key)
        items = _list(self._get(key), path)
        for i, v in enumerate(items):
            if not isinstance(v, str):
                msg = f"{path}[{i}] must be a str (a parameter name), got {v!r}"
                raise ValueError(msg)
        return items


def _list(value: object, path: str) -> list[Any]:
    if not isinstance(value, list | tuple):
        msg = f"{path} must be a list, got {type(value).__qualname__}"
        raise ValueError(msg)
    return list(value)


_INFINITIES: Final = {"inf": math.inf, "-inf": -math.inf}
"""How :func:`portable` writes the infinite floats of a state (see there)."""


def portable(value: Any) -> Any:
    """*value* (a state of plain values) with every infinite float written as the string
    ``"inf"`` or ``"-inf"``: strict JSON has no infinity (``json.dumps`` writes a non-standard
    ``Infinity``, orjson writes ``null``), so this way any JSON encoder carries the state, and
    the readers here take the strings back as numbers."""
    if isinstance(value, float):
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return value
    if isinstance(value, dict):
        return {k: portable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [portable(v) for v in value]
    return value


def _number(path: str, value: object) -> float:
    """*value* as a float: a number, or ``"inf"``/``"-inf"`` (:func:`portable`); never NaN."""
    if isinstance(value, str) and value in _INFINITIES:
        value = _INFINITIES[value]
    if isinstance(value, bool) or not isinstance(value, int | float):
        msg = f"{path} must be a number, got {value!r}"
        raise ValueError(msg)
    number = float(value)
    if math.isnan(number):
        msg = f"{path} must be a number, got {value!r}"
        raise ValueError(msg)
    return number


def _integer(path: str, value: object) -> int:
    """*value*, any int (an octave may be negative)."""
    if isinstance(value, bool) or not isinstance(value, int):
        msg = f"{path} must be an int, got {value!r}"
        raise ValueError(msg)
    return value


def check_format(state: StateReader, expected: str, version: int, what: str) -> None:
    """Check that *state* is *what* (its ``"format"`` is *expected*) of a version this release
    reads (``1 .. version``).

    Raises:
        ValueError: if the format differs or the version is later or malformed.
    """
    found = state.text("format")
    if found != expected:
        msg = f"{state.path} is not {what}: its format is {found!r}, expected {expected!r}"
        raise ValueError(msg)
    saved = state.count("version")
    if not 1 <= saved <= version:
        msg = (
            f"{state.at('version')} is {saved}: this release reads {what} of version 1 to {version}"
            " (saved by a later release? upgrade eventbus-debug to load it)"
        )
        raise ValueError(msg)
