"""Audit s11: the async semantics on every backend, and the thread/loop boundary.

Each test is a bug found by the audit (it failed before the fix, on trio at least): calls from
a thread other than the bus's event loop (``publish_nowait``, ``publish_many_nowait``,
``subscribe``, ``Subscription.cancel``), a sink's ``KeyboardInterrupt`` on trio, and the
library's own sinks whose blocking I/O could not be abandoned on trio (the bus's close held).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import anyio
import pytest

from eventbus_debug import EventBus, SyncEventBus
from eventbus_debug.events import Event, SinkUnresponsive, StepCompleted
from eventbus_debug.sinks import ReportWriter
from eventbus_debug.sinks.report import writer as report_writer
from eventbus_debug.testing import RecordingSink
from eventbus_debug.threads import DaemonWorker, run_in_daemon_thread


@pytest.fixture(name="gate")
def _gate() -> Iterator[threading.Event]:
    """Released at teardown: a blocked thread of a test never outlives it for long."""
    gate = threading.Event()
    yield gate
    gate.set()


def _join(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.join()


def _steps(recorder: RecordingSink) -> list[int | None]:
    return [e.step for e in recorder.of_type(StepCompleted)]


class TestPublishFromAnotherThread:
    """``publish_nowait`` from a worker thread (the trio bug's class: a probe offloading to
    ``anyio.to_thread``) woke the dispatcher from the wrong thread: on trio it raised and left
    the dispatcher asleep for good (``drain`` hung, the close lost every later event); on
    asyncio it raced the loop. It now goes the thread-safe way, and says so once."""

    async def test_publish_nowait_from_a_worker_thread_is_delivered(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        recorder = RecordingSink()
        caplog.set_level(logging.WARNING, logger="eventbus_debug")
        async with EventBus(close_timeout=5) as bus:
            bus.subscribe(recorder)
            await bus.drain()  # the dispatcher idles: the next publish wakes it
            await anyio.to_thread.run_sync(bus.publish_nowait, StepCompleted(step=1))
            await anyio.to_thread.run_sync(bus.publish_nowait, StepCompleted(step=2))
            with anyio.fail_after(5):
                await bus.drain()
            assert _steps(recorder) == [1, 2]
            bus.publish_nowait(StepCompleted(step=3))  # the loop's own publishes still flow
            with anyio.fail_after(5):
                await bus.drain()
            assert _steps(recorder) == [1, 2, 3]
        warnings = [
            r for r in caplog.records if r.getMessage().startswith("publish_nowait_from_thread")
        ]
        assert len(warnings) == 1  # once per bus
        assert "publish_threadsafe" in warnings[0].getMessage()

    async def test_publish_many_nowait_from_a_worker_thread(self) -> None:
        recorder = RecordingSink()
        async with EventBus(close_timeout=5) as bus:
            bus.subscribe(recorder)
            await bus.drain()
            batch = [StepCompleted(step=i) for i in range(5)]
            await anyio.to_thread.run_sync(bus.publish_many_nowait, batch)
            with anyio.fail_after(5):
                await bus.drain()
            assert _steps(recorder) == [0, 1, 2, 3, 4]

    async def test_threads_and_the_loop_publishing_at_once_lose_nothing(self) -> None:
        recorder = RecordingSink()
        per_thread = 500
        async with EventBus(close_timeout=5, capacity=10_000) as bus:
            bus.subscribe(recorder, StepCompleted)

            def worker(k: int) -> None:
                for i in range(per_thread):
                    bus.publish_nowait(StepCompleted(step=i, source=f"thread-{k}"))

            threads = [threading.Thread(target=worker, args=(k,)) for k in range(3)]
            for thread in threads:
                thread.start()
            for i in range(per_thread):
                bus.publish_nowait(StepCompleted(step=i, source="loop"))
                if i % 16 == 0:
                    await anyio.lowlevel.checkpoint()
            with anyio.fail_after(10):
                await anyio.to_thread.run_sync(_join, threads)
                await bus.drain()
        by_source: dict[str, list[int | None]] = {}
        for event in recorder.of_type(StepCompleted):
            by_source.setdefault(event.source, []).append(event.step)
        assert sorted(by_source) == ["loop", "thread-0", "thread-1", "thread-2"]
        for steps in by_source.values():
            assert steps == list(range(per_thread))  # each thread's order is kept


class TestSubscriptionsFromAnotherThread:
    async def test_subscribe_from_a_thread_is_a_clear_error_that_changes_nothing(self) -> None:
        """It used to register the subscription, then fail to start its task: every later
        drain waited for a sink that never ran, and the close counted its events lost."""
        recorder = RecordingSink()
        other = RecordingSink(name="other")
        async with EventBus(close_timeout=5) as bus:
            bus.subscribe(recorder)
            with pytest.raises(RuntimeError, match=r"subscribe\(\) was called from thread"):
                await anyio.to_thread.run_sync(bus.subscribe, other)
            assert [s.name for s in bus.subscriptions] == ["recorder"]
            bus.publish_nowait(StepCompleted(step=1))
            with anyio.fail_after(5):
                await bus.drain()
            # the portable way from a thread: run it on the loop
            sub = await anyio.to_thread.run_sync(
                lambda: anyio.from_thread.run_sync(bus.subscribe, other)
            )
            bus.publish_nowait(StepCompleted(step=2))
            with anyio.fail_after(5):
                await bus.drain()
        assert _steps(recorder) == [1, 2]
        assert _steps(other) == [2]
        assert sub.statistics().undelivered == 0
        assert other.closed == 1

    async def test_cancel_from_a_worker_thread(self) -> None:
        recorder = RecordingSink()
        leaving = RecordingSink(name="leaving")
        async with EventBus(close_timeout=5) as bus:
            bus.subscribe(recorder)
            sub = bus.subscribe(leaving)
            bus.publish_nowait(StepCompleted(step=1))
            with anyio.fail_after(5):
                await bus.drain()
                await anyio.to_thread.run_sync(sub.cancel)
            assert [s.name for s in bus.subscriptions] == ["recorder"]
            bus.publish_nowait(StepCompleted(step=2))
            with anyio.fail_after(5):
                await bus.drain()
        assert _steps(leaving) == [1]
        assert _steps(recorder) == [1, 2]
        assert sub.statistics().delivered == 1

    def test_cancel_after_the_event_loop_ended(self, anyio_backend: str) -> None:
        """``sub.cancel()`` outside any event loop (after ``anyio.run``) used to raise
        anyio's ``NoEventLoopError`` from the middle of the unsubscribe."""

        async def main() -> object:
            async with EventBus(close_timeout=5) as bus:
                sub = bus.subscribe(RecordingSink())
                bus.publish_nowait(StepCompleted(step=1))
            return sub

        sub = anyio.run(main, backend=anyio_backend)
        sub.cancel()  # type: ignore[attr-defined]
        sub.cancel()  # type: ignore[attr-defined]  # idempotent

    def test_sync_bus_subscription_cancelled_from_the_training_thread(self) -> None:
        """``with sync_bus.subscribe(sink):`` on the training thread: leaving the block
        cancels the subscription from a thread that is not the bus's (it raised
        ``NoEventLoopError`` and left the subscription half removed)."""
        recorder = RecordingSink()
        scoped = RecordingSink(name="scoped")
        with SyncEventBus(close_timeout=5) as bus:
            bus.subscribe(recorder)
            with bus.subscribe(scoped, StepCompleted) as sub:
                bus.publish(StepCompleted(step=1))
                bus.drain(timeout=5)
            assert [s.name for s in bus.bus.subscriptions] == ["recorder"]
            bus.publish(StepCompleted(step=2))
            bus.drain(timeout=5)
        assert _steps(scoped) == [1]
        assert _steps(recorder) == [1, 2]
        assert sub.statistics().delivered == 1
        assert bus.statistics().published == 2


class TestInterruptsFromASink:
    @pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
    def test_a_sinks_interrupt_leaves_the_bus_on_trio(self, interrupt: type[BaseException]) -> None:
        """On trio a sink's task runs in the bus's task group: its ``KeyboardInterrupt`` was
        dropped there and the block left with trio's ``Cancelled`` (outside its scope); it
        now goes on as itself, as on asyncio (where it leaves the event loop itself)."""
        left_with: list[BaseException] = []

        async def interrupts(event: StepCompleted) -> None:
            raise interrupt

        async def main() -> None:
            try:
                async with EventBus(close_timeout=2) as bus:
                    bus.subscribe(interrupts, StepCompleted)
                    bus.publish_nowait(StepCompleted(step=1))
                    with anyio.fail_after(5):
                        await anyio.sleep_forever()
            except BaseException as exc:
                left_with.append(exc)
                raise

        with pytest.raises(interrupt):
            anyio.run(main, backend="trio")
        assert [type(e) for e in left_with] == [interrupt]

    @pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
    def test_a_sinks_close_raising_an_interrupt_on_trio(
        self, interrupt: type[BaseException]
    ) -> None:
        """A sink's ``aclose`` raising ``KeyboardInterrupt`` left the bus's close half done
        (the sinks after it never closed, the bus CLOSING) and its task group never left, which
        trio answers with ``TrioInternalError``. Every sink is closed now, then it goes on."""
        recorder = RecordingSink()
        states: list[bool] = []

        class InterruptsInClose:
            name = "interrupts-in-close"

            async def handle(self, event: Event) -> None:
                pass

            async def aclose(self) -> None:
                raise interrupt

        async def main() -> None:
            bus = EventBus(close_timeout=2)
            try:
                async with bus:
                    bus.subscribe(recorder)
                    bus.subscribe(InterruptsInClose())
                    bus.publish_nowait(StepCompleted(step=1))
            finally:
                states.append(bus.closed and not bus.running)

        with pytest.raises(interrupt):
            anyio.run(main, backend="trio")
        assert states == [True]
        assert recorder.closed == 1
        assert _steps(recorder) == [1]


class _Hung:
    """Blocks the calling thread until the test's gate opens (a stuck network disk)."""

    def __init__(self, gate: threading.Event) -> None:
        self.gate = gate
        self.entered = threading.Event()

    def __call__(self, *args: object, **kwargs: object) -> None:
        self.entered.set()
        self.gate.wait(30)


class TestOwnSinksWithHungIOCloseInBoundedTime:
    """The report, TensorBoard and W&B sinks waited on anyio's worker threads, which cannot be
    abandoned: on trio, where the bus joins the sinks' tasks, a write that hung held the
    bus's close for as long as it hung (no ``SinkUnresponsive``). They now use daemon threads
    that a cancelled caller abandons, as the log does."""

    async def test_report_writer_whose_write_hangs(
        self, tmp_path: Path, gate: threading.Event, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        hung = _Hung(gate)
        monkeypatch.setattr(report_writer, "write_report", hung)
        recorder = RecordingSink()
        with anyio.fail_after(15):
            async with EventBus(close_timeout=0.3) as bus:
                bus.subscribe(recorder)
                bus.subscribe(ReportWriter(tmp_path))
                bus.publish_nowait(StepCompleted(step=1, loss=0.5))
        assert hung.entered.is_set()
        (unresponsive,) = recorder.of_type(SinkUnresponsive)
        assert unresponsive.sink == "ReportWriter" and unresponsive.phase == "close"
        assert unresponsive.thread_abandoned

    async def test_tensorboard_sink_whose_write_hangs(
        self, tmp_path: Path, gate: threading.Event
    ) -> None:
        tensorboard = pytest.importorskip("eventbus_debug.sinks.tensorboard")
        try:
            sink = tensorboard.TensorBoardSink(tmp_path / "tb")
        except ImportError:
            pytest.skip("tensorboard is not installed")
        hung = _Hung(gate)
        sink._write = hung
        recorder = RecordingSink()
        with anyio.fail_after(15):
            async with EventBus(close_timeout=0.3) as bus:
                bus.subscribe(recorder)
                bus.subscribe(sink)
                bus.publish_nowait(StepCompleted(step=1, loss=0.5))
                with anyio.fail_after(5):
                    await anyio.to_thread.run_sync(hung.entered.wait)
        (unresponsive,) = recorder.of_type(SinkUnresponsive)
        assert unresponsive.phase == "drain" and unresponsive.thread_abandoned


class _SlowBatches:
    """A sink that takes a while per batch, so that a cancel lands mid-batch."""

    name = "slow"

    def __init__(self) -> None:
        self.steps: list[int | None] = []

    async def handle_batch(self, events: Sequence[Event]) -> None:
        await anyio.sleep(0.01)
        self.steps.extend(e.step for e in events)


async def test_cancelled_around_the_bus_mid_batch_delivers_everything() -> None:
    """A task group cancelled while a sink is mid-batch: the (shielded) close still delivers
    every event published before the cancel, on every backend."""
    sink = _SlowBatches()
    published: list[int] = []
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:

            async def train() -> None:
                async with EventBus(close_timeout=10, capacity=100_000) as bus:
                    bus.subscribe(sink)
                    for i in range(2_000):
                        bus.publish_nowait(StepCompleted(step=i))
                        published.append(i)
                        if i % 50 == 0:
                            await anyio.sleep(0)
                    await anyio.sleep_forever()

            tg.start_soon(train)
            while len(sink.steps) < 100:
                await anyio.sleep(0.005)
            tg.cancel_scope.cancel()
    assert sink.steps == published


async def test_a_sinks_worker_threads_publish_while_the_bus_closes() -> None:
    """The library's daemon threads ran without the caller's context, so a sink's worker
    thread was not the sink's: what it published while the bus closed was refused
    (``BusClosedError``, the close failed) where anyio's worker threads would have been taken.
    """
    recorder = RecordingSink()

    class PublishesFromThreads:
        name = "publishes-from-threads"

        def __init__(self, bus: EventBus) -> None:
            self.bus = bus

        async def handle(self, event: Event) -> None:
            pass

        async def aclose(self) -> None:
            await run_in_daemon_thread(self.bus.publish_threadsafe, StepCompleted(step=7))
            worker = DaemonWorker("audit-worker")
            try:
                await worker.run(self.bus.publish_threadsafe, StepCompleted(step=8))
            finally:
                worker.stop()

    with anyio.fail_after(10):
        async with EventBus(close_timeout=2) as bus:
            bus.subscribe(recorder)
            bus.subscribe(PublishesFromThreads(bus))
    assert _steps(recorder) == [7, 8]
    assert recorder.kinds() == ["step_completed", "step_completed"]  # no sink_close_failed


def test_one_session_entered_from_two_threads_at_once() -> None:
    """Entering is claimed under a lock: of threads entering one session at once, one enters."""
    from torch import nn

    from eventbus_debug import SyncSession

    model = nn.Linear(2, 1)
    session = SyncSession(model, report=False, alerts=False, console=False, log_dir=None)
    barrier = threading.Barrier(8)
    outcomes: list[str] = []

    def enter() -> None:
        barrier.wait(5)
        try:
            session._claim()
        except RuntimeError:
            outcomes.append("refused")
        else:
            outcomes.append("entered")

    threads = [threading.Thread(target=enter) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert sorted(outcomes) == ["entered"] + ["refused"] * 7


def test_sync_bus_drain_from_its_own_thread_is_a_clear_error() -> None:
    """A sink calling ``SyncEventBus.drain()`` runs on the bus's thread: the drain waited for
    the loop the sink held (forever without a timeout; with one, a TimeoutError blaming the
    sink). It is a clear error at once now."""
    errors: list[BaseException] = []
    done = threading.Event()
    recorder = RecordingSink()
    with SyncEventBus(close_timeout=5) as bus:

        async def drains(event: StepCompleted) -> None:
            try:
                bus.drain()
            except RuntimeError as exc:
                errors.append(exc)
            finally:
                done.set()

        bus.subscribe(recorder)
        bus.subscribe(drains, StepCompleted)
        bus.publish(StepCompleted(step=1))
        bus.flush()
        assert done.wait(10)
        bus.drain(timeout=5)  # the training thread's drain is fine
    assert len(errors) == 1
    assert "own thread" in str(errors[0])
    assert _steps(recorder) == [1]
