"""What the bus costs one training step: a session-like loop, against the same loop without a bus.

Run: ``.venv/bin/python benchmarks/bench_step_loop.py [--steps N] [--rounds R] [--work-us W]``

Each step does what a session's step does to the bus: build and publish two telemetry events,
ask the safe point's two questions (an incident in flight? the engine's queue empty?) and yield
to the event loop once: ``await bus.publish(second)`` as ``Session.step_completed`` does, or,
with ``--yield checkpoint``, ``publish_nowait`` twice and ``await anyio.lowlevel.checkpoint()``. The step's own work is a sleep of ``--work-us`` (it releases the GIL, as torch's
kernels do). Variants, measured in the same run, interleaved round by round:

- ``bare``: the same step without a bus (build the events, sleep, one checkpoint): the baseline;
- ``bus``: publish to a bus with no subscriber;
- ``bus+sink``: one subscriber whose ``handle_batch`` never awaits (a sink that buffers, as a
  log front handing batches to its writer on a timer does);
- ``bus+log``: a :class:`~eventbus_debug.sinks.RotatingFileSink` subscribed (flow-controlled);
- ``bus+log+safepoint``: plus an incident subscriber and the safe point's questions
  (``has_undispatched(Anomaly)`` and the subscriber's pending count).

Prints the median µs per step, the overhead over ``bare`` and the ratio to it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import anyio
import anyio.lowlevel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eventbus_debug import Anomaly, Event, EventBus, Subscription
from eventbus_debug.events import StepCompleted
from eventbus_debug.sinks import RotatingFileSink

VARIANTS = ("bare", "bus", "bus+sink", "bus+log", "bus+log+safepoint")


class _Buffering:
    """A subscriber that keeps what it gets without awaiting: one list extend per batch."""

    name = "buffer"

    def __init__(self) -> None:
        self.events: list[Event] = []

    async def handle_batch(self, events: Sequence[Event], /) -> None:
        self.events.extend(events)
        if len(self.events) > 10_000:
            self.events.clear()


class _Incidents:
    """The recovery engine's stand-in: a subscriber of incidents that keeps nothing."""

    name = "engine"

    async def handle_batch(self, events: Sequence[Event], /) -> None:
        del events


def _queue_empty(sub: Subscription) -> Callable[[], bool]:
    """The engine's "my queue is empty" question, through the cheapest API the bus offers."""
    if hasattr(Subscription, "pending"):
        return lambda: sub.pending == 0
    return lambda: sub.statistics().queued == 0  # before Subscription.pending existed


async def _loop(steps: int, work_s: float, step: Callable[[int], Awaitable[None]]) -> list[float]:
    perf = time.perf_counter
    sleep = time.sleep
    out: list[float] = []
    for i in range(steps):
        t0 = perf()
        if work_s:
            sleep(work_s)
        await step(i)
        out.append(perf() - t0)
    return out


async def run_variant(
    variant: str, steps: int, work_s: float, log_dir: Path, yield_with: str
) -> list[float]:
    """Per-step seconds of one variant over *steps* steps."""
    checkpoint = anyio.lowlevel.checkpoint
    if variant == "bare":

        async def bare(i: int) -> None:
            StepCompleted(step=i, loss=1.0)
            StepCompleted(step=i, loss=2.0)
            await checkpoint()

        return await _loop(steps, work_s, bare)
    async with EventBus() as bus:
        if variant == "bus+sink":
            bus.subscribe(_Buffering())
        elif variant != "bus":
            bus.subscribe(RotatingFileSink(log_dir, max_bytes=1 << 30))
        publish = bus.publish_nowait

        async def publish_then_checkpoint(event: Event) -> None:
            publish(event)
            await checkpoint()

        last = publish_then_checkpoint if yield_with == "checkpoint" else bus.publish
        if variant == "bus+log+safepoint":
            empty = _queue_empty(bus.subscribe(_Incidents(), Anomaly))
            undispatched = bus.has_undispatched

            async def with_safepoint(i: int) -> None:
                publish(StepCompleted(step=i, loss=1.0))
                if undispatched(Anomaly) or not empty():
                    await bus.drain()
                await last(StepCompleted(step=i, loss=2.0))

            return await _loop(steps, work_s, with_safepoint)

        async def plain(i: int) -> None:
            publish(StepCompleted(step=i, loss=1.0))
            await last(StepCompleted(step=i, loss=2.0))

        return await _loop(steps, work_s, plain)


async def bench_safepoint_questions(n: int) -> tuple[float, float]:
    """ns per call of the safe point's two questions on a healthy bus (nothing in flight)."""
    async with EventBus() as bus:
        empty = _queue_empty(bus.subscribe(_Incidents(), Anomaly))
        for i in range(1000):  # a buffer of telemetry in flight: what a scan would walk
            bus.publish_nowait(StepCompleted(step=i))
        undispatched = bus.has_undispatched
        perf = time.perf_counter_ns
        t0 = perf()
        for _ in range(n):
            undispatched(Anomaly)
        t_undispatched = (perf() - t0) / n
        await bus.drain()
        t0 = perf()
        for _ in range(n):
            empty()
        t_empty = (perf() - t0) / n
    return t_undispatched, t_empty


async def main_async(steps: int, rounds: int, work_us: float, yield_with: str) -> None:
    work_s = work_us / 1e6
    per_variant: dict[str, list[float]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for variant in VARIANTS:
                log_dir = Path(tmp) / f"{variant}-{r}"
                per_variant[variant] += await run_variant(
                    variant, steps, work_s, log_dir, yield_with
                )
    base = statistics.median(per_variant["bare"])
    print(
        f"{steps} steps x {rounds} rounds, step work {work_us:.0f} µs (sleep), "
        f"one yield per step: {yield_with}"
    )
    print(f"{'variant':<20} {'median µs/step':>15} {'overhead µs':>12} {'ratio':>7}")
    for variant in VARIANTS:
        med = statistics.median(per_variant[variant])
        print(f"{variant:<20} {med * 1e6:15.1f} {(med - base) * 1e6:12.1f} {med / base:7.3f}")
    t_undispatched, t_empty = await bench_safepoint_questions(200_000)
    print(
        f"safe point questions, 1000 telemetry events undispatched: "
        f"has_undispatched(Anomaly) {t_undispatched:.0f} ns, queue empty {t_empty:.0f} ns"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000, help="steps per variant and round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--work-us", type=float, default=500.0, help="the step's own work (µs)")
    parser.add_argument(
        "--yield",
        dest="yield_with",
        choices=("publish", "checkpoint"),
        default="publish",
        help="how a step yields: await bus.publish(event) or publish_nowait + checkpoint",
    )
    args = parser.parse_args(argv)
    anyio.run(main_async, args.steps, args.rounds, args.work_us, args.yield_with)


if __name__ == "__main__":
    main()
