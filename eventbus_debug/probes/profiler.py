"""The profiler: ``torch.profiler`` windows, gzipped Chrome traces written off the event loop.

Two ways in:

- :class:`profiling`: ``async with profiling("traces", bus) as prof:`` profiles the block;
- :class:`StepProfiler`: called once per step (one comparison while disarmed); :meth:`arm`
  (by hand, or by an incident it is subscribed to, e.g. a slow step) profiles the next steps
  with a ``torch.profiler.schedule`` (wait / warmup / active).

Each capture is exported as a Chrome trace in a worker thread, gzipped, kept in a
:class:`TraceStore` that deletes the oldest traces beyond a count and a total size, and
announced by a :class:`~eventbus_debug.events.ProfileCaptured` event naming the file and the operators
with the largest self CPU time.
"""

from __future__ import annotations

import gzip
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Final

import anyio
import anyio.abc
import torch
from torch.profiler import ProfilerActivity, profile, schedule
from typing_extensions import Self

from eventbus_debug.diagnostics import get_logger

from .._validate import positive_int, publisher
from ..events import Event, ProfileCaptured
from ..exceptions import ArgumentTypeError
from ..typing import Publisher

__all__ = ("ProfileSchedule", "StepProfiler", "TraceStore", "profiling")

_log = get_logger(__name__)

TRACE_SUFFIX: Final = ".pt.trace.json.gz"
DEFAULT_MAX_TRACES: Final = 5
DEFAULT_MAX_BYTES: Final = 256 << 20
DEFAULT_TOP: Final = 10


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfileSchedule:
    """The window of an armed capture, in steps (``torch.profiler.schedule``).

    Attributes:
        wait: steps skipped after arming.
        warmup: steps profiled but discarded (the profiler's own start-up cost).
        active: steps recorded in the trace.
    """

    wait: int = 1
    warmup: int = 1
    active: int = 3

    def __post_init__(self) -> None:
        for name in ("wait", "warmup", "active"):
            value = getattr(self, name)
            low = 1 if name == "active" else 0
            if isinstance(value, bool) or not isinstance(value, int):
                # the wrong type: a TypeError that is also the ValueError raised before
                msg = f"{name} must be an int >= {low} (steps), got {value!r}"
                raise ArgumentTypeError(msg)
            if value < low:
                msg = f"{name} must be an int >= {low} (steps), got {value!r}"
                raise ValueError(msg)


class TraceStore:
    """A directory of gzipped Chrome traces, capped in number and in total size.

    After each write the oldest traces are deleted until at most *max_traces* files and
    *max_bytes* bytes remain (the newest trace is always kept).

    Raises:
        ArgumentTypeError: if *max_traces* or *max_bytes* is not an int (a ``TypeError``).
        ValueError: if *max_traces* or *max_bytes* is below 1.
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        max_traces: int = DEFAULT_MAX_TRACES,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        self.directory = Path(directory)
        self.max_traces = positive_int("max_traces", max_traces)
        self.max_bytes = positive_int("max_bytes", max_bytes)

    def traces(self) -> list[Path]:
        """The traces kept, oldest first."""
        if not self.directory.is_dir():
            return []
        found = [p for p in self.directory.iterdir() if p.name.endswith(TRACE_SUFFIX)]
        return sorted(found, key=lambda p: (p.stat().st_mtime_ns, p.name))

    def add(self, json_trace: Path, stem: str) -> Path:
        """Gzip *json_trace* into the store as ``<stem>.pt.trace.json.gz``, delete it, prune.

        Blocking: call it from a worker thread.
        """
        self.directory.mkdir(parents=True, exist_ok=True)
        target = self.directory / f"{stem}{TRACE_SUFFIX}"
        with json_trace.open("rb") as src, gzip.open(target, "wb", compresslevel=6) as dst:
            shutil.copyfileobj(src, dst)
        json_trace.unlink(missing_ok=True)
        self.prune(keep=target)
        return target

    def prune(self, *, keep: Path | None = None) -> list[Path]:
        """Delete the oldest traces beyond the caps (never *keep*); return the deleted ones."""
        traces = self.traces()
        sizes = {p: p.stat().st_size for p in traces}
        total = sum(sizes.values())
        deleted: list[Path] = []
        for p in traces:
            if len(traces) - len(deleted) <= self.max_traces and total <= self.max_bytes:
                break
            if p == keep:
                continue
            p.unlink(missing_ok=True)
            total -= sizes[p]
            deleted.append(p)
        if deleted:
            _log.info(
                "profiler_traces_pruned", deleted=len(deleted), kept=len(traces) - len(deleted)
            )
        return deleted


def _top_ops(prof: Any, top: int) -> tuple[tuple[str, float], ...]:
    rows = [
        (str(e.key), float(e.self_cpu_time_total))
        for e in prof.key_averages()
        if not str(e.key).startswith("ProfilerStep")
    ]
    rows.sort(key=lambda r: -r[1])
    return tuple(rows[:top])


def _export(
    prof: Any, store: TraceStore | None, stem: str, top: int
) -> tuple[str, int, tuple[tuple[str, float], ...]]:
    """Write *prof*'s trace into *store* and read its top operators (blocking: a worker thread)."""
    ops = _top_ops(prof, top)
    if store is None:
        return "", 0, ops
    fd, tmp = tempfile.mkstemp(suffix=".json", prefix=f"{stem}.")
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        prof.export_chrome_trace(str(tmp_path))
        path = store.add(tmp_path, stem)
    finally:
        tmp_path.unlink(missing_ok=True)
    return str(path), path.stat().st_size, ops


def _activities(activities: Sequence[ProfilerActivity] | None) -> list[ProfilerActivity]:
    if activities is not None:
        return list(activities)
    found = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        found.append(ProfilerActivity.CUDA)
    return found


def _store(
    directory: str | Path | TraceStore | None, max_traces: int, max_bytes: int
) -> TraceStore | None:
    if directory is None or isinstance(directory, TraceStore):
        return directory
    return TraceStore(directory, max_traces=max_traces, max_bytes=max_bytes)


class profiling:
    """Profile a block with ``torch.profiler``; on exit write its trace off the event loop.

    ::

        async with profiling("traces", bus) as prof:
            for x, y in batches:
                train_step(x, y)
                prof.step()          # optional step markers in the trace
        print(prof.captured.path, prof.captured.top_ops[:3])

    Args:
        directory: where traces go (a path or a :class:`TraceStore`; None: no file, only
            the top operators).
        bus: where the :class:`~eventbus_debug.events.ProfileCaptured` is published (None: none).
        max_traces, max_bytes: the store's caps when *directory* is a path.
        top: how many operators the event lists.
        activities: profiler activities (default CPU, plus CUDA when available).
        record_shapes: record input shapes (larger traces).
        step: the step the event carries.
        trigger: why the capture runs (in the event).
        source: the event's source.

    Raises:
        TypeError: if *bus* is not a Publisher (either bus) or None.
    """

    def __init__(
        self,
        directory: str | Path | TraceStore | None,
        bus: Publisher | None = None,
        *,
        max_traces: int = DEFAULT_MAX_TRACES,
        max_bytes: int = DEFAULT_MAX_BYTES,
        top: int = DEFAULT_TOP,
        activities: Sequence[ProfilerActivity] | None = None,
        record_shapes: bool = False,
        step: int | None = None,
        trigger: str = "manual",
        source: str = "profiler",
    ) -> None:
        self._store = _store(directory, max_traces, max_bytes)
        self._bus = publisher("bus", bus)
        self._top = top
        self._step = step
        self._trigger = trigger
        self._source = source
        self._prof = profile(activities=_activities(activities), record_shapes=record_shapes)
        self._steps = 0
        self._captured: ProfileCaptured | None = None

    def _publish(self, event: Event) -> None:
        if self._bus is not None:
            self._bus.publish_nowait(event)

    def step(self) -> None:
        """Mark the end of a step in the trace."""
        self._steps += 1
        self._prof.step()

    @property
    def captured(self) -> ProfileCaptured:
        """The capture's event (file, size, top operators).

        Raises:
            RuntimeError: before the block exited.
        """
        if self._captured is None:
            msg = "profiling(...).captured is known only once the block exited"
            raise RuntimeError(msg)
        return self._captured

    async def __aenter__(self) -> Self:
        self._prof.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._prof.stop()
        stem = f"profile_{time.strftime('%Y%m%d-%H%M%S')}_{time.time_ns() % 1_000_000_000:09d}"
        path, size, ops = await anyio.to_thread.run_sync(
            _export, self._prof, self._store, stem, self._top
        )
        self._captured = ProfileCaptured(
            step=self._step,
            source=self._source,
            path=path,
            steps=max(1, self._steps),
            size_bytes=size,
            top_ops=ops,
            trigger=self._trigger,
        )
        self._publish(self._captured)


class StepProfiler:
    """Profile a window of steps when armed; one comparison per step while disarmed.

    Call :meth:`step` at the end of every training step. :meth:`arm` (or an incident
    delivered to :meth:`handle`, when subscribed as a sink) profiles the next
    ``wait + warmup + active`` steps; the trace is exported in a worker thread (a task of the
    profiler's own task group: ``async with StepProfiler(...)``), so the loop goes on while it
    is written. Arming while a capture is under way is ignored.

    Example::

        async with StepProfiler(bus, "traces") as profiler:
            bus.subscribe(profiler.handle, SlowStepDetected)   # any incident type
            for step in range(steps):
                train_step()
                profiler.step(step)

    Args:
        bus: where :class:`~eventbus_debug.events.ProfileCaptured` events are published.
        directory: where traces go (a path or a :class:`TraceStore`; None: top operators only).
        schedule: the window an :meth:`arm` opens.
        max_traces, max_bytes: the store's caps when *directory* is a path.
        top: how many operators each event lists.
        activities: profiler activities (default CPU, plus CUDA when available).
        record_shapes: record input shapes (larger traces).
        source: the events' source.

    Raises:
        TypeError: if *bus* is not a Publisher (either bus) or None.
    """

    def __init__(
        self,
        bus: Publisher | None,
        directory: str | Path | TraceStore | None,
        *,
        schedule: ProfileSchedule | None = None,
        max_traces: int = DEFAULT_MAX_TRACES,
        max_bytes: int = DEFAULT_MAX_BYTES,
        top: int = DEFAULT_TOP,
        activities: Sequence[ProfilerActivity] | None = None,
        record_shapes: bool = False,
        source: str = "profiler",
    ) -> None:
        self._bus = publisher("bus", bus)
        self.store = _store(directory, max_traces, max_bytes)
        self.schedule = schedule or ProfileSchedule()
        self._top = top
        self._activities = _activities(activities)
        self._record_shapes = record_shapes
        self.source = source
        self._pending: tuple[ProfileSchedule, str] | None = None
        self._prof: Any = None
        self._window: tuple[ProfileSchedule, str] | None = None
        self._ready: Any = None
        self._tg: anyio.abc.TaskGroup | None = None
        self.captures: list[ProfileCaptured] = []
        """Every capture published so far, oldest first."""

    def _publish(self, event: Event) -> None:
        if self._bus is not None:
            self._bus.publish_nowait(event)

    @property
    def armed(self) -> bool:
        """True while a capture is pending or under way."""
        return self._pending is not None or self._prof is not None

    def arm(self, steps: int | None = None, *, trigger: str = "manual") -> bool:
        """Profile the next steps: ``wait + warmup + (steps or schedule.active)``.

        Returns:
            False when a capture was already pending or under way (nothing changes).

        Raises:
            ValueError: if *steps* is below 1.
        """
        if self.armed:
            return False
        window = self.schedule
        if steps is not None:
            window = ProfileSchedule(wait=window.wait, warmup=window.warmup, active=steps)
        self._pending = (window, trigger)
        _log.info("profiler_armed", steps=window.active, trigger=trigger)
        return True

    async def handle(self, event: Event) -> None:
        """A sink: arm for the schedule's window when an incident arrives."""
        self.arm(trigger=event.kind)

    def _on_ready(self, prof: Any) -> None:
        self._ready = prof

    def step(self, step: int) -> None:
        """Mark the end of *step*: start, advance or finish an armed capture."""
        if self._prof is None:
            if self._pending is None:
                return
            window, trigger = self._pending
            self._pending = None
            self._window = (window, trigger)
            self._prof = profile(
                activities=self._activities,
                record_shapes=self._record_shapes,
                schedule=schedule(
                    wait=window.wait, warmup=window.warmup, active=window.active, repeat=1
                ),
                on_trace_ready=self._on_ready,
            )
            self._prof.start()
            return
        self._prof.step()
        if self._ready is not None:
            self._finish(step)

    def _finish(self, step: int | None) -> None:
        prof, self._prof = self._prof, None
        window, self._window = self._window, None
        prof.stop()  # stopping inside the recorded steps hands what they recorded to _on_ready
        ready, self._ready = self._ready, None
        if ready is None or window is None:
            return
        if self._tg is None:
            msg = "StepProfiler must run inside `async with StepProfiler(...)` to write traces"
            raise RuntimeError(msg)
        self._tg.start_soon(self._export, ready, window, step)

    async def _export(
        self, prof: Any, window: tuple[ProfileSchedule, str], step: int | None
    ) -> None:
        sched, trigger = window
        stem = f"step{step if step is not None else 'x'}_{time.time_ns() % 1_000_000_000:09d}"
        path, size, ops = await anyio.to_thread.run_sync(_export, prof, self.store, stem, self._top)
        event = ProfileCaptured(
            step=step,
            source=self.source,
            path=path,
            steps=sched.active,
            size_bytes=size,
            top_ops=ops,
            trigger=trigger,
        )
        self.captures.append(event)
        self._publish(event)

    async def __aenter__(self) -> Self:
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Stop a capture under way (writing what it recorded) and wait for pending writes."""
        tg = self._tg
        if tg is None:
            return
        self._pending = None
        try:
            if self._prof is not None:
                self._finish(None)
        finally:
            await tg.__aexit__(None, None, None)
            self._tg = None
