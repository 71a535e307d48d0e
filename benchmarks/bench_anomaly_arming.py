"""What DebugMode.ANOMALY_DETECTION's localization costs on healthy steps, and armed.

Healthy steps pay one root forward pre-hook (AnomalyArming) and, in ``training_step``, one
capture of the CPU random state. Armed steps (after an incident, bounded) pay the locator's
hooks. Each figure is a ratio against the same forward+backward without any of it, measured
in this run (median of repeated blocks).

    .venv/bin/python benchmarks/bench_anomaly_arming.py [--steps 200] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from eventbus_debug.probes import FirstNonFiniteLocator
from eventbus_debug.probes.anomaly_arming import AnomalyArming, RngState

STEPS = 200
REPEATS = 7


def _model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.LayerNorm(width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def _block(step: Callable[[], None], steps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t0) / steps


def _ratio(
    base: Callable[[], None], other: Callable[[], None], steps: int, repeats: int
) -> tuple[float, float]:
    """Median base step time and median ratio other/base, blocks interleaved (noise cancels)."""
    for _ in range(min(20, steps)):
        base()
        other()
    bases, ratios = [], []
    for _ in range(repeats):
        b = _block(base, steps)
        ratios.append(_block(other, steps) / b)
        bases.append(b)
    return statistics.median(bases), statistics.median(ratios)


def main(steps: int = STEPS, repeats: int = REPEATS) -> None:
    torch.set_num_threads(1)
    for width, depth in ((64, 4), (512, 8)):
        model = _model(width, depth)
        x = torch.randn(32, width)

        def step(model: nn.Module = model, x: torch.Tensor = x) -> None:
            model(x).sum().backward()
            model.zero_grad(set_to_none=True)

        arming = AnomalyArming(FirstNonFiniteLocator(model), step=lambda: 0)

        def healthy(model: nn.Module = model, arming: AnomalyArming = arming) -> None:
            arming.install()  # idempotent: the root pre-hook stays
            RngState.capture(model)
            step()

        def plain(arming: AnomalyArming = arming) -> None:
            arming.close()  # removes the root pre-hook (nothing armed: nothing judged)
            step()

        base, idle = _ratio(plain, healthy, steps, repeats)
        arming.close()
        locator = FirstNonFiniteLocator(model)

        def watched(locator: FirstNonFiniteLocator = locator) -> None:
            locator.arm()
            step()
            assert locator.result() is None  # each pass judged, as the armed window does

        def unwatched(locator: FirstNonFiniteLocator = locator) -> None:
            locator.disarm()
            step()

        _, armed = _ratio(unwatched, watched, steps, repeats)
        locator.disarm()
        print(
            f"MLP width {width} depth {depth}: step {base * 1e3:.3f} ms; "
            f"healthy with arming installed {idle:.3f}x; armed {armed:.2f}x"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=STEPS, help="steps per timed block")
    parser.add_argument("--repeats", type=int, default=REPEATS, help="interleaved blocks")
    args = parser.parse_args()
    main(args.steps, args.repeats)
