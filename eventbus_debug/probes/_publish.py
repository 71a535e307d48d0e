"""Resolve "a bus" to one non-blocking publish function, once, at construction."""

from __future__ import annotations

from collections.abc import Callable

from .._bus import EventBus, SyncEventBus
from ..events import Event

__all__ = ("Publish", "publisher_for")

Publish = Callable[[Event], None]


def _discard(event: Event, /) -> None:
    del event


def publisher_for(bus: EventBus | SyncEventBus | None, *, argument: str = "bus") -> Publish:
    """The function that publishes onto *bus* without blocking the caller.

    An :class:`~eventbus_debug.EventBus` publishes with ``publish_nowait``, a
    :class:`~eventbus_debug.SyncEventBus` with ``publish``; with ``None`` events are discarded
    (the caller only wants the returned results).

    Raises:
        TypeError: if *bus* is none of these.
    """
    if bus is None:
        return _discard
    if isinstance(bus, EventBus):
        return bus.publish_nowait
    if isinstance(bus, SyncEventBus):
        return bus.publish
    msg = (
        f"{argument} must be an EventBus, a SyncEventBus or None, got {bus!r}; "
        "pass the bus the probe should publish onto"
    )
    raise TypeError(msg)
