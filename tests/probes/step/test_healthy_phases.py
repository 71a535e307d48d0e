"""Healthy training phases users run for days: the detectors leave them alone, and a fault
planted in the same phase is still caught.

Found by ``benchmarks/bench_decisions.py``'s ``sgdr_restarts`` run (SGD + momentum under
``CosineAnnealingWarmRestarts(T_0=250)``, peak LR 0.1): 35 steps after the restart at step
13,000, the loss climbed to 6x its converged median (0.14 -> 0.8..1.1) for five steps and was
reported as a sustained loss spike. Such a climb is what a warm restart does (the high LR
kicks the model out of its basin, back toward the losses it had in its first cycle), but the
run had shown those only more than *memory* (1,000) observations earlier, outside the
detectors' recent range. The LR is visible to the library (the optimizer's ``param_groups``):
while it is at least twice its recent low, the range also holds the baselines the run had at
an LR of that order, however long ago (:class:`~eventbus_debug.probes.step._windows.LrRange`).
With a constant or decaying LR nothing changed, and a loss or norm far beyond what the run
showed at that LR (wrong labels, a 1000x gradient) is still reported at its first step.

The sequences are deterministic (seeded ``random.Random``); the session tests drive a real
``Session`` with a real scheduler and synthetic gradients and losses (fast), the slow one a
real SGDR training.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.optim.lr_scheduler import CosineAnnealingWarmRestarts

from eventbus_debug import Anomaly, Event, Session
from eventbus_debug.events import RecoveryAction, RecoveryApplied
from eventbus_debug.probes.levels import Thresholds
from eventbus_debug.probes.step._arguments import optimizer_lr
from eventbus_debug.probes.step._explosions import ExplosionDetector
from eventbus_debug.probes.step._spikes import LossSpikeDetector
from eventbus_debug.probes.step._windows import LrRange

CYCLE = 1200
"""Steps per warm-restart cycle: longer than the detectors' memory (1,000), so the first
cycle's levels are outside the recent range when the second cycle starts."""
PEAK_LR = 0.1
CLIMB = range(CYCLE + 10, CYCLE + 22)
"""Steps after the restart where the loss and the gradient norm climb (the LR is at ~99 % of
its peak)."""


def sgdr_lr(step: int) -> float:
    """Cosine annealing with warm restarts every :data:`CYCLE` steps, from PEAK_LR to 1e-5."""
    phase = (step % CYCLE) / CYCLE
    return 1e-5 + (PEAK_LR - 1e-5) * 0.5 * (1.0 + math.cos(math.pi * phase))


def sgdr_losses(seed: int, *, climb: float = 0.8) -> list[float]:
    """Cycle 1: 2.0 falling to 0.1; then converged at 0.1 with noise; after the restart the
    loss climbs to *climb* for 12 steps (below the first cycle's 2.0)."""
    rng = random.Random(seed)
    out = []
    for step in range(CYCLE + 200):
        base = max(0.1, 2.0 * math.exp(-step / 150)) if step < 300 else 0.1
        if step in CLIMB:
            base = climb
        out.append(base * (1.0 + 0.2 * rng.uniform(-1, 1)))
    return out


def sgdr_norms(seed: int, *, climb: float = 5.0) -> list[float]:
    """Norms at 3.0 for the first 100 steps, decaying to 0.3; after the restart they climb
    to *climb* (1.5x the largest norm the run accepted, 1.7x its early median)."""
    rng = random.Random(seed)
    out = []
    for step in range(CYCLE + 200):
        base = 3.0 if step < 100 else max(0.3, 3.0 * math.exp(-(step - 100) / 40))
        if step in CLIMB:
            base = climb
        out.append(base * (1.0 + 0.1 * rng.uniform(-1, 1)))
    return out


def loss_reports(values: Sequence[float], lrs: Sequence[float | None]) -> list[tuple[int, str]]:
    detector = LossSpikeDetector.from_thresholds(Thresholds())
    out = []
    for i, (v, lr) in enumerate(zip(values, lrs, strict=True)):
        verdict = detector.observe(v, lr)
        if verdict is not None:
            out.append((i, verdict.rule.value))
    return out


def norm_reports(values: Sequence[float], lrs: Sequence[float | None]) -> list[int]:
    detector = ExplosionDetector.from_thresholds(Thresholds())
    return [i for i, (v, lr) in enumerate(zip(values, lrs, strict=True)) if detector.observe(v, lr)]


SCHEDULE = [sgdr_lr(s) for s in range(CYCLE + 200)]
CONSTANT = [PEAK_LR] * (CYCLE + 200)
UNKNOWN: list[float | None] = [None] * (CYCLE + 200)
SEEDS = range(4)


class TestWarmRestart:
    @pytest.mark.parametrize("seed", SEEDS)
    def test_a_loss_climbing_after_a_restart_is_quiet(self, seed: int) -> None:
        assert loss_reports(sgdr_losses(seed), SCHEDULE) == []

    @pytest.mark.parametrize("seed", SEEDS)
    def test_the_same_climb_without_the_lr_is_reported(self, seed: int) -> None:
        # what fired before: no LR known (or a constant one), the first cycle is too far back
        for lrs in (UNKNOWN, CONSTANT):
            reports = loss_reports(sgdr_losses(seed), lrs)
            assert reports and reports[0][0] in CLIMB

    @pytest.mark.parametrize("seed", SEEDS)
    def test_a_loss_beyond_the_runs_levels_at_that_lr_is_still_reported(self, seed: int) -> None:
        # wrong labels right after the restart: 10x the first cycle's losses
        reports = loss_reports(sgdr_losses(seed, climb=20.0), SCHEDULE)
        assert reports[0] == (CLIMB[0], "spike")

    @pytest.mark.parametrize("seed", SEEDS)
    def test_a_norm_climbing_after_a_restart_is_quiet(self, seed: int) -> None:
        assert norm_reports(sgdr_norms(seed), SCHEDULE) == []

    @pytest.mark.parametrize("seed", SEEDS)
    def test_the_same_norm_without_the_lr_is_an_explosion(self, seed: int) -> None:
        for lrs in (UNKNOWN, CONSTANT):
            assert norm_reports(sgdr_norms(seed), lrs)[0] == CLIMB[0]

    @pytest.mark.parametrize("seed", SEEDS)
    def test_an_explosion_after_a_restart_is_still_reported(self, seed: int) -> None:
        norms = sgdr_norms(seed, climb=0.3)
        norms[CLIMB[0]] *= 1000.0
        assert norm_reports(norms, SCHEDULE) == [CLIMB[0]]

    def test_a_decaying_lr_is_no_rise(self) -> None:
        lr_range = LrRange(1000)
        for step, lr in enumerate(range(1000, 0, -1), start=1):
            lr_range.step(step, lr / 1000)
            lr_range.feed(10.0)
            assert not lr_range.raised
            assert lr_range.largest() == -math.inf

    def test_the_range_is_the_runs_levels_at_that_lr(self) -> None:
        lr_range = LrRange(100)
        lr_range.step(1, 0.1)
        lr_range.feed(2.0)  # early training at the peak LR
        lr_range.step(2, 0.001)
        lr_range.feed(0.05)  # converged at a low LR
        lr_range.step(3, 0.002)  # rising, but far from the peak's order
        assert lr_range.raised
        assert lr_range.largest() == 0.05
        lr_range.step(4, 0.09)  # restarted
        assert lr_range.largest() == 2.0
        lr_range.step(5, None)
        assert not lr_range.raised


class TestOptimizerLr:
    def test_the_largest_group_lr(self) -> None:
        a, b = nn.Linear(2, 2), nn.Linear(2, 2)
        assert optimizer_lr(torch.optim.SGD(a.parameters(), lr=0.1)) == 0.1
        opt = torch.optim.SGD(a.parameters(), lr=0.1)
        opt.add_param_group({"params": list(b.parameters()), "lr": 0.5})  # unfrozen later
        assert optimizer_lr(opt) == 0.5

    def test_a_cpu_tensor_lr(self) -> None:
        opt = torch.optim.Adam(nn.Linear(2, 2).parameters(), lr=torch.tensor(0.01))
        assert optimizer_lr(opt) == pytest.approx(0.01)


# -- through a Session: a real scheduler, synthetic gradients and losses ---------------------


class _Tally:
    name = "tally"

    def __init__(self) -> None:
        self.incidents: list[tuple[int | None, str]] = []
        self.actions: list[tuple[int | None, str]] = []

    async def handle_batch(self, events: Sequence[Event], /) -> None:
        for e in events:
            if isinstance(e, Anomaly):
                self.incidents.append((e.step, e.kind))
            elif isinstance(e, RecoveryApplied) and e.action is not RecoveryAction.CONTINUE:
                self.actions.append((e.step, e.action.value))


async def _synthetic_sgdr(
    losses: Sequence[float], norms: Sequence[float], *, restarts: bool = True
) -> _Tally:
    """A session over a one-parameter model whose gradient norm and loss are given per step,
    under SGD with ``CosineAnnealingWarmRestarts(T_0=CYCLE)`` (or a constant LR)."""
    torch.manual_seed(0)
    model = nn.Linear(1, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=PEAK_LR)
    sched = CosineAnnealingWarmRestarts(opt, T_0=CYCLE, eta_min=1e-5) if restarts else None
    tally = _Tally()
    async with Session(
        model,
        opt,
        log_dir=None,
        report=False,
        alerts=False,
        system_interval=None,
        sinks=[tally],
        scheduler=sched,
    ) as session:
        for step, (loss, norm) in enumerate(zip(losses, norms, strict=True)):
            model.weight.grad = torch.full_like(model.weight, norm)
            verdict = await session.check_step(step, loss=loss)
            if verdict.should_step:
                with torch.no_grad():  # the update itself does not matter here
                    model.weight.zero_()
            opt.zero_grad(set_to_none=True)
            if sched is not None:
                sched.step()
            await session.step_completed(step, loss=verdict.loss)
    return tally


class TestThroughASession:
    @pytest.mark.anyio
    async def test_a_warm_restart_is_left_alone(self) -> None:
        tally = await _synthetic_sgdr(sgdr_losses(0), sgdr_norms(0))
        assert tally.incidents == []
        assert tally.actions == []

    @pytest.mark.anyio
    async def test_without_the_restart_the_climb_is_reported(self) -> None:
        tally = await _synthetic_sgdr(sgdr_losses(0), sgdr_norms(0), restarts=False)
        kinds = {kind for _, kind in tally.incidents}
        assert kinds == {"loss_spiked", "gradient_exploded"}
        assert min(step for step, _ in tally.incidents if step is not None) == CLIMB[0]

    @pytest.mark.anyio
    async def test_faults_after_a_restart_are_still_caught(self) -> None:
        losses, norms = sgdr_losses(0, climb=20.0), sgdr_norms(0, climb=0.3)
        norms[CLIMB[0] + 5] *= 1e4
        losses[CLIMB[-1] + 5] = math.nan
        tally = await _synthetic_sgdr(losses, norms)
        first: dict[str, int | None] = {}
        for step, kind in tally.incidents:
            first.setdefault(kind, step)
        assert first["loss_spiked"] == CLIMB[0]
        assert first["gradient_exploded"] == CLIMB[0] + 5
        assert first["non_finite_detected"] == CLIMB[-1] + 5
        assert (CLIMB[-1] + 5, "skip_step") in tally.actions


# -- a real SGDR training (the battery's sgdr_restarts, shortened to the restart that fired) ---


async def _real_sgdr(*, corrupt_from: int | None, steps: int) -> _Tally:
    d, k, n = 32, 10, 4096
    g = torch.Generator().manual_seed(1234)
    teacher = torch.randn(d, k, generator=g)
    x = torch.randn(n, d, generator=g)
    y = (x @ teacher).argmax(1)
    flip = torch.rand(n, generator=g) < 0.02
    y = torch.where(flip, torch.randint(0, k, (n,), generator=g), y)
    idx = torch.randint(0, n, (steps, 32), generator=g)
    torch.manual_seed(1234)
    model = nn.Sequential(
        nn.Linear(d, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, k)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    sched = CosineAnnealingWarmRestarts(opt, T_0=250, eta_min=1e-5)
    tally = _Tally()
    async with Session(
        model,
        opt,
        log_dir=None,
        report=False,
        alerts=False,
        system_interval=None,
        sinks=[tally],
        scheduler=sched,
    ) as session:
        for step in range(steps):
            xb, yb = x[idx[step]], y[idx[step]]
            if corrupt_from is not None and step >= corrupt_from:
                yb = (yb + 1 + step % (k - 1)) % k  # always a wrong label
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()  # type: ignore[no-untyped-call]
            verdict = await session.check_step(step, loss=loss)
            if verdict.should_step:
                opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            await session.step_completed(step, loss=verdict.loss)
    return tally


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")  # a small MLP for 13,000 steps
class TestRealSgdr:
    @pytest.mark.anyio
    async def test_thirteen_thousand_steps_of_restarts_are_left_alone(self) -> None:
        tally = await _real_sgdr(corrupt_from=None, steps=13_100)  # fired at 13,035 before
        assert tally.incidents == []
        assert tally.actions == []

    @pytest.mark.anyio
    async def test_wrong_labels_after_a_restart_are_caught_at_once(self) -> None:
        tally = await _real_sgdr(corrupt_from=13_010, steps=13_030)
        assert tally.incidents[0][0] == 13_010
        assert (13_010, "loss_spiked") in tally.incidents
