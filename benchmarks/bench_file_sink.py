"""End-to-end throughput into RotatingFileSink, against aiofiles baselines measured in the same run.

Run: ``.venv/bin/python benchmarks/bench_file_sink.py [--events N] [--repeat R] [--profile]``

What is timed, per figure (best of ``--repeat`` runs, events pre-built so that event
construction is not measured):

- ``RotatingFileSink``: from the first ``publish_nowait`` to the end of ``async with EventBus()``
  — every event dispatched, encoded, written, the files rotated (``max_bytes`` set so that the
  run rotates about ten times, 3 backups) and closed. Target: >= 500k events/s.
- ``RotatingFileSink + gzip``: the same with ``compress=True``.
- baseline ``aiofiles, one write per event``: ``await f.write(encode_event(e))`` per event, the
  naive async logger (measured on a tenth of the events: it is slow).
- reference ``aiofiles, one write per 4096``: encoding on the event loop, one aiofiles write per
  4096 events — what batching alone buys, without the bus.

``--profile`` runs the sink case once under cProfile and prints the top functions by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiofiles
import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eventbus_debug import EventBus, StepCompleted, encode_event
from sinks import RotatingFileSink

BURST = 1000
BATCH = 4096


def _events(n: int) -> list[StepCompleted]:
    return [
        StepCompleted(step=i, loss=1.0 / (i + 1), learning_rate=1e-3, seq=i + 1) for i in range(n)
    ]


async def _sink_run(events: list[StepCompleted], directory: Path, *, compress: bool) -> float:
    line = len(encode_event(events[-1]))
    max_bytes = max(line * 16, line * len(events) // 10)
    sink = RotatingFileSink(directory, max_bytes=max_bytes, backup_count=3, compress=compress)
    t0 = time.perf_counter()
    async with EventBus() as bus:
        bus.subscribe(sink, capacity=len(events) + 1)
        for start in range(0, len(events), BURST):
            for event in events[start : start + BURST]:
                bus.publish_nowait(event)
            await anyio.lowlevel.checkpoint()  # a training step's await
    elapsed = time.perf_counter() - t0
    stats = sink.statistics()
    if stats.lines_written != len(events) or stats.rotations < 1:
        msg = f"sink wrote {stats.lines_written}/{len(events)} lines, {stats.rotations} rotations"
        raise RuntimeError(msg)
    return elapsed


async def _aiofiles_per_event(events: list[StepCompleted], directory: Path) -> float:
    t0 = time.perf_counter()
    async with aiofiles.open(directory / "baseline.jsonl", "ab") as f:
        for event in events:
            await f.write(encode_event(event))
    return time.perf_counter() - t0


async def _aiofiles_batched(events: list[StepCompleted], directory: Path) -> float:
    t0 = time.perf_counter()
    async with aiofiles.open(directory / "batched.jsonl", "ab") as f:
        for start in range(0, len(events), BATCH):
            await f.write(b"".join(map(encode_event, events[start : start + BATCH])))
    return time.perf_counter() - t0


def _best_rate(
    run: Callable[[list[StepCompleted], Path], Awaitable[float]],
    events: list[StepCompleted],
    repeat: int,
) -> float:
    best = float("inf")
    for _ in range(repeat):
        directory = Path(tempfile.mkdtemp(prefix="bench_file_sink_"))
        try:
            best = min(best, anyio.run(run, events, directory))
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    return len(events) / best


def _plain(events: list[StepCompleted], d: Path) -> Awaitable[float]:
    return _sink_run(events, d, compress=False)


def _gzip(events: list[StepCompleted], d: Path) -> Awaitable[float]:
    return _sink_run(events, d, compress=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()

    events = _events(args.events)
    small = events[: max(1000, args.events // 10)]
    print(
        f"{args.events:,} StepCompleted events, best of {args.repeat}; Python {sys.version.split()[0]}"
    )
    rows = [
        ("RotatingFileSink (rotation on)", _best_rate(_plain, events, args.repeat)),
        ("RotatingFileSink + gzip", _best_rate(_gzip, events, args.repeat)),
        (
            "baseline: aiofiles, one write per event",
            _best_rate(_aiofiles_per_event, small, args.repeat),
        ),
        (
            "reference: aiofiles, one write per 4096",
            _best_rate(_aiofiles_batched, events, args.repeat),
        ),
    ]
    baseline = rows[2][1]
    for label, rate in rows:
        print(f"  {label:<42} {rate:>12,.0f} events/s   {rate / baseline:6.1f}x baseline")
    target = rows[0][1]
    print(
        f"target >= 500,000 events/s: {'met' if target >= 500_000 else 'NOT met'} ({target:,.0f})"
    )

    if args.profile:
        directory = Path(tempfile.mkdtemp(prefix="bench_file_sink_prof_"))
        profiler = cProfile.Profile()
        try:
            profiler.enable()
            anyio.run(_plain, events, directory)
            profiler.disable()
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        print("\ncProfile, top 12 by own time (worker threads are not profiled by cProfile):")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
