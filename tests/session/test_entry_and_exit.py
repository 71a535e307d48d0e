"""A session's entry and exit: entered once at a time, reusable after its exit, leaving a bus
it does not own as it found it, and bounded by ``close_timeout``."""

from __future__ import annotations

import gc
import math
import threading
import warnings
from pathlib import Path

import anyio
import pytest

from eventbus_debug import (
    EventBus,
    RecoveryEngine,
    Session,
    SessionOptions,
    SyncSession,
    read_events,
)
from eventbus_debug.events import (
    Event,
    EventsUndelivered,
    NonFiniteDetected,
    SessionEnded,
    SessionStarted,
    SinkUnresponsive,
    StepCompleted,
    TensorRole,
)
from eventbus_debug.exceptions import BusClosedError, SubscriptionError
from eventbus_debug.sinks import AlertSink
from eventbus_debug.sinks.alerts import Alert, AlertRule
from eventbus_debug.testing import RecordingSink
from tests._doubles import RecordingPublisher

from ._helpers import setup

GUARD_S = 25.0
"""A hang guard, well under the bus's default close timeout (30 s): not a timing assertion."""


async def _hang(event: Event) -> None:
    await anyio.sleep(3600)


def _non_finite(step: int) -> NonFiniteDetected:
    return NonFiniteDetected(
        step=step, source="test", role=TensorRole.LOSS, names=("loss",), nan_count=1
    )


class TestEnteredOnce:
    async def test_nested_async_entry_refused_and_outer_session_unharmed(
        self, tmp_path: Path
    ) -> None:
        """Entering a running Session raises and changes nothing: the outer one runs on, and
        its exit closes its one bus and ends its log."""
        model, opt = setup()
        session = Session(model, opt, log_dir=tmp_path)
        with warnings.catch_warnings():
            warnings.simplefilter("error", ResourceWarning)
            async with session:
                bus = session.bus
                await session.step_completed(0, loss=1.0)
                with pytest.raises(RuntimeError, match=r"'training' is already running"):
                    async with session:
                        pytest.fail("entered twice")  # pragma: no cover
                assert session.bus is bus
                await session.step_completed(1, loss=1.0)
            gc.collect()
        assert bus.closed
        kinds = [e.kind for e in read_events(tmp_path)]
        assert kinds.count(SessionStarted.kind) == 1
        assert kinds[-1] == SessionEnded.kind and kinds.count(SessionEnded.kind) == 1
        assert kinds.count(StepCompleted.kind) == 2

    async def test_async_session_reusable_after_exit(self, tmp_path: Path) -> None:
        """Entered again after its exit, a Session starts afresh on a new bus."""
        model, opt = setup()
        session = Session(model, opt, log_dir=None, report=False)
        buses = []
        for step in range(2):
            async with session:
                buses.append(session.bus)
                await session.step_completed(step, loss=1.0)
        assert buses[0] is not buses[1] and all(b.closed for b in buses)
        assert session.steps_completed == 1  # each entry counts its own steps

    def test_nested_sync_entry_refused_and_threads_stopped(self, tmp_path: Path) -> None:
        """A running SyncSession refuses a second entry; its exit stops the threads it started
        (the bus's portal, the log's writers)."""
        model, opt = setup()
        before = set(threading.enumerate())
        session = SyncSession(model, opt, log_dir=tmp_path)
        with session:
            with pytest.raises(RuntimeError, match=r"already running"):
                with session:
                    pytest.fail("entered twice")  # pragma: no cover
            session.step_completed(0, loss=1.0)
            started = [
                t
                for t in threading.enumerate()
                if t not in before and t.name.startswith(("asyncio-portal", "eventbus-"))
            ]
        assert len(started) >= 2  # the portal and the log's writer
        for thread in started:
            thread.join(GUARD_S)  # the writers end just after the log's close returned
        assert [t.name for t in started if t.is_alive()] == []
        with session:  # and entered again after its exit
            session.step_completed(1, loss=1.0)
        assert session.steps_completed == 1

    async def test_failed_entry_can_be_retried(self) -> None:
        """An entry that fails leaves the session not entered (a retry gets the same error)."""
        model, opt = setup()
        session = Session(model, opt, log_dir=None, bus=EventBus())
        for _ in range(2):
            with pytest.raises(BusClosedError, match=r"bus must be a running EventBus"):
                async with session:
                    pytest.fail("entered")  # pragma: no cover


class TestSharedBus:
    async def test_sequential_sessions_leave_the_bus_as_they_found_it(self, tmp_path: Path) -> None:
        """Every subscription a session made on a bus it does not own (sinks, recovery,
        localization hooks) is removed at its exit; a second session then starts cleanly."""
        async with EventBus(close_timeout=5.0) as bus:
            keep = bus.subscribe(RecordingSink(), name="mine")
            for run in range(2):
                model, opt = setup()
                log = tmp_path / f"run{run}"
                async with Session(
                    model, opt, log_dir=log, bus=bus, mode="anomaly_detection"
                ) as session:
                    names = {s.name for s in bus.subscriptions}
                    assert {"training.log", "training.recovery", "training.localizer"} <= names
                    await session.step_completed(0, loss=1.0)
                assert bus.subscriptions == (keep,)
                # the sinks it subscribed were closed by it: the report is written
                kinds = [e.kind for e in read_events(log)]
                assert kinds[0] == SessionStarted.kind and kinds[-1] == SessionEnded.kind
                assert (log / "report.json").exists()

    async def test_a_given_recovery_engine_stays_subscribed(self, bus: EventBus) -> None:
        """An engine the user subscribed is the user's: the session leaves it on the bus."""
        engine = RecoveryEngine(bus, name="my.recovery")
        model, opt = setup()
        async with Session(model, opt, log_dir=None, bus=bus, recovery=engine):
            pass
        assert [s.name for s in bus.subscriptions] == ["my.recovery"]

    async def test_failed_entry_removes_what_it_subscribed(self, bus: EventBus) -> None:
        """A name clash half-way through the entry: the subscriptions made before it go."""
        taken = bus.subscribe(RecordingSink(), name="training.alerts")
        model, opt = setup()
        with pytest.raises(SubscriptionError, match=r"training\.alerts"):
            async with Session(model, opt, log_dir=None, bus=bus):
                pytest.fail("entered")  # pragma: no cover
        assert bus.subscriptions == (taken,)

    async def test_hanging_sink_bounded_by_close_timeout(
        self, bus: EventBus, tmp_path: Path
    ) -> None:
        """On a shared bus close_timeout bounds the drain of the session's subscriptions; the
        hanging one is removed all the same, its discarded events reported on the bus (the
        session's log, removed after it, records that too)."""
        mine = RecordingSink()
        keep = bus.subscribe(mine, name="mine")
        model, opt = setup()
        with anyio.fail_after(GUARD_S):
            async with Session(
                model, opt, log_dir=tmp_path, bus=bus, sinks=[_hang], close_timeout=0.5
            ) as session:
                for step in range(3):
                    await session.step_completed(step, loss=1.0)
        assert bus.subscriptions == (keep,)
        await bus.drain()
        reported = mine.of_type(EventsUndelivered)
        assert [(e.sink, e.timeout_s) for e in reported] == [("training._hang", 0.5)]
        assert reported[0].undelivered > 0
        logged = [e for e in read_events(tmp_path) if isinstance(e, EventsUndelivered)]
        assert logged == reported


class TestCloseTimeout:
    async def test_own_bus_hanging_sink_reported(self, tmp_path: Path) -> None:
        """The session's own bus gets close_timeout: a hanging sink is abandoned after it and
        its undelivered events are reported in the log."""
        model, opt = setup()
        with anyio.fail_after(GUARD_S):
            async with Session(
                model, opt, log_dir=tmp_path, sinks=[_hang], close_timeout=0.5
            ) as session:
                for step in range(3):
                    await session.step_completed(step, loss=1.0)
        events = list(read_events(tmp_path))
        undelivered = [e for e in events if isinstance(e, EventsUndelivered)]
        assert [(e.sink, e.timeout_s) for e in undelivered] == [("training._hang", 0.5)]
        assert undelivered[0].undelivered > 0
        assert any(isinstance(e, SinkUnresponsive) and e.sink == "training._hang" for e in events)

    def test_sync_session_hanging_sink_reported(self, tmp_path: Path) -> None:
        """SyncSession takes close_timeout too."""
        model, opt = setup()
        done = threading.Event()

        def run() -> None:
            with SyncSession(
                model, opt, log_dir=tmp_path, sinks=[_hang], close_timeout=0.5
            ) as session:
                for step in range(3):
                    session.step_completed(step, loss=1.0)
            done.set()

        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        worker.join(GUARD_S)
        assert done.is_set()
        undelivered = [e for e in read_events(tmp_path) if isinstance(e, EventsUndelivered)]
        assert [e.timeout_s for e in undelivered] == [0.5]

    @pytest.mark.parametrize("value", [0, -1.0, math.nan, math.inf])
    def test_out_of_range_refused(self, value: float) -> None:
        with pytest.raises(ValueError, match=r"close_timeout must be a finite number"):
            SessionOptions(close_timeout=value)

    @pytest.mark.parametrize("value", ["1", True, [1.0]])
    def test_wrong_type_refused(self, value: object) -> None:
        model, opt = setup()
        with pytest.raises(TypeError, match=r"close_timeout must be a number of seconds"):
            SyncSession(model, opt, close_timeout=value)  # type: ignore[arg-type]

    def test_default_is_the_bus_default(self) -> None:
        assert SessionOptions().close_timeout is None
        assert SessionOptions(close_timeout=2).close_timeout == 2.0


class TestSyncExit:
    def test_alert_flusher_stopped_and_pending_summary_delivered(self) -> None:
        """The alert sink's flusher task is cancelled at exit (its sleep, an hour here, does
        not hold the exit up) and the summary still pending is delivered by the sink's close."""
        got: list[Alert] = []
        alerts = AlertSink(RecordingPublisher(), flush_interval=3600.0)
        alerts.add_rule(AlertRule(event_types=(NonFiniteDetected,), cooldown=3600.0), got.append)
        model, opt = setup()
        done = threading.Event()

        def run() -> None:
            with SyncSession(model, opt, log_dir=None, alerts=alerts) as session:
                session.publish(_non_finite(0))
                session.publish(_non_finite(1))  # within the cooldown: held for the summary
            done.set()

        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        worker.join(GUARD_S)
        assert done.is_set()
        assert [a.suppressed for a in got] == [0, 1]
