"""Audit s11: recovery under real faults in realistic loops (schedulers, optimizers, snapshots).

Each test names the scenario that broke before its fix; all are seeded and bounded.
"""

from __future__ import annotations

import math
import weakref
from pathlib import Path

import anyio
import pytest
import torch
from torch import nn

from eventbus_debug import (
    CallState,
    EventBus,
    RecoveryEngine,
    Retrying,
    SafePoint,
    StepProbe,
    SyncEventBus,
    TrainingStopped,
    retrying,
)
from eventbus_debug.events import NonFiniteDetected, RecoveryAction, RecoveryApplied
from eventbus_debug.recovery import Decision, ScaleLR, SkipStep, StateSnapshots, scale_learning_rate
from eventbus_debug.testing import RecordingSink

S = torch.optim.lr_scheduler


def _lrs(
    make: object, *, scale_at: int | None, undo_at: int | None, steps: int = 60
) -> list[float]:
    """The LR of group 0 after each of *steps* scheduler steps, with an optional x0.5 scale
    (and its undo, x2) applied as the safe point applies them."""
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = make(opt)  # type: ignore[operator]
    out: list[float] = []
    for t in range(steps):
        if t == scale_at:
            scale_learning_rate(opt, 0.5, [sched])
        if t == undo_at:
            scale_learning_rate(opt, 2.0, [sched])
        opt.step()
        if isinstance(sched, S.ReduceLROnPlateau):
            sched.step(1.0)  # a flat metric: it keeps reducing, down to its floor
        else:
            sched.step()
        out.append(opt.param_groups[0]["lr"])
    return out


FLOORED = {
    "cosine_eta_min": lambda o: S.CosineAnnealingLR(o, T_max=20, eta_min=0.01),
    "cosine_restarts": lambda o: S.CosineAnnealingWarmRestarts(o, T_0=10, eta_min=0.01),
    "plateau_min_lr": lambda o: S.ReduceLROnPlateau(o, patience=0, factor=0.5, min_lr=0.04),
    "sequential_to_cosine": lambda o: S.SequentialLR(
        o,
        [S.LinearLR(o, 0.1, 1.0, 10), S.CosineAnnealingLR(o, T_max=40, eta_min=0.01)],
        milestones=[10],
    ),
}


class TestSchedulerFloors:
    @pytest.mark.parametrize("name", sorted(FLOORED))
    def test_a_scaled_schedule_stays_proportional_and_the_undo_is_exact(self, name: str) -> None:
        """Before: CosineAnnealingLR's eta_min pulled a halved LR back toward the unscaled
        floor (and after the undo the LR stayed above its schedule for good, 0.058 off at
        lr 0.1); ReduceLROnPlateau's min_lr raised a halved LR at the floor straight back (the
        scheduler undid the decision). The floors are scaled with the LR now."""
        make = FLOORED[name]
        base = _lrs(make, scale_at=None, undo_at=None)
        halved = _lrs(make, scale_at=5, undo_at=None)
        undone = _lrs(make, scale_at=5, undo_at=25)
        for t in range(5, 60):
            assert halved[t] == pytest.approx(0.5 * base[t], rel=1e-9, abs=1e-12), t
        for t in range(25, 60):
            assert undone[t] == pytest.approx(base[t], rel=1e-9, abs=1e-12), t


def _linear(model: nn.Module, index: int) -> nn.Linear:
    layer = model.get_submodule(str(index))
    assert isinstance(layer, nn.Linear)
    return layer


def _norm(model: nn.Module) -> nn.BatchNorm1d:
    layer = model.get_submodule("1")
    assert isinstance(layer, nn.BatchNorm1d)
    return layer


def _running_mean(model: nn.Module) -> torch.Tensor:
    mean = _norm(model).running_mean
    assert mean is not None
    return mean


def _unfreezing() -> tuple[nn.Sequential, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.AdamW(_linear(model, 2).parameters(), lr=1e-2, weight_decay=0.1)
    return model, opt


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 4, generator=gen)).pow(2).mean().backward()
        opt.step()


class TestAddParamGroup:
    def test_capture_after_add_param_group_does_not_crash(self) -> None:
        """Progressive unfreezing: before, the first capture after add_param_group raised
        ValueError (zip() argument 2 is longer) from the safe point of a healthy step."""
        model, opt = _unfreezing()
        snaps = StateSnapshots(every=1)
        _train(model, opt, 2)
        assert snaps.capture(2, model, opt)
        opt.add_param_group({"params": list(_linear(model, 0).parameters()), "lr": 1e-3})
        _train(model, opt, 1)
        assert snaps.capture(3, model, opt)
        assert len(snaps._optimizer["param_groups"]) == 2  # type: ignore[index]
        _train(model, opt, 2)
        assert snaps.restore(model, opt) == 3

    def test_restore_of_a_state_held_before_add_param_group(self) -> None:
        """Before: ValueError (different number of parameter groups). Now each parameter gets
        back its captured state by identity, the new group starts with none (as when it was
        added), and the groups keep their settings."""
        model, opt = _unfreezing()
        snaps = StateSnapshots(every=1)
        _train(model, opt, 2)
        assert snaps.capture(2, model, opt)
        head = _linear(model, 2).weight
        weight = head.detach().clone()
        moment = opt.state[head]["exp_avg"].clone()
        opt.add_param_group(
            {"params": list(_linear(model, 0).parameters()), "lr": 1e-3, "weight_decay": 0}
        )
        _train(model, opt, 3)
        assert snaps.restore(model, opt) == 2
        assert torch.equal(head, weight)
        assert torch.equal(opt.state[head]["exp_avg"], moment)
        assert float(opt.state[head]["step"]) == 2.0  # AdamW's count goes back with the moments
        assert _linear(model, 0).weight not in opt.state
        settings = [(g["lr"], g["weight_decay"], len(g["params"])) for g in opt.param_groups]
        assert settings == [(1e-2, 0.1, 2), (1e-3, 0, 2)]
        _train(model, opt, 1)  # and the optimizer steps on
        assert float(opt.state[_linear(model, 0).weight]["step"]) == 1.0


def _bn_model() -> tuple[nn.Sequential, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


class TestSnapshotsHoldOnlyGoodState:
    def test_a_non_finite_buffer_is_not_captured(self) -> None:
        """A NaN written into BatchNorm's running mean leaves a train-mode loss finite; before,
        the next capture took it, and every restore brought it back (restored every 10
        steps for ever)."""
        model, opt = _bn_model()
        snaps = StateSnapshots(every=1)
        _train_bn(model, opt, 2)
        assert snaps.capture(2, model, opt)
        with torch.no_grad():
            _running_mean(model)[0] = math.nan
        assert not snaps.capture(3, model, opt)  # the plan is reused, and still refuses
        assert snaps.step == 2
        snaps.restore(model, opt)
        assert bool(torch.isfinite(_running_mean(model)).all())

    def test_an_infinite_mask_buffer_is_captured_and_checkpointed(self, tmp_path: Path) -> None:
        """A causal mask of -inf registered as a buffer is by construction, not a fault: the
        buffer check refuses NaN only (parameters and moments: NaN and Inf)."""
        model, opt = _bn_model()
        mask = torch.full((4, 4), -math.inf).triu(1)
        model.register_buffer("mask", mask)
        _train_bn(model, opt, 1)
        snaps = StateSnapshots(every=1)
        assert snaps.capture(1, model, opt)
        path = tmp_path / "masked.pt"
        snaps.save(path)
        assert StateSnapshots(checkpoint=path).restore(model, opt) == 1
        assert torch.equal(model.get_buffer("mask"), mask)

    def test_non_finite_optimizer_state_is_not_captured(self) -> None:
        model, opt = _bn_model()
        snaps = StateSnapshots(every=1)
        _train_bn(model, opt, 2)
        opt.state[_linear(model, 0).weight]["exp_avg_sq"][0, 0] = math.inf
        assert not snaps.capture(2, model, opt)

    def test_a_large_half_precision_model_is_captured(self) -> None:
        """Before: the norms of an fp16 model were summed in fp16 and overflowed 65504 (a 70B
        fp16 checkpoint's weight norms add up to ~1e5), so every capture was refused and a
        fault found no good state. They are summed in float32."""
        model = nn.Sequential(*[nn.Linear(256, 256, bias=False) for _ in range(40)]).half()
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(8.0)  # each weight's norm is 2048: 81,920 in all
        assert StateSnapshots().capture(0, model, None)
        with torch.no_grad():
            _linear(model, 3).weight[0, 0] = math.nan
        assert not StateSnapshots().capture(0, model, None)

    async def test_a_nan_buffer_in_a_loop_is_restored_for_good(
        self, bus: EventBus, recorder: RecordingSink
    ) -> None:
        """The loop: a NaN running mean at step 21 is found by the buffer check (step 30) and
        restored from a state taken before it, once; the run ends finite."""
        bus.subscribe(recorder)
        model, opt = _bn_model()
        engine = RecoveryEngine(bus)
        probe = StepProbe(model, bus)
        safe = SafePoint(engine, model, opt, snapshots=StateSnapshots(every=2))
        gen = torch.Generator().manual_seed(2)
        x = torch.randn(256, 8, generator=gen)
        y = x.sum(1, keepdim=True)
        with anyio.fail_after(30):
            for step in range(60):
                opt.zero_grad(set_to_none=True)
                if step == 21:
                    with torch.no_grad():
                        _running_mean(model)[0] = math.nan
                i = (step * 32) % 256
                loss = nn.functional.mse_loss(model(x[i : i + 32]), y[i : i + 32])
                loss.backward()  # type: ignore[no-untyped-call]
                await probe.check_step(step, loss=loss)
                if (await safe.before_optimizer_step(step)).should_step:
                    opt.step()
            await bus.drain()
        found = [e.step for e in recorder.of_type(NonFiniteDetected)]
        restores = [
            e.step
            for e in recorder.of_type(RecoveryApplied)
            if e.action is RecoveryAction.RESTORE_STATE
        ]
        assert len(found) == 1
        assert restores == found
        assert bool(torch.isfinite(_running_mean(model)).all())


def _train_bn(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    gen = torch.Generator().manual_seed(3)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(16, 8, generator=gen)).pow(2).mean().backward()
        opt.step()


class TestCheckpoint:
    def test_a_non_finite_checkpoint_is_refused_naming_the_entry(self, tmp_path: Path) -> None:
        model, opt = _bn_model()
        _train_bn(model, opt, 1)
        state = model.state_dict()
        state["1.running_var"] = state["1.running_var"].clone()
        state["1.running_var"][2] = math.nan
        path = tmp_path / "bad.pt"
        torch.save({"model": state, "optimizer": opt.state_dict(), "step": 7}, path)
        with pytest.raises(ValueError, match=r"non-finite values in 1\.running_var"):
            StateSnapshots(checkpoint=path)

    def test_another_checkpoint_layout_is_refused_at_load(self, tmp_path: Path) -> None:
        """Lightning's layout was taken for a bare model state dict, and failed only when a
        fault needed the state (load_state_dict: unexpected keys 'state_dict', 'epoch')."""
        model, _ = _bn_model()
        path = tmp_path / "lightning.ckpt"
        torch.save({"state_dict": model.state_dict(), "epoch": 3}, path)
        with pytest.raises(ValueError, match="not a model state dict"):
            StateSnapshots(checkpoint=path)
        torch.save({"model": model.state_dict(), "optimizer": {"lr": 0.1}}, path)
        with pytest.raises(ValueError, match="'optimizer' must be an optimizer's state_dict"):
            StateSnapshots(checkpoint=path)

    def test_a_good_checkpoint_restores_model_and_optimizer(self, tmp_path: Path) -> None:
        model, opt = _bn_model()
        _train_bn(model, opt, 3)
        path = tmp_path / "good.pt"
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 3}, path)
        expected = [t.clone() for t in model.state_dict().values()]
        snaps = StateSnapshots(checkpoint=path)
        _train_bn(model, opt, 2)
        assert snaps.restore(model, opt) == 3
        assert all(
            torch.equal(a, b) for a, b in zip(model.state_dict().values(), expected, strict=True)
        )
        assert float(opt.state[_linear(model, 0).weight]["step"]) == 3.0


class TestStopsAfterACaughtCallStop:
    async def test_a_later_exhausted_call_still_stops(self, bus: EventBus) -> None:
        """Before: once one retried call had given up (TrainingStopped, caught by the loop),
        the engine's "already stopping" rule made every later exhausted incident decide
        nothing: a later OOM escaped raw instead of TrainingStopped."""
        engine = RecoveryEngine(bus)

        @retrying(engine, state=CallState(batch_size=1), pass_state=True)
        async def at_the_floor(*, state: CallState) -> None:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

        @retrying(engine)
        async def no_batch() -> None:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

        with anyio.fail_after(30):
            with pytest.raises(TrainingStopped, match="exhausted"):
                await at_the_floor()  # type: ignore[call-arg]
            with pytest.raises(TrainingStopped, match="exhausted") as stopped:
                await no_batch()
        assert isinstance(stopped.value.__cause__, torch.OutOfMemoryError)

    async def test_a_later_unrestorable_step_still_stops(
        self, bus: EventBus, recorder: RecordingSink
    ) -> None:
        """Same root: after a caught call-level stop, non-finite parameters that three
        restores did not fix went on being trained instead of stopping."""
        bus.subscribe(recorder)
        engine = RecoveryEngine(bus)

        @retrying(engine, state=CallState(batch_size=1), pass_state=True)
        async def at_the_floor(*, state: CallState) -> None:
            raise torch.OutOfMemoryError("CUDA out of memory.")

        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        probe = StepProbe(model, bus)
        safe = SafePoint(engine, model, opt, snapshots=StateSnapshots(every=1))
        with anyio.fail_after(30):
            with pytest.raises(TrainingStopped):
                await at_the_floor()  # type: ignore[call-arg]
            with pytest.raises(TrainingStopped, match="exhausted") as stopped:
                for step in range(20):
                    opt.zero_grad()
                    if step >= 5:  # a fault that survives every restore
                        with torch.no_grad():
                            model.weight[0, 0] = math.nan
                    loss = model(torch.randn(8, 4)).pow(2).mean()
                    loss.backward()
                    await probe.check_step(step, loss=loss)
                    if (await safe.before_optimizer_step(step)).should_step:
                        opt.step()
            await bus.drain()
        assert "non-finite" in str(stopped.value)
        stops = [
            e
            for e in recorder.of_type(RecoveryApplied)
            if e.action is RecoveryAction.STOP and e.source == "recovery.safe_point"
        ]
        assert len(stops) == 1


class TestTemporaryLRWithAddedGroups:
    async def test_the_undo_leaves_a_group_added_meanwhile_alone(
        self, bus: EventBus, recorder: RecordingSink
    ) -> None:
        """Unfreezing while a temporary LR halving is in force: before, the undo doubled every
        group, including the one added at its own LR after the halving (a permanent x2)."""
        bus.subscribe(recorder)
        model, opt = _unfreezing()
        engine = RecoveryEngine(bus)

        def halve(incident: object, history: object) -> list[Decision]:
            return [
                Decision(action=SkipStep(), reason="skip"),
                Decision(action=ScaleLR(factor=0.5, steps=4), reason="halve for 4 steps"),
            ]

        engine.register(halve, on=NonFiniteDetected, max_attempts=1)
        probe = StepProbe(model, bus)
        safe = SafePoint(engine, model, opt)
        gen = torch.Generator().manual_seed(4)
        lrs: list[list[float]] = []
        with anyio.fail_after(30):
            for step in range(12):
                if step == 5:
                    opt.add_param_group(
                        {"params": list(_linear(model, 0).parameters()), "lr": 1e-3}
                    )
                opt.zero_grad()
                loss = model(torch.randn(8, 4, generator=gen)).pow(2).mean()
                if step == 2:
                    loss = loss * math.nan
                loss.backward()
                await probe.check_step(step, loss=loss)
                if (await safe.before_optimizer_step(step)).should_step:
                    opt.step()
                lrs.append([g["lr"] for g in opt.param_groups])
            await bus.drain()
        assert lrs[2] == [5e-3]
        assert lrs[5] == [5e-3, 1e-3]
        assert lrs[-1] == [1e-2, 1e-3]
        restored = [
            e.detail
            for e in recorder.of_type(RecoveryApplied)
            if e.action is RecoveryAction.SCALE_LR and e.outcome == "restored"
        ]
        assert len(restored) == 1
        assert "in 1 param group(s) of 2" in restored[0]
        assert safe.temporary_lr_changes == ()

    def test_scale_learning_rate_refuses_unknown_groups(self) -> None:
        opt = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
        with pytest.raises(ValueError, match="groups must be indices"):
            scale_learning_rate(opt, 0.5, groups=[1])
        assert opt.param_groups[0]["lr"] == 0.1


class TestOOMRetryFreesTheFailedAttempt:
    async def test_the_failed_attempts_tensors_are_gone_before_the_retry(
        self, bus: EventBus
    ) -> None:
        """Before: the kept error's traceback held the failed attempt's frames, so its
        activations were still alive when the retry at half the batch ran (on a GPU,
        ``empty_cache()`` could not return their memory: the retry ran short of it)."""
        engine = RecoveryEngine(bus)
        alive: list[list[bool]] = []
        refs: list[weakref.ref[torch.Tensor]] = []

        @retrying(engine, state=CallState(batch_size=64), pass_state=True)
        async def train_step(*, state: CallState) -> int:
            alive.append([r() is not None for r in refs])
            activations = torch.empty(state.batch_size or 1, 1024)
            refs.append(weakref.ref(activations))
            if (state.batch_size or 1) > 16:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return state.batch_size or 1

        with anyio.fail_after(30):
            assert await train_step() == 16  # type: ignore[call-arg]
        assert alive == [[], [False], [False, False]]

    def test_the_context_manager_form_too(self) -> None:
        alive: list[list[bool]] = []
        refs: list[weakref.ref[torch.Tensor]] = []

        def forward(batch: int) -> None:
            activations = torch.empty(batch, 1024)
            refs.append(weakref.ref(activations))
            if batch > 16:
                raise torch.OutOfMemoryError("CUDA out of memory.")

        with SyncEventBus() as bus:
            engine = RecoveryEngine(bus)
            for attempt in Retrying(engine, state=CallState(batch_size=64)):
                with attempt:
                    alive.append([r() is not None for r in refs])
                    forward(attempt.state.batch_size or 1)
        assert alive == [[], [False], [False, False]]


class TestGradScalerOnASkippedStep:
    @pytest.mark.parametrize("unscaled_first", [False, True])
    async def test_the_documented_amp_loop_survives_a_real_fault(
        self, bus: EventBus, unscaled_first: bool
    ) -> None:
        """``if should_step: scaler.step(opt)`` then ``scaler.update()`` (docs/recovery.md#amp):
        before, the first skipped step raised ``AssertionError: No inf checks were recorded
        prior to update.`` from ``update()``. With ``SafePoint(scaler=)`` the skip records the
        check (the NaN gradients: the scale backs off)."""
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)
        engine = RecoveryEngine(bus)
        probe = StepProbe(model, bus)
        safe = SafePoint(engine, model, opt, scaler=scaler)
        x = torch.randn(64, 8)
        y = x.sum(1, keepdim=True)
        skipped = []
        with anyio.fail_after(30):
            for step in range(16):
                opt.zero_grad(set_to_none=True)
                loss = nn.functional.mse_loss(model(x), y)
                if step in (5, 9):
                    loss = loss * math.nan
                scaler.scale(loss).backward()  # type: ignore[no-untyped-call]
                if unscaled_first:
                    scaler.unscale_(opt)
                await probe.check_step(step, loss=loss)
                if (await safe.before_optimizer_step(step)).should_step:
                    scaler.step(opt)
                else:
                    skipped.append(step)
                scaler.update()
        assert skipped == [5, 9]
        assert scaler.get_scale() == 256.0
        assert all(bool(torch.isfinite(p).all()) for p in model.parameters())

    def test_scaler_must_be_a_grad_scaler(self) -> None:
        with SyncEventBus() as bus:
            model = nn.Linear(2, 1)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            with pytest.raises(TypeError, match=r"scaler must be a torch\.amp\.GradScaler"):
                SafePoint(RecoveryEngine(bus), model, opt, scaler=object())  # type: ignore[arg-type]
