"""The system sampler: readings, thresholds with hysteresis, the summary, the timer task."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import anyio
import pytest

from eventbus_debug import EventBus
from eventbus_debug.events import ResourceThresholdExceeded, SystemSampled
from eventbus_debug.probes import ResourceThresholds, SystemReading, SystemSampler, read_system
from eventbus_debug.testing import RecordingSink


def _fake(cpu: list[float], memory: float = 50.0) -> Callable[[], SystemReading]:
    values: Iterator[float] = iter(cpu)

    def sample() -> SystemReading:
        return SystemReading(cpu_percent=next(values), memory_percent=memory, disk_percent=40.0)

    return sample


async def test_sustained_pressure_fires_once_per_episode(
    bus: EventBus, recorder: RecordingSink
) -> None:
    """Three readings in a row above the threshold are one incident; below threshold - hysteresis re-arms."""
    cpu = [10.0, 95.0, 97.0, 99.0, 88.0, 96.0, 80.0, 91.0, 93.0, 94.0]
    sub = bus.subscribe(recorder, SystemSampled, ResourceThresholdExceeded)
    thresholds = ResourceThresholds(cpu_percent=90.0)
    sampler = SystemSampler(bus, sample=_fake(cpu), step=lambda: 7, thresholds=thresholds)
    for _ in cpu:
        await sampler.sample_once()
    await bus.drain(sub)
    incidents = recorder.of_type(ResourceThresholdExceeded)
    # 95, 97, 99: the third fires; 88 is above 90 - 5, no re-arm; 96 still the same episode;
    # 80 re-arms; 91, 93, 94: the third fires again.
    assert [(e.metric, e.value, e.threshold) for e in incidents] == [
        ("cpu_percent", 99.0, 90.0),
        ("cpu_percent", 94.0, 90.0),
    ]
    assert len(recorder.of_type(SystemSampled)) == len(cpu)
    assert all(e.step == 7 for e in recorder.events)


async def test_a_spike_is_not_pressure(bus: EventBus, recorder: RecordingSink) -> None:
    """Readings above the threshold interrupted by one below it never fire."""
    memory = [95.0, 95.0, 50.0, 95.0, 95.0, 50.0]
    values = iter(memory)
    sub = bus.subscribe(recorder, ResourceThresholdExceeded)
    sampler = SystemSampler(
        bus,
        sample=lambda: SystemReading(
            cpu_percent=10.0, memory_percent=next(values), disk_percent=10.0
        ),
    )
    for _ in memory:
        await sampler.sample_once()
    await bus.drain(sub)
    assert recorder.of_type(ResourceThresholdExceeded) == []


async def test_busy_cpu_is_not_an_incident_by_default(
    bus: EventBus, recorder: RecordingSink
) -> None:
    """A CPU at 100 % for the whole run (training) raises nothing with the default thresholds."""
    sub = bus.subscribe(recorder, ResourceThresholdExceeded)
    sampler = SystemSampler(bus, sample=_fake([100.0] * 20))
    for _ in range(20):
        await sampler.sample_once()
    await bus.drain(sub)
    assert recorder.of_type(ResourceThresholdExceeded) == []
    assert sampler.summary().metrics["cpu_percent"].max == 100.0


async def test_summary_has_mean_min_max_span_and_count() -> None:
    """The summary aggregates every reading per metric."""
    sampler = SystemSampler(None, sample=_fake([10.0, 20.0, 60.0], memory=91.0))
    for _ in range(3):
        await sampler.sample_once()
    summary = sampler.summary()
    assert summary.samples == 3 and summary.span_s >= 0
    cpu = summary.metrics["cpu_percent"]
    assert (cpu.mean, cpu.min, cpu.max, cpu.samples) == (30.0, 10.0, 60.0, 3)
    assert "gpu_utilization" not in summary.metrics
    assert summary.incidents == 1  # memory 91 % > 90 % three readings in a row, once


async def test_run_as_a_task_samples_on_its_timer(bus: EventBus, recorder: RecordingSink) -> None:
    """`async with` starts the task; the first reading is taken before the body runs."""
    sub = bus.subscribe(recorder, SystemSampled)
    sampler = SystemSampler(bus, interval=0.001, sample=_fake([1.0] * 1000))
    with anyio.fail_after(10):
        async with sampler:
            assert sampler.summary().samples >= 1
            while sampler.summary().samples < 3:
                await anyio.sleep(0.001)
    await bus.drain(sub)
    assert len(recorder.of_type(SystemSampled)) >= 3


async def test_run_with_a_limit_in_a_task_group() -> None:
    """`run(limit=n)` takes exactly n readings."""
    sampler = SystemSampler(None, interval=0.001, sample=_fake([5.0] * 10))
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: sampler.run(limit=4))
    assert sampler.summary().samples == 4


async def test_one_real_psutil_reading() -> None:
    """The default reader returns percentages in range (psutil, no NVML here)."""
    sampler = SystemSampler(None)
    reading = await sampler.sample_once()
    for value in (reading.cpu_percent, reading.memory_percent, reading.disk_percent):
        assert 0.0 <= value <= 100.0
    direct = read_system("/")
    assert 0.0 <= direct.memory_percent <= 100.0


def test_arguments_are_validated() -> None:
    """Bad intervals, hysteresis and sustain counts are rejected with the rule."""
    with pytest.raises(ValueError, match="interval must be a positive number"):
        SystemSampler(None, interval=0)
    with pytest.raises(ValueError, match="hysteresis"):
        ResourceThresholds(hysteresis=-1)
    with pytest.raises(ValueError, match="sustain must be an integer >= 1"):
        ResourceThresholds(sustain=0)
    with pytest.raises(TypeError, match="bus must be"):
        SystemSampler("bus")  # type: ignore[arg-type]


async def test_session_runs_the_sampler_as_a_task(tmp_path: object) -> None:
    """A Session starts the sampler off the training path and stops it on exit."""
    from torch import nn

    from eventbus_debug import Session, SyncSession

    model = nn.Linear(2, 1)
    with anyio.fail_after(10):
        async with Session(
            model, log_dir=None, report=False, alerts=False, system_interval=0.01
        ) as session:
            assert session.system is not None
            while session.system.summary().samples < 2:
                await anyio.sleep(0.01)
    async with Session(model, log_dir=None, report=False, system_interval=None) as session:
        assert session.system is None
    with SyncSession(model, log_dir=None, report=False, system_interval=0.01) as sync:
        assert sync.system is not None
    with pytest.raises(ValueError, match="system_interval"):
        Session(model, system_interval=0)


def test_cpu_meter_sees_a_busy_thread() -> None:
    """The meter's deltas see this process spinning (bounded, not timed)."""
    import time

    from eventbus_debug.probes import CpuMeter

    meter = CpuMeter(first_interval=0.05)
    meter.percent()
    end = time.perf_counter() + 0.2
    while time.perf_counter() < end:
        pass
    assert 0.0 < meter.percent() <= 100.0


async def test_default_reader_also_samples_memory(bus: EventBus, recorder: RecordingSink) -> None:
    """The real reader publishes a MemorySampled beside each SystemSampled (report memory)."""
    from eventbus_debug.events import MemorySampled

    bus.subscribe(recorder)
    sampler = SystemSampler(bus, step=lambda: 3)
    await sampler.sample_once()
    await bus.drain()
    (memory,) = recorder.of_type(MemorySampled)
    assert memory.rss_bytes > 0 and memory.step == 3 and memory.label == "system_sampler"
    assert len(recorder.of_type(SystemSampled)) == 1


async def test_custom_reader_publishes_no_memory(bus: EventBus, recorder: RecordingSink) -> None:
    """A custom reading function speaks for itself: no memory sample is invented."""
    from eventbus_debug.events import MemorySampled

    bus.subscribe(recorder)
    sampler = SystemSampler(bus, sample=_fake([1.0]))
    await sampler.sample_once()
    await bus.drain()
    assert recorder.of_type(MemorySampled) == []
