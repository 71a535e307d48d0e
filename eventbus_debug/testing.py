"""Helpers for testing code that publishes events, in the spirit of ``structlog.testing``.

Example::

    async with EventBus() as bus:
        async with capture_events(bus, StepCompleted) as events:
            bus.publish_nowait(StepCompleted(step=1, loss=0.5))
        assert [e.step for e in events] == [1]
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import TypeVar, final

from ._bus import EventBus
from .events import Event

__all__ = ("RecordingSink", "capture_events")

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
