"""Audit regressions: recovery, alerts and reports used the way docs/recovery.md,
docs/alerts.md and docs/reports.md describe them."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest
import torch
from torch import nn

from eventbus_debug import CallState, EventBus, RecoveryEngine, SafePoint, SyncEventBus
from eventbus_debug.compat import ErrorHandler
from eventbus_debug.events import (
    GradientExploded,
    NonFiniteDetected,
    StepCompleted,
    TensorRole,
)
from eventbus_debug.recovery import ShrinkBatch, report_error, report_error_sync
from eventbus_debug.sinks import Alert, AlertHandlerFailed, AlertSink, ReportWriter, rules
from eventbus_debug.testing import capture_events

OOM = "CUDA out of memory. Tried to allocate 2.00 GiB"


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# -- recovery ---------------------------------------------------------------------------------


@pytest.mark.parametrize("context", [3, 1.5, ["train_step"], {1: "x"}])
def test_error_handler_context_of_wrong_type_is_a_type_error_naming_context(
    context: object,
) -> None:
    with SyncEventBus() as bus:
        handler = ErrorHandler(RecoveryEngine(bus), state=CallState(batch_size=32))
        with pytest.raises(TypeError, match="context"):
            handler.handle_error(torch.OutOfMemoryError(OOM), context=context, max_retries=2)  # type: ignore[arg-type]
        # nothing was counted or changed by the refused call
        success, _ = handler.handle_error(torch.OutOfMemoryError(OOM), context="s", max_retries=2)
    assert success and handler.state.batch_size == 16


async def test_error_handler_async_context_of_wrong_type_is_a_type_error() -> None:
    async with EventBus() as bus:
        handler = ErrorHandler(RecoveryEngine(bus), state=CallState(batch_size=32))
        with pytest.raises(TypeError, match="context"):
            await handler.ahandle_error(torch.OutOfMemoryError(OOM), context=7)  # type: ignore[arg-type]


async def test_report_error_accepts_the_call_state_as_settings() -> None:
    async with EventBus() as bus:
        engine = RecoveryEngine(bus)
        decided = await report_error(
            engine, torch.OutOfMemoryError(OOM), settings=CallState(batch_size=8)
        )
        with pytest.raises(TypeError, match="settings"):
            await report_error(engine, torch.OutOfMemoryError(OOM), settings={"batch_size": 8})  # type: ignore[arg-type]
    assert [d.kind.value for d in decided] == ["shrink_batch"]
    action = decided[0].decision.action
    assert isinstance(action, ShrinkBatch) and action.size == 4


def test_report_error_sync_accepts_the_call_state_as_settings() -> None:
    with SyncEventBus() as bus:
        engine = RecoveryEngine(bus)
        decided = report_error_sync(
            engine, torch.OutOfMemoryError(OOM), settings=CallState(batch_size=8)
        )
    action = decided[0].decision.action
    assert isinstance(action, ShrinkBatch) and action.size == 4


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [({"agree": 1}, "agree"), ({"snapshots": "every 10"}, "snapshots")],
)
def test_safe_point_checks_agree_and_snapshots_at_construction(
    kwargs: dict[str, object], name: str
) -> None:
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with SyncEventBus() as bus:
        engine = RecoveryEngine(bus)
        with pytest.raises(TypeError, match=name):
            SafePoint(engine, model, optimizer, **kwargs)  # type: ignore[arg-type]


# -- alerts -----------------------------------------------------------------------------------


async def test_sync_handler_returning_a_coroutine_is_delivered() -> None:
    received: list[int] = []

    async def send(alert: Alert) -> None:
        received.append(alert.count)

    async def broken(alert: Alert) -> None:
        raise RuntimeError("pager down")

    async with EventBus() as bus:
        alerts = AlertSink(bus, timeout=1.0)
        alerts.add_rule(rules.non_finite(), lambda alert: send(alert))
        alerts.add_rule(rules.non_finite(), lambda alert: broken(alert))
        sub = bus.subscribe(alerts)
        async with capture_events(bus, AlertHandlerFailed) as failures:
            bus.publish_nowait(NonFiniteDetected(step=3, role=TensorRole.LOSS, names=("loss",)))
            await bus.drain(sub)
    assert received == [1]
    assert [(f.error_type, f.timed_out) for f in failures if isinstance(f, AlertHandlerFailed)] == [
        ("RuntimeError", False)
    ]
    assert len(failures) == 1
    assert alerts.statistics().failed == 1


async def test_alert_sink_reused_on_a_second_bus_delivers_its_summaries_at_close() -> None:
    received: list[tuple[int, bool]] = []
    clock = FakeClock()
    async with EventBus() as bus:
        alerts = AlertSink(bus, clock=clock)
        alerts.add_rule(
            rules.gradient_explosion(), lambda alert: received.append((alert.count, alert.summary))
        )
        bus.subscribe(alerts)
        for step in range(3):
            bus.publish_nowait(GradientExploded(step=step, total_norm=1e4, threshold=10.0))
    assert received == [(1, False), (2, True)]
    async with EventBus() as bus:  # the same sink, a second run
        bus.subscribe(alerts)
        for step in range(3, 7):
            bus.publish_nowait(GradientExploded(step=step, total_norm=1e4, threshold=10.0))
    assert received == [(1, False), (2, True), (4, True)]
    assert alerts.statistics().pending == 0
    assert await alerts.flush(force=True) == 0  # closing again has nothing left
    await alerts.aclose()
    assert len(received) == 3


async def test_run_flusher_of_a_reused_alert_sink_runs_until_the_next_close() -> None:
    clock = FakeClock()
    received: list[int] = []
    async with EventBus() as bus:
        alerts = AlertSink(bus, clock=clock, flush_interval=0.01)
        alerts.add_rule(rules.gradient_explosion(), lambda alert: received.append(alert.count))
        bus.subscribe(alerts)
    async with EventBus() as bus:
        bus.subscribe(alerts)
        bus.publish_nowait(GradientExploded(step=0, total_norm=1e4, threshold=10.0))
        bus.publish_nowait(GradientExploded(step=1, total_norm=1e4, threshold=10.0))
        await bus.drain()
        async with anyio.create_task_group() as tg:
            await tg.start(alerts.run_flusher)
            clock.now = 120.0  # the cooldown is over, no new event arrives
            with anyio.fail_after(3):
                while len(received) < 2:
                    await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
    assert received == [1, 1]


# -- reports ----------------------------------------------------------------------------------


async def test_report_writer_reused_on_a_second_bus_writes_at_the_second_close(
    tmp_path: Path,
) -> None:
    report = ReportWriter(tmp_path / "report", interval=None)
    for first in (0, 10):
        async with EventBus() as bus:
            bus.subscribe(report)
            for step in range(first, first + 10):
                bus.publish_nowait(StepCompleted(step=step, loss=1.0))
        written = json.loads((tmp_path / "report" / "report.json").read_text())
        assert written["summary"]["steps"] == first + 10
    assert report.writes == 2
    await report.aclose()  # nothing new: idempotent
    assert report.writes == 2


def test_call_state_refuses_settings_no_call_runs_with() -> None:
    from eventbus_debug.exceptions import ArgumentTypeError
    from eventbus_debug.recovery import CallState

    for bad in ({"batch_size": 0}, {"batch_size": -4}, {"num_workers": -1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            CallState(**bad)  # type: ignore[arg-type]
    with pytest.raises(ArgumentTypeError, match="batch_size"):
        CallState(batch_size="8")  # type: ignore[arg-type]
    assert CallState(batch_size=8, num_workers=0).settings().num_workers == 0


async def test_retrying_refuses_a_first_wait_longer_than_the_longest() -> None:
    from eventbus_debug.recovery import Retrying

    async with EventBus() as bus:
        engine = RecoveryEngine(bus)
        with pytest.raises(ValueError, match=r"initial_delay \(5 s\) must be <= max_delay"):
            Retrying(engine, initial_delay=5, max_delay=1)


async def test_error_handler_max_retries_wrong_type_is_an_argument_type_error() -> None:
    from eventbus_debug.exceptions import ArgumentTypeError

    async with EventBus() as bus:
        engine = RecoveryEngine(bus)
        with pytest.raises(ArgumentTypeError, match="max_retries"):
            ErrorHandler(engine, max_retries="2")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="max_retries must be an int >= 0"):
            ErrorHandler(engine, max_retries=-1)


def test_report_writer_clock_must_be_callable(tmp_path: Path) -> None:
    from eventbus_debug.sinks import ReportWriter

    with pytest.raises(TypeError, match="clock must be a function"):
        ReportWriter(tmp_path, clock=1)  # type: ignore[arg-type]
