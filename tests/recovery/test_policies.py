"""Recovery policies through a real Session: safe defaults that never touch a healthy run."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from eventbus_debug import Anomaly, RecoveryEngine, SafePoint, Session, TrainingStopped
from eventbus_debug.events import (
    Event,
    GradientExploded,
    LossSpiked,
    NonFiniteDetected,
    RecoveryAction,
    RecoveryApplied,
    ScalerInTrouble,
    StepSkipped,
    TensorRole,
)
from eventbus_debug.recovery import (
    ClipOnExplosion,
    RecoveryPolicy,
    RollbackOnLossSpike,
    default_strategies,
)
from eventbus_debug.recovery.registry import StrategySpec
from eventbus_debug.recovery.strategies import StrategyHistory
from eventbus_debug.testing import RecordingSink

from ._loop import all_finite


def classifier() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 5))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = torch.randn(2048, 20)
    y = (x[:, :5].argmax(dim=1) + (torch.rand(2048) < 0.2).long()) % 5  # 20 % label noise
    return model, opt, x, y


async def train(
    session: Session,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    steps: int,
    *,
    nan_loss_at: tuple[int, ...] = (),
    nan_param_at: tuple[int, ...] = (),
) -> None:
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        idx = torch.randint(0, len(x), (16,), generator=gen)
        if step in nan_param_at:
            with torch.no_grad():
                next(model.parameters())[0, 0] = math.nan
        loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
        if step in nan_loss_at:
            loss = loss * math.nan
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        verdict = await session.check_step(step, loss=loss)
        if verdict.should_step:
            opt.step()
        await session.step_completed(step, loss=verdict.loss)


def session_for(
    model: nn.Module, opt: torch.optim.Optimizer, recorder: RecordingSink, **kwargs: object
) -> Session:
    return Session(
        model,
        opt,
        log_dir=None,
        report=False,
        alerts=False,
        system_interval=None,
        sinks=[recorder],
        **kwargs,  # type: ignore[arg-type]
    )


def incidents(recorder: RecordingSink) -> list[Event]:
    return [e for e in recorder.events if isinstance(e, Anomaly)]


class TestSafeDefaults:
    async def test_healthy_noisy_classifier_is_never_touched(self) -> None:
        """500 noisy batch-16 AdamW steps: no incident, no action, the LR unchanged.

        (benchmarks/bench_decisions.py runs this workload for 20,000 steps.)
        """
        model, opt, x, y = classifier()
        recorder = RecordingSink()
        async with session_for(model, opt, recorder) as session:
            await train(session, model, opt, x, y, 500)
        assert incidents(recorder) == []
        assert recorder.of_type(RecoveryApplied) == []
        assert opt.param_groups[0]["lr"] == pytest.approx(3e-3)

    @pytest.mark.parametrize(
        ("policy", "acts"), [(RecoveryPolicy.SAFE, False), (RecoveryPolicy.AGGRESSIVE, True)]
    )
    async def test_a_sustained_loss_shift_is_reported_never_rolled_back_by_default(
        self, policy: RecoveryPolicy, acts: bool
    ) -> None:
        """A curriculum phase: from step 300 the targets come from a new, harder task, so the
        loss stays far above its baseline for many steps. A loss signal alone cannot tell that
        from a fault: the safe default reports it (sustained spikes included) and never rolls
        back or touches the LR; the aggressive policy rolls back."""
        model, opt, x, y = classifier()
        y_new = (x[:, 5:10].argmin(dim=1) + 2) % 5  # the next phase's task
        recorder = RecordingSink()
        gen = torch.Generator().manual_seed(1)
        async with session_for(model, opt, recorder, policy=policy) as session:
            for step in range(500):
                idx = torch.randint(0, len(x), (16,), generator=gen)
                target = y[idx] if step < 300 else y_new[idx]
                loss = nn.functional.cross_entropy(model(x[idx]), target)
                opt.zero_grad(set_to_none=True)
                loss.backward()  # type: ignore[no-untyped-call]
                verdict = await session.check_step(step, loss=loss)
                if verdict.should_step:
                    opt.step()
                await session.step_completed(step, loss=verdict.loss)
        spikes = recorder.of_type(LossSpiked)
        assert spikes and all(e.step is not None and e.step >= 300 for e in spikes)
        applied = recorder.of_type(RecoveryApplied)
        assert bool(applied) is acts
        if not acts:
            assert "sustained" in {e.rule for e in spikes}
            assert not recorder.of_type(StepSkipped)
            assert opt.param_groups[0]["lr"] == pytest.approx(3e-3)

    async def test_a_raw_scale_regression_is_never_clipped(self) -> None:
        """An MLP regressing raw prices (targets ~7e5, MSE, Adam) has gradient norms of 1e7 to
        1e9 from its first step, above the 1e6 cap: at most the first is reported, nothing is
        clipped, skipped or rescaled, and the parameters equal a plain loop's."""

        def build() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
            torch.manual_seed(0)
            gen = torch.Generator().manual_seed(0)
            x = torch.randn(512, 13, generator=gen)
            w = torch.rand(13, generator=gen) * 3e4
            y = 4.0 * (x @ w + 1.8e5 + 2e4 * torch.randn(512, generator=gen))[:, None]
            model = nn.Sequential(nn.Linear(13, 32), nn.ReLU(), nn.Linear(32, 1))
            return model, torch.optim.Adam(model.parameters(), lr=0.3), x, y

        def batch(step: int, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            idx = torch.arange(32) + 32 * (step % 16)
            return nn.functional.mse_loss(model(x[idx]), y[idx])

        plain, plain_opt, x, y = build()
        for step in range(300):
            plain_opt.zero_grad(set_to_none=True)
            batch(step, plain, x, y).backward()  # type: ignore[no-untyped-call]
            plain_opt.step()
        model, opt, x, y = build()
        recorder = RecordingSink()
        async with session_for(model, opt, recorder) as session:
            for step in range(300):
                opt.zero_grad(set_to_none=True)
                loss = batch(step, model, x, y)
                loss.backward()  # type: ignore[no-untyped-call]
                verdict = await session.check_step(step, loss=loss)
                if verdict.should_step:
                    opt.step()
                await session.step_completed(step, loss=verdict.loss)
        exploded = recorder.of_type(GradientExploded)
        assert [(e.step, e.rule) for e in exploded] in ([], [(0, "cap")])
        assert incidents(recorder) == exploded
        assert recorder.of_type(RecoveryApplied) == []
        assert not recorder.of_type(StepSkipped)
        for ours, theirs in zip(model.parameters(), plain.parameters(), strict=True):
            assert torch.equal(ours, theirs)

    async def test_nan_parameter_and_loss_restore_at_once(self) -> None:
        """A NaN parameter makes the loss NaN in the same step: restored right there, no LR cut."""
        model, opt, x, y = classifier()
        recorder = RecordingSink()
        async with session_for(model, opt, recorder) as session:
            await train(session, model, opt, x, y, 60, nan_param_at=(30,))
        applied = [(a.step, a.action) for a in recorder.of_type(RecoveryApplied)]
        assert (30, RecoveryAction.RESTORE_STATE) in applied
        assert all(a is not RecoveryAction.SCALE_LR for _, a in applied)
        roles = {e.role for e in recorder.of_type(NonFiniteDetected) if e.step == 30}
        assert TensorRole.PARAMETER in roles
        assert all_finite(model)
        assert opt.param_groups[0]["lr"] == pytest.approx(3e-3)

    async def test_a_run_of_bad_batches_is_skipped_never_stopped(self) -> None:
        """Twenty NaN batches in a row: all skipped, one precautionary restore, no stop."""
        model, opt, x, y = classifier()
        recorder = RecordingSink()
        bad = tuple(range(40, 60))
        async with session_for(model, opt, recorder) as session:
            await train(session, model, opt, x, y, 80, nan_loss_at=bad)
        skipped = sorted({e.step for e in recorder.of_type(StepSkipped) if e.step is not None})
        assert skipped == list(bad)
        restores = [
            a.step
            for a in recorder.of_type(RecoveryApplied)
            if a.action is RecoveryAction.RESTORE_STATE
        ]
        assert restores == [42]
        assert opt.param_groups[0]["lr"] == pytest.approx(3e-3)
        assert all_finite(model)

    async def test_non_finite_state_without_a_good_state_stops(self) -> None:
        """A NaN parameter before any good step cannot be brought back: TrainingStopped."""
        model, opt, x, y = classifier()
        recorder = RecordingSink()
        with pytest.raises(TrainingStopped, match="no good state"):
            async with session_for(model, opt, recorder) as session:
                await train(session, model, opt, x, y, 5, nan_param_at=(0,))

    async def test_batchnorm_buffers_are_checked_and_restored(self) -> None:
        """A NaN batch poisons BatchNorm's running stats: reported as a buffer and restored."""
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        recorder = RecordingSink()
        async with session_for(model, opt, recorder) as session:
            for step in range(30):
                xb = torch.randn(32, 8)
                if step == 20:
                    xb[0, 0] = math.nan
                loss = model(xb).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                if (await session.check_step(step, loss=loss)).should_step:
                    opt.step()
                await session.step_completed(step)
        roles = {e.role for e in recorder.of_type(NonFiniteDetected) if e.step == 20}
        assert TensorRole.BUFFER in roles
        bn = model[1]
        assert isinstance(bn, nn.BatchNorm1d) and bn.running_mean is not None
        assert bool(torch.isfinite(bn.running_mean).all())

    async def test_observe_never_acts(self) -> None:
        """policy='observe': the NaN step is reported, nothing is applied, the loop decides."""
        model, opt, x, y = classifier()
        recorder = RecordingSink()
        async with session_for(model, opt, recorder, policy="observe") as session:
            gen = torch.Generator().manual_seed(0)
            idx = torch.randint(0, len(x), (16,), generator=gen)
            loss = nn.functional.cross_entropy(model(x[idx]), y[idx]) * math.nan
            loss.backward()  # type: ignore[no-untyped-call]
            verdict = await session.check_step(0, loss=loss)
        assert not verdict.finite and verdict.should_step
        assert recorder.of_type(NonFiniteDetected)
        assert recorder.of_type(RecoveryApplied) == []

    def test_unknown_policy_is_a_clear_error(self) -> None:
        """A misspelled policy names the valid ones."""
        with pytest.raises(ValueError, match="'observe', 'safe', 'aggressive'"):
            default_strategies("careful")
        assert default_strategies(RecoveryPolicy.OBSERVE) == []


class TestAmp:
    async def test_grad_scaler_overflows_are_step_skipped_not_incidents(self) -> None:
        """fp16 autocast + GradScaler('cpu') from a huge initial scale: overflows are routine."""
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
        recorder = RecordingSink()
        async with session_for(model, opt, recorder, scaler=scaler) as session:
            for step in range(40):
                xb = torch.randn(32, 16)
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = model(xb).float().pow(2).mean()
                opt.zero_grad()
                scaler.scale(loss).backward()
                verdict = await session.check_step(step, loss=loss)
                if verdict.should_step:
                    scaler.step(opt)
                scaler.update()
                await session.step_completed(step, loss=verdict.loss)
        skipped = recorder.of_type(StepSkipped)
        assert skipped, "the scaler never overflowed: raise init_scale"
        assert all(
            s.scale_before is not None
            and s.scale_after is not None
            and s.scale_after < s.scale_before
            for s in skipped
        )
        assert incidents(recorder) == []
        assert recorder.of_type(RecoveryApplied) == []
        assert all_finite(model)

    async def test_a_collapsing_scaler_is_an_incident(self) -> None:
        """Gradients that overflow at every scale: ScalerInTrouble once, no recovery action."""
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
        recorder = RecordingSink()
        async with session_for(model, opt, recorder, scaler=scaler) as session:
            for step in range(15):
                loss = model(torch.randn(8, 4)).pow(2).mean()
                opt.zero_grad()
                scaler.scale(loss).backward()
                with torch.no_grad():
                    model.weight.grad.fill_(math.inf)  # type: ignore[union-attr]
                verdict = await session.check_step(step, loss=loss)
                assert verdict.should_step and verdict.probe.overflow
                scaler.step(opt)
                scaler.update()
                await session.step_completed(step)
        trouble = recorder.of_type(ScalerInTrouble)
        assert len(trouble) == 1
        assert recorder.of_type(RecoveryApplied) == []


class TestLearningRate:
    async def test_session_hands_the_scheduler_to_the_safe_point(self) -> None:
        """Session(scheduler=...) reaches the safe point so LR decisions survive the schedule."""
        model, opt, _, _ = classifier()
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0)
        async with session_for(model, opt, RecordingSink(), scheduler=sched) as session:
            assert session.safe_point is not None
            assert session.safe_point.schedulers == (sched,)
        with pytest.raises(TypeError, match="LR scheduler"):
            session_for(model, opt, RecordingSink(), scheduler=object())

    async def test_temporary_lr_change_is_undone_after_healthy_steps(self) -> None:
        """A rollback's LR x0.5 for 5 healthy steps is undone at the fifth, scheduler included."""
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0)
        recorder = RecordingSink()
        from eventbus_debug import EventBus
        from eventbus_debug.events import LossSpiked

        async with EventBus() as bus:
            bus.subscribe(recorder)
            engine = RecoveryEngine(
                bus,
                strategies=[
                    StrategySpec(
                        strategy=RollbackOnLossSpike(rules=("spike",), lr_steps=5), on=LossSpiked
                    )
                ],
            )
            safe = SafePoint(engine, model, opt, schedulers=[sched])
            lrs = []
            for step in range(12):
                if step == 3:
                    bus.publish_nowait(
                        LossSpiked(step=3, loss=9.0, running_mean=1.0, ratio=9.0, rule="spike")
                    )
                await safe.before_optimizer_step(step)
                lrs.append(opt.param_groups[0]["lr"])
                opt.step()
                sched.step()
        assert lrs[3:8] == pytest.approx([0.05] * 5)
        assert lrs[8:] == pytest.approx([0.1] * 4)
        outcomes = [a.outcome for a in recorder.of_type(RecoveryApplied)]
        assert "restored" in outcomes


class TestVanishing:
    async def test_attention_key_bias_is_not_vanishing(self) -> None:
        """A key bias has a zero gradient by construction (softmax shift): never reported."""

        class Attention(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.q = nn.Linear(16, 16)
                self.k = nn.Linear(16, 16)
                self.v = nn.Linear(16, 16)
                self.out = nn.Linear(16, 1)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                scores = self.q(x) @ self.k(x).transpose(1, 2) / 4.0
                out: torch.Tensor = self.out((scores.softmax(-1) @ self.v(x)).mean(1))
                return out

        torch.manual_seed(0)
        model = Attention()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        recorder = RecordingSink()
        async with session_for(model, opt, recorder, level="advanced") as session:
            for step in range(60):
                x = torch.randn(8, 6, 16)
                loss = (model(x) - x.sum((1, 2)).unsqueeze(1) / 10).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                if (await session.check_step(step, loss=loss)).should_step:
                    opt.step()
                await session.step_completed(step)
        assert incidents(recorder) == []

    async def test_frozen_parameters_are_never_stalled(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        """At ADVANCED, frozen parameters are out of the update ratios (no 'stalled')."""
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
        for p in model[0].parameters():
            p.requires_grad_(False)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
        recorder = RecordingSink()
        from eventbus_debug.events import StepChecked

        async with session_for(model, opt, recorder, level="advanced") as session:
            for step in range(25):
                loss = model(torch.randn(16, 8)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                if (await session.check_step(step, loss=loss)).should_step:
                    opt.step()
                await session.step_completed(step)
        ratios = [e.update_ratios for e in recorder.of_type(StepChecked) if e.update_ratios]
        assert ratios and all(set(r) == {"2.weight", "2.bias"} for r in ratios)


class TestChecksInTheirPrecision:
    async def test_a_finite_float64_loss_of_1e39_is_finite(self) -> None:
        """The loss is checked in its own precision (1e39 overflows float32, not float64)."""
        model = nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        recorder = RecordingSink()
        async with session_for(model, opt, recorder, policy="observe") as session:
            loss = model(torch.ones(1, 2)).sum().double() * 0 + 1e39
            loss.backward()
            verdict = await session.check_step(0, loss=loss)
            python = await session.check_step(1, loss=1e39)
        assert verdict.finite and verdict.loss == 1e39
        assert python.finite


def test_default_safe_chain_has_no_stop_for_bad_batches() -> None:
    """The safe policy's non-finite loss/gradient strategy never declines (never exhausts)."""
    names = [s.name for s in default_strategies()]
    assert names[:3] == ["skip_non_finite", "restore_non_finite_state", "report_non_finite"]


class TestClipOnExplosion:
    @staticmethod
    def exploded(largest: float) -> GradientExploded:
        return GradientExploded(step=0, total_norm=3e8, threshold=1e6, largest=largest, rule="cap")

    def test_safe_never_clips_without_accepted_history(self) -> None:
        """min_ratio 100 with no accepted norm (largest 0): nothing shows the norm is 100x the
        run's scale, so it is reported, not clipped."""
        decided = ClipOnExplosion(min_ratio=100.0).decide(self.exploded(0.0), StrategyHistory())
        assert decided is not None and [d.action.kind for d in decided] == [RecoveryAction.CONTINUE]
        assert "no accepted norm" in decided[0].reason

    def test_safe_clips_far_beyond_the_accepted_history(self) -> None:
        """With history, a norm 100x the largest accepted one is clipped to the threshold."""
        decided = ClipOnExplosion(min_ratio=100.0).decide(self.exploded(1e4), StrategyHistory())
        assert decided is not None and decided[0].action.kind is RecoveryAction.CLIP_GRADIENTS

    def test_min_ratio_one_clips_at_the_cap_without_history(self) -> None:
        """min_ratio 1 clips every detected explosion, the first one included."""
        decided = ClipOnExplosion().decide(self.exploded(0.0), StrategyHistory())
        assert decided is not None and decided[0].action.kind is RecoveryAction.CLIP_GRADIENTS
