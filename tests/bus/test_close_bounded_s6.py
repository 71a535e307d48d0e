"""The close is bounded whatever a sink does, and every event is counted exactly once.

The sinks here hang in ways a cancellation cannot end: a handler that swallows it, one waiting
on a worker thread that hangs, a close that shields itself, a synchronous ``close()``. Each
hang lasts until a watchdog (``RELEASE_S``, the ``release`` fixture of conftest.py) releases it, so that a bus that waited for it
fails the test instead of hanging it; the bus must be closed before the release.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import anyio
import pytest

from eventbus_debug import EventBus, Session, SubscriptionError
from eventbus_debug._bus import subscription as _subscription
from eventbus_debug.events import (
    Event,
    EventsDropped,
    EventsUndelivered,
    SinkUnresponsive,
    StepCompleted,
)
from eventbus_debug.testing import RecordingSink

GUARD_S = 60.0


@pytest.fixture(autouse=True)
def _short_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_subscription, "CLOSE_GRACE", 0.05)


async def _swallow_cancellation_until(release: threading.Event) -> None:
    """Wait for *release*, swallowing every cancellation meanwhile."""
    while not release.is_set():
        try:
            await anyio.sleep(0.02)
        except anyio.get_cancelled_exc_class():
            pass


async def _shielded_until(release: threading.Event) -> None:
    """Wait for *release*, shielded from cancellation."""
    with anyio.CancelScope(shield=True):
        while not release.is_set():
            await anyio.sleep(0.02)


class _Hangs:
    """A sink that hangs somewhere until *release* is set (the ``release`` fixture); this base
    only handles events (``entered`` is set at the first)."""

    def __init__(self, release: threading.Event) -> None:
        self.release = release
        self.entered = anyio.Event()

    async def handle(self, event: Event, /) -> None:
        self.entered.set()


class _IgnoresCancellation(_Hangs):
    """A handler that swallows every cancellation until released."""

    name = "ignores-cancel"

    async def handle(self, event: Event, /) -> None:
        self.entered.set()
        await _swallow_cancellation_until(self.release)


class _ShieldedHandle(_Hangs):
    name = "shielded-handle"

    async def handle(self, event: Event, /) -> None:
        self.entered.set()
        await _shielded_until(self.release)


class _ThreadHangs(_Hangs):
    """Follows the advice "blocking work in a worker thread", without abandon_on_cancel."""

    name = "webhook"

    async def handle(self, event: Event, /) -> None:
        self.entered.set()
        await anyio.to_thread.run_sync(self.release.wait)


class _SyncCloseHangs(_Hangs):
    name = "sync-close"

    def close(self) -> None:
        self.release.wait()


class _ShieldedAcloseHangs(_Hangs):
    name = "shielded-aclose"

    async def aclose(self) -> None:
        await _shielded_until(self.release)


class _IgnoresCancellationInClose(_Hangs):
    name = "close-ignores-cancel"

    async def aclose(self) -> None:
        await _swallow_cancellation_until(self.release)


_ON_TRIO_IT_HOLDS = pytest.mark.asyncio_only(
    "trio cannot abandon a task: a sink that cannot be cancelled holds the close (docs/bus.md)"
)
_HUNG_IN_HANDLE = [
    pytest.param(t, marks=_ON_TRIO_IT_HOLDS, id=t.__name__)
    for t in (_IgnoresCancellation, _ShieldedHandle, _ThreadHangs)
]
_HUNG_IN_CLOSE = [
    pytest.param(_SyncCloseHangs, id="_SyncCloseHangs"),  # a thread: bounded on every backend
    *(
        pytest.param(t, marks=_ON_TRIO_IT_HOLDS, id=t.__name__)
        for t in (_ShieldedAcloseHangs, _IgnoresCancellationInClose)
    ),
]


class TestCloseIsBounded:
    @pytest.mark.parametrize("sink_type", _HUNG_IN_HANDLE)
    async def test_a_sink_hung_in_its_call(self, release: threading.Event, sink_type: type) -> None:
        """Abandoned at the deadline; its 5 events are counted once, as undelivered."""
        sink = sink_type(release)
        recorder = RecordingSink()
        with anyio.fail_after(GUARD_S):
            async with EventBus(close_timeout=0.1) as bus:
                bus.subscribe(recorder)
                sub = bus.subscribe(sink, StepCompleted)
                for i in range(5):
                    bus.publish_nowait(StepCompleted(step=i))
                await sink.entered.wait()
        assert not release.is_set()  # the close did not wait for the sink
        stats = sub.statistics()
        assert (stats.delivered, stats.failed, stats.undelivered) == (0, 0, 5)
        assert stats.queued == 0
        [lost] = recorder.of_type(EventsUndelivered)
        assert (lost.sink, lost.undelivered) == (sink.name, 5)
        [unresponsive] = recorder.of_type(SinkUnresponsive)
        assert (unresponsive.sink, unresponsive.phase) == (sink.name, "drain")
        assert recorder.closed == 1
        release.set()  # the abandoned call ends before the event loop's shutdown waits for it

    @pytest.mark.parametrize("sink_type", _HUNG_IN_CLOSE)
    async def test_a_sink_whose_close_hangs(
        self, release: threading.Event, sink_type: type
    ) -> None:
        """A close that blocks, shields itself or swallows the cancellation is abandoned."""
        sink = sink_type(release)
        recorder = RecordingSink()
        with anyio.fail_after(GUARD_S):
            async with EventBus(close_timeout=0.1) as bus:
                bus.subscribe(recorder)
                sub = bus.subscribe(sink, StepCompleted)
                for i in range(5):
                    bus.publish_nowait(StepCompleted(step=i))
                await sink.entered.wait()
        assert not release.is_set()
        assert sub.statistics().delivered == 5
        [unresponsive] = recorder.of_type(SinkUnresponsive)
        assert (unresponsive.sink, unresponsive.phase) == (sink.name, "close")
        release.set()

    async def test_a_synchronous_close_runs_in_a_thread(self) -> None:
        """A sink's synchronous close() runs off the event loop (it may block)."""
        loop_thread = threading.get_ident()
        threads: list[int] = []

        class SyncClose:
            async def handle(self, event: Event, /) -> None:
                pass

            def close(self) -> None:
                threads.append(threading.get_ident())

        with anyio.fail_after(GUARD_S):
            async with EventBus() as bus:
                bus.subscribe(SyncClose())
        assert len(threads) == 1 and threads[0] != loop_thread

    @_ON_TRIO_IT_HOLDS
    async def test_a_hung_sink_unsubscribed_does_not_hold_the_close(
        self, release: threading.Event
    ) -> None:
        """The adversary's case: cancel a subscription whose sink is stuck, then close."""
        sink = _ShieldedHandle(release)
        with anyio.fail_after(GUARD_S):
            async with EventBus(close_timeout=0.1) as bus:
                sub = bus.subscribe(sink)
                bus.publish_nowait(StepCompleted(step=1))
                await sink.entered.wait()
                sub.cancel()
        assert not release.is_set()
        assert sub.statistics().discarded == 1
        release.set()


class TestTheAdviceForBlockingWork:
    async def test_a_synchronous_handle_is_refused_with_the_abandonable_thread(
        self, bus: EventBus
    ) -> None:
        """The advice names a worker thread the bus can abandon (``abandon_on_cancel``)."""

        class Blocking:
            def handle(self, event: Event, /) -> None:
                pass

        with pytest.raises(SubscriptionError, match=r"run_sync\(fn, abandon_on_cancel=True\)"):
            bus.subscribe(Blocking())


class _Gate:
    """Holds each event until opened."""

    def __init__(self) -> None:
        self.entered = anyio.Event()
        self.opened = anyio.Event()
        self.steps: list[int | None] = []

    async def handle(self, event: Event, /) -> None:
        self.entered.set()
        await self.opened.wait()
        self.steps.append(event.step)


class TestUnsubscribeCountsTheEventInHand:
    async def test_cancel_from_outside(self) -> None:
        """The event in the sink's hands is discarded with the queued ones: 5 of 5."""
        gate = _Gate()
        with anyio.fail_after(GUARD_S):
            async with EventBus() as bus:
                sub = bus.subscribe(gate, StepCompleted)
                for i in range(5):
                    bus.publish_nowait(StepCompleted(step=i))
                await gate.entered.wait()
                sub.cancel()
                gate.opened.set()
                await bus.drain()
        stats = sub.statistics()
        assert (stats.delivered, stats.discarded, stats.queued) == (0, 5, 0)
        assert gate.steps == []  # its call was cancelled

    async def test_cancel_from_inside_the_sink(self) -> None:
        """A sink cancelling its own subscription: its current call completes and counts."""
        subs: dict[str, object] = {}
        got: list[object] = []

        async def handler(event: Event, /) -> None:
            got.append(event.step)
            if event.step == 3:
                sub = subs["me"]
                assert isinstance(sub, _subscription.Subscription)
                sub.cancel()
                await anyio.sleep(0)
                got.append("after")

        with anyio.fail_after(GUARD_S):
            async with EventBus() as bus:
                subs["me"] = sub = bus.subscribe(handler, StepCompleted)
                for i in range(10):
                    bus.publish_nowait(StepCompleted(step=i))
                await bus.drain()
        stats = sub.statistics()
        assert got == [0, 1, 2, 3, "after"]
        assert (stats.delivered, stats.discarded) == (4, 6)

    async def test_session_on_a_given_bus_reports_the_event_in_hand(self) -> None:
        """Session(bus=...) takes its sinks back at exit: one stuck past the timeout loses
        the queued events and the one in its hands, all in the EventsUndelivered."""
        import torch
        from torch import nn

        entered = anyio.Event()

        async def stuck(event: Event, /) -> None:
            if event.kind == "step_completed":
                entered.set()
                await anyio.sleep(GUARD_S)

        model = nn.Linear(2, 1)
        recorder = RecordingSink()
        with anyio.fail_after(GUARD_S):
            async with EventBus() as bus:
                bus.subscribe(recorder, EventsUndelivered)
                async with Session(
                    model,
                    torch.optim.SGD(model.parameters(), lr=0.1),
                    bus=bus,
                    log_dir=None,
                    sinks=[stuck],
                    system_interval=None,
                    close_timeout=0.1,
                ) as session:
                    for step in range(3):
                        await session.step_completed(step, loss=1.0)
                    await entered.wait()
        [lost] = [e for e in recorder.of_type(EventsUndelivered) if e.sink != "recorder"]
        assert lost.undelivered == 4  # step 0 in its hands; steps 1, 2 and SessionEnded queued


class _Slow:
    name = "slow"

    async def handle_batch(self, events: Sequence[Event], /) -> None:
        await anyio.sleep(0.001)


class TestDropReportsDuringClose:
    async def test_coalesced_while_the_close_drains(self) -> None:
        """Telemetry shed during the close is reported as while running: here one report
        when shedding starts and a final one (the interval is longer than the close)."""
        recorder = RecordingSink()
        with anyio.fail_after(GUARD_S):
            async with EventBus(drop_report_interval=60) as bus:
                bus.subscribe(recorder, EventsDropped)
                sub = bus.subscribe(_Slow(), StepCompleted, capacity=10)
                bus.publish_many_nowait(StepCompleted(step=i) for i in range(20_000))
        reports = recorder.of_type(EventsDropped)
        assert 1 <= len(reports) <= 2
        assert sum(r.dropped for r in reports) == sub.statistics().shed > 0
