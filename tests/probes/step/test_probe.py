from __future__ import annotations

import math

import anyio
import pytest
import torch
from torch import nn

from eventbus_debug import Cadence, DebugLevel, EventBus, StepProbe, StepVerdict, Thresholds
from eventbus_debug.events import (
    GradientExploded,
    GradientVanished,
    LossSpiked,
    NonFiniteDetected,
    StepChecked,
    TensorRole,
)
from eventbus_debug.testing import capture_events
from tests._doubles import RecordingPublisher

from ..conftest import batch, grad_of, grads_of, linear_at, make_mlp


def mse_step(model: nn.Module, seed: int) -> torch.Tensor:
    x, y = batch(seed)
    loss = nn.functional.mse_loss(model(x), y)
    torch.autograd.backward(loss)
    return loss


class TestHealthyTraining:
    async def test_clean_steps_publish_telemetry_only(
        self, bus: EventBus, mlp: nn.Sequential
    ) -> None:
        """A healthy loop publishes one StepChecked per step with the exact total norm."""
        probe = StepProbe(mlp, bus)
        opt = torch.optim.SGD(mlp.parameters(), lr=0.01)
        with anyio.fail_after(10):
            async with capture_events(bus) as events:
                for step in range(5):
                    loss = mse_step(mlp, step)
                    expected = torch.nn.utils.get_total_norm(grads_of(mlp))
                    verdict = await probe.check_step(step, loss=loss)
                    assert verdict.ok and verdict.finite
                    assert verdict.grad_norm == pytest.approx(expected.item(), rel=1e-5)
                    assert verdict.loss == pytest.approx(loss.item())
                    opt.step()
                    opt.zero_grad()
        assert [type(e) for e in events] == [StepChecked] * 5
        assert [e.step for e in events] == list(range(5))
        first, second = events[0], events[1]
        assert isinstance(first, StepChecked) and isinstance(second, StepChecked)
        assert first.param_norm is not None and second.param_norm is None  # every 10


class TestNonFinite:
    async def test_nan_gradient_from_sqrt_at_zero_is_named(
        self, bus: EventBus, mlp: nn.Sequential
    ) -> None:
        """sqrt at 0 in the forward makes 0.weight's gradient NaN: named, counted, not the loss."""
        probe = StepProbe(mlp, bus)
        x, y = batch(0)
        loss = (
            nn.functional.mse_loss(mlp(x), y) + torch.sqrt(linear_at(mlp, 0).weight[0, 0] * 0).sum()
        )
        torch.autograd.backward(loss)
        async with capture_events(bus, NonFiniteDetected) as events:
            verdict = await probe.check_step(7, loss=loss)
        assert not verdict.finite and verdict.fired == ("non_finite_detected",)
        (event,) = events
        assert isinstance(event, NonFiniteDetected)
        assert event.step == 7 and event.role is TensorRole.GRADIENT
        assert event.names == ("0.weight",) and event.nan_count == 1 and event.inf_count == 0

    async def test_log_zero_loss_is_reported_as_loss(
        self, bus: EventBus, mlp: nn.Sequential
    ) -> None:
        """log(0) in the loss: the loss itself is reported, with its NaN/Inf count."""
        probe = StepProbe(mlp, bus)
        x, _ = batch(1)
        loss = torch.log(mlp(x).sum() * 0)
        torch.autograd.backward(loss)
        async with capture_events(bus, NonFiniteDetected) as events:
            verdict = await probe.check_step(3, loss=loss)
        roles = {e.role for e in events if isinstance(e, NonFiniteDetected)}
        assert TensorRole.LOSS in roles and not verdict.finite
        loss_event = next(
            e for e in events if isinstance(e, NonFiniteDetected) and e.role is TensorRole.LOSS
        )
        assert loss_event.inf_count == 1 and loss_event.names == ("loss",)

    async def test_inf_parameter_found_on_parameter_steps(
        self, bus: EventBus, mlp: nn.Sequential
    ) -> None:
        """An Inf written into a parameter is reported with role PARAMETER and its name."""
        probe = StepProbe(mlp, bus, cadence=Cadence(param_every=2))
        with torch.no_grad():
            linear_at(mlp, 2).bias[0] = math.inf
        async with capture_events(bus, NonFiniteDetected) as events:
            await probe.check_step(2)
        (event,) = [e for e in events if isinstance(e, NonFiniteDetected)]
        assert event.role is TensorRole.PARAMETER and event.names == ("2.bias",)

    async def test_fp16_overflow(self, bus: EventBus) -> None:
        """fp16 activations overflow to Inf; the loss and gradients are reported non-finite."""
        torch.manual_seed(0)
        model = nn.Linear(4, 4).half()
        x = torch.full((2, 4), 60000.0, dtype=torch.float16)
        loss = model(x).float().pow(2).sum()
        torch.autograd.backward(loss)
        probe = StepProbe(model, bus)
        verdict = await probe.check_step(0, loss=loss)
        assert not verdict.finite and "non_finite_detected" in verdict.fired


class TestExplosionAndVanishing:
    async def test_too_high_learning_rate_explodes(self, bus: EventBus) -> None:
        """After 5 steps at a sane LR, LR=3 diverges and the growth rule fires before NaN."""
        model = make_mlp()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        probe = StepProbe(model, bus)
        async with capture_events(bus, GradientExploded) as events:
            for step in range(30):
                if step == 5:
                    opt.param_groups[0]["lr"] = 3.0
                verdict = await probe.check_step(step, loss=mse_step(model, 0))
                opt.step()
                opt.zero_grad()
                if events or not verdict.finite:
                    break
        assert events, "divergence was not reported"
        first = events[0]
        assert isinstance(first, GradientExploded) and first.step is not None and first.step > 5
        assert first.total_norm > first.threshold
        assert first.top and first.top[0][1] == max(n for _, n in first.top)

    async def test_fixed_cap(self, bus: EventBus, mlp: nn.Sequential) -> None:
        """A fixed cap fires from the first step, naming the largest gradients first."""
        probe = StepProbe(mlp, bus, thresholds=Thresholds(explosion=1e-3, top_k=2))
        verdict = await probe.check_step(0, loss=mse_step(mlp, 0))
        assert verdict.fired == ("gradient_exploded",)

    async def test_dead_from_init_is_not_vanishing(self, bus: EventBus) -> None:
        """Layers that never had a gradient (zero by construction) are not reported as dead."""
        model = make_mlp()
        with torch.no_grad():
            linear_at(model, 0).weight.zero_()
            linear_at(model, 0).bias.fill_(-1.0)
        probe = StepProbe(model, bus)
        async with capture_events(bus, GradientVanished) as events:
            for step in range(12):
                await probe.check_step(step, loss=mse_step(model, step))
                model.zero_grad()
        assert events == []

    async def test_all_zero_gradients(self, bus: EventBus, mlp: nn.Sequential) -> None:
        """A loss that does not depend on the output: every gradient is zero."""
        probe = StepProbe(mlp, bus)
        x, _ = batch(0)
        torch.autograd.backward(mlp(x).sum() * 0)
        async with capture_events(bus, GradientVanished) as events:
            await probe.check_step(0)
        assert isinstance(events[0], GradientVanished) and events[0].all_zero
        assert events[0].mean_abs == 0.0


class TestLossSpike:
    async def test_spike_and_sustained_rules(self, bus: EventBus, mlp: nn.Sequential) -> None:
        """A 5x jump is a 'spike'; five 4x losses in a row end in one 'sustained'."""
        probe = StepProbe(mlp, bus, cadence=Cadence(grad_every=1000, param_every=1000))
        losses = [1.0] * 10 + [5.0] + [1.0] * 2 + [4.0] * 5 + [4.0] * 3
        async with capture_events(bus, LossSpiked) as events:
            for step, value in enumerate(losses):
                await probe.check_step(step, loss=value)
        spikes = [e for e in events if isinstance(e, LossSpiked)]
        assert [(e.step, e.rule) for e in spikes] == [
            (10, "spike"),
            (13, "spike"),
            (14, "spike"),
            (15, "spike"),
            (16, "spike"),
            (17, "sustained"),
        ]  # after "sustained" the baseline is the new level: 18-20 are not spikes
        assert spikes[0].running_mean == pytest.approx(1.0) and spikes[0].ratio == pytest.approx(
            5.0
        )

    async def test_rebaseline_forgets_the_window(self, bus: EventBus, mlp: nn.Sequential) -> None:
        """After rebaseline() (a restore) a higher loss level is the new baseline, not a spike."""
        probe = StepProbe(mlp, bus, cadence=Cadence(grad_every=1000, param_every=1000))
        async with capture_events(bus, LossSpiked) as events:
            for step in range(10):
                await probe.check_step(step, loss=0.1)
            probe.rebaseline()
            for step in range(10, 20):
                await probe.check_step(step, loss=1.0)
        assert events == []


class TestModes:
    async def test_deferred_gives_the_same_verdicts_one_step_late(self, bus: EventBus) -> None:
        """Deferred mode returns step N's verdict at step N+1, equal to the immediate one."""
        a, b = make_mlp(), make_mlp()
        now, late = StepProbe(a, bus), StepProbe(b, bus, deferred=True)
        immediate: list[StepVerdict] = []
        deferred: list[StepVerdict | None] = []
        for step in range(4):
            la, lb = mse_step(a, step), mse_step(b, step)
            if step == 2:
                with torch.no_grad():
                    grad_of(linear_at(a, 0).weight)[0, 0] = math.nan
                    grad_of(linear_at(b, 0).weight)[0, 0] = math.nan
            immediate.append(await now.check_step(step, loss=la))
            deferred.append(await late.check_step(step, loss=lb))
            a.zero_grad()
            b.zero_grad()
        deferred.append(await late.flush())
        assert deferred[0] is not None and not deferred[0].checked
        for x, y in zip(immediate, deferred[1:], strict=True):
            assert y is not None and y.deferred and x.step == y.step
            assert (x.finite, x.fired, x.grad_norm) == (y.finite, y.fired, y.grad_norm) or (
                math.isnan(x.grad_norm or 0.0) and not y.finite and x.fired == y.fired
            )
        assert not immediate[2].finite

    async def test_levels_change_between_steps(self, bus: EventBus, mlp: nn.Sequential) -> None:
        """OFF checks nothing; ADVANCED adds per-layer norms and update ratios; EXTREME dead units."""
        probe = StepProbe(mlp, bus, level=DebugLevel.OFF)
        opt = torch.optim.SGD(mlp.parameters(), lr=0.1)
        async with capture_events(bus, StepChecked) as events:
            v0 = await probe.check_step(0, loss=mse_step(mlp, 0))
            opt.zero_grad()
            probe.level = DebugLevel.ADVANCED
            await probe.check_step(10, loss=mse_step(mlp, 1))  # update ratio snapshot taken
            opt.step()
            opt.zero_grad()
            await probe.check_step(11, loss=mse_step(mlp, 2))
            opt.zero_grad()
            probe.level = DebugLevel.EXTREME
            await probe.check_step(12, loss=mse_step(mlp, 3))
            probe.level = DebugLevel.BASIC
        assert not v0.checked
        checked = [e for e in events if isinstance(e, StepChecked)]
        assert [e.step for e in checked] == [10, 11, 12]
        assert set(checked[0].layer_grad_norms) == set(probe.parameter_names)
        ratios = checked[1].update_ratios
        assert set(ratios) == set(probe.parameter_names) and all(r > 0 for r in ratios.values())
        assert (
            set(checked[2].dead_fractions) == {"1"} and 0.0 <= checked[2].dead_fractions["1"] <= 1.0
        )
        assert not probe.activation_hooks_armed  # BASIC removed the EXTREME hooks


class TestModelShapes:
    async def test_tied_frozen_sparse_and_mixed_dtypes(self, bus: EventBus) -> None:
        """Tied weights once, frozen/unused params skipped, sparse and fp64 grads included."""

        class Net(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.emb = nn.Embedding(10, 4, sparse=True)
                self.out = nn.Linear(4, 10, bias=False)
                self.out.weight = nn.Parameter(torch.randn(10, 4))
                self.tied = self.out  # the same module twice: its weight counted once
                self.frozen = nn.Linear(4, 4)
                self.frozen.requires_grad_(False)
                self.unused = nn.Linear(4, 4)
                self.extra = nn.Parameter(torch.randn(3, dtype=torch.float64))

            def forward(self, idx: torch.Tensor) -> torch.Tensor:
                logits: torch.Tensor = self.tied(self.frozen(self.emb(idx)))
                return logits.sum() + self.extra.sum().float()

        torch.manual_seed(0)
        model = Net()
        loss = model(torch.tensor([1, 2, 2]))
        torch.autograd.backward(loss)
        probe = StepProbe(model, bus)
        names = probe.parameter_names
        assert names.count("out.weight") == 1 and "tied.weight" not in names
        verdict = await probe.check_step(0, loss=loss)
        grads = [
            grad_of(model.emb.weight).to_dense(),
            grad_of(model.out.weight),
            grad_of(model.extra),
        ]
        expected = math.sqrt(sum(g.double().pow(2).sum().item() for g in grads))
        assert verdict.grad_norm == pytest.approx(expected, rel=1e-5) and verdict.finite

    async def test_model_without_parameters(self, bus: EventBus) -> None:
        """A parameterless model checks only its loss."""
        probe = StepProbe(nn.ReLU(), bus)
        verdict = await probe.check_step(0, loss=torch.tensor(0.5))
        assert verdict.checked and verdict.grad_norm is None and verdict.loss == 0.5


class TestBadInput:
    @pytest.mark.parametrize(
        ("step", "loss", "error", "match"),
        [
            ("1", None, TypeError, "step must be an int"),
            (True, None, TypeError, "step must be an int"),
            (-1, None, ValueError, "step must be >= 0"),
            (2**63, None, ValueError, r"step must fit in 64 bits .*got 9223372036854775808"),
            (0, torch.ones(3), ValueError, "scalar tensor"),
            (0, torch.tensor(1 + 2j), TypeError, "loss must be real, got a torch.complex64"),
            (0, "0.5", TypeError, "loss must be"),
        ],
    )
    async def test_rejected(
        self, mlp: nn.Sequential, step: object, loss: object, error: type[Exception], match: str
    ) -> None:
        """Bad steps and losses raise with a message naming what was wrong."""
        probe = StepProbe(mlp)
        with pytest.raises(error, match=match):
            await probe.check_step(step, loss=loss)  # type: ignore[arg-type]

    def test_bad_constructor_arguments(self, mlp: nn.Sequential) -> None:
        """A non-module, a non-bus and bad thresholds are rejected at construction."""
        with pytest.raises(TypeError, match="model must be"):
            StepProbe("model")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="bus must be"):
            StepProbe(mlp, object())  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="vanishing must be"):
            Thresholds(vanishing=-1.0)
        with pytest.raises(ValueError, match="param_every must be"):
            Cadence(param_every=0)
        with pytest.raises(TypeError, match="level must be"):
            StepProbe(mlp).level = 1  # type: ignore[assignment]
        with pytest.raises(ValueError, match="level must be one of"):
            StepProbe(mlp).level = "loud"


class TestEntries:
    @pytest.mark.asyncio_only("asyncio's FIFO scheduling (trio shuffles a batch of ready tasks)")
    async def test_checkpoint_false_never_yields(self, mlp: nn.Sequential) -> None:
        """check_step(checkpoint=False) lets no other task run; the default yields once."""
        probe = StepProbe(mlp)
        ran: list[int] = []

        async def other() -> None:
            ran.append(1)

        async with anyio.create_task_group() as tg:
            tg.start_soon(other)
            await probe.check_step(0, loss=mse_step(mlp, 0), checkpoint=False)
            assert ran == []
            await probe.check_step(1, loss=mse_step(mlp, 1))
            assert ran == [1]

    def test_sync_entry(self, mlp: nn.Sequential) -> None:
        """check_step_sync checks without an event loop; `_nowait` names are not used (it may wait)."""
        probe = StepProbe(mlp)
        verdict = probe.check_step_sync(0, loss=mse_step(mlp, 0))
        assert verdict.checked and verdict.finite
        assert not hasattr(StepProbe, "check_step_nowait")
        assert not hasattr(StepProbe, "flush_nowait")

    def test_any_publisher_receives_the_events(self, mlp: nn.Sequential) -> None:
        """A Publisher that is not a bus gets the incidents and the telemetry, in order."""
        sink = RecordingPublisher()
        probe = StepProbe(mlp, sink)
        mse_step(mlp, 0)
        with torch.no_grad():
            grad_of(linear_at(mlp, 0).weight)[0, 0] = math.nan
        probe.check_step_sync(0, loss=1.0)
        assert [type(e) for e in sink.events] == [NonFiniteDetected, StepChecked]

    def test_offload_numel_must_be_positive(self, mlp: nn.Sequential) -> None:
        """offload_numel is validated with the other arguments."""
        with pytest.raises(ValueError, match="offload_numel must be an int >= 1"):
            StepProbe(mlp, offload_numel=0)


class TestDeviceSide:
    def test_deferred_reads_only_what_arrived_and_waits_past_the_limit(
        self, mlp: nn.Sequential, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A step whose copy is not done is read later; past MAX_IN_FLIGHT the oldest is read."""
        from eventbus_debug.probes.step import _launch, probe as probe_module

        monkeypatch.setattr(_launch.Pending, "ready", lambda self: False)
        probe = StepProbe(mlp, deferred=True)
        limit = probe_module.MAX_IN_FLIGHT
        verdicts = [probe.check_step_sync(s, loss=mse_step(mlp, s)) for s in range(limit + 3)]
        assert all(not v.checked for v in verdicts[:limit])
        assert [v.step for v in verdicts[limit:]] == [0, 1, 2]
        flushed = probe.flush_sync()
        assert flushed is not None and flushed.step == limit + 2 and flushed.deferred
        assert probe.flush_sync() is None

    async def test_extreme_update_ratios_are_the_real_ones(self, mlp: nn.Sequential) -> None:
        """‖Δw‖/‖w‖ per parameter between two EXTREME steps, from the persistent snapshot."""
        sink = RecordingPublisher()
        probe = StepProbe(mlp, sink, level=DebugLevel.EXTREME)
        opt = torch.optim.SGD(mlp.parameters(), lr=0.1)
        probe.check_step_sync(0, loss=mse_step(mlp, 0))
        before = [p.detach().clone() for p in mlp.parameters()]
        opt.step()
        opt.zero_grad()
        after = [p.detach().clone() for p in mlp.parameters()]
        for step in (1, 2):
            probe.check_step_sync(step, loss=mse_step(mlp, step))
            opt.step()
            opt.zero_grad()
        checked = [e for e in sink.events if isinstance(e, StepChecked)]
        want = {
            name: ((a - b).norm() / b.norm()).item()
            for name, a, b in zip(probe.parameter_names, after, before, strict=True)
        }
        assert checked[1].update_ratios == pytest.approx(want, rel=1e-4)
        assert set(checked[2].update_ratios) == set(want)
        assert set(checked[1].dead_fractions) == {"1"}

    def test_tiny_gradients_vanish_after_patience(self, mlp: nn.Sequential) -> None:
        """Non-zero gradients with a mean |grad| under the threshold fire once, after patience."""
        sink = RecordingPublisher()
        probe = StepProbe(
            mlp,
            sink,
            cadence=Cadence(vanishing_every=1),
            thresholds=Thresholds(vanishing_patience=3, vanishing=1e-3),
        )
        for step in range(8):
            loss = mse_step(mlp, step)
            with torch.no_grad():
                for p in mlp.parameters():
                    grad_of(p).mul_(1e-6)
            probe.check_step_sync(step, loss=loss)
            mlp.zero_grad()
        fired = [e for e in sink.events if isinstance(e, GradientVanished)]
        mean_abs = fired[0].mean_abs if len(fired) == 1 else None
        assert mean_abs is not None and not fired[0].all_zero and mean_abs < 1e-3

    def test_fused_parameter_norms_sit_after_the_mean_abs_pass(self, mlp: nn.Sequential) -> None:
        """Step 0 runs gradients, mean |grad| and parameters in one plan: each value is right."""
        probe = StepProbe(mlp)
        loss = mse_step(mlp, 0)
        verdict = probe.check_step_sync(0, loss=loss)
        params = torch.nn.utils.get_total_norm([p.detach() for p in mlp.parameters()])
        grads = torch.nn.utils.get_total_norm(grads_of(mlp))
        assert verdict.param_norm == pytest.approx(params.item(), rel=1e-5)
        assert verdict.grad_norm == pytest.approx(grads.item(), rel=1e-5)

    def test_scaled_gradients_are_judged_unscaled(self, mlp: nn.Sequential) -> None:
        """Under a GradScaler the norm is the unscaled one, divided on the device."""
        opt = torch.optim.SGD(mlp.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        probe = StepProbe(mlp, scaler=scaler, optimizer=opt)
        x, y = batch(0)
        loss = nn.functional.mse_loss(mlp(x), y)
        scaler.scale(loss).backward()  # type: ignore[no-untyped-call]
        verdict = probe.check_step_sync(0, loss=loss)
        unscaled = torch.nn.utils.get_total_norm(grads_of(mlp)).item() / 1024.0
        assert verdict.grad_norm == pytest.approx(unscaled, rel=1e-5) and verdict.ok

    def test_source_is_stamped_and_assignable(self, mlp: nn.Sequential) -> None:
        """Events carry the probe's source; assigning a new one applies to the next step."""
        sink = RecordingPublisher()
        probe = StepProbe(mlp, sink, source="first")
        probe.check_step_sync(0, loss=mse_step(mlp, 0))
        probe.source = "second"
        probe.check_step_sync(1, loss=mse_step(mlp, 1))
        assert [e.source for e in sink.events] == ["first", "second"]
