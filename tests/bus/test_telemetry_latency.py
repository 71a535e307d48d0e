"""EventBus(telemetry_latency=...): telemetry fanned out in batches, incidents never wait."""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import ClassVar

import anyio
import pytest

from eventbus_debug import Delivery, Event, EventBus, event_type
from eventbus_debug._bus._dispatch import HOLD_MAX
from eventbus_debug.events import StepCompleted

LONG = 30.0
"""A latency no test waits out: anything delivered early was released by the rule tested."""


@event_type
class _Alarm(Event):
    """A test incident."""

    kind: ClassVar[str] = "test.latency.alarm"
    delivery: ClassVar[Delivery] = Delivery.INCIDENT


class _Batches:
    """Records every batch a sink was handed."""

    def __init__(self) -> None:
        self.batches: list[list[Event]] = []

    async def handle_batch(self, events: Sequence[Event], /) -> None:
        self.batches.append(list(events))

    @property
    def events(self) -> list[Event]:
        return [e for batch in self.batches for e in batch]

    def steps(self) -> list[int | None]:
        return [e.step for e in self.events if isinstance(e, StepCompleted)]


async def _settle() -> None:
    """Let every task run until all are blocked (no timer fires in between)."""
    await anyio.wait_all_tasks_blocked()
    await anyio.wait_all_tasks_blocked()


async def _started(bus: EventBus) -> None:
    """Publish one event after a quiet spell and let it through: the bus then holds."""
    bus.publish_nowait(StepCompleted(step=-1))
    await _settle()


async def test_steady_telemetry_is_delivered_in_batches_in_order_and_complete() -> None:
    """A loop publishing one event per turn gets them in a few batches, every one, in order."""
    sink = _Batches()
    async with EventBus(telemetry_latency=LONG) as bus:
        bus.subscribe(sink)
        for step in range(300):
            bus.publish_nowait(StepCompleted(step=step))
            await anyio.sleep(0)  # a training step's await: the dispatcher gets a turn
    assert sink.steps() == list(range(300))
    assert len(sink.batches) <= 3  # without the latency: one batch per event


async def test_telemetry_waits_during_a_hold_and_an_incident_releases_it_at_once() -> None:
    """Held telemetry stays put; an incident is dispatched at once, with what waited before it."""
    sink = _Batches()
    async with EventBus(telemetry_latency=LONG) as bus:
        bus.subscribe(sink)
        await _started(bus)
        bus.publish_nowait(StepCompleted(step=0))
        bus.publish_nowait(StepCompleted(step=1))
        await _settle()
        assert sink.steps() == [-1]  # held
        assert bus.has_undispatched()
        bus.publish_nowait(_Alarm())
        with anyio.fail_after(5):
            while not any(isinstance(e, _Alarm) for e in sink.events):
                await anyio.sleep(0.001)
        assert sink.steps() == [-1, 0, 1]
        assert isinstance(sink.events[-1], _Alarm)


async def test_publish_many_with_an_incident_releases_the_hold() -> None:
    """A batch holding an incident (the probe's events of a firing step) is not held."""
    sink = _Batches()
    async with EventBus(telemetry_latency=LONG) as bus:
        bus.subscribe(sink)
        await _started(bus)
        bus.publish_many_nowait([StepCompleted(step=0)])
        await _settle()
        assert sink.steps() == [-1]
        bus.publish_many_nowait([StepCompleted(step=1), _Alarm()])
        with anyio.fail_after(5):
            while len(sink.events) < 4:
                await anyio.sleep(0.001)
        assert sink.steps() == [-1, 0, 1]


async def test_drain_releases_the_hold() -> None:
    """drain() returns promptly with everything delivered, whatever the latency."""
    sink = _Batches()
    async with EventBus(telemetry_latency=LONG) as bus:
        bus.subscribe(sink)
        await _started(bus)
        for step in range(5):
            bus.publish_nowait(StepCompleted(step=step))
        with anyio.fail_after(5):
            await bus.drain()
        assert sink.steps() == [-1, 0, 1, 2, 3, 4]


async def test_close_delivers_held_telemetry_without_waiting_out_the_latency() -> None:
    """Leaving the bus delivers what was held, in far less than the latency."""
    sink = _Batches()
    with anyio.fail_after(5):
        async with EventBus(telemetry_latency=LONG) as bus:
            bus.subscribe(sink)
            await _started(bus)
            for step in range(3):
                bus.publish_nowait(StepCompleted(step=step))
            await _settle()
    assert sink.steps() == [-1, 0, 1, 2]


async def test_a_full_hold_is_dispatched_without_waiting() -> None:
    """HOLD_MAX waiting events are dispatched at once (the held buffer stays bounded)."""
    sink = _Batches()
    async with EventBus(telemetry_latency=LONG) as bus:
        bus.subscribe(sink, capacity=4 * HOLD_MAX)
        await _started(bus)
        for step in range(HOLD_MAX + 10):
            bus.publish_nowait(StepCompleted(step=step))
        with anyio.fail_after(5):
            while len(sink.steps()) < HOLD_MAX:
                await anyio.sleep(0.001)
        assert sink.steps()[: HOLD_MAX + 1] == [-1, *range(HOLD_MAX)]


async def test_the_first_event_after_a_quiet_spell_is_dispatched_at_once() -> None:
    """A sparse publisher pays no latency: the hold only batches a steady stream."""
    sink = _Batches()
    async with EventBus(telemetry_latency=0.05) as bus:
        bus.subscribe(sink)
        await _started(bus)
        await anyio.sleep(0.1)  # quiet for longer than the latency
        bus.publish_nowait(StepCompleted(step=0))
        await _settle()
        assert sink.steps() == [-1, 0]


async def test_held_telemetry_arrives_within_the_latency() -> None:
    """Nobody drains, nothing urgent: the held events still arrive once the latency ran out."""
    sink = _Batches()
    async with EventBus(telemetry_latency=0.05) as bus:
        bus.subscribe(sink)
        await _started(bus)
        bus.publish_nowait(StepCompleted(step=0))
        await _settle()
        with anyio.fail_after(5):
            while sink.steps() != [-1, 0]:
                await anyio.sleep(0.01)


async def test_thread_telemetry_waits_and_a_thread_incident_releases_the_hold() -> None:
    """From threads too: telemetry rides the hold, an incident ends it."""
    sink = _Batches()
    async with EventBus(telemetry_latency=LONG) as bus:
        bus.subscribe(sink)
        await _started(bus)
        bus.publish_nowait(StepCompleted(step=0))  # the dispatcher now holds
        await _settle()

        def publish(event: Event) -> None:
            thread = threading.Thread(target=bus.publish_threadsafe, args=(event,))
            thread.start()
            thread.join()

        publish(StepCompleted(step=1))
        await _settle()
        assert sink.steps() == [-1]
        publish(_Alarm())
        with anyio.fail_after(5):
            while not any(isinstance(e, _Alarm) for e in sink.events):
                await anyio.sleep(0.001)
        assert sink.steps() == [-1, 0, 1]


async def test_without_a_latency_every_turn_dispatches() -> None:
    """The default (0): an event is delivered at the publisher's next await, as documented."""
    sink = _Batches()
    async with EventBus() as bus:
        bus.subscribe(sink)
        for step in range(3):
            bus.publish_nowait(StepCompleted(step=step))
            await _settle()
            assert sink.steps() == list(range(step + 1))


@pytest.mark.parametrize("bad", [-0.1, math.nan, math.inf])
def test_a_bad_latency_is_refused(bad: float) -> None:
    """A negative or non-finite latency is a ValueError naming the argument."""
    with pytest.raises(ValueError, match="telemetry_latency"):
        EventBus(telemetry_latency=bad)


def test_a_latency_of_the_wrong_type_is_refused() -> None:
    """A string latency is refused with a message naming the argument."""
    with pytest.raises((TypeError, ValueError), match="telemetry_latency"):
        EventBus(telemetry_latency="0.1")  # type: ignore[arg-type]
