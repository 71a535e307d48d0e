"""device_skip: a non-finite step skipped on the device by a fused optimizer, no host sync."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from torch import nn

from eventbus_debug import Session, SessionOptions, SyncEventBus, SyncSession, read_events
from eventbus_debug.events import (
    NonFiniteDetected,
    RecoveryAction,
    RecoveryApplied,
    RecoveryDecided,
    StepCompleted,
    StepSkipped,
)
from eventbus_debug.probes.step._launch import Pending
from eventbus_debug.recovery import DecidedAction, Decision, RestoreState, SkipStep
from eventbus_debug.recovery.agreement import Agreement
from eventbus_debug.recovery.device_skip import DeviceSkip, fused_optimizer
from eventbus_debug.session._wiring import build_recovery

Factory = Callable[[nn.Module], torch.optim.Optimizer]

OPTIMIZERS: dict[str, Factory] = {
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True),
    "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, fused=True),
}

QUIET: dict[str, Any] = {"log_dir": None, "system_interval": None, "report": False}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))


def _batches(n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(5, 6, generator=gen) for _ in range(n)]


def _loss(model: nn.Module, x: torch.Tensor, bad: bool) -> torch.Tensor:
    loss: torch.Tensor = model(x).pow(2).mean()
    return loss * math.nan if bad else loss


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every parameter and every tensor of the optimizer state, cloned."""
    out = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        for v in opt.state.get(p, {}).values():
            if isinstance(v, torch.Tensor):
                out.append(v.detach().clone())
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


class HostReads:
    """Spies every Python-level host read of a tensor and every Pending.read, with its step."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.reads: list[tuple[str, int | None]] = []  # (method, step of the Pending read)
        self.pending: list[int] = []
        self._inside: int | None = None
        self._mp = monkeypatch
        original_read = Pending.read

        def read(pending: Pending) -> list[float]:
            self.pending.append(pending.layout.step)
            self._inside = pending.layout.step
            try:
                return original_read(pending)
            finally:
                self._inside = None

        monkeypatch.setattr(Pending, "read", read)
        for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__"):
            self._spy(name)

    def _spy(self, name: str) -> None:
        original = getattr(torch.Tensor, name)

        def spy(tensor: torch.Tensor, *args: Any) -> Any:
            self.reads.append((name, self._inside))
            return original(tensor, *args)

        self._mp.setattr(torch.Tensor, name, spy)

    @contextmanager
    def window(self) -> Iterator[list[tuple[str, int | None]]]:
        """The reads made inside the block."""
        start = len(self.reads)
        out: list[tuple[str, int | None]] = []
        yield out
        out.extend(self.reads[start:])


async def _run(
    factory: Factory,
    *,
    device_skip: bool,
    bad: frozenset[int] = frozenset(),
    steps: int = 6,
    log_dir: Path | None = None,
    spy: HostReads | None = None,
) -> tuple[list[list[torch.Tensor]], dict[int, list[tuple[str, int | None]]]]:
    """Train *steps* steps; the state after each, and the host reads of each bad step."""
    model = _model()
    opt = factory(model)
    states: list[list[torch.Tensor]] = []
    windows: dict[int, list[tuple[str, int | None]]] = {}
    knobs = {**QUIET, "log_dir": log_dir, "report": log_dir is not None}
    async with Session(model, opt, device_skip=device_skip, **knobs) as session:
        for step, x in enumerate(_batches(steps)):
            loss = _loss(model, x, step in bad)
            torch.autograd.backward(loss)
            if spy is not None and step in bad:
                with spy.window() as reads:
                    verdict = await session.check_step(step, loss=loss)
                    if verdict.should_step:
                        opt.step()
                windows[step] = reads
            else:
                verdict = await session.check_step(step, loss=loss)
                if verdict.should_step:
                    opt.step()
            opt.zero_grad()
            await session.step_completed(step)
            states.append(_state(model, opt))
    return states, windows


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
class TestSkipOnDevice:
    async def test_nan_step_leaves_params_and_state_exactly_as_before(
        self, name: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A NaN at step 3 changes no parameter and no state tensor (moments, step count)."""
        spy = HostReads(monkeypatch)
        states, windows = await _run(
            OPTIMIZERS[name], device_skip=True, bad=frozenset({3}), spy=spy
        )
        assert _same(states[3], states[2])
        assert not _same(states[4], states[3])  # the next, healthy step is taken
        # No host read of step 3's numbers before its optimizer step: the one read is the
        # deferred read of step 2's vector (a copy already on the host on a GPU).
        assert windows[3] and all(step == 2 for _, step in windows[3]), windows[3]

    async def test_healthy_steps_bitwise_identical_to_a_run_without_it(self, name: str) -> None:
        """Without faults, device_skip changes no bit of the parameters or the optimizer state."""
        with_it, _ = await _run(OPTIMIZERS[name], device_skip=True)
        without, _ = await _run(OPTIMIZERS[name], device_skip=False)
        assert all(_same(a, b) for a, b in zip(with_it, without, strict=True))

    async def test_same_trajectory_as_the_host_skip(self, name: str) -> None:
        """Skipped on the device or on the host, a run with NaN steps ends bit-identical."""
        bad = frozenset({2, 4})
        with_it, _ = await _run(OPTIMIZERS[name], device_skip=True, bad=bad, steps=7)
        without, _ = await _run(OPTIMIZERS[name], device_skip=False, bad=bad, steps=7)
        assert all(_same(a, b) for a, b in zip(with_it, without, strict=True))


async def test_the_log_records_the_step_one_step_later(tmp_path: Path) -> None:
    """NonFiniteDetected names step 3, after StepCompleted(3); recovery saw it, skipped nothing more."""
    await _run(OPTIMIZERS["adamw"], device_skip=True, bad=frozenset({3}), log_dir=tmp_path)
    events = list(read_events(tmp_path))
    nan = [i for i, e in enumerate(events) if isinstance(e, NonFiniteDetected)]
    done3 = next(i for i, e in enumerate(events) if isinstance(e, StepCompleted) and e.step == 3)
    assert nan and all(events[i].step == 3 for i in nan)
    assert min(nan) > done3  # read at step 4's check
    decided = [e for e in events if isinstance(e, RecoveryDecided)]
    assert any(e.action is RecoveryAction.SKIP_STEP and e.step == 3 for e in decided)
    skipped = [e for e in events if isinstance(e, StepSkipped)]
    assert [e.step for e in skipped] == [3]
    assert "device_skip" in skipped[0].reason
    # the stale SKIP decision was not applied to step 4's healthy gradients
    assert not [e for e in events if isinstance(e, RecoveryApplied)]


async def test_last_step_nan_reaches_the_log_on_exit(tmp_path: Path) -> None:
    """A NaN at the last step is read by the session's exit flush."""
    await _run(OPTIMIZERS["sgd"], device_skip=True, bad=frozenset({3}), steps=4, log_dir=tmp_path)
    found = [e for e in read_events(tmp_path) if isinstance(e, NonFiniteDetected)]
    assert {e.step for e in found} == {3} and {e.role.value for e in found} == {"loss", "gradient"}


async def test_three_nan_steps_in_a_row_still_restore() -> None:
    """The SAFE policy's restore after 3 skips in a row still applies (a step later)."""
    model = _model()
    opt = OPTIMIZERS["adamw"](model)
    verdicts = []
    async with Session(model, opt, device_skip=True, **QUIET) as session:
        for step, x in enumerate(_batches(9)):
            torch.autograd.backward(_loss(model, x, step in {4, 5, 6}))
            verdict = await session.check_step(step)
            verdicts.append(verdict)
            if verdict.should_step:
                opt.step()
            opt.zero_grad()
            await session.step_completed(step)
    assert "restore_state" in verdicts[7].actions  # step 6 read at step 7
    assert not verdicts[7].should_step  # step 7's gradients belong to the discarded state
    assert all(v.should_step for i, v in enumerate(verdicts) if i != 7)


async def test_sgd_momentum_first_step_is_checked_on_the_host() -> None:
    """A NaN first step of fused SGD with momentum leaves no uninitialized momentum buffer."""
    bad_first, _ = await _run(OPTIMIZERS["sgd"], device_skip=True, bad=frozenset({0}), steps=3)
    reference, _ = await _run(OPTIMIZERS["sgd"], device_skip=False, bad=frozenset({0}), steps=3)
    assert all(torch.isfinite(t).all() for t in bad_first[-1])
    assert all(_same(a, b) for a, b in zip(bad_first, reference, strict=True))


async def test_training_step_reports_the_current_loss() -> None:
    """training_step with device_skip steps every batch and returns the step's own loss."""
    model = _model()
    opt = OPTIMIZERS["adamw"](model)
    xs = _batches(3)
    async with Session(model, opt, device_skip=True, **QUIET) as session:
        results = [
            await session.training_step(x, torch.zeros(5, 3), nn.functional.mse_loss) for x in xs
        ]
    assert [r.stepped for r in results] == [True, True, True]
    assert results[2].verdict.probe.step == 1  # the verdict is a step late
    assert results[2].loss != results[1].loss
    assert not hasattr(opt, "found_inf")


async def test_level_off_checks_the_gradients_themselves() -> None:
    """With no probe check due, the flag comes from the gradients' max-norms: still skipped."""
    model = _model()
    opt = OPTIMIZERS["adamw"](model)
    before = after = None
    async with Session(model, opt, device_skip=True, level="off", **QUIET) as session:
        for step, x in enumerate(_batches(3)):
            torch.autograd.backward(_loss(model, x, step == 1))
            verdict = await session.check_step(step)
            before = _state(model, opt) if step == 1 else before
            if verdict.should_step:
                opt.step()
            after = _state(model, opt) if step == 1 else after
            opt.zero_grad()
            await session.step_completed(step)
    assert before is not None and after is not None and _same(before, after)


async def test_a_python_float_loss_that_is_nan_sets_the_flag() -> None:
    """A non-finite loss given as a number is checked on the host (it is there already)."""
    model = _model()
    opt = OPTIMIZERS["adamw"](model)
    async with Session(model, opt, device_skip=True, **QUIET) as session:
        torch.autograd.backward(model(_batches(1)[0]).sum())
        await session.check_step(0, loss=math.inf)
        assert session.device_skip is not None and session.device_skip.flag is not None
        assert float(session.device_skip.flag) == 1.0
        assert getattr(opt, "found_inf", None) is session.device_skip.flag
        await session.step_completed(0)


class TestAttributes:
    async def test_removed_after_step_at_step_completed_and_on_exit(self) -> None:
        """found_inf lives from check_step to optimizer.step() (or step_completed, or exit)."""
        model = _model()
        opt = OPTIMIZERS["adamw"](model)
        async with Session(model, opt, device_skip=True, **QUIET) as session:
            torch.autograd.backward(model(_batches(1)[0]).sum())
            await session.check_step(0)
            assert isinstance(getattr(opt, "found_inf", None), torch.Tensor)
            assert not hasattr(opt, "grad_scale")  # never set: a scaler multiplies it
            opt.step()
            assert not hasattr(opt, "found_inf")  # the post-step hook
            await session.step_completed(0)
            await session.check_step(1)
            await session.step_completed(1)  # the loop chose not to step
            assert not hasattr(opt, "found_inf")
            await session.check_step(2)  # the session exits mid-step
        assert not hasattr(opt, "found_inf")
        assert not opt._optimizer_step_post_hooks
        torch.autograd.backward(model(_batches(1)[0]).sum())
        opt.step()  # an ordinary step after the session

    async def test_check_step_twice_keeps_one_flag(self) -> None:
        """A second check of the same step recomputes the flag in place; one step follows."""
        model = _model()
        opt = OPTIMIZERS["sgd"](model)
        async with Session(model, opt, device_skip=True, **QUIET) as session:
            torch.autograd.backward(model(_batches(1)[0]).sum())
            await session.check_step(0)
            first = opt.__dict__["found_inf"]
            await session.check_step(0)
            assert opt.__dict__["found_inf"] is first and float(first) == 0.0
            opt.step()
            await session.step_completed(0)
        assert not hasattr(opt, "found_inf")

    async def test_a_foreign_found_inf_is_refused(self) -> None:
        """A found_inf set by someone else (a GradScaler step under way) is never overwritten."""
        model = _model()
        opt = OPTIMIZERS["adamw"](model)
        async with Session(model, opt, device_skip=True, **QUIET) as session:
            torch.autograd.backward(model(_batches(1)[0]).sum())
            opt.found_inf = torch.zeros(())  # type: ignore[attr-defined]
            with pytest.raises(RuntimeError, match="GradScaler"):
                await session.check_step(0)
            del opt.found_inf  # type: ignore[attr-defined]

    async def test_a_scaler_stepping_behind_the_sessions_back_does_not_crash(self) -> None:
        """scaler.step() overwrites and deletes found_inf; the session's removal tolerates it."""
        model = _model()
        opt = OPTIMIZERS["adamw"](model)
        scaler = torch.amp.GradScaler("cpu")
        async with Session(model, opt, device_skip=True, **QUIET) as session:
            torch.autograd.backward(scaler.scale(model(_batches(1)[0]).sum()))
            await session.check_step(0)
            scaler.step(opt)
            scaler.update()
            await session.step_completed(0)
        assert not hasattr(opt, "found_inf")


async def test_lr_scheduler_follows_its_schedule_through_a_skipped_step() -> None:
    """optimizer.step() runs on the NaN step, so the scheduler warns nothing and keeps time."""
    lrs: dict[bool, list[Any]] = {}
    for skip in (True, False):
        model = _model()
        opt = OPTIMIZERS["adamw"](model)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        async with Session(model, opt, device_skip=skip, scheduler=sched, **QUIET) as session:
            for step, x in enumerate(_batches(5)):
                torch.autograd.backward(_loss(model, x, step == 0))
                verdict = await session.check_step(step)
                if verdict.should_step or not skip:
                    opt.step()  # (the host-skip loop steps too: its gradients were zeroed)
                opt.zero_grad()
                sched.step()
                await session.step_completed(step)
        lrs[skip] = sched.get_last_lr()
    assert lrs[True] == lrs[False]


def test_sync_session_skips_on_the_device_too() -> None:
    """SyncSession shares the boundary: a NaN step leaves parameters and state untouched."""
    model = _model()
    opt = OPTIMIZERS["adamw"](model)
    states = []
    with SyncSession(model, opt, device_skip=True, **QUIET) as session:
        for step, x in enumerate(_batches(4)):
            torch.autograd.backward(_loss(model, x, step == 2))
            if session.check_step(step).should_step:
                opt.step()
            opt.zero_grad()
            session.step_completed(step)
            states.append(_state(model, opt))
    assert _same(states[2], states[1]) and not _same(states[3], states[2])
    assert not hasattr(opt, "found_inf")


class TestRefused:
    @pytest.mark.parametrize(
        ("make", "error", "match"),
        [
            (lambda m: torch.optim.AdamW(m.parameters()), ValueError, "AdamW does not"),
            (lambda m: torch.optim.SGD(m.parameters(), lr=0.1), ValueError, "SGD does not"),
            (lambda m: torch.optim.RMSprop(m.parameters()), ValueError, "RMSprop"),
            (lambda m: None, TypeError, "got NoneType"),
        ],
    )
    def test_an_optimizer_that_reads_no_flag(
        self, make: Callable[[nn.Module], Any], error: type[Exception], match: str
    ) -> None:
        """A non-fused optimizer (or none) is refused when the session is built, by name."""
        model = _model()
        with pytest.raises(error, match=match):
            Session(model, make(model), device_skip=True, **QUIET)

    def test_the_deprecated_grad_scaler_keyword_contract(self) -> None:
        """An optimizer taking grad_scaler= in step() reads no found_inf: refused."""

        class Custom(torch.optim.SGD):
            _step_supports_amp_scaling = True

            def step(self, closure: Any = None, grad_scaler: Any = None) -> Any:
                return super().step(closure)

        with pytest.raises(ValueError, match="deprecated grad_scaler"):
            fused_optimizer(Custom(_model().parameters(), lr=0.1))

    @pytest.mark.parametrize(
        ("knobs", "match"),
        [
            ({"scaler": torch.amp.GradScaler("cpu")}, "scaler=: the GradScaler owns"),
            ({"skip_non_finite": False}, "skip_non_finite=False"),
            ({"distributed": True}, "distributed=True"),
            ({"mode": "anomaly_detection"}, "ANOMALY_DETECTION"),
        ],
    )
    def test_a_combination_that_cannot_work(self, knobs: dict[str, Any], match: str) -> None:
        """Each clashing knob is named in a ValueError when the options are built."""
        with pytest.raises(ValueError, match=match):
            SessionOptions(device_skip=True, **knobs)

    def test_not_a_bool(self) -> None:
        """device_skip takes a bool."""
        with pytest.raises(TypeError, match="device_skip must be a bool"):
            SessionOptions(device_skip=1)  # type: ignore[arg-type]


def test_agree_drops_only_stale_skips_and_clips() -> None:
    """Decisions about an earlier step's gradients go; a restore, and this step's skip, stay."""
    opt = OPTIMIZERS["adamw"](_model())
    skip = DeviceSkip(opt)
    skip.launched(5, None, None)

    def decided(step: int, action: Any) -> DecidedAction:
        return DecidedAction(
            decision=Decision(action=action, reason="r"),
            strategy="s",
            trigger_kind=NonFiniteDetected.kind,
            trigger_seq=0,
            step=step,
        )

    stale, restore, current = (
        decided(4, SkipStep()),
        decided(4, RestoreState()),
        decided(5, SkipStep()),
    )
    assert skip.agree([stale, restore, current]) == [restore, current]


async def test_a_float64_run_takes_the_generic_check() -> None:
    """A float64 vector (no AMP check for it) still flags a NaN step, and only that one."""
    model = _model().double()
    opt = OPTIMIZERS["adamw"](model)
    flags = []
    async with Session(model, opt, device_skip=True, **QUIET) as session:
        for step, x in enumerate(_batches(3)):
            torch.autograd.backward(_loss(model, x.double(), step == 1))
            await session.check_step(step, loss=None)
            assert session.device_skip is not None and session.device_skip.flag is not None
            flags.append(float(session.device_skip.flag))
            opt.step()
            opt.zero_grad()
            await session.step_completed(step)
    assert flags == [0.0, 1.0, 0.0]


def test_an_agreeing_process_group_is_refused_at_start() -> None:
    """In a process group that agrees, each rank would skip on its own flag: refused."""
    model = _model()
    opt = OPTIMIZERS["adamw"](model)
    options = SessionOptions(device_skip=True, **QUIET)
    agreement = cast(Agreement, object())
    with pytest.raises(ValueError, match="process group that agrees"):
        build_recovery(
            options,
            model,
            opt,
            SyncEventBus(),
            agreement=agreement,
            on_restore=lambda: None,
            device_skip=DeviceSkip(opt),
        )
