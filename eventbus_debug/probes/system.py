"""The system-resource sampler: CPU, memory, disk (and GPU through NVML) on a timer.

System resources, off the training path: the sampler runs as its own task,
its psutil / NVML calls run in a worker thread (``anyio.to_thread.run_sync``), and it publishes
:class:`~eventbus_debug.events.SystemSampled` telemetry plus a
:class:`~eventbus_debug.events.ResourceThresholdExceeded` incident when a metric stays above its
threshold for ``sustain`` consecutive readings (pressure, not a spike), once per episode: the
metric must fall back below ``threshold - hysteresis`` to re-arm. CPU is not watched by default:
a CPU kept busy by training is what training does.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Final

import anyio
import anyio.abc
import psutil
from typing_extensions import Self

from eventbus_debug.diagnostics import get_logger

from .._validate import non_negative, positive_int, positive_seconds, publisher
from ..events import Event, MemorySampled, ResourceThresholdExceeded, SystemSampled
from ..typing import Publisher
from .memory import MemorySnapshot, memory_snapshot

__all__ = (
    "CpuMeter",
    "MetricSummary",
    "ResourceThresholds",
    "SystemReading",
    "SystemSampler",
    "SystemSummary",
    "read_system",
)

_log = get_logger(__name__)

METRICS: Final = (
    "cpu_percent",
    "memory_percent",
    "disk_percent",
    "gpu_utilization",
    "gpu_memory_percent",
)


@dataclass(frozen=True, slots=True, kw_only=True)
class SystemReading:
    """One reading of the host (and GPU) utilisation, in percent.

    Attributes:
        cpu_percent: system-wide CPU utilisation since the previous reading.
        memory_percent: used virtual memory.
        disk_percent: used space of the sampled disk.
        gpu_utilization: the busiest GPU's utilisation (None without NVML).
        gpu_memory_percent: the fullest GPU's memory use (None without NVML).
    """

    cpu_percent: float
    memory_percent: float
    disk_percent: float
    gpu_utilization: float | None = None
    gpu_memory_percent: float | None = None

    def value(self, metric: str) -> float | None:
        """The reading of *metric* (one of ``METRICS``)."""
        return getattr(self, metric)  # type: ignore[no-any-return]


def _nvml() -> Any:
    """The NVML module when ``pynvml`` is importable and a driver answers, else None."""
    try:
        import pynvml  # type: ignore[import-not-found,unused-ignore]

        pynvml.nvmlInit()
    except Exception:
        return None
    return pynvml


def _gpu_reading(nvml: Any) -> tuple[float | None, float | None]:
    if nvml is None:
        return None, None
    try:
        util = 0.0
        mem = 0.0
        for i in range(int(nvml.nvmlDeviceGetCount())):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            util = max(util, float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu))
            info = nvml.nvmlDeviceGetMemoryInfo(handle)
            mem = max(mem, 100.0 * float(info.used) / float(info.total or 1))
    except Exception:
        return None, None
    return util, mem


class CpuMeter:
    """System-wide CPU utilisation between successive readings (``psutil.cpu_times`` deltas).

    Holds its own previous reading (psutil's ``cpu_percent(interval=None)`` keeps it per
    thread, which a pool of worker threads defeats). The first reading measures over
    *first_interval* seconds (blocking).
    """

    def __init__(self, first_interval: float = 0.1) -> None:
        self.first_interval = first_interval
        self._last: tuple[float, float] | None = None

    @staticmethod
    def _times() -> tuple[float, float]:
        t = psutil.cpu_times()
        idle = float(t.idle) + float(getattr(t, "iowait", 0.0))
        # Linux counts guest time inside user/nice too (psutil subtracts it the same way).
        guest = float(getattr(t, "guest", 0.0)) + float(getattr(t, "guest_nice", 0.0))
        return float(sum(t)) - guest, idle

    def percent(self) -> float:
        """The utilisation since the previous call (blocking on the first call)."""
        if self._last is None:
            self._last = self._times()
            time.sleep(self.first_interval)
        total, idle = self._times()
        last_total, last_idle = self._last
        self._last = (total, idle)
        d_total = total - last_total
        if d_total <= 0:
            return 0.0
        return max(0.0, min(100.0, 100.0 * (1.0 - (idle - last_idle) / d_total)))


def read_system(
    disk_path: str = "/", *, nvml: Any = None, cpu: CpuMeter | None = None
) -> SystemReading:
    """Read CPU, memory and disk use now (blocking: call it from a worker thread).

    Args:
        disk_path: the path whose disk is sampled.
        nvml: an initialised ``pynvml`` module for GPU metrics (None: no GPU metrics).
        cpu: the meter giving CPU use since its previous reading (default: a new one, which
            measures over 0.1 s).
    """
    gpu_util, gpu_mem = _gpu_reading(nvml)
    return SystemReading(
        cpu_percent=(cpu or CpuMeter()).percent(),
        memory_percent=float(psutil.virtual_memory().percent),
        disk_percent=float(psutil.disk_usage(disk_path).percent),
        gpu_utilization=gpu_util,
        gpu_memory_percent=gpu_mem,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class ResourceThresholds:
    """The percentages above which a sustained metric is an incident (None: never).

    Attributes:
        cpu_percent: default None (a CPU kept busy by training is normal; set e.g. 95 to
            watch a data pipeline starving the host).
        memory_percent: default 90.
        disk_percent: default 95.
        gpu_utilization: default None (a busy GPU is what training wants).
        gpu_memory_percent: default 95.
        hysteresis: a metric that fired re-arms only once it fell below
            ``threshold - hysteresis`` (so a sustained condition is one incident).
        sustain: how many consecutive readings above the threshold make an incident (default
            3: with the session's 10 s interval, half a minute of pressure); 1 fires at once.

    Raises:
        TypeError: if a threshold is neither None nor a number, *hysteresis* not a number or
            *sustain* not an int.
        ValueError: if a threshold or *hysteresis* is negative or not finite, or *sustain* is
            below 1.
    """

    cpu_percent: float | None = None
    memory_percent: float | None = 90.0
    disk_percent: float | None = 95.0
    gpu_utilization: float | None = None
    gpu_memory_percent: float | None = 95.0
    hysteresis: float = 5.0
    sustain: int = 3

    def __post_init__(self) -> None:
        for metric in METRICS:
            value = getattr(self, metric)
            if value is not None:
                try:
                    non_negative(metric, value)
                except ValueError as exc:
                    msg = f"{metric} must be a finite percentage >= 0 or None, got {value!r}"
                    raise type(exc)(msg) from None
        non_negative("hysteresis", self.hysteresis)
        try:
            positive_int("sustain", self.sustain)
        except ValueError as exc:
            msg = f"sustain must be an integer >= 1 (consecutive readings), got {self.sustain!r}"
            raise type(exc)(msg) from None

    def threshold(self, metric: str) -> float | None:
        """The threshold of *metric*."""
        return getattr(self, metric)  # type: ignore[no-any-return]


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricSummary:
    """Mean, minimum and maximum of one metric over the sampled period."""

    mean: float
    min: float
    max: float
    samples: int


@dataclass(frozen=True, slots=True, kw_only=True)
class SystemSummary:
    """Statistics per metric over the sampled period.

    Attributes:
        samples: how many readings were taken.
        start_ns: when the first reading was taken (``time.time_ns()``; 0 with no reading).
        end_ns: when the last one was taken.
        metrics: per metric name, its :class:`MetricSummary` (metrics never read are absent).
        incidents: how many threshold incidents were published.
    """

    samples: int
    start_ns: int
    end_ns: int
    metrics: Mapping[str, MetricSummary] = field(default_factory=dict)
    incidents: int = 0

    @property
    def span_s(self) -> float:
        """Seconds between the first and the last reading."""
        return (self.end_ns - self.start_ns) / 1e9


@dataclass(slots=True)
class _Acc:
    total: float = 0.0
    low: float = math.inf
    high: float = -math.inf
    n: int = 0

    def add(self, v: float) -> None:
        self.total += v
        self.low = min(self.low, v)
        self.high = max(self.high, v)
        self.n += 1


class SystemSampler:
    """Sample the system every *interval* seconds, off the training path.

    Run it as a task: ``async with SystemSampler(bus):`` (it starts its own task group) or
    ``tg.start_soon(sampler.run)`` in yours. Each reading runs in a worker thread and is
    published as a :class:`~eventbus_debug.events.SystemSampled`; a metric above its threshold
    publishes one :class:`~eventbus_debug.events.ResourceThresholdExceeded` per crossing.

    Args:
        bus: the bus to publish onto (an :class:`~eventbus_debug.EventBus`; None: only
            :meth:`summary`).
        interval: seconds between readings.
        thresholds: the incident thresholds (defaults: CPU and memory 90 %).
        sample: a function returning a :class:`SystemReading` (default: :func:`read_system`
            with NVML when ``pynvml`` is installed); tests inject fake readings here.
        disk_path: the path whose disk is sampled by the default reader.
        step: a function giving the current training step, stamped on the events.
        source: the events' source.

    Raises:
        ValueError: if *interval* is not a positive finite number.
        TypeError: if *bus* is not a Publisher (either bus) or None, *interval* not a number,
            *thresholds* not a :class:`ResourceThresholds` or None, or *sample* / *step* not
            callable.
    """

    def __init__(
        self,
        bus: Publisher | None = None,
        *,
        interval: float = 10.0,
        thresholds: ResourceThresholds | None = None,
        sample: Callable[[], SystemReading] | None = None,
        disk_path: str = "/",
        step: Callable[[], int | None] | None = None,
        source: str = "system_sampler",
    ) -> None:
        try:
            self.interval = positive_seconds("interval", interval)
        except ValueError as exc:
            msg = f"interval must be a positive number of seconds, got {interval!r}"
            raise type(exc)(msg) from None
        if thresholds is not None and not isinstance(thresholds, ResourceThresholds):
            msg = f"thresholds must be a ResourceThresholds or None, got {thresholds!r}"
            raise TypeError(msg)
        self.thresholds = thresholds if thresholds is not None else ResourceThresholds()
        for name, fn in (("sample", sample), ("step", step)):
            if fn is not None and not callable(fn):
                msg = f"{name} must be a callable or None, got {fn!r}"
                raise TypeError(msg)
        self._bus = publisher("bus", bus)
        self._sample = sample
        self._disk_path = disk_path
        self._step = step
        self.source = source
        self._acc: dict[str, _Acc] = {}
        self._fired: set[str] = set()
        self._above: dict[str, int] = {}
        self._first_ns = 0
        self._last_ns = 0
        self._samples = 0
        self._incidents = 0
        self._nvml: Any = None
        self._cpu = CpuMeter()
        self._tg: anyio.abc.TaskGroup | None = None
        self._stopped = False
        self.last: SystemReading | None = None
        """The latest reading (None before the first)."""

    def _publish(self, event: Event) -> None:
        if self._bus is not None:
            self._bus.publish_nowait(event)

    def _read(self) -> SystemReading:
        if self._sample is not None:
            return self._sample()
        return read_system(self._disk_path, nvml=self._nvml, cpu=self._cpu)

    async def sample_once(self) -> SystemReading:
        """Take one reading now (in a worker thread), publish it and check the thresholds.

        With the sampler's default reader it also publishes a :class:`MemorySampled` (RSS and,
        on CUDA, allocated / reserved / peak bytes), so every session's report shows memory,
        the CUDA peak included, without a memory-tracking mode.
        """
        # Abandoned on cancel: a session's exit never waits for a reading.
        reading, memory = await anyio.to_thread.run_sync(self._read_all, abandon_on_cancel=True)
        self._record(reading)
        if memory is not None and not self._stopped:
            self._publish(
                MemorySampled(
                    step=self._step() if self._step is not None else None,
                    source=self.source,
                    rss_bytes=memory.rss_bytes,
                    cuda_allocated=memory.cuda_allocated,
                    cuda_reserved=memory.cuda_reserved,
                    cuda_peak=memory.cuda_peak,
                    cuda_alloc_retries=memory.cuda_alloc_retries,
                    cuda_ooms=memory.cuda_ooms,
                    label="system_sampler",
                )
            )
        return reading

    def _read_all(self) -> tuple[SystemReading, MemorySnapshot | None]:
        reading = self._read()
        # A custom reader (tests, replays) speaks for itself; the real one samples memory too.
        return reading, (memory_snapshot() if self._sample is None else None)

    def stop(self) -> None:
        """Publish nothing more: a reading still in its worker thread is discarded.

        Call it before publishing a final event (a session's end) that must come last; the
        task itself ends at its next wake-up, or when cancelled.
        """
        self._stopped = True

    def _record(self, reading: SystemReading) -> None:
        if self._stopped:
            return
        now = time.time_ns()
        if not self._samples:
            self._first_ns = now
        self._last_ns = now
        self._samples += 1
        self.last = reading
        step = self._step() if self._step is not None else None
        self._publish(
            SystemSampled(
                step=step,
                source=self.source,
                cpu_percent=reading.cpu_percent,
                memory_percent=reading.memory_percent,
                disk_percent=reading.disk_percent,
                gpu_utilization=reading.gpu_utilization,
                gpu_memory_percent=reading.gpu_memory_percent,
            )
        )
        for metric in METRICS:
            value = reading.value(metric)
            if value is None:
                continue
            self._acc.setdefault(metric, _Acc()).add(value)
            limit = self.thresholds.threshold(metric)
            if limit is None:
                continue
            if metric in self._fired:
                if value < limit - self.thresholds.hysteresis:
                    self._fired.discard(metric)
                    self._above.pop(metric, None)
                continue
            if value <= limit:
                self._above.pop(metric, None)
                continue
            run = self._above[metric] = self._above.get(metric, 0) + 1
            if run >= self.thresholds.sustain:
                self._fired.add(metric)
                self._incidents += 1
                _log.info("resource_threshold_exceeded", metric=metric, value=value)
                self._publish(
                    ResourceThresholdExceeded(
                        step=step,
                        source=self.source,
                        metric=metric,
                        value=value,
                        threshold=limit,
                    )
                )

    async def run(
        self,
        *,
        limit: int | None = None,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Sample every :attr:`interval` seconds until cancelled (or *limit* readings).

        The first reading is taken at once; ``await tg.start(sampler.run)`` returns after it.
        """
        if self._sample is None and self._nvml is None:
            self._nvml = await anyio.to_thread.run_sync(_nvml)
        await self.sample_once()
        task_status.started()
        taken = 1
        while (limit is None or taken < limit) and not self._stopped:
            await anyio.sleep(self.interval)
            await self.sample_once()
            taken += 1

    def summary(self) -> SystemSummary:
        """Mean / min / max per metric, the time span and the number of readings so far."""
        return SystemSummary(
            samples=self._samples,
            start_ns=self._first_ns,
            end_ns=self._last_ns,
            metrics={
                m: MetricSummary(mean=a.total / a.n, min=a.low, max=a.high, samples=a.n)
                for m, a in self._acc.items()
            },
            incidents=self._incidents,
        )

    async def __aenter__(self) -> Self:
        """Start sampling in a task of its own (the first reading is taken before the body).

        A sampler that was stopped (its block left) samples again when entered again; the
        summary goes on accumulating.

        Raises:
            RuntimeError: if the sampler is already running (entered and not left).
        """
        if self._tg is not None:
            msg = "this SystemSampler is already running; leave its block before entering it again"
            raise RuntimeError(msg)
        self._stopped = False
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        try:
            await tg.start(self.run)
        except BaseException:
            tg.cancel_scope.cancel()
            await tg.__aexit__(None, None, None)
            self._tg = None
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        tg, self._tg = self._tg, None
        if tg is None:
            return
        self.stop()
        tg.cancel_scope.cancel()
        await tg.__aexit__(None, None, None)
