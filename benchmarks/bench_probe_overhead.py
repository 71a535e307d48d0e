"""Per-step cost of the probes, as ratios to a bare training step measured in the same run.

Run: ``.venv/bin/python benchmarks/bench_probe_overhead.py [--repeats 5] [--w2] [--only W1]``

Workloads (CPU, AdamW, one torch thread):

- W1: MLP 784-512-512-10, batch 64;
- W3: 200 x (Linear(32, 32) + LayerNorm), 800 parameter tensors, batch 64;
- W2 (``--w2``, slow): a 4-layer transformer encoder, d_model 256, batch 16 x 64 tokens.

Every variant runs the same seeded step (forward, backward, probe, optimizer step) inside one
``anyio.run`` with a bus and one no-op sink. Variants run round-robin, *repeats* times, and the
median ms/step of each is divided by the bare step's median. Targets (issue 3): default probe
every step <= 1.06x on W1 and <= 1.10x on W3; deferred <= 1.03x on W1; disarmed localization
hooks <= 1.01x.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import anyio
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eventbus_debug import Event, EventBus
from eventbus_debug.probes import Cadence, DebugLevel, FirstNonFiniteLocator, StepProbe

Step = Callable[[int], Awaitable[None]]


@dataclass
class Workload:
    name: str
    model: nn.Module
    make_batch: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    steps: int


def w1() -> Workload:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
    )
    x, y = torch.randn(64, 784), torch.randint(0, 10, (64,))
    return Workload("W1", model, lambda: (x, y), nn.functional.cross_entropy, 150)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 32)
        self.norm = nn.LayerNorm(32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.norm(self.lin(x)))


def w3() -> Workload:
    torch.manual_seed(0)
    model = nn.Sequential(*[_Block() for _ in range(200)], nn.Linear(32, 10))
    x, y = torch.randn(64, 32), torch.randint(0, 10, (64,))
    return Workload("W3", model, lambda: (x, y), nn.functional.cross_entropy, 25)


def w2() -> Workload:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True, dropout=0.0)
    enc = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
    head = nn.Linear(256, 10)
    model = nn.Sequential(enc, head)
    x, y = torch.randn(16, 64, 256), torch.randint(0, 10, (16 * 64,))
    return Workload(
        "W2",
        model,
        lambda: (x, y),
        lambda out, t: nn.functional.cross_entropy(out.reshape(-1, 10), t),
        4,
    )


def seed_style_check(model: nn.Module) -> None:
    """What the seed documents do: per-parameter norms and NaN checks, one .item() each."""
    for _, p in model.named_parameters():
        if p.grad is not None:
            p.grad.norm().item()
            bool(torch.isnan(p.grad).any().item())
            bool(torch.isinf(p.grad).any().item())


def variants(wl: Workload, bus: EventBus) -> dict[str, Step]:
    model, opt = wl.model, torch.optim.AdamW(wl.model.parameters(), lr=1e-4)

    def forward_backward() -> torch.Tensor:
        x, y = wl.make_batch()
        loss = wl.loss_fn(model(x), y)
        torch.autograd.backward(loss)
        return loss

    def finish() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    async def bare(step: int) -> None:
        forward_backward()
        finish()

    async def seed(step: int) -> None:
        loss = forward_backward()
        loss.item()
        seed_style_check(model)
        finish()

    default = StepProbe(model, bus)
    every10 = StepProbe(model, bus, cadence=Cadence(loss_every=10, grad_every=10, param_every=10))
    deferred = StepProbe(model, bus, deferred=True)

    def probed(probe: StepProbe) -> Step:
        async def run(step: int) -> None:
            loss = forward_backward()
            await probe.check_step(step, loss=loss)
            finish()

        return run

    def anomaly(check_nan: bool) -> Step:
        async def run(step: int) -> None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "Anomaly Detection has been enabled"
                with torch.autograd.detect_anomaly(check_nan=check_nan):
                    forward_backward()
            finish()

        return run

    FirstNonFiniteLocator(model)  # constructed, never armed: must add no hooks and no cost

    async def disarmed(step: int) -> None:
        forward_backward()
        finish()

    return {
        "bare step": bare,
        "seed-style per-parameter .item()": seed,
        "probe, default set, every step": probed(default),
        "probe, default set, every 10th step": probed(every10),
        "probe, deferred, every step": probed(deferred),
        "detect_anomaly(check_nan=True)": anomaly(True),
        "detect_anomaly(check_nan=False)": anomaly(False),
        "localization hooks, disarmed": disarmed,
    }


async def measure(wl: Workload, repeats: int) -> dict[str, list[float]]:
    async def sink(event: Event) -> None:
        del event

    async with EventBus() as bus:
        bus.subscribe(sink, name="noop")
        steps = variants(wl, bus)
        times: dict[str, list[float]] = {k: [] for k in steps}
        for fn in steps.values():  # warm up every path once
            for i in range(3):
                await fn(i)
        for _ in range(repeats):
            for name, fn in steps.items():
                start = time.perf_counter()
                for i in range(wl.steps):
                    await fn(i)
                times[name].append((time.perf_counter() - start) / wl.steps * 1e3)
                await bus.drain()
        times["(probe call alone, default set)"] = isolated_probe_ms(wl, bus)
        for level in (DebugLevel.ADVANCED, DebugLevel.EXTREME):
            times[f"(probe call alone, {level.value})"] = isolated_probe_ms(wl, bus, level)
    return times


def isolated_probe_ms(
    wl: Workload, bus: EventBus, level: DebugLevel = DebugLevel.BASIC, calls: int = 50
) -> list[float]:
    """ms per ``check_step_sync`` on fixed gradients: the probe's own cost, less noisy.

    At EXTREME the activation hooks are armed for the one forward pass that fills them, and
    removed afterwards (the loops above never see them).
    """
    probe = StepProbe(wl.model, bus, level=level)
    x, y = wl.make_batch()
    wl.model.zero_grad()
    loss = wl.loss_fn(wl.model(x), y)
    torch.autograd.backward(loss)
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        for i in range(calls):
            probe.check_step_sync(i, loss=loss)
        runs.append((time.perf_counter() - start) / calls * 1e3)
    probe.close()
    wl.model.zero_grad()
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--w2", action="store_true", help="also run the (slow) transformer W2")
    parser.add_argument("--only", choices=["W1", "W2", "W3"], default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    loads = [w1, w3] + ([w2] if args.w2 else [])
    for make in loads:
        wl = make()
        if args.only and wl.name != args.only:
            continue
        times = anyio.run(measure, wl, args.repeats)
        base = statistics.median(times["bare step"])
        best = min(times["bare step"])
        print(
            f"\n{wl.name}: bare step {base:.2f} ms/step (median of {args.repeats} runs x "
            f"{wl.steps} steps); ratios: median/median, and min/min (less sensitive to other load)"
        )
        for name, runs in times.items():
            med = statistics.median(runs)
            print(f"  {name:<36} {med:8.2f} ms  {med / base:6.3f}x  {min(runs) / best:6.3f}x")


if __name__ == "__main__":
    main()
