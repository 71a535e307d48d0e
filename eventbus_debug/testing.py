"""Helpers for testing code that publishes events, in the spirit of ``structlog.testing``.

Example::

    async with EventBus() as bus:
        async with capture_events(bus, StepCompleted) as events:
            bus.publish_nowait(StepCompleted(step=1, loss=0.5))
        assert [e.step for e in events] == [1]
"""

from __future__ import annotations

import collections.abc
import contextlib
import dataclasses
import enum
import types
import typing
from collections.abc import AsyncIterator, Sequence
from typing import Any, Final, TypeVar, final

from ._bus import EventBus
from .events import Event

__all__ = ("RecordingSink", "capture_events", "make_sample_event")

E = TypeVar("E", bound=Event)


@final
class RecordingSink:
    """A sink that keeps every event it receives, in order, in :attr:`events`.

    Args:
        name: the subscription name the bus will use.
    """

    def __init__(self, name: str = "recorder") -> None:
        self.name = name
        self.events: list[Event] = []
        self.closed = 0

    async def handle_batch(self, events: Sequence[Event], /) -> None:
        """Record a batch."""
        self.events.extend(events)

    async def aclose(self) -> None:
        """Count closes (the bus closes a sink once)."""
        self.closed += 1

    def of_type(self, cls: type[E], /) -> list[E]:
        """The recorded events that are instances of *cls*, in order."""
        return [e for e in self.events if isinstance(e, cls)]

    def kinds(self) -> list[str]:
        """The ``kind`` of every recorded event, in order."""
        return [e.kind for e in self.events]

    def clear(self) -> None:
        """Forget everything recorded so far."""
        self.events.clear()


@contextlib.asynccontextmanager
async def capture_events(bus: EventBus, /, *event_types: type[Event]) -> AsyncIterator[list[Event]]:
    """Record the events of *event_types* (all when none) published while the block runs.

    On exit the bus is drained, so the list holds every matching event published inside the
    block, and the temporary subscription is cancelled.
    """
    recorder = RecordingSink(name=f"capture-{id(bus):x}-{len(bus.subscriptions)}")
    sub = bus.subscribe(recorder, *event_types, capacity=1 << 30)
    try:
        yield recorder.events
        await bus.drain(sub)
    finally:
        sub.cancel()


_HEADER_KEPT: Final = frozenset({"seq", "time_ns", "rank", "severity"})


def make_sample_event(cls: type[E], /, **overrides: Any) -> E:
    """Build an instance of the event class *cls* with a plausible value in every field.

    Useful for contract tests ("my sink handles every kind of event") and for exercising
    encoders: every ``init`` field gets a value of its declared type (``int`` 1, ``float`` 0.5,
    ``str`` ``"sample-<field>"``, the first member of an enum, one item in tuples and mappings,
    nested dataclasses built the same way, the non-``None`` branch of an ``Optional``). The
    header keeps its defaults except ``step=1`` and ``source="sample"``. *overrides* win.

    Raises:
        TypeError: if *cls* is not an :class:`~eventbus_debug.Event` dataclass, or a field's
            type has no sample value (the message names the field and type; pass it in
            *overrides*).
    """
    if not (isinstance(cls, type) and issubclass(cls, Event) and dataclasses.is_dataclass(cls)):
        msg = f"make_sample_event needs an event class (an Event dataclass), got {cls!r}"
        raise TypeError(msg)
    return typing.cast(E, _sample_dataclass(cls, overrides, header=True))


def _sample_dataclass(cls: type[Any], overrides: dict[str, Any], *, header: bool) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not f.init or f.name in overrides:
            continue
        if header and f.name in _HEADER_KEPT:
            continue
        if header and f.name == "step":
            kwargs["step"] = 1
        elif header and f.name == "source":
            kwargs["source"] = "sample"
        else:
            try:
                kwargs[f.name] = _sample_value(hints[f.name], f.name)
            except TypeError as exc:
                msg = f"{cls.__qualname__}.{f.name}: {exc}; pass {f.name}=... explicitly"
                raise TypeError(msg) from None
    kwargs.update(overrides)
    return cls(**kwargs)


def _sample_value(tp: Any, name: str) -> Any:
    if tp is bool:
        return True
    if tp is int:
        return 1
    if tp is float:
        return 0.5
    if tp is str:
        return f"sample-{name}"
    if tp is bytes:
        return b"sample"
    if tp is Any or tp is object:
        return f"sample-{name}"
    if tp is type(None):
        return None
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return next(iter(tp))
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _sample_dataclass(tp, {}, header=False)
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        non_none = [a for a in args if a is not type(None)]
        return _sample_value(non_none[0], name) if non_none else None
    if origin is typing.Literal:
        return args[0]
    if origin is tuple:
        if not args:
            return ()
        if len(args) == 2 and args[1] is Ellipsis:
            return (_sample_value(args[0], name),)
        return tuple(_sample_value(a, name) for a in args)
    if origin in (list, collections.abc.Sequence, collections.abc.Iterable):
        item = _sample_value(args[0], name) if args else "sample"
        return [item] if origin is list else (item,)
    if origin in (set, frozenset, collections.abc.Set):
        item = _sample_value(args[0], name) if args else "sample"
        return {item} if origin is set else frozenset({item})
    if origin in (dict, collections.abc.Mapping):
        if len(args) == 2:
            return {_sample_value(args[0], f"{name}-key"): _sample_value(args[1], name)}
        return {}
    msg = f"no sample value for type {tp!r}"
    raise TypeError(msg)
