"""What leaves ``async with EventBus()``: the block's own exception, never wrapped in a group.

The bus runs its dispatcher and the sinks' tasks in an anyio task group; anyio wraps whatever
reaches a task group in a ``BaseExceptionGroup``. The bus keeps that inside: the block's
exception (a user's, the library's own clear errors, ``KeyboardInterrupt``, ``SystemExit``, a
cancellation) propagates as itself. Only a failure of the bus's own tasks gives a group.
"""

from __future__ import annotations

import logging
import math
import subprocess
import sys
import textwrap
from typing import NoReturn

import anyio
import pytest

from eventbus_debug import BusClosedError, Event, EventBus, SubscriptionError, SyncEventBus
from eventbus_debug._bus.bus import OWN_TASKS_FAILED
from eventbus_debug.events import StepCompleted
from eventbus_debug.testing import RecordingSink

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup, ExceptionGroup


class _Fatal(BaseException):
    """A BaseException that is not an Exception (escapes a sink's failure handling)."""


async def _handler(event: Event, /) -> None:
    """A valid sink."""


def _crash_dispatcher_on(bus: EventBus, dispatch: int) -> None:
    """Make the bus's dispatcher raise on its *dispatch*-th round (a stand-in for a bug)."""
    original = bus._dispatch
    rounds = 0

    def dispatch_or_crash() -> None:
        nonlocal rounds
        rounds += 1
        if rounds >= dispatch:
            msg = "dispatcher bug"
            raise RuntimeError(msg)
        original()

    bus._dispatch = dispatch_or_crash  # type: ignore[method-assign]


class TestBodyExceptionsUnwrapped:
    @pytest.mark.parametrize("exc_type", [ValueError, RuntimeError, OSError, _Fatal])
    async def test_the_blocks_exception_is_itself(self, exc_type: type[BaseException]) -> None:
        """The very exception object raised in the block leaves it, with no group around it."""
        raised = exc_type("mine")
        with pytest.raises(exc_type) as info:
            async with EventBus():
                raise raised
        assert info.value is raised
        assert not isinstance(info.value, BaseExceptionGroup)

    async def test_raised_after_awaiting_with_sinks(self) -> None:
        """Also after events went through sinks: delivery finishes, then the error propagates."""
        recorder = RecordingSink()
        with pytest.raises(ValueError, match="mine"):
            async with EventBus() as bus:
                bus.subscribe(recorder)
                bus.publish_nowait(StepCompleted(step=1))
                await anyio.sleep(0)
                msg = "mine"
                raise ValueError(msg)
        assert len(recorder.of_type(StepCompleted)) == 1

    async def test_keyboard_interrupt_is_itself(self) -> None:
        with pytest.raises(KeyboardInterrupt) as info:
            async with EventBus():
                raise KeyboardInterrupt
        assert type(info.value) is KeyboardInterrupt

    async def test_system_exit_keeps_its_code(self) -> None:
        with pytest.raises(SystemExit) as info:
            async with EventBus():
                sys.exit(3)
        assert type(info.value) is SystemExit
        assert info.value.code == 3

    def test_sys_exit_in_the_block_sets_the_exit_status(self) -> None:
        """The user-visible outcome: the process exits with the status given, no traceback."""
        code = textwrap.dedent(
            """
            import sys, anyio
            from eventbus_debug import EventBus
            async def main():
                async with EventBus():
                    sys.exit(3)
            anyio.run(main)
            """
        )
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=90, check=False
        )
        assert done.returncode == 3, done.stderr
        assert "Traceback" not in done.stderr

    def test_a_sink_calling_sys_exit_exits_without_a_group(self) -> None:
        """A sink's SystemExit leaves the event loop as itself (asyncio re-raises it there); the
        bus's close does not add a group about it during the loop's shutdown."""
        code = textwrap.dedent(
            """
            import sys, anyio
            from eventbus_debug import EventBus
            from eventbus_debug.events import StepCompleted
            async def exits(event):
                sys.exit(5)
            async def main():
                async with EventBus(close_timeout=5) as bus:
                    bus.subscribe(exits)
                    bus.publish_nowait(StepCompleted(step=1))
                    await anyio.sleep_forever()
            anyio.run(main)
            """
        )
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=90, check=False
        )
        assert done.returncode == 5, done.stderr
        assert "ExceptionGroup" not in done.stderr


class TestLibraryErrorsUnwrapped:
    async def test_subscribe_a_non_sink(self) -> None:
        with pytest.raises(TypeError, match="is not a sink") as info:
            async with EventBus() as bus:
                bus.subscribe(object())
        assert type(info.value) is SubscriptionError

    async def test_subscribe_a_non_event_type(self) -> None:
        with pytest.raises(SubscriptionError, match="event_types must be Event subclasses"):
            async with EventBus() as bus:
                bus.subscribe(_handler, int)  # type: ignore[arg-type]

    async def test_subscribe_a_sync_function(self) -> None:
        with pytest.raises(SubscriptionError, match="is not an async function"):
            async with EventBus() as bus:
                bus.subscribe(lambda event: None)

    async def test_capacity_zero(self) -> None:
        with pytest.raises(SubscriptionError, match="capacity must be a positive integer"):
            async with EventBus() as bus:
                bus.subscribe(_handler, capacity=0)

    async def test_publish_a_non_event(self) -> None:
        with pytest.raises(TypeError, match="only Event instances can be published") as info:
            async with EventBus() as bus:
                bus.publish_nowait("x")  # type: ignore[arg-type]
        assert type(info.value) is TypeError

    async def test_publish_after_aclose(self) -> None:
        with pytest.raises(BusClosedError):
            async with EventBus() as bus:
                await bus.aclose()
                bus.publish_nowait(StepCompleted(step=1))

    async def test_drain_timeout(self) -> None:
        """drain's TimeoutError is caught by its type; the hung sink is abandoned at close."""
        gate = anyio.Event()

        async def hangs(event: Event, /) -> None:
            await gate.wait()

        with pytest.raises(TimeoutError) as info:
            async with EventBus(close_timeout=0.2) as bus:
                bus.subscribe(hangs)
                bus.publish_nowait(StepCompleted(step=0))
                await bus.drain(timeout=0.05)
        assert type(info.value) is TimeoutError


class TestCancellation:
    async def test_move_on_after_around_the_bus(self) -> None:
        """A cancelled scope around the bus ends cleanly, and what was published is delivered."""
        recorder = RecordingSink()
        with anyio.move_on_after(0.05) as scope:
            async with EventBus() as bus:
                bus.subscribe(recorder)
                for step in range(5):
                    bus.publish_nowait(StepCompleted(step=step))
                await anyio.sleep_forever()
        assert scope.cancelled_caught
        assert bus.closed
        assert len(recorder.of_type(StepCompleted)) == 5

    async def test_scope_cancelled_before_entering(self) -> None:
        with anyio.CancelScope() as scope:
            scope.cancel()
            async with EventBus() as bus:
                await anyio.sleep_forever()
        assert scope.cancelled_caught
        assert bus.closed

    async def test_cancelled_from_another_task(self) -> None:
        """Cancelling a task group whose task holds a bus: no exception leaves the group."""
        entered = anyio.Event()
        buses: list[EventBus] = []

        async def trains() -> None:
            async with EventBus() as bus:
                buses.append(bus)
                entered.set()
                await anyio.sleep_forever()

        async with anyio.create_task_group() as tg:
            tg.start_soon(trains)
            await entered.wait()
            tg.cancel_scope.cancel()
        assert buses[0].closed

    async def test_cancellation_is_not_swallowed(self) -> None:
        """The cancellation goes on propagating past the bus: code after it does not run."""
        reached = False
        with anyio.CancelScope() as scope:
            async with EventBus():
                scope.cancel()
                await anyio.sleep(0)
            reached = True
        assert scope.cancelled_caught
        assert not reached


class TestOwnTaskFailures:
    async def test_dispatcher_crash_gives_a_group(self, caplog: pytest.LogCaptureFixture) -> None:
        """A crash of the bus's own dispatcher is reported as a group (and logged), and the
        close waits for what was dispatched only, not for the close timeout."""
        recorder = RecordingSink()
        with caplog.at_level(logging.ERROR, logger="eventbus_debug"):
            with pytest.raises(ExceptionGroup) as info:
                async with EventBus(close_timeout=1.0) as bus:
                    bus.subscribe(recorder)
                    bus.publish_nowait(StepCompleted(step=1))
                    await bus.drain()
                    _crash_dispatcher_on(bus, 1)
                    bus.publish_nowait(StepCompleted(step=2))
                    await anyio.sleep_forever()  # cancelled by the crash
        group = info.value
        assert group.message == OWN_TASKS_FAILED
        assert [type(e) for e in group.exceptions] == [RuntimeError]
        assert [e.step for e in recorder.of_type(StepCompleted)] == [1]
        messages = [r.getMessage() for r in caplog.records]
        assert any(m.startswith("bus_task_failed") for m in messages)
        assert not any(m.startswith("close_timed_out") for m in messages)

    @pytest.mark.asyncio_only(
        "asyncio's scheduling order: the block raises before the crash cancels it"
    )
    async def test_blocks_exception_comes_first(self) -> None:
        with pytest.raises(ExceptionGroup) as info:
            async with EventBus(close_timeout=1.0) as bus:
                _crash_dispatcher_on(bus, 1)
                bus.publish_nowait(StepCompleted(step=1))
                await anyio.lowlevel.checkpoint()
                msg = "mine"
                raise ValueError(msg)
        assert [type(e) for e in info.value.exceptions] == [ValueError, RuntimeError]

    @pytest.mark.asyncio_only(
        "asyncio's scheduling order: the block raises before the crash cancels it"
    )
    async def test_system_exit_wins_over_a_crash(self) -> None:
        with pytest.raises(SystemExit) as info:
            async with EventBus(close_timeout=1.0) as bus:
                _crash_dispatcher_on(bus, 1)
                bus.publish_nowait(StepCompleted(step=1))
                await anyio.lowlevel.checkpoint()
                sys.exit(4)
        assert info.value.code == 4

    async def test_sink_raising_a_base_exception(self) -> None:
        """A sink's BaseException (not an Exception) escapes its task: a BaseExceptionGroup."""

        async def fatal(event: Event, /) -> NoReturn:
            raise _Fatal

        with pytest.raises(BaseExceptionGroup) as info:
            async with EventBus(close_timeout=1.0) as bus:
                bus.subscribe(fatal)
                bus.publish_nowait(StepCompleted(step=1))
                await anyio.sleep_forever()  # cancelled by the failure
        assert not isinstance(info.value, ExceptionGroup)
        assert [type(e) for e in info.value.exceptions] == [_Fatal]


class TestDrainTimeoutArgument:
    @pytest.mark.parametrize("timeout", [math.nan, -1, -0.5, math.inf, True, "1"])
    async def test_bad_timeout(self, bus: EventBus, timeout: object) -> None:
        with pytest.raises(ValueError, match=r"timeout must be a finite number >= 0, got"):
            await bus.drain(timeout=timeout)  # type: ignore[arg-type]

    async def test_bad_timeout_before_the_bus_starts(self) -> None:
        """The argument is checked first, also on a bus not entered yet."""
        with pytest.raises(ValueError, match="timeout"):
            await EventBus().drain(timeout=math.nan)

    async def test_zero_only_checks(self, bus: EventBus) -> None:
        """timeout=0 returns when everything is handled already, else raises TimeoutError."""
        await bus.drain(timeout=0)
        gate = anyio.Event()

        async def waits(event: Event, /) -> None:
            await gate.wait()

        bus.subscribe(waits)
        bus.publish_nowait(StepCompleted(step=0))
        with pytest.raises(TimeoutError):
            await bus.drain(timeout=0)
        gate.set()
        await bus.drain(timeout=5)

    @pytest.mark.parametrize("timeout", [math.nan, -1, "x"])
    def test_sync_bus_bad_timeout(self, timeout: object) -> None:
        with SyncEventBus() as bus, pytest.raises(ValueError, match="timeout must be"):
            bus.drain(timeout=timeout)  # type: ignore[arg-type]


class TestSyncBus:
    def test_the_blocks_exception_is_itself(self) -> None:
        with pytest.raises(ValueError, match="mine") as info, SyncEventBus():
            msg = "mine"
            raise ValueError(msg)
        assert type(info.value) is ValueError

    def test_subscribe_error_is_itself(self) -> None:
        with pytest.raises(SubscriptionError), SyncEventBus() as bus:
            bus.subscribe(object())

    def test_system_exit_keeps_its_code(self) -> None:
        with pytest.raises(SystemExit) as info, SyncEventBus():
            sys.exit(3)
        assert info.value.code == 3
