"""One subscription: its pending count, its sink's adaptation, its default name and the close
of its sink."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import anyio
import pytest

from eventbus_debug import EventBus, Subscription, SubscriptionError
from eventbus_debug._bus._adapter import SinkAdapter, default_name, is_async_callable
from eventbus_debug.events import Event, SinkCloseFailed, SinkUnresponsive, StepCompleted
from eventbus_debug.testing import RecordingSink


class _Gate:
    """A batch sink that holds its first batch until :meth:`open` is called."""

    def __init__(self) -> None:
        self.name = "gate"
        self.entered = anyio.Event()
        self._open = anyio.Event()
        self.seen = 0

    def open(self) -> None:
        self._open.set()

    async def handle_batch(self, events: list[Event], /) -> None:
        self.entered.set()
        await self._open.wait()
        self.seen += len(events)


async def _held(bus: EventBus) -> tuple[_Gate, Subscription]:
    """A gate subscribed to *bus*, holding one event in its hands."""
    gate = _Gate()
    sub = bus.subscribe(gate)
    bus.publish_nowait(StepCompleted(step=0))
    with anyio.fail_after(5):
        await gate.entered.wait()
    return gate, sub


class TestPending:
    async def test_zero_before_anything_is_published(self, bus: EventBus) -> None:
        """A new subscription has nothing pending."""
        sub = bus.subscribe(RecordingSink())
        assert sub.pending == 0

    async def test_counts_queued_and_in_flight_events(self, bus: EventBus) -> None:
        """Events in the sink's hands and events queued behind them are both pending."""
        gate, sub = await _held(bus)
        assert sub.pending == 1  # in flight
        bus.publish_many_nowait([StepCompleted(step=1), StepCompleted(step=2)])
        await anyio.wait_all_tasks_blocked()
        assert sub.pending == 3
        assert sub.statistics().queued == sub.pending
        gate.open()
        with anyio.fail_after(5):
            await bus.drain()
        assert sub.pending == 0 and gate.seen == 3

    async def test_undispatched_events_are_not_pending_yet(self, bus: EventBus) -> None:
        """Before the dispatcher runs, an event is undispatched, not pending."""
        sub = bus.subscribe(RecordingSink())
        bus.publish_nowait(StepCompleted(step=0))
        assert sub.pending == 0 and bus.has_undispatched()
        with anyio.fail_after(5):
            await bus.drain()
        assert sub.pending == 0 and not bus.has_undispatched()

    async def test_cancel_discards_what_was_pending(self, bus: EventBus) -> None:
        """A cancelled subscription has nothing pending; the queued events and the one in the
        sink's hands count as discarded."""
        gate, sub = await _held(bus)
        bus.publish_nowait(StepCompleted(step=1))
        await anyio.wait_all_tasks_blocked()
        sub.cancel()
        assert sub.pending == 0
        assert sub.statistics().discarded == 2
        gate.open()


class TestAdapter:
    def test_batch_sink_resolves_both_methods(self) -> None:
        """An object with handle_batch and aclose is adapted once, keeping both."""
        adapter = SinkAdapter(RecordingSink(), "rec")
        assert adapter.handle_batch is not None and adapter.aclose is not None
        assert adapter.handle is None and adapter.start is None

    def test_async_function_is_a_handler(self) -> None:
        """A bare ``async def`` becomes the adapter's handle."""

        async def handler(event: Event) -> None:
            del event

        adapter = SinkAdapter(handler, "fn")
        assert adapter.handle is handler and adapter.handle_batch is None

    def test_sync_start_is_refused(self) -> None:
        """A synchronous start method is refused with a message naming it."""

        class _Sink:
            async def handle(self, event: Event) -> None:
                del event

            def start(self) -> None:
                pass

        with pytest.raises(SubscriptionError, match="start must be an `async def` method"):
            SinkAdapter(_Sink(), "s")

    def test_async_call_instances_count_as_async(self) -> None:
        """An instance with an async ``__call__`` is an async callable; a sync one is not."""

        class _Async:
            async def __call__(self, event: Event) -> None:
                del event

        class _Sync:
            def __call__(self, event: Event) -> None:
                del event

        assert is_async_callable(_Async())
        assert not is_async_callable(_Sync())


class TestDefaultName:
    def test_name_attribute_wins(self) -> None:
        """A sink's non-empty ``name`` attribute names its subscription."""
        assert default_name(RecordingSink(name="mine")) == "mine"

    def test_function_uses_its_qualname(self) -> None:
        """A handler function is named after its sink (function name without <locals>, or class name)."""

        async def handler(event: Event) -> None:
            del event

        assert default_name(handler).endswith("handler")

    def test_empty_name_falls_back_to_the_type(self) -> None:
        """An empty ``name`` is ignored: the type's name is used."""

        class _Unnamed:
            name = ""

        assert default_name(_Unnamed()) == "_Unnamed"


class _SyncClose:
    """A sink with only a synchronous ``close`` (counted)."""

    name = "sync_close"

    def __init__(self) -> None:
        self.closed = 0

    async def handle_batch(self, events: Sequence[Event], /) -> None:
        del events

    def close(self) -> None:
        self.closed += 1


class _BadClose:
    """A sink whose ``aclose`` raises, or never returns (*hang*)."""

    def __init__(self, name: str, *, hang: bool = False) -> None:
        self.name = name
        self._hang = hang

    async def handle_batch(self, events: Sequence[Event], /) -> None:
        del events

    async def aclose(self) -> None:
        if self._hang:
            await anyio.sleep_forever()
        raise OSError("flush failed")


class TestCloseSink:
    async def test_closes_a_removed_sink_once(self, bus: EventBus) -> None:
        """After cancel the caller closes the sink it gave; a second call does nothing."""
        recorder = RecordingSink()
        sub = bus.subscribe(recorder)
        sub.cancel()
        with anyio.fail_after(5):
            await sub.close_sink(1.0)
            await sub.close_sink(1.0)
        assert recorder.closed == 1

    async def test_synchronous_close_is_called(self, bus: EventBus) -> None:
        """A sink with only ``close()`` (not awaitable) has it called."""
        sink = _SyncClose()
        sub = bus.subscribe(sink)
        sub.cancel()
        await sub.close_sink(1.0)
        assert sink.closed == 1

    async def test_function_handler_has_nothing_to_close(self, bus: EventBus) -> None:
        """A plain ``async def`` handler is left alone: no error, nothing called."""

        async def handler(event: Event) -> None:
            del event

        sub = bus.subscribe(handler)
        sub.cancel()
        await sub.close_sink(1.0)

    async def test_failing_close_is_published_while_subscribed(self, bus: EventBus) -> None:
        """A close that raises is not raised; on the bus it becomes a SinkCloseFailed."""
        recorder = RecordingSink()
        bus.subscribe(recorder, SinkCloseFailed)
        sub = bus.subscribe(_BadClose("failing"))
        await sub.close_sink(1.0)
        with anyio.fail_after(5):
            await bus.drain()
        (report,) = recorder.of_type(SinkCloseFailed)
        assert report.sink == "failing" and "flush failed" in report.message

    async def test_failing_close_after_cancel_is_logged(
        self, bus: EventBus, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Off the bus, a close that raises is logged (``sink_close_failed``), not raised."""
        recorder = RecordingSink()
        bus.subscribe(recorder, SinkCloseFailed)
        sub = bus.subscribe(_BadClose("failing"))
        sub.cancel()
        with caplog.at_level(logging.WARNING, logger="eventbus_debug"):
            await sub.close_sink(1.0)
        with anyio.fail_after(5):
            await bus.drain()
        assert recorder.of_type(SinkCloseFailed) == []
        assert any("sink_close_failed" in r.getMessage() for r in caplog.records)

    async def test_hanging_close_is_abandoned_after_the_timeout(
        self, bus: EventBus, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A close that never returns is abandoned after *timeout*, logged and reported."""
        recorder = RecordingSink()
        bus.subscribe(recorder, SinkUnresponsive)
        sub = bus.subscribe(_BadClose("hanging", hang=True))
        with caplog.at_level(logging.ERROR, logger="eventbus_debug"), anyio.fail_after(5):
            await sub.close_sink(0.05)
            await bus.drain()
        (report,) = recorder.of_type(SinkUnresponsive)
        assert report.sink == "hanging" and report.phase == "close"
        assert report.waited_s == pytest.approx(0.05)
        assert any("sink_close_timed_out" in r.getMessage() for r in caplog.records)

    @pytest.mark.parametrize("timeout", [0, -1.0, float("nan"), float("inf"), True])
    async def test_timeout_is_validated(self, bus: EventBus, timeout: float) -> None:
        """A timeout that is not a finite number of seconds > 0 is refused, naming it."""
        sub = bus.subscribe(RecordingSink())
        with pytest.raises(ValueError, match=r"timeout must be a finite number of seconds > 0"):
            await sub.close_sink(timeout)
