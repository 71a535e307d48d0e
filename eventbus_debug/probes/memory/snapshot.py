"""Memory snapshots: process and device memory at one moment, the live-tensor census, and the
before/after tracking of a block.

Process memory is the resident set size (psutil); where CUDA is available, the caching
allocator's allocated / reserved / peak bytes, allocation retries and OOM count
(``torch.cuda.memory_stats``).
"""

from __future__ import annotations

import gc
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Final

import psutil
import torch
from typing_extensions import Self

from ..._validate import publisher
from ...events import MemorySampled
from ...typing import Publisher

__all__ = (
    "MemoryDelta",
    "MemorySnapshot",
    "TensorCensus",
    "memory_snapshot",
    "memory_tracking",
    "tensor_census",
)

MIB: Final = 1 << 20
"""Bytes in a mebibyte (messages print MiB)."""


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
        """This snapshot as a :class:`~eventbus_debug.events.MemorySampled` event."""
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

    On exit it publishes two :class:`~eventbus_debug.events.MemorySampled` events (labels
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
        TypeError: if *bus* is not a Publisher (either bus) or None.
    """

    def __init__(
        self,
        name: str,
        bus: Publisher | None = None,
        *,
        step: int | None = None,
        count_tensors: bool = False,
        source: str = "memory_tracking",
    ) -> None:
        self.name = name
        self._bus = publisher("bus", bus)
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
        if self._bus is not None:
            self._bus.publish_many_nowait(
                snap.to_event(step=self._step, source=self._source, label=f"{self.name}:{which}")
                for snap, which in ((before, "before"), (after, "after"))
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
