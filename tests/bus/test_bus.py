"""The async EventBus: delivery, isolation, overflow, drain, close and leaks."""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Sequence
from typing import ClassVar

import anyio
import pytest

from eventbus_debug import (
    BusClosedError,
    Delivery,
    Event,
    EventBus,
    Severity,
    SubscriptionError,
    event_type,
)
from eventbus_debug._bus import _dispatch
from eventbus_debug.events import (
    EventsDropped,
    EventsUndelivered,
    GradientExploded,
    SessionStarted,
    SinkDisabled,
    SinkFailed,
    StepCompleted,
)
from eventbus_debug.testing import RecordingSink, capture_events


@event_type
class _Alarm(Event):
    """A test incident."""

    kind: ClassVar[str] = "test.bus.alarm"
    delivery: ClassVar[Delivery] = Delivery.INCIDENT
    severity: Severity = Severity.ERROR
    n: int = 0


class _Gate:
    """A sink that blocks in ``handle`` until :meth:`open` is called, recording what it saw."""

    def __init__(self, name: str = "gate") -> None:
        self.name = name
        self.events: list[Event] = []
        self.entered = anyio.Event()
        self._open = anyio.Event()

    def open(self) -> None:
        self._open.set()

    async def handle(self, event: Event, /) -> None:
        self.entered.set()
        await self._open.wait()
        self.events.append(event)


class _Raising:
    """A sink that raises on every event whose step is in ``bad`` (all events when None)."""

    def __init__(self, name: str = "raising", bad: set[int] | None = None) -> None:
        self.name = name
        self.bad = bad
        self.seen: list[Event] = []

    async def handle(self, event: Event, /) -> None:
        self.seen.append(event)
        if self.bad is None or event.step in self.bad:
            raise ValueError(f"boom at step {event.step}")


class _Hanging:
    """A sink that never returns from handle, nor from aclose."""

    name = "hanging"

    def __init__(self) -> None:
        self.started = anyio.Event()

    async def handle(self, event: Event, /) -> None:
        self.started.set()
        await anyio.sleep_forever()

    async def aclose(self) -> None:
        await anyio.sleep_forever()


class TestDelivery:
    async def test_every_subscriber_gets_every_event_in_order(self, bus: EventBus) -> None:
        """Fan-out: each subscription receives all matching events in publish order."""
        sinks = [RecordingSink(name=f"r{i}") for i in range(4)]
        for s in sinks:
            bus.subscribe(s)
        for i in range(50):
            bus.publish_nowait(StepCompleted(step=i, loss=float(i)))
        with anyio.fail_after(5):
            await bus.drain()
        for s in sinks:
            assert [e.step for e in s.of_type(StepCompleted)] == list(range(50))
        stats = bus.statistics()
        assert stats.published == 50
        assert all(sub.delivered == 50 for sub in stats.subscriptions)

    async def test_sequence_numbers_are_assigned_in_publish_order(self, bus: EventBus) -> None:
        """``seq`` is -1 until dispatch, then strictly increasing per bus."""
        rec = RecordingSink()
        bus.subscribe(rec)
        ev = StepCompleted(step=0)
        assert ev.seq == -1
        for i in range(5):
            bus.publish_nowait(StepCompleted(step=i))
        await bus.drain()
        seqs = [e.seq for e in rec.events]
        assert seqs == sorted(seqs) and len(set(seqs)) == 5 and seqs[0] >= 1

    async def test_every_event_class_gets_its_sequence_number(self, bus: EventBus) -> None:
        """Built-in telemetry and incidents (Anomaly subclasses) and a user's own event type,
        read back through their own classes (on Python 3.10 every slotted subclass re-declares
        the base's slots: a stamp through Event's slot was invisible, seq stayed -1)."""
        rec = RecordingSink()
        bus.subscribe(rec)
        for event in (
            StepCompleted(step=0),
            GradientExploded(step=0, total_norm=1e4, threshold=10.0),
            _Alarm(n=1),
        ):
            bus.publish_nowait(event)
        await bus.drain()
        assert [type(e).__name__ for e in rec.events] == [
            "StepCompleted",
            "GradientExploded",
            "_Alarm",
        ]
        assert [e.seq for e in rec.events] == [1, 2, 3]

    async def test_type_filter_matches_subclasses(self, bus: EventBus) -> None:
        """A subscription to a base class receives subclasses; others are filtered out."""
        rec = RecordingSink()
        bus.subscribe(rec, _Alarm)
        bus.publish_nowait(StepCompleted(step=1))
        bus.publish_nowait(_Alarm(n=1))
        await bus.drain()
        assert rec.kinds() == ["test.bus.alarm"]

    async def test_async_function_sink(self, bus: EventBus) -> None:
        """A plain ``async def`` is a sink."""
        got: list[int | None] = []

        async def handler(event: StepCompleted) -> None:
            got.append(event.step)

        bus.subscribe(handler, StepCompleted)
        await bus.publish(StepCompleted(step=7))
        await bus.drain()
        assert got == [7]

    async def test_publish_many_nowait(self, bus: EventBus, recorder: RecordingSink) -> None:
        """A batch is accepted in order; a non-event in it rejects the whole batch."""
        bus.subscribe(recorder)
        bus.publish_many_nowait([StepCompleted(step=i) for i in range(3)])
        with pytest.raises(TypeError, match="only Event instances"):
            bus.publish_many_nowait([StepCompleted(step=9), "nope"])  # type: ignore[list-item]
        await bus.drain()
        assert [e.step for e in recorder.events] == [0, 1, 2]

    async def test_start_and_aclose_called_once(self) -> None:
        """Optional ``start`` runs before the first event; ``aclose`` once at close."""
        calls: list[str] = []

        class Sink:
            async def start(self) -> None:
                calls.append("start")

            async def handle(self, event: Event, /) -> None:
                calls.append(event.kind)

            async def aclose(self) -> None:
                calls.append("close")

        async with EventBus() as bus:
            bus.subscribe(Sink(), StepCompleted)
            bus.publish_nowait(StepCompleted(step=1))
        await bus.aclose()
        assert calls == ["start", "step_completed", "close"]

    async def test_subscribe_before_start(self) -> None:
        """Subscriptions made before entering the bus start with it."""
        rec = RecordingSink()
        bus = EventBus()
        bus.subscribe(rec)
        async with bus:
            bus.publish_nowait(StepCompleted(step=3))
        assert [e.step for e in rec.events] == [3]

    async def test_sinks_closed_in_reverse_order(self) -> None:
        """Sinks close in reverse order of subscription."""
        order: list[str] = []

        class Sink:
            def __init__(self, name: str) -> None:
                self.name = name

            async def handle(self, event: Event, /) -> None:
                return None

            async def aclose(self) -> None:
                order.append(self.name)

        async with EventBus() as bus:
            for n in ("a", "b", "c"):
                bus.subscribe(Sink(n))
        assert order == ["c", "b", "a"]


class TestIsolation:
    async def test_raising_sink_reports_and_keeps_receiving(
        self, bus: EventBus, recorder: RecordingSink
    ) -> None:
        """A failure becomes a SinkFailed incident with the traceback; delivery continues."""
        bad = _Raising(bad={1})
        bus.subscribe(recorder)
        sub = bus.subscribe(bad, StepCompleted, SinkFailed)
        for i in range(4):
            bus.publish_nowait(StepCompleted(step=i))
        with anyio.fail_after(5):
            await bus.drain()
            await bus.drain()
        failures = recorder.of_type(SinkFailed)
        assert len(failures) == 1
        f = failures[0]
        assert f.sink == "raising" and f.error_type == "ValueError"
        assert f.message == "boom at step 1" and f.event_kind == "step_completed"
        assert "Traceback (most recent call last)" in f.traceback
        assert "raise ValueError" in f.traceback
        assert f.severity is Severity.ERROR and f.step == 1
        # It kept receiving, and never received the report about itself.
        assert [e.step for e in bad.seen] == [0, 1, 2, 3]
        assert not any(isinstance(e, SinkFailed) for e in bad.seen)
        st = sub.statistics()
        assert (st.delivered, st.failed, st.disabled) == (3, 1, False)
        # The other sink got every event.
        assert [e.step for e in recorder.of_type(StepCompleted)] == [0, 1, 2, 3]

    async def test_sink_disabled_after_consecutive_failures(self, recorder: RecordingSink) -> None:
        """N consecutive failures disable the sink with a SinkDisabled incident."""
        bad = _Raising()
        async with EventBus(max_consecutive_failures=3) as bus:
            bus.subscribe(recorder)
            sub = bus.subscribe(bad, Event)
            for i in range(10):
                bus.publish_nowait(StepCompleted(step=i))
            with anyio.fail_after(5):
                await bus.drain()
                await bus.drain()
            st = sub.statistics()
            assert st.disabled and st.failed == 3
            assert st.failed + st.discarded + st.delivered == 10
        disabled = recorder.of_type(SinkDisabled)
        assert len(disabled) == 1
        assert disabled[0].sink == "raising" and disabled[0].consecutive_failures == 3
        assert "ValueError: boom" in disabled[0].reason
        assert [f.consecutive_failures for f in recorder.of_type(SinkFailed)] == [1, 2, 3]
        assert len(bad.seen) == 3
        assert not any(isinstance(e, (SinkFailed, SinkDisabled)) for e in bad.seen)

    async def test_success_resets_consecutive_count(self, recorder: RecordingSink) -> None:
        """Only consecutive failures count towards disabling."""
        bad = _Raising(bad={0, 1, 3, 4, 6, 7})
        async with EventBus(max_consecutive_failures=3) as bus:
            bus.subscribe(recorder)
            sub = bus.subscribe(bad, StepCompleted)
            for i in range(9):
                bus.publish_nowait(StepCompleted(step=i))
            await bus.drain()
            assert not sub.statistics().disabled
        assert recorder.of_type(SinkDisabled) == []

    async def test_failing_start_is_reported(self, recorder: RecordingSink) -> None:
        """An exception in ``start`` becomes a SinkFailed; the sink still receives events."""
        got: list[Event] = []

        class Sink:
            name = "bad-start"

            async def start(self) -> None:
                raise OSError("cannot open")

            async def handle(self, event: Event, /) -> None:
                got.append(event)

        async with EventBus() as bus:
            bus.subscribe(recorder)
            bus.subscribe(Sink(), StepCompleted)
            bus.publish_nowait(StepCompleted(step=1))
        (failure,) = recorder.of_type(SinkFailed)
        assert failure.error_type == "OSError" and failure.event_kind == ""
        assert len(got) == 1

    async def test_exception_never_reaches_publisher(self, recorder: RecordingSink) -> None:
        """Publishing to a raising sink and closing the bus raise nothing."""
        async with EventBus() as bus:
            bus.subscribe(_Raising())
            bus.subscribe(recorder)
            await bus.publish(StepCompleted(step=0))
            await bus.drain()
        assert len(recorder.of_type(StepCompleted)) == 1

    async def test_hanging_sink_close_timeout_reported(self, recorder: RecordingSink) -> None:
        """A hanging sink delays no one; at close its queue is reported as undelivered."""
        hanging = _Hanging()
        async with EventBus(close_timeout=0.2) as bus:
            bus.subscribe(recorder)
            sub = bus.subscribe(hanging, StepCompleted)
            for i in range(5):
                bus.publish_nowait(StepCompleted(step=i))
            with anyio.fail_after(5):
                await hanging.started.wait()
                await bus.drain(bus.subscriptions[0])
            assert len(recorder.of_type(StepCompleted)) == 5
        (report,) = recorder.of_type(EventsUndelivered)
        assert report.sink == "hanging" and report.undelivered == 5
        assert report.timeout_s == pytest.approx(0.2)
        assert sub.statistics().undelivered == 5
        assert recorder.closed == 1


class TestLifecycleErrors:
    async def test_publish_before_start(self) -> None:
        """Publishing to a bus that was never entered says how to start it."""
        bus = EventBus()
        with pytest.raises(BusClosedError, match="not running yet"):
            bus.publish_nowait(StepCompleted(step=0))
        with pytest.raises(BusClosedError, match="not running yet"):
            bus.publish_threadsafe(StepCompleted(step=0))
        with pytest.raises(BusClosedError, match="needs a running bus"):
            await bus.drain()

    async def test_publish_after_close(self) -> None:
        """Every publish operation raises BusClosedError after close."""
        async with EventBus() as bus:
            pass
        assert bus.closed and not bus.running
        for op in (bus.publish_nowait, bus.publish_threadsafe):
            with pytest.raises(BusClosedError, match="the bus is closed"):
                op(StepCompleted(step=0))
        with pytest.raises(BusClosedError, match="the bus is closed"):
            await bus.publish(StepCompleted(step=0))
        with pytest.raises(BusClosedError, match="the bus is closed"):
            bus.publish_many_nowait([StepCompleted(step=0)])
        with pytest.raises(BusClosedError, match="cannot subscribe"):
            bus.subscribe(RecordingSink())

    async def test_publish_non_event(self, bus: EventBus) -> None:
        """Only Event instances can be published."""
        with pytest.raises(TypeError, match="only Event instances can be published, got dict"):
            bus.publish_nowait({"step": 1})  # type: ignore[arg-type]

    async def test_close_is_idempotent(self, recorder: RecordingSink) -> None:
        """aclose twice, and aclose then leaving the block, close each sink once."""
        async with EventBus() as bus:
            bus.subscribe(recorder)
            await bus.aclose()
            await bus.aclose()
        await bus.aclose()
        assert recorder.closed == 1

    async def test_enter_twice(self) -> None:
        """A bus can be entered once."""
        async with EventBus() as bus:
            pass
        with pytest.raises(RuntimeError, match="entered once"):
            await bus.__aenter__()

    @pytest.mark.parametrize(
        ("kwargs", "match"),
        [
            ({"capacity": 0}, "capacity must be an int >= 1, got 0"),
            ({"capacity": True}, "capacity must be an int >= 1, got True"),
            ({"close_timeout": 0}, "close_timeout must be a finite number of seconds > 0"),
            ({"close_timeout": float("nan")}, "close_timeout must be a finite number of seconds"),
            ({"max_consecutive_failures": -1}, "max_consecutive_failures must be an int >= 1"),
            ({"drop_report_interval": -1.0}, "drop_report_interval must be a finite number of"),
            ({"stall_threshold": 0.0}, "stall_threshold must be a finite number of seconds > 0"),
        ],
    )
    def test_bad_bus_options(self, kwargs: dict[str, object], match: str) -> None:
        """Constructor arguments are validated with a message naming them."""
        with pytest.raises(ValueError, match=match):
            EventBus(**kwargs)  # type: ignore[arg-type]


class TestSubscribeValidation:
    def _sync_fn(self, event: Event) -> None:
        return None

    @pytest.mark.parametrize(
        ("sink", "types", "kwargs", "match"),
        [
            (42, (), {}, r"42 is not a sink: pass an `async def handler\(event\)`"),
            (print, (), {}, "is not an async function"),
            (RecordingSink, (), {}, r"is a class \(RecordingSink\); pass an instance"),
            (
                RecordingSink(),
                (int,),
                {},
                "event_types must be Event subclasses, got <class 'int'>",
            ),
            (RecordingSink(), ("StepCompleted",), {}, "event_types must be Event subclasses"),
            (RecordingSink(), (), {"capacity": 0}, "capacity must be a positive integer, got 0"),
            (RecordingSink(), (), {"capacity": 2.5}, "capacity must be a positive integer"),
            (RecordingSink(), (), {"name": ""}, "name must be a non-empty string"),
        ],
    )
    async def test_bad_arguments(
        self,
        bus: EventBus,
        sink: object,
        types: tuple[object, ...],
        kwargs: dict[str, object],
        match: str,
    ) -> None:
        """subscribe rejects unusable arguments with a message naming the argument and rule."""
        with pytest.raises(SubscriptionError, match=match):
            bus.subscribe(sink, *types, **kwargs)  # type: ignore[arg-type]
        assert bus.subscriptions == ()

    async def test_sync_handle_method(self, bus: EventBus) -> None:
        """A sink whose handle is not ``async def`` is rejected."""

        class SyncSink:
            def handle(self, event: Event) -> None:
                return None

        with pytest.raises(SubscriptionError, match="handle must be an `async def` method"):
            bus.subscribe(SyncSink())

    async def test_sync_start_method(self, bus: EventBus) -> None:
        """A sink whose start is not ``async def`` is rejected."""

        class SyncStart:
            def start(self) -> None:
                return None

            async def handle(self, event: Event) -> None:
                return None

        with pytest.raises(SubscriptionError, match="start must be an `async def` method"):
            bus.subscribe(SyncStart())

    async def test_duplicate_name(self, bus: EventBus) -> None:
        """An explicit duplicate name is an error; a default name is made unique."""
        bus.subscribe(RecordingSink(name="rec"))
        with pytest.raises(SubscriptionError, match="a subscription named 'rec' already exists"):
            bus.subscribe(RecordingSink(), name="rec")
        second = bus.subscribe(RecordingSink(name="rec"))
        assert second.name == "rec-2"

    async def test_subscribe_errors_are_type_errors(self, bus: EventBus) -> None:
        """SubscriptionError is a TypeError, so generic handlers catch it."""
        with pytest.raises(TypeError):
            bus.subscribe(object())


class TestOverflow:
    async def test_full_queue_sheds_telemetry_oldest_first(self, recorder: RecordingSink) -> None:
        """Telemetry beyond capacity is shed oldest first and counted; incidents all arrive."""
        gate = _Gate()
        async with EventBus(drop_report_interval=60.0) as bus:
            bus.subscribe(recorder, name="all", capacity=10_000)
            sub = bus.subscribe(gate, name="gate", capacity=4)
            bus.publish_nowait(StepCompleted(step=-1))
            with anyio.fail_after(5):
                await gate.entered.wait()  # step -1 is in flight, the queue is empty
            for i in range(20):
                bus.publish_nowait(StepCompleted(step=i))
                if i % 2:
                    bus.publish_nowait(_Alarm(n=i))
            await bus.drain(bus.subscriptions[0])
            st = sub.statistics()
            # 10 incidents were queued beyond capacity; all telemetry shed to make room.
            assert st.shed == 20
            assert st.queued >= 10
            gate.open()
            with anyio.fail_after(5):
                await bus.drain()
        alarms = [e.n for e in gate.events if isinstance(e, _Alarm)]
        assert alarms == list(range(1, 20, 2))
        steps = [e.step for e in gate.events if isinstance(e, StepCompleted)]
        assert steps == [-1]
        drops = [e for e in recorder.of_type(EventsDropped) if e.sink == "gate"]
        assert sum(d.dropped for d in drops) == 20
        assert drops[-1].total_dropped == 20
        assert len(drops) < 20  # coalesced, not one per shed event
        assert sum(sum(d.by_kind.values()) for d in drops) == 20
        assert set().union(*(d.by_kind for d in drops)) == {"step_completed"}
        assert bus.statistics().shed == 20

    async def test_deferred_drop_report_arrives_after_the_interval(
        self, recorder: RecordingSink
    ) -> None:
        """Sheds within the report interval are reported once it has passed, unprompted."""
        gate = _Gate()
        async with EventBus(drop_report_interval=0.05) as bus:
            bus.subscribe(recorder, EventsDropped, name="all", capacity=10_000)
            bus.subscribe(gate, StepCompleted, name="gate", capacity=2)
            bus.publish_nowait(StepCompleted(step=-1))
            with anyio.fail_after(5):
                await gate.entered.wait()
            for i in range(5):
                bus.publish_nowait(StepCompleted(step=i))
            await bus.drain(bus.subscriptions[0])
            for i in range(5, 9):
                bus.publish_nowait(StepCompleted(step=i))
            await bus.drain(bus.subscriptions[0])
            with anyio.fail_after(5):
                while len(recorder.events) < 2:
                    await anyio.sleep(0.01)  # the interval is what is being tested
            gate.open()
        reports = recorder.of_type(EventsDropped)
        assert [r.dropped for r in reports] == [3, 4]
        assert [r.total_dropped for r in reports] == [3, 7]

    async def test_newest_telemetry_kept(self) -> None:
        """With only telemetry queued, the newest events survive."""
        gate = _Gate()
        async with EventBus(drop_report_interval=60.0) as bus:
            sub = bus.subscribe(gate, StepCompleted, capacity=3)
            bus.publish_nowait(StepCompleted(step=-1))
            with anyio.fail_after(5):
                await gate.entered.wait()
            for i in range(10):
                bus.publish_nowait(StepCompleted(step=i))
            await bus.publish(StepCompleted(step=10))
            with anyio.fail_after(5):  # dispatched (at once on asyncio; trio may take turns)
                while sub.statistics().shed < 8:
                    await anyio.sleep(0.001)
            assert sub.statistics().shed == 8
            gate.open()
        assert [e.step for e in gate.events] == [-1, 8, 9, 10]


class TestThreads:
    async def test_four_threads_publish_concurrently(self, recorder: RecordingSink) -> None:
        """Nothing is lost and each thread's order is kept."""
        n_threads, per_thread = 4, 2000
        barrier = threading.Barrier(n_threads)
        async with EventBus(capacity=n_threads * per_thread * 2) as bus:
            bus.subscribe(recorder, StepCompleted)

            def worker(k: int) -> None:
                barrier.wait()
                for i in range(per_thread):
                    bus.publish_threadsafe(StepCompleted(step=i, source=f"t{k}"))

            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    for k in range(n_threads):
                        tg.start_soon(anyio.to_thread.run_sync, worker, k)
                await bus.drain()
            assert bus.statistics().published == n_threads * per_thread
        for k in range(n_threads):
            steps = [e.step for e in recorder.events if e.source == f"t{k}"]
            assert steps == list(range(per_thread))
        seqs = [e.seq for e in recorder.events]
        assert seqs == sorted(seqs)

    async def test_publish_threadsafe_without_wake(self, bus: EventBus) -> None:
        """``wake=False`` events are picked up by the next wake-up or drain."""
        rec = RecordingSink()
        bus.subscribe(rec)

        def worker() -> None:
            for i in range(5):
                bus.publish_threadsafe(StepCompleted(step=i), wake=False)

        await anyio.to_thread.run_sync(worker)
        assert bus.statistics().pending == 5
        await bus.drain()
        assert [e.step for e in rec.events] == list(range(5))


class TestDrain:
    async def test_drain_waits_only_for_given_subscriptions(self, bus: EventBus) -> None:
        """drain(sub) returns while another sink is still blocked."""
        gate = _Gate()
        fast = RecordingSink()
        fast_sub = bus.subscribe(fast)
        bus.subscribe(gate)
        for i in range(3):
            bus.publish_nowait(StepCompleted(step=i))
        with anyio.fail_after(5):
            await bus.drain(fast_sub)
        assert len(fast.events) == 3
        assert gate.events == []
        with pytest.raises(TimeoutError):
            await bus.drain(timeout=0.05)
        gate.open()
        with anyio.fail_after(5):
            await bus.drain()
        assert len(gate.events) == 3

    async def test_drain_covers_events_published_by_sinks(self, bus: EventBus) -> None:
        """Failure reports published by the bus are delivered by a second drain."""
        rec = RecordingSink()
        bus.subscribe(rec)
        bus.subscribe(_Raising(), StepCompleted)
        bus.publish_nowait(StepCompleted(step=0))
        await bus.drain()
        await bus.drain()
        assert len(rec.of_type(SinkFailed)) == 1

    async def test_drain_on_idle_bus_returns(self, bus: EventBus) -> None:
        """Draining with nothing published returns at once."""
        with anyio.fail_after(5):
            await bus.drain()
            await bus.drain(timeout=1.0)

    async def test_has_undispatched_filters_by_type(self, bus: EventBus) -> None:
        """has_undispatched sees published-but-not-dispatched events, by type, until dispatch."""
        bus.subscribe(RecordingSink())
        assert not bus.has_undispatched()
        bus.publish_nowait(StepCompleted(step=0))
        assert bus.has_undispatched()
        assert bus.has_undispatched(StepCompleted)
        assert not bus.has_undispatched(SinkFailed)
        await bus.drain()
        assert not bus.has_undispatched(StepCompleted)
        bus.publish_threadsafe(_Alarm(step=1), wake=False)
        assert bus.has_undispatched(_Alarm)
        await bus.drain()
        assert not bus.has_undispatched()

    async def test_drain_after_close_returns(self) -> None:
        """drain on a closed bus returns (everything was delivered by close)."""
        async with EventBus() as bus:
            pass
        with anyio.fail_after(5):
            await bus.drain()


@event_type
class _Tripwire(Event):
    """A test incident with a telemetry subclass (the counter cannot answer for it)."""

    kind: ClassVar[str] = "test.bus.tripwire"
    delivery: ClassVar[Delivery] = Delivery.INCIDENT


@event_type
class _QuietTripwire(_Tripwire):
    """A telemetry subclass of an incident class."""

    kind: ClassVar[str] = "test.bus.quiet_tripwire"
    delivery: ClassVar[Delivery] = Delivery.TELEMETRY


class TestUndispatchedIncidents:
    async def test_telemetry_in_flight_is_no_incident(self, bus: EventBus) -> None:
        """Only telemetry in flight: has_undispatched(incident type) is False, the type asked
        for telemetry is True."""
        bus.subscribe(RecordingSink())
        bus.publish_many_nowait([StepCompleted(step=i) for i in range(100)])
        assert not bus.has_undispatched(_Alarm)
        assert not bus.has_undispatched(_Alarm, SinkFailed)
        assert bus.has_undispatched(StepCompleted)
        assert bus.has_undispatched(_Alarm, StepCompleted)

    async def test_every_publish_path_counts_incidents(self, bus: EventBus) -> None:
        """publish_nowait, publish_many_nowait and publish_threadsafe incidents are seen until
        dispatched, then not any more."""
        bus.subscribe(RecordingSink())
        bus.publish_nowait(_Alarm(n=1))
        assert bus.has_undispatched(_Alarm)
        await bus.drain()
        assert not bus.has_undispatched(_Alarm)
        bus.publish_many_nowait([StepCompleted(step=1), _Alarm(n=2)])
        assert bus.has_undispatched(_Alarm)
        await bus.drain()
        assert not bus.has_undispatched(_Alarm)
        bus.publish_threadsafe(_Alarm(n=3), wake=False)
        assert bus.has_undispatched(_Alarm)
        await bus.drain()
        assert not bus.has_undispatched(_Alarm)

    async def test_an_incident_of_another_type_is_not_a_match(self, bus: EventBus) -> None:
        """An undispatched SinkFailed does not count as an undispatched _Alarm."""
        bus.subscribe(RecordingSink())
        bus.publish_nowait(SinkFailed(sink="x", error_type="E", message="m"))
        assert bus.has_undispatched(SinkFailed)
        assert not bus.has_undispatched(_Alarm)
        await bus.drain()

    async def test_a_burst_longer_than_a_round_keeps_its_count(
        self, bus: EventBus, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """After one dispatch round of a long burst, the incidents left in the buffer count."""
        monkeypatch.setattr(_dispatch, "DISPATCH_ROUND", 4)
        bus.subscribe(RecordingSink())
        bus.publish_many_nowait([StepCompleted(step=i) for i in range(6)] + [_Alarm(n=1)])
        bus._dispatch()  # one round, synchronously: the incident is in what is left
        assert bus.has_undispatched(_Alarm)
        bus._dispatch()
        assert not bus.has_undispatched(_Alarm)
        bus.publish_many_nowait([_Alarm(n=2)] + [StepCompleted(step=i) for i in range(6)])
        bus._dispatch()  # the incident went out in the first round
        assert not bus.has_undispatched(_Alarm)
        assert bus.has_undispatched(StepCompleted)
        await bus.drain()

    async def test_a_telemetry_subclass_is_still_found(self, bus: EventBus) -> None:
        """A telemetry subclass of an incident class is found by a scan, not missed."""
        bus.subscribe(RecordingSink())
        bus.publish_nowait(_QuietTripwire())
        assert bus.has_undispatched(_Tripwire)
        await bus.drain()
        assert not bus.has_undispatched(_Tripwire)


class TestCancel:
    async def test_cancelled_subscription_receives_nothing(self, bus: EventBus) -> None:
        """After cancel, no event is delivered; cancel is idempotent; the name is free."""
        rec = RecordingSink(name="rec")
        sub = bus.subscribe(rec)
        bus.publish_nowait(StepCompleted(step=0))
        await bus.drain()
        sub.cancel()
        sub.cancel()
        bus.publish_nowait(StepCompleted(step=1))
        await bus.drain()
        assert [e.step for e in rec.events] == [0]
        assert bus.subscriptions == ()
        assert rec.closed == 0  # the caller owns an unsubscribed sink
        bus.subscribe(RecordingSink(name="rec"))

    async def test_cancel_discards_queued(self, bus: EventBus) -> None:
        """Events queued for a cancelled subscription, and the one in the sink's hands, are
        counted as discarded."""
        gate = _Gate()
        with bus.subscribe(gate) as sub:
            for i in range(4):
                bus.publish_nowait(StepCompleted(step=i))
            with anyio.fail_after(5):
                await gate.entered.wait()
        assert sub.statistics().discarded == 4
        await bus.drain()

    async def test_capture_events(self, bus: EventBus) -> None:
        """capture_events records the block's events and unsubscribes."""
        async with capture_events(bus, StepCompleted) as events:
            bus.publish_nowait(StepCompleted(step=1))
            bus.publish_nowait(SessionStarted(name="x"))
        assert [type(e) for e in events] == [StepCompleted]
        assert bus.subscriptions == ()


class TestCancellationAndLeaks:
    async def test_cancelling_enclosing_task_still_drains(self) -> None:
        """Close is shielded: cancelling the training task delivers what was queued."""
        rec = RecordingSink()
        slow_seen: list[int | None] = []

        async def slow(event: StepCompleted) -> None:
            await anyio.sleep(0)
            slow_seen.append(event.step)

        async def training() -> None:
            async with EventBus() as bus:
                bus.subscribe(rec)
                bus.subscribe(slow, StepCompleted)
                for i in range(200):
                    bus.publish_nowait(StepCompleted(step=i))
                await anyio.sleep_forever()

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(training)
                await anyio.wait_all_tasks_blocked()
                tg.cancel_scope.cancel()
        assert len(rec.events) == 200
        assert slow_seen == list(range(200))
        assert rec.closed == 1

    async def test_closed_bus_and_cancelled_subscription_are_collectable(self) -> None:
        """No reference cycle keeps a closed bus, a cancelled subscription or its sink alive."""
        async with EventBus() as live:
            sink = RecordingSink()
            sub = live.subscribe(sink)
            live.publish_nowait(StepCompleted(step=0))
            await live.drain()
            sub.cancel()
            await live.drain()
            sub_ref, sink_ref = weakref.ref(sub), weakref.ref(sink)
            del sub, sink
            with anyio.fail_after(
                5
            ):  # its task has ended (at once on asyncio; trio may take turns)
                while gc.collect() or sub_ref() is not None:
                    await anyio.sleep(0.001)
            assert sub_ref() is None
            assert sink_ref() is None

        async with EventBus() as bus:
            bus.subscribe(RecordingSink())
            bus.publish_nowait(StepCompleted(step=0))
        bus_ref = weakref.ref(bus)
        del bus
        gc.collect()
        assert bus_ref() is None

    def test_unclosed_bus_warns(self) -> None:
        """A running bus collected without being closed emits a ResourceWarning."""
        bus = EventBus()
        bus._state = type(bus._state).RUNNING  # simulate a leaked, running bus
        with pytest.warns(ResourceWarning, match="garbage-collected without being closed"):
            bus.__del__()
        bus._state = type(bus._state).CLOSED


class TestStatistics:
    async def test_statistics_shape(self, bus: EventBus) -> None:
        """Statistics are frozen snapshots with per-subscription counters."""
        sub = bus.subscribe(RecordingSink(name="r"), capacity=7)
        bus.publish_nowait(StepCompleted(step=0))
        snap = bus.statistics()
        assert snap.pending == 1 and snap.published == 1
        await bus.drain()
        st = sub.statistics()
        assert (st.name, st.capacity, st.delivered, st.queued) == ("r", 7, 1, 0)
        with pytest.raises(AttributeError):
            st.delivered = 3  # type: ignore[misc]
        assert bus.statistics().dispatched == 1


async def test_batch_sink_receives_batches(bus: EventBus) -> None:
    """handle_batch receives everything queued at once, in order, never empty."""
    batches: list[int] = []

    class Batcher:
        async def handle_batch(self, events: Sequence[Event], /) -> None:
            assert events
            batches.append(len(events))

    bus.subscribe(Batcher())
    for i in range(100):
        bus.publish_nowait(StepCompleted(step=i))
    await bus.drain()
    assert sum(batches) == 100
    assert len(batches) < 100
