"""Test doubles shared across the test tree."""

from __future__ import annotations

from collections.abc import Iterable

from eventbus_debug.events import Event


class RecordingPublisher:
    """A Publisher test double: no bus, the events it was given in a list."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def publish_nowait(self, event: Event, /) -> None:
        self.events.append(event)

    def publish_many_nowait(self, events: Iterable[Event], /) -> None:
        self.events.extend(events)
