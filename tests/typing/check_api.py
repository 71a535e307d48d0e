"""Type-checked only (``mypy tests/typing``), never run: the public API's types hold up.

Lines marked ``# type: ignore[...]`` must stay errors: pyproject turns ``warn_unused_ignores``
on, so mypy fails the moment one of them starts type-checking (a negative check that holds).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import ClassVar

import eventbus_debug
from eventbus_debug import (
    BusStatistics,
    Event,
    EventBus,
    Severity,
    Subscription,
    SubscriptionStatistics,
    SyncEventBus,
    decode_event,
    encode_event,
    event_type,
    read_events,
)
from eventbus_debug.events import StepCompleted
from eventbus_debug.log.encoding import encode_events
from eventbus_debug.testing import RecordingSink, capture_events, make_sample_event
from eventbus_debug.typing import Publisher


@event_type
class Custom(Event):
    kind: ClassVar[str] = "typing.custom"
    value: int
    ratio: float = 0.0


class BatchSink:
    async def handle_batch(self, events: Sequence[Event], /) -> None:
        return None


async def handler(event: StepCompleted) -> None:
    return None


async def uses_the_bus() -> None:
    async with EventBus(capacity=16, close_timeout=1.0) as bus:
        sub: Subscription = bus.subscribe(BatchSink(), StepCompleted, name="b", capacity=8)
        bus.subscribe(handler, StepCompleted)
        bus.publish_nowait(Custom(value=1, step=2))
        await bus.publish(StepCompleted(step=1, loss=0.5))
        bus.publish_threadsafe(StepCompleted(step=1))
        await bus.drain(sub, timeout=1.0)
        stats: BusStatistics = bus.statistics()
        per_sub: SubscriptionStatistics = sub.statistics()
        _ = (stats.shed, per_sub.delivered)
        async with capture_events(bus, Custom) as captured:
            _ = len(captured)
        bus.publish_nowait({"step": 1})  # type: ignore[arg-type]


def builds_events() -> None:
    custom = Custom(value=1, severity=Severity.ERROR)
    number: int = custom.value
    custom.value = 2  # type: ignore[misc]
    Custom(1)  # type: ignore[call-arg]
    sample: Custom = make_sample_event(Custom)
    line: bytes = encode_event(sample)
    lines: bytes = encode_events([sample, custom])
    back: Event = decode_event(line + lines)
    recorder = RecordingSink()
    customs: list[Custom] = recorder.of_type(Custom)
    _ = (back, customs, number)


def uses_the_sync_bus() -> None:
    with SyncEventBus(max_pending=64) as bus:
        bus.subscribe(RecordingSink())
        bus.publish(StepCompleted(step=1))
        bus.flush()
        bus.drain(timeout=1.0)
        bus.publish_nowait(StepCompleted(step=2))
        bus.publish_many_nowait([StepCompleted(step=3)])


async def the_sync_bus_is_not_awaited() -> None:
    with SyncEventBus() as bus:
        await bus.publish(StepCompleted(step=1))  # type: ignore[func-returns-value, misc]


def publishers(bus: EventBus, sync_bus: SyncEventBus) -> None:
    either: list[Publisher] = [bus, sync_bus]
    for publisher in either:
        publisher.publish_nowait(StepCompleted(step=1))
    not_a_publisher: Publisher = RecordingSink()  # type: ignore[assignment]
    _ = not_a_publisher


def the_front_door_is_explicit() -> None:
    events: Iterator[Event] = read_events(Path("events.jsonl"), strict=False)
    _ = events
    _ = eventbus_debug.NonFiniteDetected  # type: ignore[attr-defined]  # one dot away: .events
    eventbus_debug.EventBus(capacity="16")  # type: ignore[arg-type]
    read_events(Path("events.jsonl"), False)  # type: ignore[call-arg]
