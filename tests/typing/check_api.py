"""Type-checked only (``mypy tests/typing``), never run: the public API's types hold up.

Lines marked ``# type: ignore[...]`` must stay errors; mypy's ``warn_unused_ignores`` (part of
``strict``) fails if one of them starts type-checking.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

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
)
from eventbus_debug.events import StepCompleted
from eventbus_debug.log.encoding import encode_events
from eventbus_debug.testing import RecordingSink, capture_events, make_sample_event


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
    Custom(1)  # type: ignore[misc, call-arg]
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
