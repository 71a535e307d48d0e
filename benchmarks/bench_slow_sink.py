"""A subscriber taking 10 ms per event beside a fast one: the publisher must not notice.

Run: ``.venv/bin/python benchmarks/bench_slow_sink.py [--steps N]``

Two runs of the same loop, in the same process: a training-like loop publishes bursts of 100
telemetry events per step and awaits once per step (as an awaited probe does). Run A has one
fast subscriber; run B adds a subscriber that sleeps 10 ms per event. Printed, with targets:

- the publisher's cost per ``publish_nowait`` and the loop's wall time per step, B / A
  (target ≤ 1.5x);
- whether the fast sink received every event in B (target: all);
- the slow subscriber's queue high-water mark and the process's memory growth (bounded by the
  queue capacity, not by the number of events);
- the number of events shed from the slow subscriber's queue, and the EventsDropped reports.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import anyio
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eventbus_debug import Event, EventBus
from eventbus_debug.events import EventsDropped, StepCompleted

BURST = 100


class _Fast:
    name = "fast"

    def __init__(self) -> None:
        self.steps = 0
        self.drops: list[EventsDropped] = []

    async def handle_batch(self, events: Sequence[Event], /) -> None:
        for e in events:
            if type(e) is StepCompleted:
                self.steps += 1
            elif type(e) is EventsDropped:
                self.drops.append(e)


class _Slow:
    name = "slow"

    async def handle(self, event: Event, /) -> None:
        await anyio.sleep(0.01)


async def run(steps: int, *, slow: bool, capacity: int) -> dict[str, float]:
    proc = psutil.Process()
    gc.collect()
    rss0 = proc.memory_info().rss
    fast = _Fast()
    high_water = 0
    per_publish: list[float] = []
    perf = time.perf_counter_ns
    async with EventBus(capacity=capacity, close_timeout=1.0) as bus:
        bus.subscribe(fast)
        slow_sub = bus.subscribe(_Slow(), StepCompleted) if slow else None
        t_start = perf()
        for step in range(steps):
            events = [StepCompleted(step=step, loss=0.5) for _ in range(BURST)]
            t0 = perf()
            for ev in events:
                bus.publish_nowait(ev)
            per_publish.append((perf() - t0) / BURST)
            await anyio.lowlevel.checkpoint()
            if slow_sub is not None and step % 10 == 0:
                high_water = max(high_water, slow_sub.statistics().queued)
        await bus.drain(bus.subscriptions[0])
        wall = (perf() - t_start) / steps
        stats = bus.statistics()
        rss1 = proc.memory_info().rss
        shed = stats.shed
        if slow_sub is not None:
            slow_sub.cancel()  # do not wait 10 s for the slow sink to catch up at close
    return {
        "publish_ns": statistics.median(per_publish),
        "step_us": wall / 1000,
        "fast_received": fast.steps,
        "expected": steps * BURST,
        "shed": shed,
        "drop_reports": len(fast.drops),
        "reported": sum(d.dropped for d in fast.drops),
        "high_water": high_water,
        "rss_growth_mb": (rss1 - rss0) / 2**20,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500, help="steps of 100 events per run")
    parser.add_argument("--capacity", type=int, default=1024, help="queue bound per subscriber")
    args = parser.parse_args(argv)
    base = anyio.run(lambda: run(args.steps, slow=False, capacity=args.capacity))
    with_slow = anyio.run(lambda: run(args.steps, slow=True, capacity=args.capacity))
    n = args.steps * BURST
    print(f"{args.steps} steps x {BURST} events = {n} events, capacity {args.capacity}")
    print(f"{'':34}{'fast only':>12}{'+ slow sink':>14}")
    print(
        f"  publish_nowait (ns, median)     {base['publish_ns']:12.0f}{with_slow['publish_ns']:14.0f}"
    )
    print(f"  loop wall time per step (µs)    {base['step_us']:12.1f}{with_slow['step_us']:14.1f}")
    print(
        f"  fast sink received              {base['fast_received']:12.0f}{with_slow['fast_received']:14.0f}"
    )
    print(f"  slow queue high-water mark      {'':>12}{with_slow['high_water']:14.0f}")
    print(
        f"  RSS growth (MiB)                {base['rss_growth_mb']:12.1f}{with_slow['rss_growth_mb']:14.1f}"
    )
    print(f"  shed (statistics)               {base['shed']:12.0f}{with_slow['shed']:14.0f}")
    print(
        f"  EventsDropped reports / counted {'':>12}{with_slow['drop_reports']:7.0f} / {with_slow['reported']:.0f}"
    )
    print("ratios (target)")
    print(
        f"  publish cost, slow / base       {with_slow['publish_ns'] / base['publish_ns']:8.2f}x  (<= 1.5)"
    )
    print(
        f"  step wall time, slow / base     {with_slow['step_us'] / base['step_us']:8.2f}x  (<= 1.5)"
    )
    print(f"  fast sink got everything        {with_slow['fast_received'] == n!s:>8}")
    bounded = with_slow["high_water"] <= args.capacity + 1  # + the event in flight
    print(f"  slow queue <= capacity + 1      {bounded!s:>8}")


if __name__ == "__main__":
    main()
