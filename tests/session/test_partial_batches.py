"""An epoch's last batch of a few samples (``drop_last=False``, PyTorch's and Hugging Face's
default) is noisy the way a batch of one sample is: one hard sample's loss and gradient are the
whole batch's. Found running a classifier (batch 64, 2 % label noise) whose dataset left one
sample over each epoch: 2 ``gradient_exploded`` and a ``loss_spiked`` in 2,400 healthy steps, at
last batches, each norm far above any full batch's. With ``check_step(..., samples=n)`` a step
of at most half the run's usual samples is judged that many times more leniently and the
detectors learn nothing from it; the planted faults below are still caught.
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from eventbus_debug import Session, SyncSession, read_events
from eventbus_debug.events import (
    GradientExploded,
    LossSpiked,
    NonFiniteDetected,
    RecoveryApplied,
)
from eventbus_debug.probes.levels import Thresholds
from eventbus_debug.probes.step._explosions import ExplosionDetector
from eventbus_debug.probes.step._spikes import LossSpikeDetector

from .._doubles import quiet


def _classifier(
    g: torch.Generator, last: int, noise: float = 0.02
) -> tuple[torch.Tensor, torch.Tensor]:
    """300 batches of 64 and one of *last* samples; 8 classes, *noise* of the labels flipped."""
    n = 64 * 300 + last
    x = torch.randn(n, 20, generator=g)
    y = (x @ torch.randn(20, 8, generator=g)).argmax(1)
    flip = torch.rand(n, generator=g) < noise
    y[flip] = torch.randint(0, 8, (int(flip.sum()),), generator=g)
    return x, y


async def _epochs(tmp_path: Path, *, epochs: int, last: int, tell: bool) -> dict[str, list[int]]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x, y = _classifier(g, last)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    step = 0
    async with Session(model, opt, **quiet(log_dir=tmp_path)) as session:
        for _ in range(epochs):
            order = torch.randperm(len(x), generator=g)
            for i in range(0, len(x), 64):
                idx = order[i : i + 64]
                opt.zero_grad(set_to_none=True)
                loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
                torch.autograd.backward(loss)
                samples = len(idx) if tell else None
                verdict = await session.check_step(step, loss=loss, samples=samples)
                if verdict.should_step:
                    opt.step()
                await session.step_completed(step, loss=verdict.loss)
                step += 1
    found: dict[str, list[int]] = {}
    for event in read_events(tmp_path):
        if isinstance(event, LossSpiked | GradientExploded) and event.step is not None:
            found.setdefault(event.kind, []).append(event.step)
    return found


@pytest.mark.slow
async def test_a_last_batch_of_one_sample_raises_nothing_when_its_samples_are_told(
    tmp_path: Path,
) -> None:
    """Eight epochs of 300 batches of 64 and one of 1: quiet when the loop says its samples,
    and the incidents it raised before (every one at an epoch's last step) without."""
    assert await _epochs(tmp_path / "told", epochs=8, last=1, tell=True) == {}
    untold = await _epochs(tmp_path / "untold", epochs=8, last=1, tell=False)
    assert untold and all(s % 301 == 300 for steps in untold.values() for s in steps), untold


def _planted(tmp_path: Path, plan: dict[int, tuple[int, float, float]]) -> dict[str, list[int]]:
    """A 4-8-1 regression for 120 steps of 64 samples; at each planted step, ``(samples, loss
    told, gradient factor)``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rng = random.Random(0)
    with SyncSession(model, opt, **quiet(log_dir=tmp_path)) as session:
        for step in range(120):
            x, y = torch.randn(64, 4), torch.randn(64, 1)
            opt.zero_grad(set_to_none=True)
            torch.autograd.backward(nn.functional.mse_loss(model(x), y))
            samples, loss, factor = plan.get(step, (64, 1.0 + 0.05 * rng.random(), 1.0))
            for p in model.parameters():
                assert p.grad is not None
                p.grad.mul_(factor)
            verdict = session.check_step(step, loss=loss, samples=samples)
            if verdict.should_step:
                opt.step()
            session.step_completed(step, loss=verdict.loss)
    found: dict[str, list[int]] = {}
    for event in read_events(tmp_path):
        if event.is_incident and event.step is not None and event.kind != "recovery_decided":
            found.setdefault(event.kind, []).append(event.step)
    return found


def test_a_partial_batch_is_judged_leniently_and_teaches_nothing(tmp_path: Path) -> None:
    """A one-sample step 20x the median loss and 30x the gradient norm is quiet; the same at 64
    samples ten steps later is reported: the partial step did not raise the largest norm
    accepted or enter the loss window."""
    plan = {100: (1, 20.0, 30.0), 110: (64, 20.0, 30.0)}
    found = _planted(tmp_path, plan)
    assert found["loss_spiked"] == [110] and found["gradient_exploded"] == [110]


def test_faults_on_a_partial_batch_are_still_caught(tmp_path: Path) -> None:
    """A NaN loss, and a gradient 10,000x the run's, on one-sample steps: caught (the first
    skipped, the second reported and clipped by the safe policy)."""
    plan = {100: (1, math.nan, 1.0), 110: (1, 1.0, 1e4)}
    found = _planted(tmp_path, plan)
    assert found["non_finite_detected"] == [100]
    assert found["gradient_exploded"] == [110]
    assert 100 in found["step_skipped"]
    applied = [
        e.action.value
        for e in read_events(tmp_path)
        if isinstance(e, RecoveryApplied) and e.step == 110
    ]
    assert applied == ["clip_gradients"]


def test_the_detectors_learn_nothing_from_a_partial_batch() -> None:
    """observe_partial leaves every detector's state as it was."""
    th = Thresholds()
    spikes, explosions = (
        LossSpikeDetector.from_thresholds(th),
        ExplosionDetector.from_thresholds(th),
    )
    rng = random.Random(0)
    for _ in range(300):
        spikes.observe(1.0 + 0.1 * rng.random())
        explosions.observe(2.0 + 0.2 * rng.random())
    before = spikes.state(), explosions.state()
    assert spikes.observe_partial(9.0, 64.0) is None
    assert explosions.observe_partial(60.0, 64.0) is None
    verdict = spikes.observe_partial(1000.0, 64.0)
    assert verdict is not None and verdict.streak == 1
    exploded = explosions.observe_partial(1e5, 64.0)
    assert exploded is not None and exploded.rule == "growth"
    assert (spikes.state(), explosions.state()) == before


@pytest.mark.parametrize(
    ("samples", "error", "match"),
    [
        ("64", TypeError, "samples must be an int"),
        (6.0, TypeError, "samples must be an int"),
        (True, TypeError, "samples must be an int"),
        (-1, ValueError, "samples must be >= 0"),
    ],
)
async def test_a_wrong_samples_count_is_refused(
    samples: object, error: type[Exception], match: str
) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    async with Session(model, opt, **quiet()) as session:
        torch.autograd.backward(model(torch.randn(6, 4)).sum())
        with pytest.raises(error, match=match):
            await session.check_step(0, loss=1.0, samples=samples)  # type: ignore[arg-type]
        verdict = await session.check_step(0, loss=1.0, samples=6)
        assert verdict.should_step


def test_training_step_tells_its_batch_size(tmp_path: Path) -> None:
    """``training_step`` passes its inputs' leading dimension (or *samples*) to the check:
    a one-sample batch 20x the loss is not a spike there either."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(3)
    with SyncSession(model, opt, **quiet(log_dir=tmp_path)) as session:
        for step in range(100):
            n = 1 if step == 90 else 64
            x = torch.randn(n, 4, generator=g)
            y = torch.randn(n, 1, generator=g)  # noise: a loss of ~1, its one-sample tail
            if step == 90:
                y += 4.5  # ~20x the median: a spike at 64 samples
            session.training_step(x, y, nn.functional.mse_loss, step=step)
    kinds = {e.kind for e in read_events(tmp_path) if e.step == 90}
    assert not kinds & {"loss_spiked", "gradient_exploded"}, kinds
    assert NonFiniteDetected.kind not in kinds


def test_the_ranks_mean_loss_of_a_partial_batch_is_judged_leniently() -> None:
    """Under DDP the loss spike is judged on the ranks' mean loss after they agreed
    (``observe_global_loss``): a partial step's mean is widened like a local one, a full
    step's is not."""
    from eventbus_debug import StepProbe

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    probe = StepProbe(model, None, global_spikes=True)
    rng = random.Random(0)
    for step in range(100):
        model.zero_grad()
        torch.autograd.backward(model(torch.randn(64, 4)).pow(2).mean())
        samples = 1 if step in (60, 80) else 64
        probe.check_step_sync(step, loss=1.0, samples=samples)
        loss = 20.0 if step in (60, 70, 80) else 1.0 + 0.05 * rng.random()
        spike = probe.observe_global_loss(step, loss)
        assert (spike is not None) == (step == 70), step


def test_training_step_counts_the_samples_of_structured_inputs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Inputs given as a mapping (or a list, a tuple) count the leading dimension of their
    first tensor, as the integrations count a batch."""
    from eventbus_debug import StepProbe

    told: list[int | None] = []
    check = StepProbe.check_step_sync

    def spy(self: StepProbe, step: int, **kwargs: Any) -> Any:
        told.append(kwargs.get("samples"))
        return check(self, step, **kwargs)

    monkeypatch.setattr(StepProbe, "check_step_sync", spy)

    class OnDict(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(4, 1)

        def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
            return self.net(batch["x"])  # type: ignore[no-any-return]

    torch.manual_seed(0)
    model = OnDict()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with SyncSession(model, opt, **quiet()) as session:
        for step, n in enumerate((8, 8, 3)):
            inputs = {"mask": None, "x": torch.randn(n, 4)}
            session.training_step(inputs, torch.randn(n, 1), nn.functional.mse_loss, step=step)
    assert told == [8, 8, 3]


def test_the_usual_count_is_a_median_that_one_odd_step_does_not_move() -> None:
    """A step that summed two batches (a window with no check before it) is not the run's
    batch: the full steps after it are still judged as full ones."""
    from eventbus_debug import StepProbe

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    probe = StepProbe(model, None)
    rng = random.Random(0)
    fired = {}
    for step in range(100):
        model.zero_grad()
        torch.autograd.backward(model(torch.randn(64, 4)).pow(2).mean())
        samples = 128 if step == 60 else 64
        # 4.5: a spike at 64 samples (3x the median), not at half the usual (6x)
        loss = 4.5 if step == 70 else 1.0 + 0.05 * rng.random()
        fired[step] = probe.check_step_sync(step, loss=loss, samples=samples).fired
    assert [s for s, kinds in fired.items() if "loss_spiked" in kinds] == [70]


async def test_step_completed_takes_the_samples_its_check_was_told(tmp_path: Path) -> None:
    """``check_step(..., samples=n)`` then ``step_completed(step)``: the record has the
    throughput without saying the samples twice."""
    from eventbus_debug.events import StepCompleted

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    async with Session(model, opt, **quiet(log_dir=tmp_path)) as session:
        for step in range(4):
            opt.zero_grad()
            torch.autograd.backward(model(torch.randn(8, 4)).pow(2).mean())
            await session.check_step(step, loss=1.0, samples=8 if step != 2 else None)
            opt.step()
            await session.step_completed(step, samples=4 if step == 3 else None)
    rates = {
        e.step: e.samples_per_s
        for e in read_events(tmp_path)
        if isinstance(e, StepCompleted) and e.step is not None
    }
    assert rates[2] is None and all(rates[s] for s in (1, 3))


def test_partial_batches_in_isolation() -> None:
    """The widening: 1.0 while nothing is known or the count is a full batch's; usual/n at
    half the usual count or below; widen_at says it only for the step judged last."""
    from eventbus_debug.probes.step._partial import PartialBatches

    partial = PartialBatches()
    assert partial.judge(0, None) == 1.0 and partial.judge(1, 1) == 1.0  # nothing known yet
    for step in range(2, 60):
        assert partial.judge(step, 64) == 1.0
    assert partial.judge(60, 33) == 1.0  # above half: a full batch's noise
    assert partial.judge(61, 32) == 2.0 and partial.widen_at(61) == 2.0
    assert partial.widen_at(60) == 1.0  # not the step judged last
    assert partial.judge(62, 1) == 64.0
    assert partial.judge(63, 0) == 1.0  # an empty batch has nothing to widen
    assert partial.judge(64, None) == 1.0 and partial.widen_at(64) == 1.0
