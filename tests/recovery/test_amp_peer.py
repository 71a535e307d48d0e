"""Mixed precision as its peers test it: torch's own ``GradScaler`` cases (growth and backoff,
``unscale_`` before clipping, an inf planted in one step's gradients, a gradient penalty,
accumulation, two optimizers on one scaler, ``state_dict`` round trips, ``scaler.step``'s
return value), Lightning's ``16-mixed`` and Hugging Face ``Trainer``'s bf16 loops. A session
around them changes nothing about the training (parameters, optimizer state and scaler state
are bit for bit those of the same run without it), reports an overflow step as a
``StepSkipped`` with its scales and never as an incident, takes no action on it, and still
reports the genuine faults: a NaN loss in fp32 and a scale that collapses."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from eventbus_debug import Anomaly, EventBus, RecoveryEngine, Session, SyncSession
from eventbus_debug.events import (
    Event,
    NonFiniteDetected,
    RecoveryAction,
    RecoveryApplied,
    ScalerInTrouble,
    StepChecked,
    StepSkipped,
    TensorRole,
)
from eventbus_debug.integrations.lightning import EventBusDebugCallback as LightningCallback
from eventbus_debug.integrations.transformers import EventBusDebugCallback as HFCallback
from eventbus_debug.recovery import ScalerStepWatcher
from eventbus_debug.recovery.amp import ScalerMonitor
from eventbus_debug.testing import RecordingSink

AnySession = Session | SyncSession


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models


def _options(recorder: RecordingSink, **options: Any) -> dict[str, Any]:
    return {
        "log_dir": None,
        "report": False,
        "alerts": False,
        "system_interval": None,
        "sinks": [recorder],
        **options,
    }


def _incidents(recorder: RecordingSink) -> list[Event]:
    return [e for e in recorder.events if isinstance(e, Anomaly)]


def _actions(recorder: RecordingSink) -> list[tuple[RecoveryAction, int | None]]:
    return [(e.action, e.step) for e in recorder.of_type(RecoveryApplied)]


def _assert_same_training(
    a: tuple[nn.Module, torch.optim.Optimizer, torch.amp.GradScaler],
    b: tuple[nn.Module, torch.optim.Optimizer, torch.amp.GradScaler],
) -> None:
    """Parameters, optimizer state and scaler state bit for bit equal."""
    (model_a, opt_a, scaler_a), (model_b, opt_b, scaler_b) = a, b
    for p, q in zip(model_a.parameters(), model_b.parameters(), strict=True):
        assert torch.equal(p, q)
        state_a, state_b = opt_a.state[p], opt_b.state[q]
        assert state_a.keys() == state_b.keys()
        for key in state_a:
            assert torch.equal(torch.as_tensor(state_a[key]), torch.as_tensor(state_b[key])), key
    assert scaler_a.state_dict() == scaler_b.state_dict()


class Calls:
    """A loop's calls into its session: none (the plain run), a ``Session`` or a
    ``SyncSession`` (blocking, called from the test's loop: its bus runs on its own thread)."""

    def __init__(self, session: AnySession | None) -> None:
        self.session = session
        self.loss: float | None = None

    async def check(self, step: int, loss: torch.Tensor) -> bool:
        session = self.session
        if session is None:
            return True
        if isinstance(session, Session):
            verdict = await session.check_step(step, loss=loss)
        else:
            verdict = session.check_step(step, loss=loss)
        self.loss = verdict.loss
        return verdict.should_step

    async def completed(self, step: int) -> None:
        session = self.session
        if isinstance(session, Session):
            await session.step_completed(step, loss=self.loss)
        elif session is not None:
            session.step_completed(step, loss=self.loss)


def _plant_inf(layer: nn.Module) -> None:
    """Fill *layer*'s weight gradient with inf, as torch's tests plant an overflow."""
    weight = layer.weight
    assert isinstance(weight, torch.Tensor) and weight.grad is not None
    with torch.no_grad():
        weight.grad.fill_(math.inf)


# -- torch's own grad-scaling cases (test_torch.py / test_cuda.py, _run_scaling_case) -----------

Variant = Literal["autocast", "clipping", "clipping_separate_unscale", "penalty", "accumulation"]
SKIP_ITER = 2
MAX_NORM = 0.2


def _scaling_models(
    ctor: Callable[..., torch.optim.Optimizer] = torch.optim.SGD, **kwargs: Any
) -> tuple[nn.Sequential, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    return model, ctor(model.parameters(), lr=1.0, **kwargs)


def _scaling_data(n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(2)
    return [(torch.randn(8, 8, generator=gen), torch.randn(8, 8, generator=gen)) for _ in range(n)]


def _scaler() -> torch.amp.GradScaler:
    """torch's: a modest initial scale, an unrealistic growth so growth errors show at once."""
    return torch.amp.GradScaler("cpu", init_scale=128.0, growth_factor=2.0, growth_interval=1)


async def _torch_case(
    variant: Variant,
    calls: Calls,
    model: nn.Sequential,
    opt: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    data: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> None:
    """torch's ``run`` of *variant*, with the session's calls where a loop makes them."""
    loss_fn = nn.MSELoss()
    for i, (x, y) in enumerate(data):
        if variant == "accumulation":
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_fn(model(x), y) / 2
            scaler.scale(loss).backward()
            if (i + 1) % 2 == 0:
                if await calls.check(i, loss):
                    scaler.step(opt)
                scaler.update()
                opt.zero_grad()
                await calls.completed(i)
            continue
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(model(x), y)
        if variant == "penalty":
            grads = torch.autograd.grad(
                scaler.scale(loss), list(model.parameters()), create_graph=True
            )
            inv_scale = 1.0 / scaler.get_scale()
            with torch.autocast("cpu", dtype=torch.float16):
                norm = sum((g * inv_scale).pow(2).sum() for g in grads)
                loss = loss + torch.as_tensor(norm).sqrt()
        scaler.scale(loss).backward()
        if variant == "clipping":
            nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM * scaler.get_scale())
        if i == SKIP_ITER:
            _plant_inf(model[1])
        if variant == "clipping_separate_unscale":
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, error_if_nonfinite=False)
        if await calls.check(i, loss):
            scaler.step(opt)
        scaler.update()
        await calls.completed(i)


@pytest.mark.parametrize(
    "variant", ["autocast", "clipping", "clipping_separate_unscale", "penalty", "accumulation"]
)
async def test_torchs_scaling_cases_are_bit_for_bit_the_same_under_a_session(
    variant: Variant,
) -> None:
    """The scale grows at every clean step and backs off at the planted inf, exactly as torch
    asserts; the one overflow is a StepSkipped with its scales, nothing else is published."""
    data = _scaling_data()
    runs = []
    recorder = RecordingSink()
    for with_session in (False, True):
        model, opt = _scaling_models()
        scaler = _scaler()
        if with_session:
            async with Session(model, opt, scaler=scaler, **_options(recorder)) as session:
                await _torch_case(variant, Calls(session), model, opt, scaler, data)
        else:
            await _torch_case(variant, Calls(None), model, opt, scaler, data)
        runs.append((model, opt, scaler))
    _assert_same_training(runs[0], runs[1])
    unskipped, skipped = (2, 0) if variant == "accumulation" else (3, 1)
    assert runs[1][2].get_scale() == 128.0 * 2.0**unskipped * 0.5**skipped
    overflows = recorder.of_type(StepSkipped)
    assert [e.step for e in overflows] == ([] if variant == "accumulation" else [SKIP_ITER])
    assert all(
        e.scale_before is not None and e.scale_after == e.scale_before / 2 for e in overflows
    )
    assert _incidents(recorder) == []
    assert _actions(recorder) == []


@pytest.mark.parametrize(
    ("ctor", "kwargs"),
    [
        (torch.optim.Adam, {"foreach": False}),
        (torch.optim.AdamW, {"foreach": True}),
        (torch.optim.AdamW, {"fused": True}),
        (torch.optim.SGD, {"momentum": 0.9, "fused": True}),
    ],
)
async def test_torchs_optimizer_matrix_is_untouched(
    ctor: type[torch.optim.Optimizer], kwargs: dict[str, Any]
) -> None:
    """torch runs its autocast case for Adam/AdamW (foreach, fused) too: same training, the
    overflow reported. At torch's lr=1.0 Adam's loss jumps 1.1 -> 126 after one step (a real
    divergence, which the detectors may report), but nothing is ever acted on."""
    data = _scaling_data()
    runs = []
    recorder = RecordingSink()
    for with_session in (False, True):
        model, opt = _scaling_models(ctor, **kwargs)
        scaler = _scaler()
        if with_session:
            async with Session(model, opt, scaler=scaler, **_options(recorder)) as session:
                await _torch_case("autocast", Calls(session), model, opt, scaler, data)
        else:
            await _torch_case("autocast", Calls(None), model, opt, scaler, data)
        runs.append((model, opt, scaler))
    _assert_same_training(runs[0], runs[1])
    assert runs[1][2].get_scale() == 128.0 * 2.0**3 * 0.5
    assert [e.step for e in recorder.of_type(StepSkipped)] == [SKIP_ITER]
    assert not recorder.of_type(NonFiniteDetected)
    assert not recorder.of_type(ScalerInTrouble)
    assert _actions(recorder) == []


async def test_two_optimizers_one_scaler_two_sessions() -> None:
    """torch's test_grad_scaling_multiple: two models, each with its optimizer, both losses
    through one scaler, opt0 unscaled separately, an inf in model1's gradients at one step.
    A session per model on one bus: model1's session reports its overflow, model0's (which
    stepped) reports nothing, and the training is the plain run's."""
    data = _scaling_data()
    runs = []
    recorder = RecordingSink()
    for with_session in (False, True):
        model0, opt0 = _scaling_models()
        model1, opt1 = _scaling_models()
        scaler = _scaler()
        loss_fn = nn.MSELoss()
        async with EventBus() as bus:
            bus.subscribe(recorder)
            options = _options(RecordingSink(), bus=bus, sinks=())
            s0 = Session(model0, opt0, scaler=scaler, name="m0", **options)
            s1 = Session(model1, opt1, scaler=scaler, name="m1", **options)
            async with s0, s1:
                calls0, calls1 = (
                    Calls(s0 if with_session else None),
                    Calls(s1 if with_session else None),
                )
                for i, (x, y) in enumerate(data):
                    opt0.zero_grad()
                    opt1.zero_grad()
                    out0, out1 = model0(x), model1(x)
                    loss0 = loss_fn(0.3 * out0 + 0.7 * out1, y)
                    loss1 = loss_fn(0.6 * out0 - 0.4 * out1, y)
                    scaler.scale(loss0).backward(retain_graph=True)
                    scaler.scale(loss1).backward()
                    if i == SKIP_ITER:
                        _plant_inf(model1[1])
                    scaler.unscale_(opt0)
                    step0 = await calls0.check(i, loss0)
                    step1 = await calls1.check(i, loss1)
                    assert step0 and step1
                    scaler.step(opt0)
                    scaler.step(opt1)
                    scaler.update()
                    await calls0.completed(i)
                    await calls1.completed(i)
            await bus.drain()
        runs.append((model0, opt0, model1, opt1, scaler))
    (a0, ao0, a1, ao1, sa), (b0, bo0, b1, bo1, sb) = runs
    _assert_same_training((a0, ao0, sa), (b0, bo0, sb))
    _assert_same_training((a1, ao1, sa), (b1, bo1, sb))
    assert sb.get_scale() == 128.0 * 2.0**3 * 0.5
    assert [(e.source, e.step) for e in recorder.of_type(StepSkipped)] == [("m1.amp", SKIP_ITER)]
    assert _incidents(recorder) == []
    assert _actions(recorder) == []


# -- long fp16 runs: hundreds of steps with routine and planted overflows --------------------


@dataclass
class Run:
    model: nn.Module
    opt: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    recorder: RecordingSink = field(default_factory=RecordingSink)
    overflowed: list[int] = field(default_factory=list)
    returned: list[object] = field(default_factory=list)

    @property
    def training(self) -> tuple[nn.Module, torch.optim.Optimizer, torch.amp.GradScaler]:
        return self.model, self.opt, self.scaler


class ReturningSGD(torch.optim.SGD):
    """An SGD whose step() returns a value, for ``scaler.step``'s return value."""

    def step(self, closure: Any = None) -> float:  # type: ignore[override]
        super().step(closure)
        return 42.0


def _long_run_parts(optimizer: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))
    params = model.parameters()
    opt: torch.optim.Optimizer
    if optimizer == "sgd":
        opt = ReturningSGD(params, lr=0.01, momentum=0.9)
    elif optimizer == "adamw":
        opt = torch.optim.AdamW(params, lr=1e-3)
    else:
        opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
    return model, opt


async def _long_run(
    run: Run,
    calls: Calls,
    steps: range,
    *,
    inf_at: frozenset[int],
    clip: bool,
    gen: torch.Generator,
) -> None:
    model, opt, scaler = run.training
    for step in steps:
        x = torch.randn(16, 8, generator=gen)
        y = torch.randn(16, 8, generator=gen)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        loss = nn.functional.mse_loss(out.float(), y)
        scaler.scale(loss).backward()  # type: ignore[no-untyped-call]
        if step in inf_at:
            _plant_inf(model.get_submodule("2"))
        if clip:  # the documented pattern: unscale_ before clip_grad_norm_
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        before = scaler.get_scale()
        if await calls.check(step, loss):
            run.returned.append(scaler.step(opt))
        scaler.update()
        if scaler.get_scale() < before:
            run.overflowed.append(step)
        await calls.completed(step)


STEPS = 300
PLANTED = frozenset({50, 51, 200})


@pytest.mark.parametrize(
    ("optimizer", "clip", "kind"),
    [
        ("sgd", False, "async"),
        ("sgd", True, "async"),
        ("adamw", False, "async"),
        ("fused", True, "async"),
        ("sgd", False, "sync"),
    ],
)
async def test_hundreds_of_fp16_steps_with_overflows_are_untouched(
    optimizer: str, clip: bool, kind: str
) -> None:
    """300 fp16 steps, a GradScaler whose scale grows every 25 clean steps (so it overflows
    again and again), infs planted at 3 steps: the same parameters, optimizer state, scaler
    state and ``scaler.step`` return values as without the session; every overflow (the
    scaler's own, found by its backoff) is one StepSkipped and nothing else is published."""
    runs: list[Run] = []
    for session_kind in (None, kind):
        model, opt = _long_run_parts(optimizer)
        run = Run(model, opt, torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=25))
        gen = torch.Generator().manual_seed(1)
        options = _options(run.recorder, scaler=run.scaler)
        go = {"inf_at": PLANTED, "clip": clip, "gen": gen}
        if session_kind is None:
            await _long_run(run, Calls(None), range(STEPS), **go)  # type: ignore[arg-type]
        elif session_kind == "async":
            async with Session(model, opt, **options) as session:
                await _long_run(run, Calls(session), range(STEPS), **go)  # type: ignore[arg-type]
        else:
            with SyncSession(model, opt, **options) as sync:
                await _long_run(run, Calls(sync), range(STEPS), **go)  # type: ignore[arg-type]
        runs.append(run)
    plain, debugged = runs
    _assert_same_training(plain.training, debugged.training)
    assert debugged.returned == plain.returned
    assert debugged.overflowed == plain.overflowed
    assert PLANTED <= set(plain.overflowed) and len(plain.overflowed) > len(PLANTED)
    if optimizer == "sgd":  # scaler.step returns optimizer.step()'s value, None when skipped
        assert plain.returned.count(None) == len(plain.overflowed)
        assert plain.returned.count(42.0) == STEPS - len(plain.overflowed)
    recorder = debugged.recorder
    skipped = recorder.of_type(StepSkipped)
    assert [e.step for e in skipped] == plain.overflowed
    assert all(e.scale_before is not None and e.scale_after == e.scale_before / 2 for e in skipped)
    assert _incidents(recorder) == []
    assert _actions(recorder) == []
    checked = recorder.of_type(StepChecked)
    assert len(checked) == STEPS
    assert all(e.finite == (e.step not in plain.overflowed) for e in checked)


async def test_a_state_dict_round_trip_resumes_the_same_run() -> None:
    """Stop at step 150 (model, optimizer and scaler state_dicts), resume in fresh objects
    under a fresh session: the end state is the uninterrupted plain run's, overflows included."""
    plain = Run(*_long_run_parts("adamw"), torch.amp.GradScaler("cpu", growth_interval=25))
    gen = torch.Generator().manual_seed(1)
    await _long_run(plain, Calls(None), range(STEPS), inf_at=PLANTED, clip=False, gen=gen)

    gen = torch.Generator().manual_seed(1)
    first = Run(*_long_run_parts("adamw"), torch.amp.GradScaler("cpu", growth_interval=25))
    async with Session(
        first.model, first.opt, **_options(first.recorder, scaler=first.scaler)
    ) as s:
        await _long_run(first, Calls(s), range(150), inf_at=PLANTED, clip=False, gen=gen)
    saved = (first.model.state_dict(), first.opt.state_dict(), first.scaler.state_dict())

    model, opt = _long_run_parts("adamw")
    second = Run(model, opt, torch.amp.GradScaler("cpu"))  # defaults, replaced by the load
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    second.scaler.load_state_dict(saved[2])
    assert second.scaler.state_dict() == saved[2]
    async with Session(model, opt, **_options(second.recorder, scaler=second.scaler)) as s:
        await _long_run(second, Calls(s), range(150, STEPS), inf_at=PLANTED, clip=False, gen=gen)

    _assert_same_training(plain.training, second.training)
    assert first.overflowed + second.overflowed == plain.overflowed
    skipped = [e.step for r in (first, second) for e in r.recorder.of_type(StepSkipped)]
    assert skipped == plain.overflowed
    for r in (first, second):
        assert _incidents(r.recorder) == []
        assert _actions(r.recorder) == []


# -- the genuine faults are still reported ---------------------------------------------------


@pytest.mark.parametrize("with_scaler", [True, False])
async def test_a_nan_loss_in_fp32_is_a_fault_skipped_as_the_scaler_would(
    with_scaler: bool,
) -> None:
    """fp32, no autocast, a NaN loss at step 5: NonFiniteDetected for the loss and the step
    skipped. With a scaler the scale backs off as the plain run's scaler.step() skip makes
    it, so the training stays the plain run's."""
    nan_at = 5
    runs = []
    recorder = RecordingSink()
    for with_session in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        scaler = torch.amp.GradScaler("cpu", enabled=with_scaler)
        gen = torch.Generator().manual_seed(1)
        options = _options(recorder, scaler=scaler if with_scaler else None)
        async with Session(model, opt, **options) as session:
            calls = Calls(session if with_session else None)
            for step in range(20):
                x = torch.randn(16, 8, generator=gen)
                loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
                if step == nan_at:
                    loss = loss * math.nan
                opt.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()  # type: ignore[no-untyped-call]
                should = await calls.check(step, loss)
                assert should == (not with_session or step != nan_at)
                if should and (with_scaler or step != nan_at):
                    scaler.step(opt)
                scaler.update()
                await calls.completed(step)
        runs.append((model, opt, scaler))
    _assert_same_training(runs[0], runs[1])
    assert all(torch.isfinite(p).all() for p in runs[1][0].parameters())
    if with_scaler:
        assert runs[1][2].get_scale() == 2.0**16 * 2**-1
    found = recorder.of_type(NonFiniteDetected)
    assert found and {e.step for e in found} == {nan_at}
    assert TensorRole.LOSS in {e.role for e in found}
    assert _actions(recorder) == [(RecoveryAction.SKIP_STEP, nan_at)]
    assert not recorder.of_type(ScalerInTrouble)


@pytest.mark.parametrize(
    ("init_scale", "fp16", "steps", "trouble_at", "scale", "run"),
    [(2.0**16, True, 40, 26, 0.5, 17), (2.0**70, False, 70, 59, 2.0**20, 50)],
)
async def test_a_collapsing_scale_is_reported_once_and_never_acted_on(
    init_scale: float, fp16: bool, steps: int, trouble_at: int, scale: float, run: int
) -> None:
    """Gradients that overflow at every scale from step 10 on: the scale halves at each step.
    Each step is a StepSkipped; ScalerInTrouble fires once, when the scale falls below 1 (from
    2**16 under fp16 autocast: 17 overflows in a row) or at 50 in a row (from 2**70 in fp32,
    where such a scale fits); no recovery action; the training is the plain run's (the scaler
    alone skipped those steps)."""
    runs = []
    recorder = RecordingSink()
    for with_session in (False, True):
        torch.manual_seed(0)
        model = nn.Linear(8, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
        gen = torch.Generator().manual_seed(1)
        async with Session(model, opt, **_options(recorder, scaler=scaler)) as session:
            calls = Calls(session if with_session else None)
            for step in range(steps):
                with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
                    loss = model(torch.randn(16, 8, generator=gen)).float().pow(2).mean()
                opt.zero_grad()
                scaler.scale(loss).backward()
                if step >= 10:
                    with torch.no_grad():
                        model.weight.grad.fill_(math.inf)  # type: ignore[union-attr]
                assert await calls.check(step, loss)
                scaler.step(opt)
                scaler.update()
                await calls.completed(step)
        runs.append((model, opt, scaler))
    _assert_same_training(runs[0], runs[1])
    assert runs[1][2].get_scale() == init_scale * 0.5 ** (steps - 10)
    assert [e.step for e in recorder.of_type(StepSkipped)] == list(range(10, steps))
    trouble = recorder.of_type(ScalerInTrouble)
    assert [(e.step, e.scale, e.consecutive_skips) for e in trouble] == [(trouble_at, scale, run)]
    assert [e.kind for e in _incidents(recorder)] == ["scaler_in_trouble"]
    assert _actions(recorder) == []


# -- ScalerStepWatcher, the loop without a session --------------------------------------------


@pytest.mark.parametrize("fused", [False, True])
async def test_scaler_step_watcher_sees_the_overflow_of_a_fused_optimizer(fused: bool) -> None:
    """A fused optimizer is stepped by scaler.step() even on an overflow (its kernel skips the
    update on the device): the watcher still says False and reports the StepSkipped (it said
    True and reported nothing), and the training is the plain run's."""
    runs = []
    recorder = RecordingSink()
    for watched in (False, True):
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
        scaler = torch.amp.GradScaler("cpu", init_scale=128.0)
        gen = torch.Generator().manual_seed(1)
        stepped = []
        async with EventBus() as bus:
            bus.subscribe(recorder)
            watcher = ScalerStepWatcher(scaler, opt, RecoveryEngine(bus)) if watched else None
            for step in range(6):
                opt.zero_grad()
                scaler.scale(model(torch.randn(3, 4, generator=gen)).pow(2).mean()).backward()
                if step == 2:
                    model.weight.grad.fill_(math.inf)  # type: ignore[union-attr]
                if watcher is None:
                    scaler.step(opt)
                    scaler.update()
                else:
                    stepped.append(watcher.step(step))
            if watcher is not None:
                watcher.close()
            await bus.drain()
        runs.append((model, opt, scaler))
    _assert_same_training(runs[0], runs[1])
    assert stepped == [step != 2 for step in range(6)]
    assert [(e.step, e.scale_before, e.scale_after) for e in recorder.of_type(StepSkipped)] == [
        (2, 128.0, 64.0)
    ]


# -- the frameworks' AMP loops ----------------------------------------------------------------


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_lightning_16_mixed_with_clipping_is_bit_for_bit_the_run_without_the_callback(
    tmp_path: Path,
) -> None:
    """Lightning's fp16 loop (the plugin unscales, clips at gradient_clip_val, scaler.step,
    update) over 160 steps whose scale grows every 10 steps: the same parameters and scaler
    state with the callback; its overflows are StepSkipped, never incidents."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(160 * 8, 8, generator=gen)
    y = x.sum(1, keepdim=True) + 0.1 * torch.randn(160 * 8, 1, generator=gen)
    runs = []
    recorder = RecordingSink()
    for debug in (False, True):
        module = Regression()
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=10)
        callbacks: list[pl.Callback] = (
            [LightningCallback(**_options(recorder, log_dir=tmp_path / "log"))] if debug else []
        )
        trainer = pl.Trainer(
            max_epochs=1,
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            gradient_clip_val=0.5,
            plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
            callbacks=callbacks,
        )
        trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=8))
        runs.append((module, scaler))
    (plain, plain_scaler), (debugged, debugged_scaler) = runs
    for p, q in zip(plain.parameters(), debugged.parameters(), strict=True):
        assert torch.equal(p, q)
    assert plain_scaler.state_dict() == debugged_scaler.state_dict()
    assert recorder.of_type(StepSkipped)  # the scale kept growing into overflows
    assert _incidents(recorder) == []
    assert _actions(recorder) == []


VOCAB = 64


def _gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=32,
        n_embd=16,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(config)


def _tokens(gen: torch.Generator, batch: int = 8, length: int = 16) -> torch.Tensor:
    """A noisy grammar: each token is (previous * 3 + 1) mod VOCAB, 10 % replaced at random."""
    tokens = [torch.randint(0, VOCAB, (batch, 1), generator=gen)]
    for _ in range(length - 1):
        tokens.append((tokens[-1] * 3 + 1) % VOCAB)
    ids = torch.cat(tokens, 1)
    noise = torch.rand(ids.shape, generator=gen) < 0.1
    return torch.where(noise, torch.randint(0, VOCAB, ids.shape, generator=gen), ids)


def test_hf_trainer_bf16_is_bit_for_bit_the_run_without_the_callback(tmp_path: Path) -> None:
    """Trainer's CPU bf16 autocast loop (AdamW, linear decay, max_grad_norm=1.0 taken over by
    the callback) on a tiny GPT-2: the same parameters and logged losses, nothing reported."""
    gen = torch.Generator().manual_seed(1)
    data = [{"input_ids": ids, "labels": ids} for ids in _tokens(gen, batch=480)]
    runs = []
    recorder = RecordingSink()
    for debug in (False, True):
        model = _gpt2()
        args = TrainingArguments(
            output_dir=str(tmp_path / f"hf_{debug}"),
            max_steps=60,
            per_device_train_batch_size=8,
            learning_rate=1e-3,
            max_grad_norm=1.0,
            bf16=True,
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            logging_steps=1,
            disable_tqdm=True,
            seed=0,
        )
        callbacks: list[TrainerCallback] = (
            [HFCallback(**_options(recorder, log_dir=tmp_path / "log"))] if debug else []
        )
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
        trainer.train()
        logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        runs.append((model, logged))
    (plain, plain_logged), (debugged, debugged_logged) = runs
    assert len(plain_logged) == 60 and debugged_logged == plain_logged
    for p, q in zip(plain.parameters(), debugged.parameters(), strict=True):
        assert torch.equal(p, q)
    assert len(recorder.of_type(StepChecked)) == 60
    assert _incidents(recorder) == []
    assert _actions(recorder) == []


@pytest.mark.slow
async def test_a_long_healthy_bf16_gpt2_run_has_no_incident_and_no_action() -> None:
    """2,000 steps of a tiny GPT-2 under CPU bf16 autocast, noisy minibatches, AdamW, the
    default session: zero incidents, zero actions, every step stepped."""
    steps = 2000
    model = _gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    gen = torch.Generator().manual_seed(1)
    recorder = RecordingSink()
    losses = []
    async with Session(model, opt, **_options(recorder)) as session:
        for step in range(steps):
            ids = _tokens(gen)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            verdict = await session.check_step(step, loss=loss)
            assert verdict.should_step
            opt.step()
            await session.step_completed(step, loss=verdict.loss)
            losses.append(verdict.loss)
    assert losses[0] is not None and losses[-1] is not None and losses[-1] < losses[0] / 2
    assert len(recorder.of_type(StepChecked)) == steps
    assert _incidents(recorder) == []
    assert _actions(recorder) == []
    assert recorder.of_type(StepSkipped) == []


def _monitored_overflows(plan: Sequence[float | None]) -> list[ScalerInTrouble]:
    """Drive a ScalerMonitor through *plan*: per step, the scale an overflow lowers the scaler
    to, or None for a clean step (the scale then stays); the ScalerInTrouble events."""
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(1))  # the scale tensor exists from here on
    events: list[object] = []
    monitor = ScalerMonitor(scaler, events.append, floor=1.0, max_skips=3)
    for step, after in enumerate(plan):
        if after is not None:
            monitor.overflowed(step)
            scaler.update(new_scale=after)
        monitor.completed(step)
    return [e for e in events if isinstance(e, ScalerInTrouble)]


def test_a_scale_staying_below_the_floor_is_reported_once() -> None:
    """Below the floor, each growth interval's overflow (after clean steps) is the same trouble:
    one ScalerInTrouble, not one per interval for days."""
    clean: list[float | None] = [None] * 5
    plan = [0.5, *clean, 0.5, *clean, 0.25, *clean, 0.5]
    troubles = _monitored_overflows(plan)
    assert [t.step for t in troubles] == [0]


def test_a_scale_that_climbed_back_is_reported_when_it_falls_again() -> None:
    clean: list[float | None] = [None] * 3
    plan = [0.5, *clean, 2.0, *clean, 0.5]  # below, back above at an overflow, below again
    troubles = _monitored_overflows(plan)
    assert [t.step for t in troubles] == [0, 8]


def test_a_long_streak_is_reported_once_per_streak_even_below_the_floor() -> None:
    plan: list[float | None] = [0.5, 0.25, 0.125, 0.0625, None, 0.5, 0.25, 0.125, 0.0625]
    troubles = _monitored_overflows(plan)
    # step 0: fell below the floor; step 7: a new streak of 3 (max_skips), still below
    assert [(t.step, t.consecutive_skips) for t in troubles] == [(0, 1), (7, 3)]
