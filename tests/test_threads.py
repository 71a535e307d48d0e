"""Daemon worker threads: calls in order, abandoned on cancel, never keeping the process alive."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import anyio
import pytest

from eventbus_debug.threads import DaemonWorker, run_in_daemon_thread


class TestDaemonThreads:
    async def test_worker_returns_and_raises_in_order(self) -> None:
        """DaemonWorker runs calls in order and hands back results and exceptions."""
        worker = DaemonWorker("test-worker")
        order: list[int] = []

        def first() -> int:
            order.append(1)
            return 41

        assert await worker.run(first) == 41
        with pytest.raises(ZeroDivisionError):
            await worker.run(lambda: 1 // 0)
        worker.stop()
        assert order == [1] and not worker.busy

    async def test_cancelling_abandons_a_hung_call(self) -> None:
        """Cancelling the caller returns at once; the thread stays busy until the call ends."""
        worker = DaemonWorker("test-worker")
        release = threading.Event()
        with anyio.fail_after(5):
            with anyio.move_on_after(0.05):
                await worker.run(release.wait, 30)
        assert worker.busy
        release.set()
        worker.stop()

    async def test_one_off_daemon_thread(self) -> None:
        """run_in_daemon_thread runs a call in a new daemon thread."""
        name = await run_in_daemon_thread(lambda: threading.current_thread().name, name="x1")
        assert name == "x1"

    def test_hung_sync_alert_handler_does_not_keep_the_process_alive(self) -> None:
        """A synchronous alert handler that never returns: the process still exits."""
        script = textwrap.dedent(
            """
            import threading, anyio
            from eventbus_debug import EventBus
            from eventbus_debug.events import SinkFailed
            from eventbus_debug.sinks import AlertRule, AlertSink

            async def main():
                async with EventBus(close_timeout=0.2) as bus:
                    alerts = AlertSink(bus, timeout=0.2, flush_interval=None)
                    alerts.add_rule(AlertRule(event_types=(SinkFailed,)),
                                    lambda alert: threading.Event().wait())
                    bus.subscribe(alerts)
                    bus.publish_nowait(SinkFailed(sink="x", error_type="E", message="m"))
                    await bus.drain()
                    await anyio.sleep(0.3)
                print("done")

            anyio.run(main)
            """
        )
        result = subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=Path(__file__).resolve().parent.parent,
            check=False,
        )
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.strip() == "done"


class TestWorkerWakeUps:
    @pytest.mark.asyncio_only("reads asyncio's loop exception handler")
    async def test_a_cancelled_call_finishing_later_raises_nothing_in_the_loop(self) -> None:
        """A call abandoned by its caller completes later without an error in the event loop."""
        errors: list[dict[str, object]] = []
        loop = asyncio.get_running_loop()
        previous = loop.get_exception_handler()
        loop.set_exception_handler(lambda _loop, context: errors.append(context))
        try:
            worker = DaemonWorker("test-worker")
            release = threading.Event()
            with anyio.move_on_after(0.05):
                await worker.run(release.wait, 30)
            release.set()
            with anyio.fail_after(5):
                # the next call runs after the abandoned one: its wake-up came and went
                assert await worker.run(lambda: 7) == 7
            worker.stop()
        finally:
            loop.set_exception_handler(previous)
        assert errors == []

    def test_one_worker_serves_two_event_loops_in_turn(self) -> None:
        """A worker used from one event loop, then from another, wakes the right loop."""
        worker = DaemonWorker("test-worker")

        async def call(value: int) -> int:
            with anyio.fail_after(5):
                return await worker.run(lambda: value * 2)

        assert anyio.run(call, 2) == 4
        assert anyio.run(call, 5) == 10
        worker.stop()
