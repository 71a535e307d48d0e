"""Protocols and aliases for the library's extension points."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Protocol, TypeAlias, TypeVar, runtime_checkable

from .events import Event

__all__ = ("BatchSink", "EventT", "EventT_contra", "Handler", "Publisher", "Sink")

EventT = TypeVar("EventT", bound=Event)
EventT_contra = TypeVar("EventT_contra", bound=Event, contravariant=True)

Handler: TypeAlias = Callable[[EventT], Awaitable[None]]
"""An async function that receives events: the lightest kind of subscriber."""


@runtime_checkable
class Sink(Protocol[EventT_contra]):
    """**Protocol:** a stateful subscriber that handles one event at a time.

    The bus gives each subscription its own bounded queue and task, so a slow ``handle`` delays
    only this sink. Optional methods, called when present:

    - ``async def start(self) -> None``: once, before the first event, in the sink's own task;
    - ``async def aclose(self) -> None`` (or a sync ``close()``): once, after the last event,
      bounded by the bus's close timeout.
    """

    async def handle(self, event: EventT_contra, /) -> None:
        """Process one event. An exception becomes a ``SinkFailed`` incident, never the loop's."""


@runtime_checkable
class BatchSink(Protocol[EventT_contra]):
    """**Protocol:** a subscriber that takes everything queued for it in one call.

    Preferred by the bus over ``handle`` when both exist: a file sink writes a whole batch with
    one system call. The batch is in publish order and never empty.
    """

    async def handle_batch(self, events: Sequence[EventT_contra], /) -> None:
        """Process a batch. An exception counts every event of the batch as failed."""


@runtime_checkable
class Publisher(Protocol):
    """**Protocol:** where probes and recovery publish: both :class:`~eventbus_debug.EventBus`
    and :class:`~eventbus_debug.SyncEventBus` satisfy it.

    Both methods accept events without ever waiting (the ``_nowait`` convention): the caller
    may be a training loop, an autograd hook or a timer thread's hand-off. Type a parameter as
    ``Publisher`` to take either bus, or your own (a test double that records events).
    """

    def publish_nowait(self, event: Event, /) -> None:
        """Accept *event* for delivery without waiting."""

    def publish_many_nowait(self, events: Iterable[Event], /) -> None:
        """Accept several events, in order, without waiting."""
