"""The one JSON encoding of events: orjson, one object per line, NaN and ±Inf preserved.

orjson writes non-finite floats as ``null``; this library exists to report NaN and Inf, so the
encoder writes them as the strings ``"NaN"``, ``"Infinity"`` and ``"-Infinity"`` and the decoder,
which knows every field's declared type, turns them back into floats. A line looks like::

    {"kind":"step_completed","seq":7,"time_ns":...,"step":3,"rank":0,"source":"",
     "severity":"debug","loss":"NaN","learning_rate":0.001,...}

The check for non-finite values is resolved once per class (which fields can hold floats), so
the common all-finite case is one ``orjson.dumps`` of the dataclass.

The encoder never writes a line the decoder refuses: every field is tested against its declared
type (:mod:`eventbus_debug.events._checks`, the decoder's rules on the object side), and an event
holding a value of the wrong type, or one JSON cannot carry, is refused with a ``TypeError``
that names the field.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import enum
import math
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final

import orjson

from ..events import Event, event_types
from ..events._checks import invalid_field
from ..exceptions import EventDecodeError, UnknownEventKindError
from ._codegen import RunEncoder, make_encoder, make_run_encoder

__all__ = ("decode_event", "encode_event", "encode_events", "unwritable_field")

_NAN: Final = "NaN"
_POS_INF: Final = "Infinity"
_NEG_INF: Final = "-Infinity"
_TOKENS: Final = frozenset({_NAN, _POS_INF, _NEG_INF})

_Convert = Callable[[Any], Any]


def _float_token(value: float) -> float | str:
    if value != value:
        return _NAN
    if value == math.inf:
        return _POS_INF
    if value == -math.inf:
        return _NEG_INF
    return value


def _sanitize(value: Any) -> Any:
    """A JSON-safe copy of *value* with non-finite floats replaced by their tokens."""
    if isinstance(value, float):
        return _float_token(value)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (tuple, list)):
        return [_sanitize(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _sanitize(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _sanitize(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return value


def _to_float(value: Any) -> float:
    if isinstance(value, str):
        if value in _TOKENS:
            return float(value)  # "NaN", "Infinity", "-Infinity" all parse
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise TypeError(_expected("a number", value))


_INT_MIN: Final = -(2**63)
_INT_MAX: Final = 2**64 - 1


def _to_int(value: Any) -> int:
    if value.__class__ is int and _INT_MIN <= value <= _INT_MAX:
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        msg = f"integer {value} is out of the 64-bit range"
        raise ValueError(msg)
    raise TypeError(_expected("an integer", value))


def _to_str(value: Any) -> str:
    if isinstance(value, str):
        return value
    raise TypeError(_expected("a string", value))


def _to_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise TypeError(_expected("true or false", value))


def _to_none(value: Any) -> None:
    if value is None:
        return
    raise TypeError(_expected("null", value))


def _expected(what: str, value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"expected {what}, got {type(value).__name__} {text}"


def _json_value(value: Any) -> Any:
    """An ``Any`` field: any JSON value, but nothing the encoder could not write back."""
    if value is None or isinstance(value, (str, bool, float)):
        return value
    if isinstance(value, int):
        return _to_int(value)
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if isinstance(value, Mapping):
        return {_to_str(k): _json_value(v) for k, v in value.items()}
    raise TypeError(_expected("a JSON value", value))


def _converter(tp: Any) -> _Convert:
    """Build a function turning decoded JSON into a value of type *tp* (resolved once)."""
    if tp is float:
        return _to_float
    simple = {int: _to_int, str: _to_str, bool: _to_bool, type(None): _to_none}.get(tp)
    if simple is not None:
        return simple
    if tp is Any or tp is object:
        return _json_value
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return tp
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        hints = typing.get_type_hints(tp)
        convs = {f.name: _converter(hints[f.name]) for f in dataclasses.fields(tp) if f.init}
        cls = tp

        def build(value: Any) -> Any:
            if not isinstance(value, Mapping):
                raise TypeError(_expected(f"an object ({cls.__name__})", value))
            return cls(**{k: convs[k](v) for k, v in value.items() if k in convs})

        return build
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        non_none = [a for a in args if a is not type(None)]
        inner = [_converter(a) for a in non_none]
        if len(inner) == 1:
            only = inner[0]
            return lambda v: None if v is None else only(v)

        has_float = float in non_none

        def first_fit(value: Any) -> Any:
            if value is None:
                return None
            if has_float and value.__class__ is str and value in _TOKENS:
                return float(value)  # a non-finite float (see the module docstring)
            for conv in inner:
                try:
                    return conv(value)
                except (TypeError, ValueError):
                    continue
            names = " or ".join(getattr(a, "__name__", str(a)) for a in non_none)
            raise TypeError(_expected(names, value))

        return first_fit
    if origin is typing.Literal:
        allowed = args

        def literal(value: Any) -> Any:
            if value in allowed and not (isinstance(value, bool) and True not in allowed):
                return value
            raise TypeError(_expected(f"one of {list(allowed)}", value))

        return literal
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            item = _converter(args[0])
            return lambda v: tuple(item(x) for x in _as_list(v))
        items = [_converter(a) for a in args]
        return lambda v: tuple(c(x) for c, x in zip(items, _as_list(v), strict=True))
    if origin in (list, collections.abc.Sequence):
        item = _converter(args[0]) if args else _json_value
        return lambda v: tuple(item(x) for x in _as_list(v))
    if origin in (dict, collections.abc.Mapping):
        key = _converter(args[0]) if len(args) == 2 else _to_str
        val = _converter(args[1]) if len(args) == 2 else _json_value
        return lambda v: {key(k): val(x) for k, x in _as_dict(v).items()}
    return _identity


def _as_list(value: Any) -> list[Any] | tuple[Any, ...]:
    if isinstance(value, (list, tuple)):
        return value
    raise TypeError(_expected("a list", value))


def _as_dict(value: Any) -> Mapping[Any, Any]:
    if isinstance(value, Mapping):
        return value
    raise TypeError(_expected("an object", value))


def _identity(value: Any) -> Any:
    return value


@dataclasses.dataclass(frozen=True, slots=True)
class _Codec:
    encode: Callable[[Event], bytes]  # generated per class: see _codegen.make_encoder
    converters: Mapping[str, _Convert]
    required: frozenset[str]
    run: RunEncoder  # the batch encoder: see _codegen.make_run_encoder


_CODECS: dict[type[Event], _Codec] = {}
_RUNS: dict[type, RunEncoder] = {}  # _CODECS' run encoders, for the batch loop's one lookup
_END: Final = object()  # what a run encoder returns at the end of its batch


def _codec(cls: type[Event]) -> _Codec:
    codec = _CODECS.get(cls)
    if codec is None:
        hints = typing.get_type_hints(cls)
        fields = dataclasses.fields(cls)
        converters = {f.name: _converter(hints[f.name]) for f in fields if f.init}
        required = frozenset(
            f.name
            for f in fields
            if f.init
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        )
        pairs = [(f.name, hints[f.name]) for f in fields]
        encode = make_encoder(cls.kind, pairs, _encode_careful)
        run = make_run_encoder(cls, pairs, _encode_careful, _END)
        codec = _Codec(encode, converters, required, run)
        _CODECS[cls] = codec
        _RUNS[cls] = run
    return codec


def _encode_careful(event: Event) -> bytes:
    """The encoding of an event that holds (or may hold) a non-finite float or a wrong type.

    Raises:
        TypeError: a field holds a value its declared type does not allow (named).
    """
    found = invalid_field(event)
    if found is not None:
        name, problem = found
        msg = f"field {name!r} {problem}"
        raise TypeError(msg)
    body = {f.name: _sanitize(getattr(event, f.name)) for f in dataclasses.fields(event)}
    return orjson.dumps({"kind": event.kind, **body}, option=orjson.OPT_APPEND_NEWLINE)


def unwritable_field(event: Event, /) -> tuple[str, str] | None:
    """Why *event* cannot be written: ``(field, problem)``, or None when every field can be.

    A field breaking its declared type's rule comes first; else the first field JSON cannot
    carry (a tensor, a set, an int beyond 64 bits in an unchecked field...).
    """
    found = invalid_field(event)
    if found is not None:
        return found
    for f in dataclasses.fields(event):
        try:
            orjson.dumps(getattr(event, f.name))  # as the fast encoder writes it
        except TypeError as exc:
            return f.name, str(exc)
    return None


def encode_event(event: Event, /) -> bytes:
    """Encode *event* as one JSON line (ending in ``\\n``), NaN and ±Inf preserved.

    Raises:
        TypeError: if *event* is not an :class:`~eventbus_debug.Event`, or holds a value orjson
            cannot serialize (events must carry plain host values, not tensors).
    """
    try:
        return _CODECS[event.__class__].encode(event)
    except KeyError:
        if not isinstance(event, Event):
            msg = f"encode_event needs an Event, got {type(event).__name__}"
            raise TypeError(msg) from None
        return _encode_one(_codec(type(event)).encode, event)
    except TypeError as exc:
        raise _unencodable(event, exc) from None


_JOIN_EVERY: Final = 256


def encode_events(events: Iterable[Event], /) -> bytes:
    """Encode several events as consecutive JSON lines: ``b"".join(map(encode_event, events))``.

    A file sink writes a whole batch with one call. Each run of consecutive events of one
    class is encoded by that class's generated run encoder (one call per run, not per event;
    :func:`~eventbus_debug.log._codegen.make_run_encoder`), and the bytes are those of
    :func:`encode_event`. Lines are joined every 256 events: holding thousands of small
    encoded lines alive before one final join made a 4,096-event batch about 3x slower per
    event than a 100-event one (measured with ``benchmarks/bench_publish.py``-sized events on
    this project's machines).

    Raises:
        TypeError: as :func:`encode_event`, for the first event that cannot be encoded.
    """
    seq = events if isinstance(events, list | tuple) else list(events)
    chunks: list[bytes] = []
    runs = _RUNS
    end: Any = _END
    try:
        for start in range(0, len(seq), _JOIN_EVERY):
            out: list[bytes] = []
            append = out.append
            rest = iter(seq[start : start + _JOIN_EVERY])
            event: Event = next(rest, end)
            while event is not end:
                run = runs.get(event.__class__)
                if run is None:
                    if not isinstance(event, Event):
                        encode_event(event)  # raises: not an Event
                    run = _codec(event.__class__).run
                event = run(event, rest, append)  # the next run's first event, or the end
            chunks.append(b"".join(out))
    except TypeError:
        # Name the first event that cannot be encoded, with encode_event's message.
        for item in seq:
            encode_event(item)
        raise
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _encode_one(encode: Callable[[Event], bytes], event: Event) -> bytes:
    try:
        return encode(event)
    except TypeError as exc:
        raise _unencodable(event, exc) from None


def _unencodable(event: object, exc: TypeError) -> TypeError:
    detail = str(exc)
    if isinstance(event, Event) and not detail.startswith("field "):
        found = unwritable_field(event)  # name the field orjson could not write
        if found is not None:
            detail = f"field {found[0]!r}: {found[1]}"
    msg = (
        f"cannot encode {type(event).__name__}: {detail}; events must hold plain host values "
        "of their fields' types (convert tensors with .item() or .tolist() before building "
        "the event)"
    )
    return TypeError(msg)


def decode_event(data: bytes | str | Mapping[str, Any], /) -> Event:
    """Turn one encoded line (or its parsed JSON object) back into the same typed event.

    Raises:
        EventDecodeError: if the line is not valid JSON, names an unknown ``kind``, lacks a
            required field or holds a value of the wrong type for its field (the message
            names the field): a decoded event can always be encoded again. An unknown
            ``kind`` is an :class:`~eventbus_debug.exceptions.UnknownEventKindError`.
    """
    if isinstance(data, Mapping):
        obj = dict(data)
    else:
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            msg = f"not a JSON event line: {exc}"
            raise EventDecodeError(msg) from None
        if not isinstance(obj, dict):
            msg = f"an event line must hold a JSON object, got {type(obj).__name__}"
            raise EventDecodeError(msg)
    kind = obj.pop("kind", None)
    registry = event_types()
    cls = registry.get(kind) if isinstance(kind, str) else None
    if cls is None:
        msg = (
            f"unknown event kind {kind!r}; import the module that defines it before decoding "
            f"(known kinds: {len(registry)})"
        )
        raise UnknownEventKindError(msg)
    codec = _codec(cls)
    missing = codec.required - obj.keys()
    if missing:
        msg = f"{kind} line lacks required field(s) {sorted(missing)}"
        raise EventDecodeError(msg)
    kwargs: dict[str, Any] = {}
    name = ""
    try:
        for name, value in obj.items():
            conv = codec.converters.get(name)
            if conv is not None:  # unknown fields (a newer writer) are ignored
                kwargs[name] = conv(value)
        name = ""
        return cls(**kwargs)
    except (TypeError, ValueError, RecursionError) as exc:
        where = f"a bad field {name!r}" if name else "bad fields"
        msg = f"{kind} line has {where}: {exc}"
        raise EventDecodeError(msg) from None
