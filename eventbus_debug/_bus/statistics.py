"""Snapshots of the bus's counters: frozen values, safe to keep and compare."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ("BusStatistics", "SubscriptionStatistics")


@dataclass(frozen=True, slots=True)
class SubscriptionStatistics:
    """A snapshot of one subscription's counters.

    Attributes:
        name: the subscription's name.
        capacity: its queue bound (incidents may exceed it; they are never shed).
        queued: events waiting in its queue now.
        delivered: events its sink handled without raising.
        failed: events whose handling raised.
        shed: telemetry events dropped from its full queue.
        discarded: events not delivered because the sink was disabled.
        undelivered: events lost at close: those the sink did not finish within the close
            timeout, and those that reached it after its own close (the reports about the
            sinks closed after it; an event from a thread that raced the bus's close).
        disabled: whether the sink was disabled after repeated failures.
    """

    name: str
    capacity: int
    queued: int
    delivered: int
    failed: int
    shed: int
    discarded: int
    undelivered: int
    disabled: bool


@dataclass(frozen=True, slots=True)
class BusStatistics:
    """A snapshot of the bus: ``published`` counts every accepted event."""

    published: int
    dispatched: int
    pending: int
    closed: bool
    subscriptions: tuple[SubscriptionStatistics, ...]

    @property
    def shed(self) -> int:
        """Total telemetry shed over all subscriptions."""
        return sum(s.shed for s in self.subscriptions)
