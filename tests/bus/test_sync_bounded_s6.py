"""SyncEventBus: a sink that blocks the bus's thread never holds the training thread for long.

A synchronous call inside an async handler (``requests.post`` to a dead host) holds the bus's
event loop: the loop-side timeouts cannot fire. The training thread bounds its own waits (a
drain's timeout, the close's bound) and names what holds the loop. Each hang lasts until a
watchdog releases it, so that a bus that waited for it fails the test instead of hanging it.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from pathlib import Path

import anyio
import pytest
import torch
from torch import nn

from eventbus_debug import SyncEventBus, SyncSession
from eventbus_debug._bus import subscription as _subscription, sync as _sync
from eventbus_debug.events import Event, StepCompleted

GUARD_S = 60.0


@pytest.fixture(autouse=True)
def _short_graces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_subscription, "CLOSE_GRACE", 0.05)
    monkeypatch.setattr(_sync, "THREAD_GRACE", 0.1)


class _HoldsTheLoop:
    """Blocks the bus's thread (a synchronous wait inside ``handle``) until released."""

    name = "holds-loop"

    def __init__(self, release: threading.Event) -> None:
        self.release = release
        self.entered = threading.Event()

    async def handle(self, event: Event, /) -> None:
        self.entered.set()
        self.release.wait()


class TestSyncEventBus:
    def test_drain_times_out_and_names_the_sink(self, release: threading.Event) -> None:
        sink = _HoldsTheLoop(release)
        with SyncEventBus(close_timeout=5) as bus:
            bus.subscribe(sink)
            bus.publish(StepCompleted(step=0))
            bus.flush()
            assert sink.entered.wait(GUARD_S)
            with pytest.raises(TimeoutError, match=r"sink 'holds-loop' holds its event loop"):
                bus.drain(timeout=0.1)
            assert not release.is_set()  # the training thread did not wait for the sink
            release.set()
            bus.drain(timeout=GUARD_S)  # the loop answers again

    def test_cancelling_a_portal_task_never_waits_for_a_held_loop(
        self, release: threading.Event
    ) -> None:
        """cancel_soon returns while a sink holds the loop (anyio < 4.16's own cancel of a
        portal future waited for it: a SyncSession's exit hung until the sink let go); the
        task is cancelled once the loop turns again."""
        sink = _HoldsTheLoop(release)
        with SyncEventBus(close_timeout=5) as bus:
            task = bus.portal.start_task_soon(anyio.sleep_forever)
            bus.subscribe(sink)
            bus.publish(StepCompleted(step=0))
            bus.flush()
            assert sink.entered.wait(GUARD_S)
            bus.cancel_soon(task)
            assert not release.is_set() and not task.done()  # returned; the loop is still held
            release.set()
            with pytest.raises(concurrent.futures.CancelledError):
                task.result(GUARD_S)

    def test_the_drains_own_timeout_names_what_it_waited_for(self) -> None:
        """A loop that answers: the drain's own TimeoutError says which sink is behind."""
        opened = threading.Event()

        class Slow:
            name = "slow"

            async def handle(self, event: Event, /) -> None:
                import anyio

                while not opened.is_set():
                    await anyio.sleep(0.01)

        with SyncEventBus(close_timeout=5) as bus:
            bus.subscribe(Slow())
            bus.publish(StepCompleted(step=0))
            try:
                with pytest.raises(TimeoutError, match=r"waiting for: sink 'slow' \(1 pending\)"):
                    bus.drain(timeout=0.05)
            finally:
                opened.set()

    def test_close_is_bounded(
        self, release: threading.Event, caplog: pytest.LogCaptureFixture
    ) -> None:
        """The close gives up on a held loop, logs what holds it, leaves the thread behind."""
        sink = _HoldsTheLoop(release)
        bus = SyncEventBus(close_timeout=0.1)
        bus.__enter__()
        host = bus._host
        assert host is not None
        bus.subscribe(sink)
        bus.publish(StepCompleted(step=0))
        bus.flush()
        assert sink.entered.wait(GUARD_S)
        with caplog.at_level(logging.ERROR, logger="eventbus_debug"):
            bus.close()
        assert not release.is_set()
        [record] = [r for r in caplog.records if "sync_bus_close_timed_out" in r.getMessage()]
        assert "holds-loop" in record.getMessage()
        assert host.thread.daemon
        release.set()
        host.thread.join(GUARD_S)  # once released, the bus closes on its own thread
        assert not host.thread.is_alive()
        assert bus.bus.closed


class TestSyncSession:
    def test_a_sink_holding_the_loop_at_a_safe_point(
        self, release: threading.Event, tmp_path: Path
    ) -> None:
        """The adversary's case: the safe point's wait for recovery gives up after the
        engine's drain_timeout (plus the grace), naming the sink; the exit is bounded."""
        sink = _HoldsTheLoop(release)
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(TimeoutError, match=r"holds-loop"):
            with SyncSession(
                model,
                opt,
                log_dir=tmp_path,
                sinks=[sink],
                system_interval=None,
                close_timeout=0.1,
            ) as session:
                assert session.recovery is not None
                session.recovery.drain_timeout = 0.1
                for step in range(3):
                    session.training_step(
                        torch.randn(8, 4), torch.randn(8, 1), nn.functional.mse_loss, step=step
                    )
        assert not release.is_set()
        release.set()
