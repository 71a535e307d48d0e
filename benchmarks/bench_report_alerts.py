"""Cost of the report writer's aggregation and of the alert sink's rule matching, per event.

Both run in their sink's own task, never in the training step; the figures say how much event
rate one core can absorb. Each is printed next to a baseline measured in the same run (a
handler that only counts), as a ratio.

The first stream is a BASIC-level run (step checks, completions with LR and throughput,
memory and system samples, a few incidents); the second adds what the ADVANCED level logs,
per-layer gradient norms and update ratios for ``--layers`` layers on every step check, which
costs O(layers) per check and nothing that grows with the run.

    .venv/bin/python benchmarks/bench_report_alerts.py [--steps 20000] [--layers 32]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from collections.abc import Callable

import anyio

from eventbus_debug.events import (
    Event,
    GradientExploded,
    MemorySampled,
    NonFiniteDetected,
    StepChecked,
    StepCompleted,
    SystemSampled,
    TensorRole,
)
from eventbus_debug.sinks import AlertSink, RunAggregator, rules, summarize
from eventbus_debug.sinks.report import render_html


def stream(steps: int) -> list[Event]:
    out: list[Event] = []
    for step in range(steps):
        loss = math.nan if step % 997 == 0 else 1.0 / (step + 1)
        out.append(StepChecked(step=step, loss=loss, grad_norm=1.0 + (step % 7)))
        out.append(
            StepCompleted(
                step=step, loss=loss, learning_rate=0.1, samples_per_s=512.0, duration_s=0.02
            )
        )
        if step % 10 == 0:
            out.append(MemorySampled(step=step, rss_bytes=100_000_000 + step))
            out.append(SystemSampled(cpu_percent=50.0, memory_percent=40.0, disk_percent=10.0))
        if step % 997 == 0:
            out.append(NonFiniteDetected(step=step, role=TensorRole.LOSS, names=("loss",)))
        if step % 501 == 0:
            out.append(GradientExploded(step=step, total_norm=1e4, threshold=10.0))
    return out


def layered(events: list[Event], layers: int) -> list[Event]:
    names = [f"encoder.layer{i}.weight" for i in range(layers)]
    out: list[Event] = []
    for e in events:
        if isinstance(e, StepChecked):
            e = dataclasses.replace(
                e,
                layer_grad_norms={n: 0.1 * (i + 1) for i, n in enumerate(names)},
                update_ratios={n: 1e-3 for n in names},
            )
        out.append(e)
    return out


def timed(fn: Callable[[], object], repeat: int = 3) -> float:
    best = math.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


class _Null:
    def publish_nowait(self, event: Event, /) -> None:
        pass


async def main(steps: int, layers: int) -> None:
    events = stream(steps)
    n = len(events)
    advanced = layered(events, layers)

    counted = [0]

    def baseline() -> None:
        for e in events:
            counted[0] += e.seq

    def aggregate() -> None:
        agg = RunAggregator()
        for e in events:
            agg.add(e)
        agg.summary()

    def aggregate_advanced() -> None:
        agg = RunAggregator()
        for e in advanced:
            agg.add(e)
        agg.summary()

    base = timed(baseline)
    agg = timed(aggregate)
    agg_adv = timed(aggregate_advanced)
    summary = summarize(events)
    html = timed(lambda: render_html(summary))
    summary_adv = summarize(advanced)
    html_adv = timed(lambda: render_html(summary_adv))
    checks = sum(1 for e in advanced if isinstance(e, StepChecked))

    sink = AlertSink(_Null(), flush_interval=None)
    for rule in rules.defaults():
        sink.add_rule(rule, lambda alert: None)

    async def noop(event: Event) -> None:
        counted[0] += 1

    t0 = time.perf_counter()
    for e in events:
        await noop(e)
    alert_base = time.perf_counter() - t0
    t0 = time.perf_counter()
    for e in events:
        await sink.handle(e)
    alert = time.perf_counter() - t0

    print(f"events: {n} ({steps} steps)")
    print(
        f"RunAggregator.add     {agg / n * 1e6:7.2f} us/event  "
        f"(baseline loop {base / n * 1e6:.3f} us/event, ratio {agg / base:.0f}x)"
    )
    print(
        f"render_html           {html * 1e3:7.1f} ms for the whole run ({len(render_html(summary)) // 1024} KiB)"
    )
    extra = (agg_adv - agg) / checks
    print(
        f"RunAggregator.add     {agg_adv / n * 1e6:7.2f} us/event at ADVANCED ({layers} layers: "
        f"+{extra * 1e6:.1f} us per step check, {extra / (2 * layers) * 1e9:.0f} ns per layer value)"
    )
    print(
        f"render_html           {html_adv * 1e3:7.1f} ms with the two {layers}-layer heatmaps "
        f"({len(render_html(summary_adv)) // 1024} KiB)"
    )
    print(
        f"AlertSink.handle      {alert / n * 1e6:7.2f} us/event with the {len(rules.defaults())} default rules "
        f"(async no-op {alert_base / n * 1e6:.3f} us/event, ratio {alert / alert_base:.0f}x); "
        f"{sink.statistics().delivered} deliveries, {sink.statistics().suppressed} suppressed"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--layers", type=int, default=32)
    args = parser.parse_args()
    anyio.run(main, args.steps, args.layers)
