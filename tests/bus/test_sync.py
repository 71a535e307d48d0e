"""SyncEventBus: the bus for plain for-loops, running on a background thread."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import ClassVar

import anyio
import pytest

from eventbus_debug import BusClosedError, Event, EventBus, SyncEventBus, event_type
from eventbus_debug.events import SessionStarted, StepCompleted
from eventbus_debug.testing import RecordingSink


@event_type
class _Incident(Event):
    kind: ClassVar[str] = "test.sync.incident"


class _Signal:
    """Sets a threading.Event once it has seen ``n`` events; records the handling thread."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.events: list[Event] = []
        self.threads: set[int] = set()
        self.done = threading.Event()

    async def handle(self, event: Event, /) -> None:
        self.threads.add(threading.get_ident())
        self.events.append(event)
        if len(self.events) >= self.n:
            self.done.set()


def test_lossless_publish_flush_close() -> None:
    """Every event published from the loop arrives, in order, by the time close returns."""
    rec = RecordingSink()
    with SyncEventBus(capacity=100_000) as bus:
        bus.subscribe(rec)
        for step in range(2000):
            bus.publish(StepCompleted(step=step, loss=1.0 / (step + 1)))
            if step % 10 == 9:
                bus.flush()
    assert [e.step for e in rec.of_type(StepCompleted)] == list(range(2000))
    assert rec.closed == 1
    assert bus.statistics().published == 2000


class _SlowLog:
    """A flow-controlled sink slower than the publisher: a short sleep per batch."""

    def __init__(self) -> None:
        self.steps: list[int | None] = []

    async def handle_batch(self, events: list[Event], /) -> None:
        await anyio.sleep(0.0005)
        self.steps += [e.step for e in events]


@pytest.mark.parametrize("flush_every", [100, 0])
def test_flush_keeps_a_flow_controlled_sink_lossless_when_publishing_outruns_it(
    flush_every: int,
) -> None:
    """A training thread that publishes faster than the bus's thread dispatches: ``flush()``
    (explicit, or the one every ``max_pending`` events) waits for the handed-over events to be
    dispatched before they would overfill a flow-controlled sink, which then sheds nothing."""
    sink = _SlowLog()
    with SyncEventBus(max_pending=64) as bus:
        sub = bus.subscribe(sink, backpressure=True, capacity=256)
        for step in range(20_000):
            bus.publish(StepCompleted(step=step, loss=1.0))
            if flush_every and step % flush_every == flush_every - 1:
                bus.flush()
    assert sub.statistics().shed == 0
    assert sink.steps == list(range(20_000))


def test_sinks_run_on_the_bus_thread() -> None:
    """subscribe is called from the training thread; the sink runs on the bus's thread."""
    sig = _Signal(1)
    with SyncEventBus() as bus:
        bus.subscribe(sig, StepCompleted)
        bus.publish(StepCompleted(step=0))
        bus.drain()
        assert len(sig.events) == 1
    assert threading.get_ident() not in sig.threads


def test_incident_flushes_at_once() -> None:
    """An incident is handed over without waiting for flush; telemetry waits for it."""
    sig = _Signal(1)
    with SyncEventBus() as bus:
        bus.subscribe(sig, _Incident)
        bus.publish(StepCompleted(step=0))
        assert bus.statistics().pending == 1  # buffered until the next flush
        bus.publish(_Incident())
        assert sig.done.wait(timeout=10)
        assert isinstance(sig.events[0], _Incident)


def test_max_pending_flushes() -> None:
    """The max_pending-th buffered event triggers a flush."""
    sig = _Signal(5)
    with SyncEventBus(max_pending=5) as bus:
        bus.subscribe(sig, StepCompleted)
        for i in range(5):
            bus.publish(StepCompleted(step=i))
        assert sig.done.wait(timeout=10)


def test_publish_many_and_drain_one_subscription() -> None:
    """publish_many flushes once; drain(sub) waits for that subscription."""
    rec = RecordingSink()
    with SyncEventBus() as bus:
        sub = bus.subscribe(rec)
        bus.publish_many([StepCompleted(step=i) for i in range(10)])
        bus.drain(sub, timeout=10)
        assert len(rec.events) == 10
        assert sub.statistics().delivered == 10


def test_exception_in_loop_still_delivers() -> None:
    """An error in the training loop propagates after everything was delivered."""
    rec = RecordingSink()
    with pytest.raises(ZeroDivisionError), SyncEventBus() as bus:
        bus.subscribe(rec)
        bus.publish(SessionStarted(name="run"))
        bus.publish(StepCompleted(step=1))
        _ = 1 / 0
    assert rec.kinds() == ["session_started", "step_completed"]


def test_lifecycle_errors() -> None:
    """Publishing before start or after close raises BusClosedError; close is idempotent."""
    bus = SyncEventBus()
    with pytest.raises(BusClosedError, match="not running yet"):
        bus.publish(StepCompleted(step=0))
    with pytest.raises(BusClosedError, match="use `with SyncEventBus"):
        bus.flush()
    with pytest.raises(BusClosedError, match="use `with SyncEventBus"):
        _ = bus.portal
    with bus:
        assert isinstance(bus.bus, EventBus)
    bus.close()
    bus.close()
    with pytest.raises(BusClosedError, match="the bus is closed"):
        bus.publish(StepCompleted(step=0))


def test_bad_options() -> None:
    """Options are validated at construction."""
    with pytest.raises(ValueError, match="max_pending must be an int >= 1, got 0"):
        SyncEventBus(max_pending=0)
    with pytest.raises(ValueError, match="capacity must be an int >= 1"):
        SyncEventBus(capacity=-1)


def test_non_event_rejected() -> None:
    """Only events can be published."""
    with SyncEventBus() as bus, pytest.raises(TypeError, match="only Event instances"):
        bus.publish("step 1")  # type: ignore[arg-type]


def test_drain_timeout() -> None:
    """drain(timeout=...) raises TimeoutError when a sink does not finish in time."""
    release = threading.Event()

    class Blocking:
        async def handle(self, event: Event, /) -> None:
            import anyio

            await anyio.to_thread.run_sync(release.wait)

    with SyncEventBus(close_timeout=5) as bus:
        bus.subscribe(Blocking())
        bus.publish(StepCompleted(step=0))
        try:
            with pytest.raises(TimeoutError):
                bus.drain(timeout=0.05)
        finally:
            release.set()
        bus.drain(timeout=10)


def test_refusals_before_with_name_the_sync_bus() -> None:
    """Every entry point of a SyncEventBus not entered yet says `with SyncEventBus() as bus:`,
    never the async bus's `async with EventBus()`."""
    bus = SyncEventBus()
    event = StepCompleted(step=0, loss=1.0)
    calls: dict[str, Callable[[], object]] = {
        "publish": lambda: bus.publish(event),
        "publish_nowait": lambda: bus.publish_nowait(event),
        "publish_many": lambda: bus.publish_many([event]),
        "publish_many_nowait": lambda: bus.publish_many_nowait([event]),
        "subscribe": lambda: bus.subscribe(RecordingSink()),
        "drain": lambda: bus.drain(),
        "flush": lambda: bus.flush(),
    }
    for name, call in calls.items():
        with pytest.raises(BusClosedError) as info:
            call()
        assert "`with SyncEventBus() as bus:`" in str(info.value), name
        assert "async with" not in str(info.value), name


async def test_async_bus_refusal_still_names_async_with() -> None:
    """The async bus's own refusal keeps its hint."""
    with pytest.raises(BusClosedError, match=r"publish inside `async with EventBus\(\) as bus:`"):
        EventBus().publish_nowait(StepCompleted(step=0, loss=1.0))


async def _hang(alert: object) -> None:
    await anyio.sleep(100)


def _incident(step: int) -> Event:
    from eventbus_debug.events import NonFiniteDetected, TensorRole

    return NonFiniteDetected(step=step, role=TensorRole.LOSS, names=("loss",))


async def test_a_sinks_incident_published_while_the_bus_closes_reaches_the_log() -> None:
    """An alert handler that times out on the last events, while the bus closes, becomes an
    AlertHandlerFailed that the sinks not closed yet (the log, subscribed first) record."""
    from eventbus_debug.sinks import AlertSink, rules

    log = RecordingSink()
    async with EventBus() as bus:
        bus.subscribe(log)
        alerts = AlertSink(bus, timeout=0.2)
        alerts.add_rule(rules.non_finite(), _hang)
        bus.subscribe(alerts)
        bus.publish_nowait(_incident(1))
    assert [e.kind for e in log.events].count("sinks.alert_handler_failed") == 1
    with pytest.raises(BusClosedError):  # anyone else is still refused after the close
        bus.publish_nowait(_incident(2))


def test_a_sinks_incident_published_while_the_sync_bus_closes_reaches_the_log() -> None:
    from eventbus_debug.sinks import AlertSink, rules

    log = RecordingSink()
    with SyncEventBus() as bus:
        bus.subscribe(log)
        alerts = AlertSink(bus, timeout=0.2)
        alerts.add_rule(rules.non_finite(), _hang)
        bus.subscribe(alerts)
        bus.publish_nowait(_incident(1))
        bus.publish_nowait(_incident(2))
    assert [e.kind for e in log.events].count("sinks.alert_handler_failed") == 2
