"""Memory probes: snapshots, before/after tracking, a model's memory profile and leak detection.

Process memory is the resident set size (psutil); where CUDA is available, the caching
allocator's allocated / reserved / peak bytes, allocation retries and OOM count
(``torch.cuda.memory_stats``). Leak detection looks for a *sustained* upward trend (a
least-squares slope over a window of samples, with a minimum total growth, so warm-up does not
fire) of RSS, CUDA memory, live tensors, or tensors that keep an autograd graph alive across
steps -- the most common real leak (``losses.append(loss)`` instead of ``loss.item()``).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import threading
import time
import warnings
import weakref
from collections import Counter, deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Final

import psutil
import torch
from torch import nn
from typing_extensions import Self

from eventbus_debug.diagnostics import get_logger

from .._bus import EventBus, SyncEventBus
from ..events import MemoryLeakSuspected, MemorySampled
from ._publish import Publish, publisher_for

__all__ = (
    "LeakDetector",
    "LeakThresholds",
    "MemoryDelta",
    "MemoryProfile",
    "MemorySnapshot",
    "TensorCensus",
    "cuda_memory_history",
    "memory_snapshot",
    "memory_tracking",
    "profile_memory",
    "tensor_census",
)

_log = get_logger(__name__)

MIB: Final = 1 << 20
DEFAULT_HISTORY_ENTRIES: Final = 100_000
RESOURCES: Final = ("rss", "cuda_allocated", "live_tensors", "graph")


# -- snapshots ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class MemorySnapshot:
    """Process and device memory at one moment (bytes).

    Attributes:
        rss_bytes: the process's resident set size.
        cuda_allocated: bytes held by live CUDA tensors (None without CUDA).
        cuda_reserved: bytes reserved by the CUDA caching allocator.
        cuda_peak: the allocator's peak allocated bytes since the last reset.
        cuda_alloc_retries: how often the allocator freed its cache to retry an allocation.
        cuda_ooms: how many out-of-memory errors the allocator raised.
        live_tensors: Python tensor objects alive (only when counted: it scans the heap).
        graph_tensors: live tensors holding an autograd graph (``grad_fn`` set), when counted.
        time_ns: when the snapshot was taken (``time.time_ns()``).
    """

    rss_bytes: int
    cuda_allocated: int | None = None
    cuda_reserved: int | None = None
    cuda_peak: int | None = None
    cuda_alloc_retries: int | None = None
    cuda_ooms: int | None = None
    live_tensors: int | None = None
    graph_tensors: int | None = None
    time_ns: int = 0

    def to_event(
        self, *, step: int | None = None, source: str = "", label: str = ""
    ) -> MemorySampled:
        """This snapshot as a :class:`~eventbus_debug.MemorySampled` event."""
        return MemorySampled(
            step=step,
            source=source,
            rss_bytes=self.rss_bytes,
            cuda_allocated=self.cuda_allocated,
            cuda_reserved=self.cuda_reserved,
            cuda_peak=self.cuda_peak,
            cuda_alloc_retries=self.cuda_alloc_retries,
            cuda_ooms=self.cuda_ooms,
            live_tensors=self.live_tensors,
            label=label,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorCensus:
    """The Python tensor objects alive at one moment (one scan of the garbage collector's heap).

    Attributes:
        live: every live tensor object (parameters and gradients included).
        graph: the live tensors with a ``grad_fn``: each keeps its autograd graph alive.
        graph_groups: ``((grad_fn name, shape), count)`` of those, most frequent first.
    """

    live: int
    graph: int
    graph_groups: tuple[tuple[tuple[str, tuple[int, ...]], int], ...] = ()


_TENSOR_TYPES: dict[type, bool] = {}
"""Whether each type met on the heap is a tensor type. ``isinstance(obj, torch.Tensor)`` goes
through torch's metaclass on every object (about 1 µs, a second per scan of a torch process's
heap); a dict hit on the object's type costs tens of nanoseconds."""


def _is_tensor_type(tp: type) -> bool:
    known = _TENSOR_TYPES.get(tp)
    if known is None:
        try:
            known = issubclass(tp, torch.Tensor)
        except Exception:
            known = False
        if len(_TENSOR_TYPES) > 4096:
            _TENSOR_TYPES.clear()  # bounded: types created at run time come and go
        _TENSOR_TYPES[tp] = known
    return known


def _live_tensors() -> Iterator[torch.Tensor]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            if _is_tensor_type(type(obj)):
                yield obj


def tensor_census(*, groups: int = 5) -> TensorCensus:
    """Count live tensors and the ones holding an autograd graph (scans ``gc.get_objects()``).

    Costs one pass over every object the garbage collector tracks (a few ms to tens of ms with
    torch imported, see docs/probes.md): call it every N steps, not every step.

    Args:
        groups: how many ``(grad_fn, shape)`` groups to keep, most frequent first.
    """
    live = 0
    counter: Counter[tuple[str, tuple[int, ...]]] = Counter()
    for t in _live_tensors():
        live += 1
        fn = t.grad_fn
        if fn is not None:
            counter[(type(fn).__name__, tuple(int(s) for s in t.shape))] += 1
    graph = sum(counter.values())
    return TensorCensus(live=live, graph=graph, graph_groups=tuple(counter.most_common(groups)))


def _cuda_stats() -> dict[str, int | None]:
    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    return {
        "cuda_allocated": int(stats.get("allocated_bytes.all.current", 0)),
        "cuda_reserved": int(stats.get("reserved_bytes.all.current", 0)),
        "cuda_peak": int(stats.get("allocated_bytes.all.peak", 0)),
        "cuda_alloc_retries": int(stats.get("num_alloc_retries", 0)),
        "cuda_ooms": int(stats.get("num_ooms", 0)),
    }


def memory_snapshot(*, count_tensors: bool = False) -> MemorySnapshot:
    """Take a :class:`MemorySnapshot` now (RSS: ~10 µs; CUDA stats where available).

    Args:
        count_tensors: also count live tensors and graph-holding tensors (scans the heap).
    """
    rss = int(psutil.Process().memory_info().rss)
    census = tensor_census(groups=0) if count_tensors else None
    return MemorySnapshot(
        rss_bytes=rss,
        live_tensors=census.live if census else None,
        graph_tensors=census.graph if census else None,
        time_ns=time.time_ns(),
        **_cuda_stats(),
    )


# -- before / after -----------------------------------------------------------------------------


def _diff(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else b - a


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryDelta:
    """How memory changed across a block (``after - before``; bytes or counts).

    Attributes:
        name: the block's name.
        before: the snapshot taken on entry.
        after: the snapshot taken on exit.
        duration_s: the block's wall time.
    """

    name: str
    before: MemorySnapshot
    after: MemorySnapshot
    duration_s: float

    @property
    def rss_bytes(self) -> int:
        """The change of the resident set size."""
        return self.after.rss_bytes - self.before.rss_bytes

    @property
    def cuda_allocated(self) -> int | None:
        """The change of CUDA allocated bytes (None without CUDA)."""
        return _diff(self.before.cuda_allocated, self.after.cuda_allocated)

    @property
    def live_tensors(self) -> int | None:
        """The change of the live tensor count (None when tensors were not counted)."""
        return _diff(self.before.live_tensors, self.after.live_tensors)

    @property
    def graph_tensors(self) -> int | None:
        """The change of graph-holding tensors (None when tensors were not counted)."""
        return _diff(self.before.graph_tensors, self.after.graph_tensors)


class memory_tracking:
    """Compare memory before and after a block: ``with`` or ``async with``.

    On exit it publishes two :class:`~eventbus_debug.MemorySampled` events (labels
    ``"<name>:before"`` and ``"<name>:after"``) when a bus is given, and :attr:`delta` holds
    the :class:`MemoryDelta`::

        with memory_tracking("forward", count_tensors=True) as tracked:
            out = model(x)
        print(tracked.delta.rss_bytes, tracked.delta.live_tensors)

    Args:
        name: the block's name (in the events' labels).
        bus: where to publish the two samples (None: only :attr:`delta`).
        step: the step the events carry.
        count_tensors: also count live tensors (scans the heap twice).
        source: the events' source.

    Raises:
        TypeError: if *bus* is not an EventBus, a SyncEventBus or None.
    """

    def __init__(
        self,
        name: str,
        bus: EventBus | SyncEventBus | None = None,
        *,
        step: int | None = None,
        count_tensors: bool = False,
        source: str = "memory_tracking",
    ) -> None:
        self.name = name
        self._publish: Publish = publisher_for(bus)
        self._step = step
        self._count = count_tensors
        self._source = source
        self._before: MemorySnapshot | None = None
        self._t0 = 0.0
        self._delta: MemoryDelta | None = None

    @property
    def delta(self) -> MemoryDelta:
        """The change across the block.

        Raises:
            RuntimeError: before the block exited.
        """
        if self._delta is None:
            msg = f"memory_tracking({self.name!r}).delta is known only once the block exited"
            raise RuntimeError(msg)
        return self._delta

    def __enter__(self) -> Self:
        self._before = memory_snapshot(count_tensors=self._count)
        self._t0 = time.perf_counter()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        before = self._before
        if before is None:  # pragma: no cover - __exit__ without __enter__
            return
        after = memory_snapshot(count_tensors=self._count)
        self._delta = MemoryDelta(
            name=self.name, before=before, after=after, duration_s=time.perf_counter() - self._t0
        )
        for snap, which in ((before, "before"), (after, "after")):
            self._publish(
                snap.to_event(step=self._step, source=self._source, label=f"{self.name}:{which}")
            )

    async def __aenter__(self) -> Self:
        return self.__enter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.__exit__(exc_type, exc, tb)


# -- a model's memory profile -------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryProfile:
    """Seed 000's ``profile_memory``: memory around one forward pass.

    Attributes:
        initial: before the forward pass.
        after_forward: right after it, with the output still alive.
        final: after the output was released and the garbage collected.
        peak_rss_bytes: the largest RSS seen: the snapshots and a thread polling RSS every
            millisecond during the forward pass (psutil has no peak of its own).
        peak_cuda_bytes: the CUDA allocator's peak during the forward (None without CUDA).
        output_shapes: the shapes of the tensors the forward returned.
    """

    initial: MemorySnapshot
    after_forward: MemorySnapshot
    final: MemorySnapshot
    peak_rss_bytes: int
    peak_cuda_bytes: int | None
    output_shapes: tuple[tuple[int, ...], ...] = field(default=())

    @property
    def forward_rss_bytes(self) -> int:
        """RSS held by the forward's output and caches (``after_forward - initial``)."""
        return self.after_forward.rss_bytes - self.initial.rss_bytes


def _shapes(out: Any) -> tuple[tuple[int, ...], ...]:
    if isinstance(out, torch.Tensor):
        return (tuple(int(s) for s in out.shape),)
    if isinstance(out, Mapping):
        return tuple(s for v in out.values() for s in _shapes(v))
    if isinstance(out, list | tuple):
        return tuple(s for v in out for s in _shapes(v))
    return ()


class _RssPeak:
    """Poll the process RSS on a daemon thread until stopped; keep the largest value."""

    def __init__(self, interval: float = 0.001) -> None:
        self._interval = interval
        self._process = psutil.Process()
        self._stop = threading.Event()
        self.peak = int(self._process.memory_info().rss)
        self._thread = threading.Thread(
            target=self._poll, name="eventbus-debug-rss-peak", daemon=True
        )

    def _poll(self) -> None:
        while not self._stop.wait(self._interval):
            self.peak = max(self.peak, int(self._process.memory_info().rss))

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, int(self._process.memory_info().rss))


def profile_memory(model: nn.Module, inputs: Any, *, grad: bool = False) -> MemoryProfile:
    """Measure memory before, right after and after one forward pass of *model* on *inputs*.

    The forward runs under ``torch.no_grad()`` unless *grad* (then the autograd graph the
    output holds is part of ``after_forward``); no backward runs, the model is not changed.

    Args:
        model: the module to run.
        inputs: a tensor, or a tuple/list of positional arguments.
        grad: build the autograd graph as training would.

    Raises:
        TypeError: if *model* is not a torch.nn.Module.
    """
    if not isinstance(model, nn.Module):
        msg = f"model must be a torch.nn.Module, got {type(model).__qualname__}"
        raise TypeError(msg)
    args = tuple(inputs) if isinstance(inputs, list | tuple) else (inputs,)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    initial = memory_snapshot()
    ctx = contextlib.nullcontext() if grad else torch.no_grad()
    with _RssPeak() as peak, ctx:
        out = model(*args)
        if cuda:
            torch.cuda.synchronize()
    after = memory_snapshot()
    shapes = _shapes(out)
    del out
    gc.collect()
    final = memory_snapshot()
    return MemoryProfile(
        initial=initial,
        after_forward=after,
        final=final,
        peak_rss_bytes=max(peak.peak, initial.rss_bytes, after.rss_bytes, final.rss_bytes),
        peak_cuda_bytes=int(torch.cuda.max_memory_allocated()) if cuda else None,
        output_shapes=shapes,
    )


# -- leak detection -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class LeakThresholds:
    """When a trend is a leak: all of these must hold over a full window of samples.

    Attributes:
        window: how many samples the trend is fitted over.
        warmup: samples ignored at the start (allocator and cache warm-up).
        rising_fraction: the fraction of sample-to-sample increments that must be positive.
        rss_bytes: the minimum RSS growth over the window.
        cuda_bytes: the minimum CUDA allocated growth over the window.
        live_tensors: the minimum growth of live tensors over the window.
        graph_tensors: the minimum growth of graph-holding tensors surviving across samples.
    """

    window: int = 8
    warmup: int = 2
    rising_fraction: float = 0.7
    rss_bytes: int = 64 * MIB
    cuda_bytes: int = 64 * MIB
    live_tensors: int = 64
    graph_tensors: int = 4

    def __post_init__(self) -> None:
        if self.window < 3:
            msg = f"window must be >= 3 samples to fit a trend, got {self.window}"
            raise ValueError(msg)
        if self.warmup < 0:
            msg = f"warmup must be >= 0, got {self.warmup}"
            raise ValueError(msg)
        if not 0.0 <= self.rising_fraction <= 1.0:
            msg = f"rising_fraction must be within [0, 1], got {self.rising_fraction}"
            raise ValueError(msg)

    def min_growth(self, resource: str) -> float:
        """The minimum growth over the window for *resource* (one of :data:`RESOURCES`)."""
        return float(
            {
                "rss": self.rss_bytes,
                "cuda_allocated": self.cuda_bytes,
                "live_tensors": self.live_tensors,
                "graph": self.graph_tensors,
            }[resource]
        )


def _slope(values: list[float]) -> float:
    n = len(values)
    mean_x = (n - 1) / 2
    mean_y = sum(values) / n
    num = sum((i - mean_x) * (v - mean_y) for i, v in enumerate(values))
    den = sum((i - mean_x) ** 2 for i in range(n))
    return num / den


class LeakDetector:
    """Fed once per step; every *every* steps it samples memory and looks for a leak.

    A sample is RSS (and CUDA allocated bytes), plus, when *count_tensors*, one scan of the
    garbage collector's heap counting live tensors and the tensors holding an autograd graph
    that were already alive at the previous sample (they survived a step: the
    ``losses.append(loss)`` leak). A resource whose window of samples rises (least-squares
    slope > 0, most increments positive, total growth above its threshold) raises one
    :class:`~eventbus_debug.MemoryLeakSuspected`; its window then restarts, so a leak that
    goes on is reported once per window, not once per sample.

    Example::

        detector = LeakDetector(bus, every=10)
        for step in range(steps):
            ...
            detector.observe(step)

    Args:
        bus: where samples and incidents are published (None: only returned).
        every: sample every *every* steps. A sample with *count_tensors* scans the heap:
            ~30 ms with 180k objects on this project's CPU (docs/probes.md), so the default
            of 50 adds ~0.6 ms per step; without it a sample costs ~30 µs.
        thresholds: window, warm-up and minimum growths.
        count_tensors: scan the heap for live and graph-holding tensors.
        publish_samples: publish a :class:`~eventbus_debug.MemorySampled` per sample.
        source: the events' source.

    Raises:
        ValueError: if *every* is below 1.
        TypeError: if *bus* is not an EventBus, a SyncEventBus or None.
    """

    def __init__(
        self,
        bus: EventBus | SyncEventBus | None = None,
        *,
        every: int = 50,
        thresholds: LeakThresholds | None = None,
        count_tensors: bool = True,
        publish_samples: bool = True,
        source: str = "leak_detector",
    ) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            msg = f"every must be an int >= 1 (steps between samples), got {every!r}"
            raise ValueError(msg)
        self.every = every
        self.thresholds = thresholds or LeakThresholds()
        self.count_tensors = count_tensors
        self.publish_samples = publish_samples
        self.source = source
        self._publish: Publish = publisher_for(bus)
        self._series: dict[str, deque[float]] = {
            r: deque(maxlen=self.thresholds.window) for r in RESOURCES
        }
        self._seen: dict[str, int] = dict.fromkeys(RESOURCES, 0)
        self._previous: dict[int, weakref.ref[torch.Tensor]] = {}
        self._last_retained = ""
        self.samples = 0

    def bind(self, bus: EventBus | SyncEventBus | None) -> None:
        """Publish onto *bus* from now on (a session binds the detector it is given).

        Raises:
            TypeError: if *bus* is not an EventBus, a SyncEventBus or None.
        """
        self._publish = publisher_for(bus)

    def _scan(self) -> tuple[int, int, str]:
        """One heap pass: live tensors, graph tensors alive at the previous sample, and what."""
        # id -> weak reference: tensors compare elementwise, so they cannot go in a WeakSet.
        current: dict[int, weakref.ref[torch.Tensor]] = {}
        survived: Counter[tuple[str, tuple[int, ...]]] = Counter()
        live = 0
        for t in _live_tensors():
            live += 1
            fn = t.grad_fn
            if fn is None:
                continue
            current[id(t)] = weakref.ref(t)
            before = self._previous.get(id(t))
            if before is not None and before() is t:
                survived[(type(fn).__name__, tuple(int(s) for s in t.shape))] += 1
        self._previous = current
        total = sum(survived.values())
        parts = [f"{n} x {name} {list(shape)}" for (name, shape), n in survived.most_common(3)]
        retained = (
            f"{total} tensors with grad_fn survived since the previous sample, each keeping "
            f"its autograd graph alive ({', '.join(parts)}); keep `loss.item()` or "
            "`loss.detach()`, not the loss"
            if total
            else ""
        )
        return live, total, retained

    def observe(self, step: int) -> tuple[MemoryLeakSuspected, ...]:
        """Account for *step*; on sampling steps, sample and return (and publish) any incident.

        Returns:
            The incidents raised at this step (usually none).
        """
        if step % self.every:
            return ()
        snap = memory_snapshot()
        live: int | None = None
        values: dict[str, float] = {"rss": float(snap.rss_bytes)}
        if snap.cuda_allocated is not None:
            values["cuda_allocated"] = float(snap.cuda_allocated)
        if self.count_tensors:
            live, graph, self._last_retained = self._scan()
            values["live_tensors"] = float(live)
            values["graph"] = float(graph)
        self.samples += 1
        if self.publish_samples:
            event = snap.to_event(step=step, source=self.source, label="leak_detector")
            if live is not None:
                event = MemorySampled(
                    step=step,
                    source=self.source,
                    rss_bytes=snap.rss_bytes,
                    cuda_allocated=snap.cuda_allocated,
                    cuda_reserved=snap.cuda_reserved,
                    cuda_peak=snap.cuda_peak,
                    cuda_alloc_retries=snap.cuda_alloc_retries,
                    cuda_ooms=snap.cuda_ooms,
                    live_tensors=live,
                    label="leak_detector",
                )
            self._publish(event)
        fired: list[MemoryLeakSuspected] = []
        for resource, value in values.items():
            incident = self._update(resource, value, step)
            if incident is not None:
                fired.append(incident)
                self._publish(incident)
        return tuple(fired)

    def _update(self, resource: str, value: float, step: int) -> MemoryLeakSuspected | None:
        self._seen[resource] += 1
        if self._seen[resource] <= self.thresholds.warmup:
            return None
        series = self._series[resource]
        series.append(value)
        if len(series) < self.thresholds.window:
            return None
        values = list(series)
        slope = _slope(values)
        rises = sum(1 for a, b in itertools.pairwise(values) if b > a)
        growth = slope * (len(values) - 1)
        if (
            slope <= 0
            or rises < self.thresholds.rising_fraction * (len(values) - 1)
            or growth < self.thresholds.min_growth(resource)
        ):
            return None
        series.clear()
        retained = self._describe(resource, values)
        _log.info("memory_leak_suspected", resource=resource, slope=slope, step=step)
        return MemoryLeakSuspected(
            step=step,
            source=self.source,
            resource=resource,
            slope=slope,
            window=len(values),
            retained=retained,
        )

    def _describe(self, resource: str, values: list[float]) -> str:
        if resource == "graph":
            return self._last_retained
        span = f"every {self.every} steps"
        if resource == "live_tensors":
            return f"live tensors grew from {int(values[0])} to {int(values[-1])} (sampled {span})"
        return (
            f"{resource} grew from {values[0] / MIB:.1f} MiB to {values[-1] / MIB:.1f} MiB "
            f"(sampled {span})"
        )


# -- CUDA memory history ------------------------------------------------------------------------


@contextlib.contextmanager
def cuda_memory_history(path: str, *, max_entries: int = DEFAULT_HISTORY_ENTRIES) -> Iterator[bool]:
    """Record the CUDA allocator's history inside the block and dump a snapshot to *path*.

    Wraps ``torch.cuda.memory._record_memory_history`` with a bounded *max_entries*; the
    snapshot opens in https://pytorch.org/memory_viz. Arm it only around the steps you need:
    recording stacks costs time on every allocation. Without CUDA it records nothing and
    yields False. (Not verified on a GPU in this project's test suite.)

    Raises:
        ValueError: if *max_entries* is below 1.
    """
    if max_entries < 1:
        msg = f"max_entries must be >= 1 (it bounds the history kept), got {max_entries}"
        raise ValueError(msg)
    if not torch.cuda.is_available():
        yield False
        return
    record = torch.cuda.memory._record_memory_history
    record(enabled="all", max_entries=max_entries)
    try:
        yield True
        torch.cuda.memory._dump_snapshot(path)  # type: ignore[no-untyped-call]
    finally:
        record(enabled=None)
