"""Every sink honours the same contract (composer's callback_settings idea).

Cases: every sink class exported by ``sinks`` (the package or any public ``sinks.*`` module),
plus user-style sinks (an ``async def`` function, a :class:`RecordingSink`). Each is built by
the factory registered under its class name in :data:`FACTORIES`; **a sink class without a
factory fails** ``test_every_sink_class_has_a_factory``, so a new sink cannot skip the contract.

The contract:

- it handles one sample of every registered event kind without raising;
- it survives ``aclose()`` after the bus closed it (a second close);
- it loses nothing when the bus closes with its queue full;
- an exception in another sink reaches neither this sink nor the publisher.
"""

from __future__ import annotations

import importlib
import inspect
import io
import pkgutil
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from eventbus_debug import Event, EventBus, sinks
from eventbus_debug.events import SessionStarted, SinkFailed, StepCompleted, event_types
from eventbus_debug.sinks import AlertSink
from eventbus_debug.testing import RecordingSink, make_sample_event

Factory = Callable[[Path, EventBus], object]


def _sink_classes() -> dict[str, type]:
    """Every class exported by sinks (package or public submodule) that is a sink."""
    modules = [sinks]
    for info in pkgutil.iter_modules(sinks.__path__, prefix="eventbus_debug.sinks."):
        if not info.name.rsplit(".", 1)[-1].startswith("_"):
            modules.append(importlib.import_module(info.name))
    found: dict[str, type] = {}
    for module in modules:
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name)
            if inspect.isclass(obj) and (hasattr(obj, "handle") or hasattr(obj, "handle_batch")):
                found[obj.__name__] = obj
    return found


async def _async_function_sink(event: Event) -> None:
    """The lightest user sink: an async function."""
    _ = event.kind


def _factories() -> dict[str, Factory]:
    table: dict[str, Factory] = {
        "async_function": lambda tmp, bus: _async_function_sink,
        "RecordingSink": lambda tmp, bus: RecordingSink(name="contract-recorder"),
    }
    classes = _sink_classes()

    def add(name: str, factory: Factory) -> None:
        if name in classes:
            table[name] = factory

    # Small sizes so that rotation, flushing and rendering really happen in the test.
    add(
        "RotatingFileSink",
        lambda tmp, bus: classes["RotatingFileSink"](tmp / "logs", max_bytes=4096, backup_count=2),
    )
    add("ConsoleSink", lambda tmp, bus: classes["ConsoleSink"](io.StringIO()))
    add("AlertSink", _alert_sink)
    add("ReportWriter", lambda tmp, bus: classes["ReportWriter"](tmp / "report", interval=None))
    add("DebugServer", lambda tmp, bus: classes["DebugServer"]())
    add("TensorBoardSink", lambda tmp, bus: classes["TensorBoardSink"](tmp / "tensorboard"))
    add("WandbSink", _wandb_sink)
    return table


def _wandb_sink(tmp: Path, bus: EventBus) -> object:
    wandb = pytest.importorskip("wandb")
    settings = wandb.Settings(console="off", silent=True)
    return _sink_classes()["WandbSink"](
        project="contract", mode="offline", dir=str(tmp), settings=settings
    )


def _alert_sink(tmp: Path, bus: EventBus) -> object:
    alert_sink: type[AlertSink] = _sink_classes()["AlertSink"]
    alerts = alert_sink(bus, flush_interval=None)
    heard: list[object] = []

    @alerts.on(Event)
    async def record(alert: object) -> None:
        heard.append(alert)

    return alerts


FACTORIES = _factories()
CASES = sorted({*FACTORIES, *_sink_classes()})


def _make(case: str, tmp_path: Path, bus: EventBus) -> object:
    factory = FACTORIES.get(case)
    if factory is None:
        pytest.fail(
            f"sink class {case} has no factory in tests/sinks/test_contract.py::_factories; "
            "add one so that it runs through the sink contract"
        )
    return factory(tmp_path, bus)


def _samples() -> list[Event]:
    return [make_sample_event(cls) for _, cls in sorted(event_types().items())]


def test_every_sink_class_has_a_factory() -> None:
    """Each exported sink class is covered by the contract."""
    missing = sorted(set(_sink_classes()) - set(FACTORIES))
    assert not missing, f"sink classes without a contract factory: {missing}"


def test_user_style_cases_present() -> None:
    """The user-style sinks are part of the contract too."""
    assert {"async_function", "RecordingSink"} <= set(CASES)


@pytest.mark.parametrize("case", CASES)
async def test_handles_every_event_kind(case: str, tmp_path: Path) -> None:
    """One sample of every registered kind is handled without a failure."""
    samples = _samples()
    observer = RecordingSink(name="observer")
    async with EventBus(close_timeout=10) as bus:
        bus.subscribe(observer, SinkFailed)
        sub = bus.subscribe(_make(case, tmp_path, bus), name="under-test")
        for ev in samples:
            bus.publish_nowait(ev)
        with anyio.fail_after(20):
            await bus.drain()
        st = sub.statistics()
    failures = [f for f in observer.of_type(SinkFailed) if f.sink == "under-test"]
    assert failures == [], failures[0].traceback if failures else ""
    assert st.failed == 0 and not st.disabled
    assert st.delivered >= len(samples)
    assert sub.statistics().undelivered == 0


@pytest.mark.parametrize("case", CASES)
async def test_survives_second_aclose(case: str, tmp_path: Path) -> None:
    """After the bus closed the sink, closing it again is harmless."""
    async with EventBus(close_timeout=10) as bus:
        sink = _make(case, tmp_path, bus)
        bus.subscribe(sink)
        bus.publish_nowait(StepCompleted(step=1, loss=0.5))
    aclose = getattr(sink, "aclose", None)
    if aclose is not None:
        with anyio.fail_after(10):
            await aclose()
            await aclose()


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kind", ["telemetry", "incidents"])
@pytest.mark.asyncio_only(
    "asserts asyncio's scheduling order (one checkpoint dispatches, the sinks wait)"
)
async def test_loses_nothing_when_closing_with_a_full_queue(
    case: str, kind: str, tmp_path: Path
) -> None:
    """Close delivers a queue filled to capacity, and incidents queued far beyond it."""
    capacity = 16
    n = capacity if kind == "telemetry" else 4 * capacity
    async with EventBus(close_timeout=10) as bus:
        sink = _make(case, tmp_path, bus)
        sub = bus.subscribe(sink, StepCompleted, SessionStarted, capacity=capacity)
        await bus.drain()  # every task started and idle
        for i in range(n):
            if kind == "telemetry":
                bus.publish_nowait(StepCompleted(step=i, loss=float(i)))
            else:
                bus.publish_nowait(SessionStarted(name=f"incident-{i}"))
        await anyio.lowlevel.checkpoint()  # dispatched: the queue is full, the sink not run
        assert sub.statistics().queued == n
    st = sub.statistics()
    assert (st.delivered, st.shed, st.failed, st.undelivered, st.discarded) == (n, 0, 0, 0, 0)


@pytest.mark.parametrize("case", CASES)
async def test_isolated_from_a_raising_sink(case: str, tmp_path: Path) -> None:
    """Another sink's exceptions reach neither this sink nor the publisher."""

    async def raising(event: Event) -> None:
        raise RuntimeError("another sink broke")

    async with EventBus(close_timeout=10, max_consecutive_failures=3) as bus:
        bus.subscribe(raising, StepCompleted, name="raising")
        sub = bus.subscribe(_make(case, tmp_path, bus), name="under-test")
        for i in range(5):
            await bus.publish(StepCompleted(step=i, loss=0.1))
        with anyio.fail_after(20):
            await bus.drain()
            await bus.drain()
        st = sub.statistics()
        raising_st = bus.subscriptions[0].statistics()
    assert raising_st.disabled and raising_st.failed == 3
    assert st.failed == 0 and not st.disabled
    assert st.delivered >= 5 + 3 + 1  # its events, the failures and the disabling
