"""Publisher-side cost of the bus, against logging and structlog measured in the same run.

Run: ``.venv/bin/python benchmarks/bench_publish.py [--bursts N]``

Prints nanoseconds per operation and the ratios the foundation issue sets as targets:

- ``publish_nowait`` of a pre-built event in bursts of 100, with 1, 4 and 16 subscribers
  (target ≤ 150 ns, 16 subscribers within 1.5x of 1);
- the same against ``logging`` + ``QueueHandler`` (target ≥ 50x cheaper) and a direct structlog
  call in its documented fast configuration (target ≥ 25x cheaper);
- one isolated publish to idle subscribers (target ≤ 1 µs);
- building one typed event and publishing it (target ≤ 1.5 µs).

Every figure is the median over bursts; subscribers drain between bursts (not timed).
"""

from __future__ import annotations

import argparse
import gc
import logging
import logging.handlers
import os
import queue
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import anyio
import orjson
import structlog

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eventbus_debug import Event, EventBus
from eventbus_debug.events import StepCompleted
from eventbus_debug.log.encoding import encode_events

BURST = 100


class _NullSink:
    """A subscriber that does nothing: what is measured is the bus, not the sink."""

    def __init__(self) -> None:
        self.n = 0

    async def handle_batch(self, events: Sequence[Event], /) -> None:
        self.n += len(events)


def _median_ns_per_call(fn: Callable[[], None], *, bursts: int, per_burst: int) -> float:
    samples = []
    perf = time.perf_counter_ns
    for _ in range(bursts):
        t0 = perf()
        fn()
        samples.append((perf() - t0) / per_burst)
    return statistics.median(samples)


def bench_logging_queue_handler(bursts: int) -> float:
    q: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    logger = logging.getLogger("bench_publish.queue_handler")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    handler = logging.handlers.QueueHandler(q)
    logger.addHandler(handler)
    info = logger.info

    def burst() -> None:
        for i in range(BURST):
            info("step completed", extra={"step": i, "loss": 0.5})
        while not q.empty():
            q.get_nowait()

    try:
        return _median_ns_per_call(burst, bursts=bursts, per_burst=BURST)
    finally:
        logger.removeHandler(handler)


def bench_structlog(bursts: int) -> float:
    # structlog's documented fast path: filtering bound logger, orjson, BytesLogger.
    with open(os.devnull, "wb") as devnull:
        log = structlog.wrap_logger(
            structlog.BytesLogger(devnull),
            wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
            processors=[
                structlog.processors.add_log_level,
                structlog.processors.TimeStamper(),
                structlog.processors.JSONRenderer(serializer=orjson.dumps),
            ],
            cache_logger_on_first_use=True,
        )
        info = log.info

        def burst() -> None:
            for i in range(BURST):
                info("step completed", step=i, loss=0.5)

        return _median_ns_per_call(burst, bursts=bursts, per_burst=BURST)


def bench_empty_call(bursts: int) -> float:
    def noop(_: object) -> None:
        return None

    def burst() -> None:
        for i in range(BURST):
            noop(i)

    return _median_ns_per_call(burst, bursts=bursts, per_burst=BURST)


def bench_encoding(bursts: int) -> tuple[float, float, float]:
    """encode_events per event; orjson.dumps of the dataclass; building the event (ns)."""
    events = [
        StepCompleted(step=i, loss=0.5, learning_rate=1e-3, samples_per_s=1e4) for i in range(BURST)
    ]
    encode_events(events)
    dumps = orjson.dumps

    def plain() -> None:
        for ev in events:
            dumps(ev)

    def build() -> None:
        for i in range(BURST):
            StepCompleted(step=i, loss=0.5, learning_rate=1e-3, samples_per_s=1e4)

    ours = _median_ns_per_call(
        lambda: encode_events(events) and None, bursts=bursts, per_burst=BURST
    )
    raw = _median_ns_per_call(plain, bursts=bursts, per_burst=BURST)
    built = _median_ns_per_call(build, bursts=bursts, per_burst=BURST)
    return ours, raw, built


async def bench_bus(n_subs: int, bursts: int) -> dict[str, float]:
    out: dict[str, float] = {}
    async with EventBus(capacity=BURST * 4) as bus:
        sinks = [_NullSink() for _ in range(n_subs)]
        for i, sink in enumerate(sinks):
            bus.subscribe(sink, name=f"null-{i}")
        events = [StepCompleted(step=i, loss=0.5) for i in range(BURST)]
        publish = bus.publish_nowait
        perf = time.perf_counter_ns

        # Warm the routing table and the pumps.
        for ev in events:
            publish(ev)
        await bus.drain()

        burst_samples: list[float] = []
        isolated: list[float] = []
        build: list[float] = []
        for _ in range(bursts):
            t0 = perf()
            for ev in events:
                publish(ev)
            burst_samples.append((perf() - t0) / BURST)
            await bus.drain()

            t0 = perf()
            publish(events[0])
            isolated.append(perf() - t0)
            await bus.drain()

            t0 = perf()
            for i in range(BURST):
                publish(StepCompleted(step=i, loss=0.5, learning_rate=1e-3))
            build.append((perf() - t0) / BURST)
            await bus.drain()
        assert all(s.n == sinks[0].n for s in sinks)
        out["burst"] = statistics.median(burst_samples)
        out["isolated"] = statistics.median(isolated)
        out["build"] = statistics.median(build)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bursts", type=int, default=300, help="bursts of 100 per figure")
    args = parser.parse_args(argv)
    bursts: int = args.bursts
    gc.collect()

    empty = bench_empty_call(bursts)
    qh = bench_logging_queue_handler(bursts)
    sl = bench_structlog(bursts)
    per_subs = {n: anyio.run(bench_bus, n, bursts) for n in (1, 4, 16)}
    encode, raw_dumps, build_only = bench_encoding(bursts)
    one = per_subs[1]["burst"]

    print(f"python {sys.version.split()[0]}, {bursts} bursts of {BURST}, median ns per operation")
    print(f"  empty python call                        {empty:8.0f} ns")
    print(f"  logging + QueueHandler                   {qh:8.0f} ns")
    print(f"  structlog direct (fast config)           {sl:8.0f} ns")
    for n, r in per_subs.items():
        print(f"  publish_nowait, burst, {n:2d} subscriber(s)   {r['burst']:8.0f} ns")
    for n, r in per_subs.items():
        print(f"  isolated publish, {n:2d} idle subscriber(s) {r['isolated']:8.0f} ns")
    for n, r in per_subs.items():
        print(f"  build StepCompleted + publish, {n:2d} subs   {r['build']:8.0f} ns")
    print(f"  build one StepCompleted (no publish)     {build_only:8.0f} ns")
    print(f"  encode_events, per event                 {encode:8.0f} ns")
    print(f"  orjson.dumps(event) alone (no NaN/kind)  {raw_dumps:8.0f} ns")
    print("ratios (target)")
    print(
        f"  16 subs / 1 sub                          {per_subs[16]['burst'] / one:8.2f}x  (<= 1.5)"
    )
    print(f"  QueueHandler / publish_nowait            {qh / one:8.1f}x  (>= 50)")
    print(f"  structlog / publish_nowait               {sl / one:8.1f}x  (>= 25)")
    print(f"  publish_nowait / empty call              {one / empty:8.1f}x")
    worst = max(r["isolated"] for r in per_subs.values())
    build = max(r["build"] for r in per_subs.values())
    print(f"  worst isolated publish                   {worst:8.0f} ns  (<= 1000)")
    print(f"  worst build + publish                    {build:8.0f} ns  (<= 1500)")
    print(f"  encode_events / orjson.dumps(event)      {encode / raw_dumps:8.2f}x")


if __name__ == "__main__":
    main()
