"""Leak detection: a *sustained* upward trend of a resource, sampled every few steps.

A least-squares slope over a window of samples, with a minimum total growth so warm-up does not
fire, of RSS, CUDA memory, live tensors, or tensors that keep an autograd graph alive across
steps -- the most common real leak (``losses.append(loss)`` instead of ``loss.item()``).
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections import Counter, deque
from dataclasses import dataclass
from typing import Final

import torch

from eventbus_debug.diagnostics import get_logger

from ..._validate import flags_and_source, fraction, non_negative, positive_int, publisher
from ...events import MemoryLeakSuspected, MemorySampled
from ...typing import Publisher
from .snapshot import MIB, _live_tensors, memory_snapshot

__all__ = ("LeakDetector", "LeakThresholds")

_log = get_logger(__name__)

RESOURCES: Final = ("rss", "cuda_allocated", "live_tensors", "graph")
"""What the detector follows: one series each."""


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

    Raises:
        TypeError: if a field is not a number (*window* not an int).
        ValueError: if *window* is below 3, *rising_fraction* outside [0, 1], or another field
            negative or NaN (a minimum growth may be ``math.inf``: that resource never leaks).
    """

    window: int = 8
    warmup: int = 2
    rising_fraction: float = 0.7
    rss_bytes: int = 64 * MIB
    cuda_bytes: int = 64 * MIB
    live_tensors: int = 64
    graph_tensors: int = 4

    def __post_init__(self) -> None:
        if positive_int("window", self.window) < 3:
            msg = f"window must be >= 3 samples to fit a trend, got {self.window}"
            raise ValueError(msg)
        non_negative("warmup", self.warmup)
        fraction("rising_fraction", self.rising_fraction)
        for name in ("rss_bytes", "cuda_bytes", "live_tensors", "graph_tensors"):
            value = getattr(self, name)
            if value != math.inf:  # inf: never a leak of this resource
                non_negative(name, value)

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
    :class:`~eventbus_debug.events.MemoryLeakSuspected`; its window then restarts, so a leak that
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
        publish_samples: publish a :class:`~eventbus_debug.events.MemorySampled` per sample.
        source: the events' source.

    Raises:
        ValueError: if *every* is below 1.
        TypeError: if *bus* is not a Publisher (either bus) or None, *every* not an int,
            *thresholds* not a :class:`LeakThresholds` or None, *count_tensors* or
            *publish_samples* not a bool, or *source* not a str.
    """

    def __init__(
        self,
        bus: Publisher | None = None,
        *,
        every: int = 50,
        thresholds: LeakThresholds | None = None,
        count_tensors: bool = True,
        publish_samples: bool = True,
        source: str = "leak_detector",
    ) -> None:
        self.every = positive_int("every", every)
        if thresholds is not None and not isinstance(thresholds, LeakThresholds):
            msg = f"thresholds must be a LeakThresholds or None, got {thresholds!r}"
            raise TypeError(msg)
        flags_and_source(source, count_tensors=count_tensors, publish_samples=publish_samples)
        self.thresholds = thresholds if thresholds is not None else LeakThresholds()
        self.count_tensors = count_tensors
        self.publish_samples = publish_samples
        self.source = source
        self._bus = publisher("bus", bus)
        self._series: dict[str, deque[float]] = {
            r: deque(maxlen=self.thresholds.window) for r in RESOURCES
        }
        self._seen: dict[str, int] = dict.fromkeys(RESOURCES, 0)
        self._peak: dict[str, float] = dict.fromkeys(RESOURCES, -math.inf)
        """The highest sample before the current window, per resource (see :meth:`_update`)."""
        self._previous: dict[int, weakref.ref[torch.Tensor]] = {}
        self._last_retained = ""
        self.samples = 0

    def bind(self, bus: Publisher | None) -> None:
        """Publish onto *bus* from now on (a session binds the detector it is given).

        Raises:
            TypeError: if *bus* is not a Publisher (either bus) or None.
        """
        self._bus = publisher("bus", bus)

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
        bus = self._bus
        if self.publish_samples and bus is not None:
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
            bus.publish_nowait(event)
        fired: list[MemoryLeakSuspected] = []
        for resource, value in values.items():
            incident = self._update(resource, value, step)
            if incident is not None:
                fired.append(incident)
                if bus is not None:
                    bus.publish_nowait(incident)
        return tuple(fired)

    def _update(self, resource: str, value: float, step: int) -> MemoryLeakSuspected | None:
        self._seen[resource] += 1
        if self._seen[resource] <= self.thresholds.warmup:
            return None
        series = self._series[resource]
        if len(series) == series.maxlen:
            self._peak[resource] = max(self._peak[resource], series[0])  # leaves the window
        series.append(value)
        if len(series) < self.thresholds.window:
            return None
        values = list(series)
        slope = _slope(values)
        rises = sum(1 for a, b in itertools.pairwise(values) if b > a)
        growth = slope * (len(values) - 1)
        minimum = self.thresholds.min_growth(resource)
        if (
            slope <= 0
            or rises < self.thresholds.rising_fraction * (len(values) - 1)
            or growth < minimum
            # A leak is memory never given back: the window must end above every earlier
            # sample by the minimum growth. A list filled each epoch and cleared at its end
            # (the epoch's losses, kept for their mean) rises the same way every epoch; it is
            # reported at most once, in the first, never again at the same level.
            or values[-1] < self._peak[resource] + minimum
        ):
            return None
        self._peak[resource] = max(self._peak[resource], *values)
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
