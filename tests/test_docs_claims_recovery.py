"""Prose claims of docs/recovery.md, alerts.md, integrations.md, seed-mapping.md and the README,
each checked by one test named after the claim."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from torch import nn

from eventbus_debug import (
    CallState,
    EventBus,
    RecoveryEngine,
    SafePoint,
    SyncEventBus,
    TrainingStopped,
    retrying,
)
from eventbus_debug.events import (
    ErrorRaised,
    GradientExploded,
    LossSpiked,
    MemoryLeakSuspected,
    NonFiniteDetected,
    RecoveryAction,
    RecoveryApplied,
    StepSkipped,
    TensorRole,
)
from eventbus_debug.recovery import (
    StateSnapshots,
    default_strategies,
    scale_learning_rate,
)
from eventbus_debug.testing import RecordingSink

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture
def sync_bus() -> Iterator[SyncEventBus]:
    with SyncEventBus() as bus:
        yield bus


def _nan(step: int, role: TensorRole = TensorRole.LOSS) -> NonFiniteDetected:
    return NonFiniteDetected(step=step, role=role, names=(role.value,))


def _kinds(decided: Any) -> list[RecoveryAction]:
    return [d.kind for d in decided]


def _model() -> tuple[nn.Sequential, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _backward(model: nn.Module) -> None:
    model.zero_grad()
    model(torch.randn(8, 4)).pow(2).mean().backward()


# --- policies ------------------------------------------------------------------------------


def test_policy_observe_has_no_strategies() -> None:
    assert default_strategies("observe") == []


def test_policy_safe_strategies_in_documented_order() -> None:
    assert [s.name for s in default_strategies("safe")] == [
        "skip_non_finite",
        "restore_non_finite_state",
        "report_non_finite",
        "clip_gradients",
        "report_vanishing",
        "free_memory_on_leak",
        "shrink_batch_on_oom",
        "data_loading_fallback",
        "model_loading_fallback",
    ]


def test_policy_aggressive_strategies_in_documented_order() -> None:
    names = [s.name for s in default_strategies("aggressive")]
    assert names[:6] == [
        "skip_non_finite",
        "restore_non_finite_state",
        "restore_and_lower_lr",
        "report_non_finite",
        "clip_gradients",
        "rollback_on_loss_spike",
    ]
    assert names[6:] == [
        "report_vanishing",
        "free_memory_on_leak",
        "shrink_batch_on_oom",
        "data_loading_fallback",
        "model_loading_fallback",
    ]


def test_policy_name_invalid_is_value_error_naming_policy(sync_bus: SyncEventBus) -> None:
    with pytest.raises(ValueError, match="policy"):
        RecoveryEngine(sync_bus, policy="careful")


def test_safe_skip_non_finite_restores_at_third_in_a_row_and_never_stops(
    sync_bus: SyncEventBus,
) -> None:
    engine = RecoveryEngine(sync_bus)
    runs = [_kinds(engine.decide(_nan(step))) for step in range(12)]
    assert runs[0] == [RecoveryAction.SKIP_STEP]
    assert runs[1] == [RecoveryAction.SKIP_STEP]
    assert runs[2] == [RecoveryAction.RESTORE_STATE, RecoveryAction.SKIP_STEP]
    assert all(r == [RecoveryAction.SKIP_STEP] for r in runs[3:])
    restore = engine.decide(_nan(20))
    assert restore  # still skipping
    assert engine.stop_reason is None


def test_safe_precautionary_restore_is_not_required(sync_bus: SyncEventBus) -> None:
    engine = RecoveryEngine(sync_bus)
    decided = [engine.decide(_nan(step)) for step in range(3)][-1]
    restore = next(d for d in decided if d.kind is RecoveryAction.RESTORE_STATE)
    action: Any = restore.action
    assert not action.required


def test_safe_restore_non_finite_parameter_three_in_a_row_then_stop(
    sync_bus: SyncEventBus,
) -> None:
    engine = RecoveryEngine(sync_bus)
    runs = [_kinds(engine.decide(_nan(step, TensorRole.PARAMETER))) for step in range(4)]
    assert runs[:3] == [[RecoveryAction.RESTORE_STATE]] * 3  # no LR change
    assert runs[3] == [RecoveryAction.STOP]
    assert engine.stop_reason is not None


def test_safe_restore_non_finite_buffer_too(sync_bus: SyncEventBus) -> None:
    engine = RecoveryEngine(sync_bus)
    (d,) = engine.decide(_nan(0, TensorRole.BUFFER))
    assert d.kind is RecoveryAction.RESTORE_STATE and d.strategy == "restore_non_finite_state"


@pytest.mark.parametrize("role", [TensorRole.INPUT, TensorRole.OUTPUT, TensorRole.ACTIVATION])
def test_safe_report_non_finite_input_output_activation_continue(
    sync_bus: SyncEventBus, role: TensorRole
) -> None:
    engine = RecoveryEngine(sync_bus)
    (d,) = engine.decide(_nan(0, role))
    assert d.kind is RecoveryAction.CONTINUE and d.strategy == "report_non_finite"


def test_safe_clip_only_at_100x_largest_accepted(sync_bus: SyncEventBus) -> None:
    engine = RecoveryEngine(sync_bus)
    below = engine.decide(GradientExploded(step=0, total_norm=99.0, threshold=10.0, largest=1.0))
    at = engine.decide(GradientExploded(step=1, total_norm=100.0, threshold=10.0, largest=1.0))
    assert _kinds(below) == [RecoveryAction.CONTINUE]
    assert _kinds(at) == [RecoveryAction.CLIP_GRADIENTS]
    clip: Any = at[0].action
    assert clip.max_norm == 10.0  # the probe threshold


def test_safe_clip_never_without_an_accepted_norm(sync_bus: SyncEventBus) -> None:
    engine = RecoveryEngine(sync_bus)
    d = engine.decide(GradientExploded(step=0, total_norm=1e12, threshold=10.0, largest=0.0))
    assert _kinds(d) == [RecoveryAction.CONTINUE]


def test_safe_loss_spikes_reported_without_action(sync_bus: SyncEventBus) -> None:
    engine = RecoveryEngine(sync_bus)
    for rule in ("spike", "sustained"):
        spike = LossSpiked(step=0, loss=100.0, running_mean=1.0, ratio=100.0, rule=rule)
        assert _kinds(engine.decide(spike)) in ([], [RecoveryAction.CONTINUE])
    assert engine.stop_reason is None


def test_safe_free_memory_on_leak_three_times_then_report(sync_bus: SyncEventBus) -> None:
    engine = RecoveryEngine(sync_bus)
    leak = [
        _kinds(engine.decide(MemoryLeakSuspected(step=s, resource="rss", slope=1.0, window=10)))
        for s in range(5)
    ]
    assert leak[:3] == [[RecoveryAction.FREE_MEMORY]] * 3
    assert leak[3:] == [[RecoveryAction.CONTINUE]] * 2


def test_safe_shrink_batch_on_oom_halves_with_floor_one(sync_bus: SyncEventBus) -> None:
    from eventbus_debug.events.recovery import CallSettings

    engine = RecoveryEngine(sync_bus)
    oom = torch.OutOfMemoryError("CUDA out of memory")
    sizes = []
    for size in (64, 3, 1):
        ev = engine.error_event(oom, settings=CallSettings(batch_size=size), retry_id=f"r{size}")
        sizes.append([(d.kind, getattr(d.action, "size", None)) for d in engine.decide(ev)])
    assert sizes[0] == [(RecoveryAction.SHRINK_BATCH, 32)]
    assert sizes[1] == [(RecoveryAction.SHRINK_BATCH, 1)]
    assert sizes[2] == [(RecoveryAction.STOP, None)]  # the floor: exhausted


def test_safe_data_loading_fallback_order(sync_bus: SyncEventBus) -> None:
    from eventbus_debug.events import ErrorCategory
    from eventbus_debug.events.recovery import CallSettings

    engine = RecoveryEngine(sync_bus)
    state: dict[str, Any] = {"num_workers": 4, "pin_memory": True}
    seen = []
    for attempt in (1, 2, 3):
        ev = ErrorRaised(
            error_type="RuntimeError",
            message="DataLoader worker (pid 1) exited unexpectedly",
            category=ErrorCategory.DATA,
            attempt=attempt,
            settings=CallSettings(**state),
            retry_id="d",
        )
        (d,) = engine.decide(ev)
        act: Any = d.action
        seen.append((act.num_workers, act.pin_memory))
        if act.num_workers is not None:
            state["num_workers"] = act.num_workers
        if act.pin_memory is not None:
            state["pin_memory"] = act.pin_memory
    assert seen == [(2, None), (None, False), (0, None)]


def test_aggressive_clip_every_explosion_and_lr_halved_every_third(
    sync_bus: SyncEventBus,
) -> None:
    engine = RecoveryEngine(sync_bus, policy="aggressive")
    runs = [
        engine.decide(GradientExploded(step=s, total_norm=20.0, threshold=10.0, largest=15.0))
        for s in range(3)
    ]
    assert [_kinds(r) for r in runs[:2]] == [[RecoveryAction.CLIP_GRADIENTS]] * 2
    assert _kinds(runs[2]) == [RecoveryAction.CLIP_GRADIENTS, RecoveryAction.SCALE_LR]
    lr: Any = runs[2][1].action
    assert lr.factor == 0.5 and lr.steps == 200


def test_aggressive_rollback_on_single_spike(sync_bus: SyncEventBus) -> None:
    engine = RecoveryEngine(sync_bus, policy="aggressive")
    spike = LossSpiked(step=0, loss=100.0, running_mean=1.0, ratio=100.0, rule="spike")
    assert _kinds(engine.decide(spike)) == [
        RecoveryAction.RESTORE_STATE,
        RecoveryAction.SKIP_STEP,
        RecoveryAction.SCALE_LR,
    ]


def test_aggressive_restore_and_lower_lr_after_three_skips(sync_bus: SyncEventBus) -> None:
    engine = RecoveryEngine(sync_bus, policy="aggressive")
    runs = [_kinds(engine.decide(_nan(s))) for s in range(4)]
    assert runs[:3] == [[RecoveryAction.SKIP_STEP]] * 3
    assert runs[3] == [RecoveryAction.RESTORE_STATE, RecoveryAction.SCALE_LR]


# --- registration --------------------------------------------------------------------------


def test_register_latest_first_and_first_false_appends(sync_bus: SyncEventBus) -> None:
    engine = RecoveryEngine(sync_bus)

    def a(incident: object, history: object) -> None:
        return None

    def b(incident: object, history: object) -> None:
        return None

    def c(incident: object, history: object) -> None:
        return None

    engine.register(a, on=LossSpiked)
    engine.register(b, on=LossSpiked)
    engine.register(c, on=LossSpiked, first=False)
    names = engine.strategy_names
    assert names[:2] == ("b", "a") and names[-1] == "c"


def test_strategy_that_raises_is_reported_and_next_tried() -> None:
    async def main() -> None:
        log = RecordingSink()
        async with EventBus() as bus:
            bus.subscribe(log, ErrorRaised)
            engine = RecoveryEngine(bus)

            def broken(incident: object, history: object) -> None:
                raise RuntimeError("boom")

            engine.register(broken, on=NonFiniteDetected)
            decided = engine.decide(_nan(0))
            await bus.drain()
        assert _kinds(decided) == [RecoveryAction.SKIP_STEP]
        (err,) = log.of_type(ErrorRaised)
        assert err.source == "recovery" and "boom" in err.message

    anyio.run(main)


@pytest.mark.parametrize(
    ("kwargs", "arg"),
    [({"max_attempts": 0}, "max_attempts"), ({"max_consecutive": -1}, "max_consecutive")],
)
def test_invalid_configuration_names_argument(
    sync_bus: SyncEventBus, kwargs: dict[str, Any], arg: str
) -> None:
    engine = RecoveryEngine(sync_bus)
    with pytest.raises((ValueError, TypeError), match=arg):
        engine.register(lambda i, h: None, on=LossSpiked, **kwargs)


def test_register_on_empty_is_value_error_naming_on(sync_bus: SyncEventBus) -> None:
    engine = RecoveryEngine(sync_bus)
    with pytest.raises(ValueError, match="on"):
        engine.register(lambda i, h: None, on=())


# --- the safe point ------------------------------------------------------------------------


def _queue(engine: RecoveryEngine, *decisions: object) -> None:
    """Queue decisions on *engine* as a registered strategy would (one incident)."""
    engine.register(lambda i, h: list(decisions), on=LossSpiked, name="test_strategy")  # type: ignore[arg-type]
    engine.decide(LossSpiked(step=0, loss=9.0, running_mean=1.0, ratio=9.0, rule="spike"))


def _applied(log: RecordingSink) -> list[RecoveryApplied]:
    return list(log.of_type(RecoveryApplied))


def test_safepoint_skip_step_zeroes_gradients_and_publishes_step_skipped(
    sync_bus: SyncEventBus,
) -> None:
    from eventbus_debug.recovery import SkipStep
    from eventbus_debug.recovery.actions import Decision

    log = RecordingSink()
    sync_bus.subscribe(log)
    model, opt = _model()
    engine = RecoveryEngine(sync_bus)
    safe = SafePoint(engine, model, opt)
    _backward(model)
    _queue(engine, Decision(action=SkipStep(), reason="test"))
    decision = safe.before_optimizer_step_sync(0)
    sync_bus.drain()
    assert not decision.should_step
    assert all(p.grad is None for p in model.parameters())
    assert [e.step for e in log.of_type(StepSkipped)] == [0]
    assert _applied(log)[-1].detail == "optimizer step 0 skipped, gradients zeroed"


def test_restore_keeps_current_learning_rates(sync_bus: SyncEventBus) -> None:
    from eventbus_debug.recovery import RestoreState
    from eventbus_debug.recovery.actions import Decision

    model, opt = _model()
    engine = RecoveryEngine(sync_bus)
    safe = SafePoint(engine, model, opt, snapshots=StateSnapshots(every=1))
    _backward(model)
    assert safe.before_optimizer_step_sync(0).should_step  # captures at lr 0.1
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    opt.param_groups[0]["lr"] = 0.01  # a scheduler moved it since
    _queue(engine, Decision(action=RestoreState(required=True), reason="test"))
    safe.before_optimizer_step_sync(1)
    assert opt.param_groups[0]["lr"] == 0.01
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_restore_gives_param_groups_added_since_fresh_state(sync_bus: SyncEventBus) -> None:
    from eventbus_debug.recovery import RestoreState
    from eventbus_debug.recovery.actions import Decision

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.Adam(model[0].parameters(), lr=0.1)
    engine = RecoveryEngine(sync_bus)
    safe = SafePoint(engine, model, opt, snapshots=StateSnapshots(every=1))
    _backward(model)
    opt.step()
    assert safe.before_optimizer_step_sync(0).should_step
    opt.add_param_group({"params": list(model[1].parameters()), "lr": 0.02})
    _backward(model)
    opt.step()
    assert all(p in opt.state for p in model[1].parameters())
    _queue(engine, Decision(action=RestoreState(required=True), reason="test"))
    safe.before_optimizer_step_sync(1)
    assert len(opt.param_groups) == 2 and opt.param_groups[1]["lr"] == 0.02
    assert all(not opt.state.get(p) for p in model[1].parameters())
    assert all(opt.state.get(p) for p in model[0].parameters())


def test_restore_detail_says_how_old_the_state_was(sync_bus: SyncEventBus) -> None:
    from eventbus_debug.recovery import RestoreState
    from eventbus_debug.recovery.actions import Decision

    log = RecordingSink()
    sync_bus.subscribe(log)
    model, opt = _model()
    engine = RecoveryEngine(sync_bus)
    safe = SafePoint(engine, model, opt, snapshots=StateSnapshots(every=100))
    for step in range(5):
        _backward(model)
        assert safe.before_optimizer_step_sync(step).should_step
    _queue(engine, Decision(action=RestoreState(required=True), reason="test"))
    safe.before_optimizer_step_sync(7)
    sync_bus.drain()
    restore = next(e for e in _applied(log) if e.action is RecoveryAction.RESTORE_STATE)
    assert restore.detail == "restored the state of step 0, 7 steps old"


def test_precautionary_restore_without_good_state_skips_with_outcome_skipped(
    sync_bus: SyncEventBus,
) -> None:
    log = RecordingSink()
    sync_bus.subscribe(log)
    model, opt = _model()
    engine = RecoveryEngine(sync_bus)
    safe = SafePoint(engine, model, opt)
    for step in range(3):  # three NaN losses in a row, never a good step
        engine.decide(_nan(step))
        _backward(model)
        decision = safe.before_optimizer_step_sync(step)
        assert not decision.should_step
    sync_bus.drain()
    restores = [e for e in _applied(log) if e.action is RecoveryAction.RESTORE_STATE]
    assert [e.outcome for e in restores] == ["skipped"]


def test_required_restore_without_good_state_stops(sync_bus: SyncEventBus) -> None:
    model, opt = _model()
    engine = RecoveryEngine(sync_bus)
    safe = SafePoint(engine, model, opt)
    engine.decide(_nan(0, TensorRole.PARAMETER))
    with pytest.raises(TrainingStopped):
        safe.before_optimizer_step_sync(0)


def test_temporary_lr_change_undone_after_200_healthy_steps(sync_bus: SyncEventBus) -> None:
    from eventbus_debug.recovery import ScaleLR
    from eventbus_debug.recovery.actions import Decision

    log = RecordingSink()
    sync_bus.subscribe(log, RecoveryApplied)
    model, opt = _model()
    engine = RecoveryEngine(sync_bus)
    safe = SafePoint(engine, model, opt)
    _queue(engine, Decision(action=ScaleLR(factor=0.5, steps=200), reason="test"))
    assert safe.before_optimizer_step_sync(0).lr_factor == 0.5
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    for step in range(1, 200):
        safe.before_optimizer_step_sync(step)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    safe.before_optimizer_step_sync(200)
    sync_bus.drain()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)
    last = _applied(log)[-1]
    assert (last.step, last.action, last.outcome) == (200, RecoveryAction.SCALE_LR, "restored")


def test_free_memory_never_skips_the_step(sync_bus: SyncEventBus) -> None:
    log = RecordingSink()
    sync_bus.subscribe(log, RecoveryApplied)
    model, opt = _model()
    engine = RecoveryEngine(sync_bus)
    safe = SafePoint(engine, model, opt)
    engine.decide(MemoryLeakSuspected(step=0, resource="rss", slope=1.0, window=10))
    _backward(model)
    decision = safe.before_optimizer_step_sync(0)
    sync_bus.drain()
    assert decision.should_step and decision.actions == (RecoveryAction.FREE_MEMORY,)
    assert "gc collected" in _applied(log)[0].detail


def test_clip_uses_probe_norm_and_applies_order(sync_bus: SyncEventBus) -> None:
    model, opt = _model()
    engine = RecoveryEngine(sync_bus)
    safe = SafePoint(engine, model, opt)
    _backward(model)
    for p in model.parameters():
        assert p.grad is not None
        p.grad.mul_(1e6)
    total = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))  # type: ignore[misc]
    engine.decide(GradientExploded(step=0, total_norm=total, threshold=1.0, largest=1.0))
    decision = safe.before_optimizer_step_sync(0)
    assert decision.should_step and decision.actions == (RecoveryAction.CLIP_GRADIENTS,)
    after = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))  # type: ignore[misc]
    assert after == pytest.approx(1.0, rel=1e-4)


def test_snapshot_refused_when_parameter_non_finite() -> None:
    model, opt = _model()
    snaps = StateSnapshots()
    with torch.no_grad():
        model[0].weight[0, 0] = math.inf  # type: ignore[operator]
    assert not snaps.capture(0, model, opt)
    assert not snaps.available


def test_snapshot_accepts_minus_inf_buffer() -> None:
    model, opt = _model()
    model.register_buffer("mask", torch.tensor([0.0, -math.inf]))
    assert StateSnapshots().capture(0, model, opt)


def test_checkpoint_without_model_state_dict_is_value_error_naming_entries(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ckpt.pt"
    torch.save({"state_dict": {"w": torch.zeros(1)}, "epoch": 3}, path)
    with pytest.raises(ValueError, match="'state_dict'"):
        StateSnapshots(checkpoint=path)


def test_checkpoint_with_nan_is_value_error_naming_entry(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    torch.save({"model": {"w": torch.tensor([math.nan])}}, path)
    with pytest.raises(ValueError, match="w"):
        StateSnapshots(checkpoint=path)


@pytest.mark.parametrize("factor", [0.0, -0.5, math.nan, math.inf])
def test_scale_learning_rate_bad_factor_is_value_error_nothing_written(factor: float) -> None:
    opt = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0)
    with pytest.raises(ValueError, match="factor"):
        scale_learning_rate(opt, factor, [sched])
    assert opt.param_groups[0]["lr"] == 0.1 and sched.base_lrs == [0.1]


def test_scale_learning_rate_scales_cosine_eta_min_and_base_lrs() -> None:
    opt = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10, eta_min=0.01)
    scale_learning_rate(opt, 0.5, [sched])
    assert sched.base_lrs == [pytest.approx(0.05)] and sched.eta_min == pytest.approx(0.005)


# --- alerts --------------------------------------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _explosion(step: int, rank: int = 0) -> GradientExploded:
    return GradientExploded(step=step, rank=rank, total_norm=1e4, threshold=10.0)


def test_alert_rule_defaults_cooldown_60_name_class_names_key_kind_rank() -> None:
    from eventbus_debug.sinks import AlertRule

    rule = AlertRule(event_types=(GradientExploded, NonFiniteDetected))
    assert rule.cooldown == 60.0 and rule.rate_limit is None and rule.when is None
    assert rule.name == "GradientExploded|NonFiniteDetected"
    ev = _explosion(3, rank=2)
    assert rule.key(ev) == ("gradient_exploded", 2)


def test_alert_rule_anomaly_matches_every_training_incident() -> None:
    from eventbus_debug import Anomaly
    from eventbus_debug.sinks import AlertRule

    rule = AlertRule(event_types=(Anomaly,))
    assert rule.matches(_explosion(0)) and rule.matches(_nan(0))
    assert rule.matches(LossSpiked(step=0, loss=2.0, running_mean=1.0, ratio=2.0, rule="spike"))


def test_alert_rule_min_severity_filters_below() -> None:
    from eventbus_debug import Severity
    from eventbus_debug.sinks import AlertRule

    rule = AlertRule(event_types=(GradientExploded,), min_severity=Severity.ERROR)
    assert not rule.matches(_explosion(0))  # WARNING
    assert AlertRule(event_types=(NonFiniteDetected,), min_severity=Severity.ERROR).matches(_nan(0))


@pytest.mark.parametrize(
    ("field", "value"), [("cooldown", -1.0), ("rate_limit", 0), ("rate_window", 0.0)]
)
def test_alert_rule_numbers_out_of_range_value_error_naming_field(field: str, value: float) -> None:
    from eventbus_debug.sinks import AlertRule

    with pytest.raises(ValueError, match=field):
        AlertRule(event_types=(GradientExploded,), **dict[str, Any]({field: value}))


@pytest.mark.parametrize(
    ("kwargs", "arg"),
    [({"bus": object()}, "bus"), ({"clock": 3}, "clock"), ({"name": 5}, "name")],
)
def test_alert_sink_bad_arguments_type_error_naming_argument(
    kwargs: dict[str, Any], arg: str
) -> None:
    from eventbus_debug.sinks import AlertSink

    args: dict[str, Any] = {"bus": SyncEventBus(), **kwargs}
    with pytest.raises(TypeError, match=arg):
        AlertSink(**args)


@pytest.mark.parametrize(("kwargs", "arg"), [({"when": 1}, "when"), ({"key": "k"}, "key")])
def test_alert_on_bad_when_or_key_type_error_at_registration(
    kwargs: dict[str, Any], arg: str
) -> None:
    from eventbus_debug.sinks import AlertSink

    alerts = AlertSink(SyncEventBus())
    with pytest.raises(TypeError, match=arg):
        alerts.on(GradientExploded, **kwargs)


def test_rules_defaults_are_memory_gpu_explosion_non_finite_without_cpu() -> None:
    from eventbus_debug.sinks import rules

    names = [r.name for r in rules.defaults()]
    assert names == [
        "memory_percent>90",
        "gpu_memory_percent>90",
        "gradient_explosion",
        "non_finite",
    ]
    assert rules.gradient_explosion().matches(_explosion(0))
    assert rules.non_finite().matches(_nan(0))


def test_rules_memory_above_sustained_per_rank() -> None:
    from eventbus_debug.events import SystemSampled
    from eventbus_debug.sinks import rules

    mem = rules.memory_above(90)

    def sample(rank: int, value: float) -> SystemSampled:
        return SystemSampled(rank=rank, cpu_percent=1.0, memory_percent=value, disk_percent=1.0)

    seq = [sample(0, 95), sample(1, 95), sample(0, 95), sample(1, 10), sample(0, 95)]
    assert [mem.matches(e) for e in seq] == [False, False, False, False, True]


def test_rules_gpu_memory_above_silent_without_gpu() -> None:
    from eventbus_debug.events import SystemSampled
    from eventbus_debug.sinks import rules

    gpu = rules.gpu_memory_above(90, sustain=1)
    ev = SystemSampled(cpu_percent=99.0, memory_percent=99.0, disk_percent=99.0)
    assert not any(gpu.matches(ev) for _ in range(5))


def test_resource_rule_shared_by_two_handlers_still_needs_sustain_readings() -> None:
    """ "the same rule may carry several handlers": a resource rule still fires on the 3rd reading."""
    from eventbus_debug.events import SystemSampled
    from eventbus_debug.sinks import Alert, AlertSink, rules

    got: dict[str, list[int]] = {"a": [], "b": []}

    async def main() -> None:
        async with EventBus() as bus:
            alerts = AlertSink(bus)
            rule = rules.memory_above(90)

            async def a(alert: Alert) -> None:
                got["a"].append(alert.event.seq)

            async def b(alert: Alert) -> None:
                got["b"].append(alert.event.seq)

            alerts.add_rule(rule, a)
            alerts.add_rule(rule, b)
            sub = bus.subscribe(alerts)
            for _ in range(2):
                bus.publish_nowait(
                    SystemSampled(cpu_percent=1.0, memory_percent=95.0, disk_percent=1.0)
                )
            with anyio.fail_after(5):
                await bus.drain(sub)
            assert got == {"a": [], "b": []}  # two readings: not sustained yet
            bus.publish_nowait(
                SystemSampled(cpu_percent=1.0, memory_percent=95.0, disk_percent=1.0)
            )
            with anyio.fail_after(5):
                await bus.drain(sub)
            assert len(got["a"]) == 1 and got["a"] == got["b"]

    anyio.run(main)


async def _run_sink(
    setup: Any,
    events: list[Any],
    clock: _Clock | None = None,
    times: list[float] | None = None,
) -> Any:
    from eventbus_debug.sinks import AlertSink

    async with EventBus() as bus:
        alerts = AlertSink(bus, clock=clock or _Clock(), timeout=2.0)
        setup(alerts)
        sub = bus.subscribe(alerts)
        for i, ev in enumerate(events):
            if clock is not None and times is not None:
                with anyio.fail_after(5):
                    await bus.drain(sub)
                clock.now = times[i]
            bus.publish_nowait(ev)
        with anyio.fail_after(5):
            await bus.drain(sub)
        return alerts


async def test_alert_cooldown_zero_delivers_every_one() -> None:
    from eventbus_debug.sinks import Alert, AlertSink

    got: list[Alert] = []

    def setup(alerts: AlertSink) -> None:
        alerts.on(GradientExploded, cooldown=0)(got.append)

    await _run_sink(setup, [_explosion(s) for s in range(5)])
    assert [(a.count, a.summary) for a in got] == [(1, False)] * 5


async def test_alert_repeats_after_cooldown_delivered_with_next_event() -> None:
    from eventbus_debug.sinks import Alert, AlertSink

    got: list[Alert] = []

    async def handler(alert: Alert) -> None:
        got.append(alert)

    def setup(alerts: AlertSink) -> None:
        alerts.on(GradientExploded, cooldown=60.0)(handler)

    clock = _Clock()
    alerts = await _run_sink(
        setup, [_explosion(s) for s in range(4)], clock, times=[0.0, 10.0, 20.0, 61.0]
    )
    # the first at once; the two held back ride with the event after the cooldown
    assert [(a.count, a.suppressed, a.summary) for a in got] == [(1, 0, False), (3, 2, True)]
    assert got[1].event.step == 3
    stats = alerts.statistics()
    assert (stats.matched, stats.delivered, stats.suppressed, stats.pending) == (4, 2, 2, 0)


async def test_alert_key_default_separates_ranks() -> None:
    from eventbus_debug.sinks import Alert, AlertSink

    got: list[Alert] = []

    def setup(alerts: AlertSink) -> None:
        alerts.on(GradientExploded)(got.append)

    await _run_sink(setup, [_explosion(0, rank=0), _explosion(0, rank=1), _explosion(1, rank=0)])
    assert [(a.event.rank, a.summary) for a in got[:2]] == [(0, False), (1, False)]


async def test_alert_rate_limit_whole_rule_excess_in_next_summary() -> None:
    from eventbus_debug.sinks import Alert, AlertSink

    got: list[Alert] = []

    def setup(alerts: AlertSink) -> None:
        alerts.on(GradientExploded, cooldown=0, rate_limit=2, rate_window=60.0)(got.append)

    clock = _Clock()
    events = [_explosion(s, rank=s) for s in range(5)] + [_explosion(9, rank=4)]
    await _run_sink(setup, events, clock, times=[0, 1, 2, 3, 4, 70])
    # two deliveries a minute for the whole rule; at 70 s the window has room for two again
    # (rank 4's event with its held repeat, rank 2's summary); rank 3's goes out at close.
    # The two of 70 s are delivered together, each handler call in its own thread: in either
    # order (a test that fixed it failed one run in a few, on trio and on asyncio alike).
    seen = [(a.event.rank, a.count, a.summary) for a in got]
    assert seen[:2] == [(0, 1, False), (1, 1, False)]
    assert sorted(seen[2:4]) == [(2, 1, True), (4, 2, True)]
    assert seen[4:] == [(3, 1, True)]


async def test_alert_flush_returns_count_and_force_delivers_held() -> None:
    from eventbus_debug.sinks import Alert, AlertSink

    got: list[Alert] = []
    clock = _Clock()
    async with EventBus() as bus:
        alerts = AlertSink(bus, clock=clock)
        alerts.on(GradientExploded)(got.append)
        sub = bus.subscribe(alerts)
        for s in range(3):
            bus.publish_nowait(_explosion(s))
        with anyio.fail_after(5):
            await bus.drain(sub)
            assert await alerts.flush() == 0  # cooldown not over
            assert await alerts.flush(force=True) == 1
            assert await alerts.flush(force=True) == 0
    assert [(a.count, a.summary) for a in got] == [(1, False), (2, True)]


async def test_alert_same_rule_several_handlers_each_own_cooldown() -> None:
    from eventbus_debug.sinks import Alert, AlertRule, AlertSink

    a: list[Alert] = []
    b: list[Alert] = []
    rule = AlertRule(event_types=(GradientExploded,))

    def setup(alerts: AlertSink) -> None:
        alerts.add_rule(rule, a.append)
        alerts.add_rule(rule, b.append)

    await _run_sink(setup, [_explosion(s) for s in range(3)])
    assert [x.count for x in a] == [1, 2] and [x.count for x in b] == [1, 2]


async def test_alert_sync_handler_runs_in_worker_thread_async_on_loop() -> None:
    import threading

    from eventbus_debug.sinks import Alert, AlertSink

    threads: dict[str, str] = {}

    def sync_handler(alert: Alert) -> None:
        threads["sync"] = threading.current_thread().name

    async def async_handler(alert: Alert) -> None:
        threads["async"] = threading.current_thread().name

    def setup(alerts: AlertSink) -> None:
        alerts.on(GradientExploded)(sync_handler)
        alerts.on(GradientExploded)(async_handler)

    await _run_sink(setup, [_explosion(0)])
    assert threads["async"] == threading.current_thread().name
    assert threads["sync"] != threads["async"]


async def test_alert_handlers_of_one_event_run_concurrently() -> None:
    from eventbus_debug.sinks import Alert, AlertSink

    first, second = anyio.Event(), anyio.Event()
    done: list[str] = []

    async def h1(alert: Alert) -> None:
        first.set()
        await second.wait()
        done.append("h1")

    async def h2(alert: Alert) -> None:
        await first.wait()
        second.set()
        done.append("h2")

    def setup(alerts: AlertSink) -> None:
        alerts.on(GradientExploded)(h1)
        alerts.on(GradientExploded)(h2)

    alerts = await _run_sink(setup, [_explosion(0)])
    assert sorted(done) == ["h1", "h2"]
    assert alerts.statistics().timed_out == 0


async def test_alert_handler_raising_becomes_alert_handler_failed_not_fed_back() -> None:
    from eventbus_debug import Event
    from eventbus_debug.sinks import Alert, AlertHandlerFailed, AlertSink

    log = RecordingSink()
    calls: list[str] = []
    async with EventBus() as bus:
        bus.subscribe(log, AlertHandlerFailed)
        alerts = AlertSink(bus)

        @alerts.on(Event, cooldown=0)
        def broken(alert: Alert) -> None:
            calls.append(alert.event.kind)
            raise RuntimeError("pager down")

        sub = bus.subscribe(alerts)
        bus.publish_nowait(_explosion(0))
        with anyio.fail_after(5):
            await bus.drain(sub)
            await bus.drain()
    (failure,) = log.of_type(AlertHandlerFailed)
    assert failure.kind == "sinks.alert_handler_failed"
    assert (failure.rule, failure.error_type, failure.timed_out) == ("Event", "RuntimeError", False)
    assert "broken" in failure.handler and "pager down" in failure.message
    assert calls == ["gradient_exploded"]


def test_alert_to_dict_keeps_nan_and_fields() -> None:
    from eventbus_debug.sinks import Alert, AlertRule, alert_to_dict

    ev = GradientExploded(step=7, total_norm=math.nan, threshold=10.0)
    d = alert_to_dict(Alert(rule=AlertRule(event_types=(GradientExploded,)), event=ev))
    assert d["event"]["total_norm"] == "NaN" and d["rule"] == "GradientExploded"
    assert d["count"] == 1 and d["summary"] is False and d["step"] == 7


def test_file_alert_creates_directory(tmp_path: Path) -> None:
    import orjson

    from eventbus_debug.sinks import Alert, AlertRule, FileAlert

    path = tmp_path / "a" / "b" / "alerts.jsonl"
    handler = FileAlert(path)
    alert = Alert(rule=AlertRule(event_types=(GradientExploded,)), event=_explosion(1))
    handler(alert)
    assert orjson.loads(path.read_bytes().splitlines()[0])["step"] == 1


def test_stderr_alert_summary_line_has_repeats() -> None:
    import io

    from eventbus_debug.sinks import Alert, AlertRule, StderrAlert

    stream = io.StringIO()
    alert = Alert(
        rule=AlertRule(event_types=(GradientExploded,)),
        event=_explosion(4),
        suppressed=4,
        count=5,
        summary=True,
    )
    StderrAlert(stream=stream, colors=False)(alert)
    assert "(x5: 4 held back since the last alert)" in stream.getvalue()


def test_log_alert_logs_at_event_severity(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from eventbus_debug.sinks import Alert, AlertRule, LogAlert

    alert = Alert(rule=AlertRule(event_types=(NonFiniteDetected,)), event=_nan(2))
    with caplog.at_level(logging.DEBUG, logger="eventbus_debug.alerts"):
        LogAlert()(alert)
    (record,) = [r for r in caplog.records if r.name == "eventbus_debug.alerts"]
    assert record.levelno == logging.ERROR and record.getMessage().startswith("alert")


# --- retried calls and the seeds' error handler ---------------------------------------------


class _Odd(Exception):
    """An error no strategy answers."""


def test_retrying_error_no_strategy_answers_propagates_unchanged(sync_bus: SyncEventBus) -> None:
    engine = RecoveryEngine(sync_bus)
    err = _Odd("strange")

    @retrying(engine, operation="train_step")
    def call() -> None:
        raise err

    with pytest.raises(_Odd) as info:
        call()
    assert info.value is err


def test_retrying_exhausted_raises_training_stopped_with_cause(sync_bus: SyncEventBus) -> None:
    engine = RecoveryEngine(sync_bus)
    oom = torch.OutOfMemoryError("CUDA out of memory")

    @retrying(engine, state=CallState(batch_size=2), pass_state=True, operation="train_step")
    def call(*, state: CallState) -> None:
        raise oom

    with pytest.raises(TrainingStopped) as info:
        call()  # type: ignore[call-arg]
    assert info.value.__cause__ is oom


def test_retrying_max_attempts_reached_raises_training_stopped(sync_bus: SyncEventBus) -> None:
    engine = RecoveryEngine(sync_bus)
    calls: list[int] = []

    @retrying(
        engine,
        state=CallState(batch_size=1024),
        pass_state=True,
        max_attempts=2,
        initial_delay=0,
    )
    def call(*, state: CallState) -> None:
        calls.append(state.batch_size)  # type: ignore[arg-type]
        raise torch.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(TrainingStopped) as info:
        call()  # type: ignore[call-arg]
    assert calls == [1024, 512]
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)


def test_retrying_success_after_changes_publishes_recovery_applied_with_batch_size(
    sync_bus: SyncEventBus,
) -> None:
    log = RecordingSink()
    sync_bus.subscribe(log)
    engine = RecoveryEngine(sync_bus)

    @retrying(engine, state=CallState(batch_size=64), pass_state=True, operation="train_step")
    def call(*, state: CallState) -> int:
        if state.batch_size > 16:  # type: ignore[operator]
            raise torch.OutOfMemoryError("CUDA out of memory")
        return state.batch_size  # type: ignore[return-value]

    assert call() == 16  # type: ignore[call-arg]
    sync_bus.drain()
    errors = log.of_type(ErrorRaised)
    assert [(e.attempt, e.settings.batch_size) for e in errors] == [(1, 64), (2, 32)]  # type: ignore[union-attr]
    assert all(e.category.value == "memory" for e in errors)
    assert any("16" in e.detail for e in log.of_type(RecoveryApplied))


def test_retrying_data_loading_context_manager_falls_back(sync_bus: SyncEventBus) -> None:
    from eventbus_debug import Retrying

    engine = RecoveryEngine(sync_bus)
    seen: list[tuple[int, bool]] = []
    for attempt in Retrying(
        engine, state=CallState(num_workers=4, pin_memory=True), operation="data_loading"
    ):
        with attempt:
            seen.append((attempt.state.num_workers, attempt.state.pin_memory))  # type: ignore[arg-type]
            if len(seen) < 3:
                raise RuntimeError("DataLoader worker (pid 7) is killed by signal")
    assert seen[0] == (4, True) and len(seen) == 3


def test_report_error_context_string_mapping_and_type_error() -> None:
    from eventbus_debug.recovery import report_error

    async def main() -> None:
        log = RecordingSink()
        async with EventBus() as bus:
            bus.subscribe(log, ErrorRaised)
            engine = RecoveryEngine(bus)
            with anyio.fail_after(10):
                await report_error(engine, _Odd("x"), context="train_step")
                await report_error(engine, _Odd("y"), context={"batch": 3})
                with pytest.raises(TypeError, match="context"):
                    await report_error(engine, _Odd("z"), context=3)  # type: ignore[arg-type]
                await bus.drain()
        contexts = [dict(e.context) for e in log.of_type(ErrorRaised)]
        assert contexts[0]["context"] == "train_step" and contexts[1]["batch"] == "3"
        assert len(contexts) == 2

    anyio.run(main)


def test_error_handler_past_max_retries_publishes_but_not_recovered(
    sync_bus: SyncEventBus,
) -> None:
    from eventbus_debug.compat import ErrorHandler

    log = RecordingSink()
    sync_bus.subscribe(log, ErrorRaised)
    handler = ErrorHandler(RecoveryEngine(sync_bus), state=CallState(batch_size=64))
    oom = torch.OutOfMemoryError("CUDA out of memory")
    results = [handler.handle_error(oom, context="step", max_retries=2) for _ in range(3)]
    sync_bus.drain()
    assert [r.recovered for r in results] == [True, True, False]
    assert handler.state.batch_size == 16
    assert len(log.of_type(ErrorRaised)) == 3
    success, detail = results[0]
    assert success is True and isinstance(detail, str)
    handler.reset("step")
    assert handler.handle_error(oom, context="step", max_retries=2).recovered


def test_error_handler_register_recovery_strategy_is_engine_register(
    sync_bus: SyncEventBus,
) -> None:
    from eventbus_debug.compat import ErrorHandler
    from eventbus_debug.recovery import Retry
    from eventbus_debug.recovery.actions import Decision

    engine = RecoveryEngine(sync_bus)
    handler = ErrorHandler(engine)

    def fn(incident: object, history: object) -> Decision:
        return Decision(action=Retry(), reason="custom")

    handler.register_recovery_strategy("disk quota", fn)
    assert engine.strategy_names[0] == "fn"
    result = handler.handle_error(OSError("Disk quota exceeded"), context="save")
    assert result.recovered and result.actions == (RecoveryAction.RETRY,)


def test_debug_decorator_retries_max_retries_after_first_call(sync_bus: SyncEventBus) -> None:
    from eventbus_debug.compat import DebugDecorator, ErrorHandler

    handler = ErrorHandler(RecoveryEngine(sync_bus), state=CallState(batch_size=64))
    calls: list[int] = []

    @DebugDecorator(handler, max_retries=2)
    def step() -> int:
        calls.append(handler.state.batch_size)  # type: ignore[arg-type]
        raise torch.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(TrainingStopped):
        step()
    assert calls == [64, 32, 16]


@pytest.mark.parametrize("bad", [-1])
def test_error_handler_negative_max_retries_value_error(sync_bus: SyncEventBus, bad: int) -> None:
    from eventbus_debug.compat import DebugDecorator, ErrorHandler

    engine = RecoveryEngine(sync_bus)
    with pytest.raises(ValueError, match="max_retries"):
        ErrorHandler(engine, max_retries=bad)
    with pytest.raises(ValueError, match="max_retries"):
        DebugDecorator(ErrorHandler(engine), max_retries=bad)


def test_error_classifier_category_and_statistics(sync_bus: SyncEventBus) -> None:
    from eventbus_debug import Severity
    from eventbus_debug.events import ErrorCategory
    from eventbus_debug.recovery import report_error_sync

    engine = RecoveryEngine(sync_bus)
    engine.classifier.register(ErrorCategory.DATA, exception=KeyError, severity=Severity.WARNING)
    ev = engine.error_event(KeyError("label"))
    assert (ev.category, ev.severity) == (ErrorCategory.DATA, Severity.WARNING)
    report_error_sync(engine, KeyError("label"))
    assert engine.statistics().errors[ErrorCategory.DATA] == 1


# --- common fixes and corrupt samples ------------------------------------------------------


def test_common_fixes_without_snapshot_lists_unrepaired_never_zeroes() -> None:
    from eventbus_debug.recovery import apply_common_fixes

    model, opt = _model()
    with torch.no_grad():
        model[0].weight[0, 0] = math.nan  # type: ignore[operator]
    fixes = apply_common_fixes(model, opt)
    assert "0.weight" in fixes.unrepaired_parameters
    assert math.isnan(model[0].weight.detach()[0, 0].item())  # type: ignore[operator]
    assert not fixes.healthy and fixes.restored_step is None


def test_common_fixes_drops_nonfinite_gradients() -> None:
    from eventbus_debug.recovery import apply_common_fixes

    model, opt = _model()
    _backward(model)
    model[0].weight.grad[0, 0] = math.inf  # type: ignore[index, operator]
    fixes = apply_common_fixes(model, opt)
    assert "nonfinite_gradient_fix" in fixes
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())


def test_common_fixes_names_all_zero_gradients_and_clips_above_max_norm() -> None:
    from eventbus_debug.recovery import apply_common_fixes

    model, opt = _model()
    _backward(model)
    model[2].bias.grad.zero_()  # type: ignore[operator, union-attr]
    for p in model.parameters():
        p.grad.mul_(1e4)  # type: ignore[union-attr]
    fixes = apply_common_fixes(model, opt)
    assert "2.bias" in fixes.zero_gradients and "zero_gradient_report" in fixes
    assert "exploding_gradient_fix" in fixes and fixes.clipped_to == 1.0


def test_corrupt_samples_default_max_skipped_is_10() -> None:
    from torch.utils.data import Dataset

    from eventbus_debug.recovery import CorruptDataError, skip_corrupt_samples

    class Bad(Dataset[torch.Tensor]):
        def __init__(self, bad: int) -> None:
            self.bad = bad

        def __len__(self) -> int:
            return 20

        def __getitem__(self, i: int) -> torch.Tensor:
            if i < self.bad:
                raise ValueError(f"bad {i}")
            return torch.zeros(2)

    assert sum(len(b) for b in skip_corrupt_samples(Bad(10), None, batch_size=4)) == 10
    with pytest.raises(CorruptDataError, match="10"):
        list(skip_corrupt_samples(Bad(11), None, batch_size=4))


# --- integrations --------------------------------------------------------------------------


def _ignite_setup(
    tmp_path: Path, **options: object
) -> tuple[nn.Sequential, torch.optim.Optimizer, Any, list[tuple[torch.Tensor, torch.Tensor]]]:
    pytest.importorskip("ignite")
    from ignite.engine import create_supervised_trainer

    from eventbus_debug.integrations.ignite import EventBusDebugHandler

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(32, 4)
    y = x.sum(1, keepdim=True)
    handler = EventBusDebugHandler(model, opt, log_dir=tmp_path / "logs", alerts=False, **options)  # type: ignore[arg-type]
    trainer = create_supervised_trainer(model, opt, handler.track_loss(nn.MSELoss()))
    handler.attach(trainer)
    data = [(x[i : i + 8], y[i : i + 8]) for i in range(0, 32, 8)]
    return model, opt, (handler, trainer), data


@pytest.mark.parametrize("option", ["model", "optimizer", "log_dir"])
def test_integration_model_optimizer_log_dir_options_refused_at_once(option: str) -> None:
    pytest.importorskip("ignite")
    from eventbus_debug.integrations.ignite import EventBusDebugHandler

    model, opt = _model()
    kwargs = {option: None} if option == "log_dir" else {option: model}
    if option == "log_dir":
        from eventbus_debug.integrations._common import FitSession

        with pytest.raises(TypeError, match="log_dir"):
            FitSession("ignite", None, {"log_dir": "x"})
        return
    with pytest.raises(TypeError, match=option):
        EventBusDebugHandler(model, opt, **kwargs)


def test_integration_misspelt_option_fails_at_fit_start_naming_it(tmp_path: Path) -> None:
    _, _, (handler, trainer), data = _ignite_setup(tmp_path, polcy="safe")
    with pytest.raises(TypeError, match="polcy"):
        trainer.run(data, max_epochs=1)
    assert handler.session is None


def test_integration_one_session_per_fit_named_after_framework_completed(tmp_path: Path) -> None:
    from eventbus_debug import read_events

    _, _, (handler, trainer), data = _ignite_setup(tmp_path)
    assert handler.session is None
    trainer.run(data, max_epochs=1)
    assert handler.session is None and handler.steps_checked == 4
    events = list(read_events(tmp_path / "logs"))
    ended = [e for e in events if e.kind == "session_ended"]
    assert len(ended) == 1 and ended[0].reason == "completed"  # type: ignore[attr-defined]
    assert ended[0].source == "ignite"


def test_ignite_skipped_step_leaves_parameters_bit_identical(tmp_path: Path) -> None:
    from ignite.engine import Events

    model, _, (handler, trainer), data = _ignite_setup(tmp_path)
    data[2][0][0, 0] = math.nan
    seen: dict[int, list[torch.Tensor]] = {}

    def before(engine: object) -> None:
        seen[engine.state.iteration] = [p.detach().clone() for p in model.parameters()]  # type: ignore[attr-defined]

    trainer.add_event_handler(Events.ITERATION_STARTED, before)
    after: list[torch.Tensor] = []
    trainer.add_event_handler(
        Events.ITERATION_COMPLETED(once=3),
        lambda e: after.extend(p.detach().clone() for p in model.parameters()),
    )
    trainer.run(data, max_epochs=1)
    assert handler.steps_skipped == 1
    assert all(torch.equal(a, b) for a, b in zip(seen[3], after, strict=True))
    assert trainer.state.iteration == 4


def test_ignite_attached_twice_runs_one_session(tmp_path: Path) -> None:
    from ignite.engine import Events

    from eventbus_debug import read_events

    _, _, (handler, trainer), data = _ignite_setup(tmp_path)
    trainer.add_event_handler(Events.STARTED, handler)
    trainer.run(data, max_epochs=1)
    started = [e for e in read_events(tmp_path / "logs") if e.kind == "session_started"]
    assert len(started) == 1 and handler.steps_checked == 4


def test_ignite_started_by_second_engine_during_run_is_value_error(tmp_path: Path) -> None:
    from ignite.engine import Engine, Events

    _, _, (handler, trainer), data = _ignite_setup(tmp_path)
    evaluator = Engine(lambda e, b: None)
    evaluator.add_event_handler(Events.STARTED, handler)
    trainer.add_event_handler(
        Events.ITERATION_COMPLETED(once=2), lambda e: evaluator.run([0], max_epochs=1)
    )
    with pytest.raises(ValueError, match="second engine"):
        trainer.run(data, max_epochs=1)
    assert handler.session is None


def test_ignite_max_grad_norm_clips_after_check_bit_for_bit(tmp_path: Path) -> None:
    pytest.importorskip("ignite")
    from ignite.engine import Engine

    from eventbus_debug.integrations.ignite import EventBusDebugHandler

    def train(with_handler: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        x = torch.randn(64, 4) * 30
        y = x.sum(1, keepdim=True)

        def update(engine: Engine, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(batch[0]), batch[1])
            loss.backward()  # type: ignore[no-untyped-call]
            if not with_handler:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            return loss.item()

        trainer = Engine(update)
        if with_handler:
            EventBusDebugHandler(
                model, opt, log_dir=None, alerts=False, console=False, max_grad_norm=0.5
            ).attach(trainer)
        trainer.run([(x[i : i + 8], y[i : i + 8]) for i in range(0, 64, 8)], max_epochs=3)
        return [p.detach().clone() for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(train(True), train(False), strict=True))


def test_ignite_non_finite_output_without_track_loss_reported_as_output(tmp_path: Path) -> None:
    pytest.importorskip("ignite")
    from ignite.engine import Engine

    from eventbus_debug import read_events
    from eventbus_debug.integrations.ignite import EventBusDebugHandler

    model, opt = _model()

    def update(engine: Engine, batch: torch.Tensor) -> float:
        opt.zero_grad()
        model(batch).mean().backward()
        opt.step()
        return math.nan if engine.state.iteration == 2 else 1.0

    trainer = Engine(update)
    EventBusDebugHandler(model, opt, log_dir=tmp_path / "logs", alerts=False).attach(trainer)
    trainer.run([torch.randn(4, 4) for _ in range(3)], max_epochs=1)
    bad = [e for e in read_events(tmp_path / "logs") if e.kind == "non_finite_detected"]
    assert [(e.step, e.role) for e in bad] == [(1, TensorRole.OUTPUT)]  # type: ignore[attr-defined]


def test_integration_handler_deepcopy_is_idle_with_options(tmp_path: Path) -> None:
    import copy
    import pickle

    from ignite.engine import Events

    _, _, (handler, trainer), data = _ignite_setup(tmp_path)
    copies: list[Any] = []
    trainer.add_event_handler(
        Events.ITERATION_COMPLETED(once=2), lambda e: copies.append(copy.deepcopy(handler))
    )
    trainer.run(data, max_epochs=1)
    (dup,) = copies
    assert dup.session is None
    assert pickle.loads(pickle.dumps(handler)).session is None


def test_lightning_two_callbacks_value_error_at_fit_start(tmp_path: Path) -> None:
    pl = pytest.importorskip("lightning.pytorch")
    from torch.utils.data import DataLoader, TensorDataset

    from eventbus_debug.integrations.lightning import EventBusDebugCallback

    class Tiny(pl.LightningModule):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(2, 1)

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            return self.net(batch[0]).pow(2).mean()  # type: ignore[no-any-return]

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    cb = EventBusDebugCallback(log_dir=tmp_path / "logs", alerts=False)
    trainer = pl.Trainer(
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[cb, cb],
        default_root_dir=tmp_path,
    )
    loader = DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=4)
    with pytest.raises(ValueError, match="EventBusDebugCallback"):
        trainer.fit(Tiny(), loader)
    assert cb.session is None


def test_lightning_model_option_refused_at_once() -> None:
    pytest.importorskip("lightning.pytorch")
    from eventbus_debug.integrations.lightning import EventBusDebugCallback

    with pytest.raises(TypeError, match="model"):
        EventBusDebugCallback(model=nn.Linear(1, 1))


def test_transformers_optimizer_option_refused_at_once() -> None:
    pytest.importorskip("transformers")
    from eventbus_debug.integrations.transformers import EventBusDebugCallback

    with pytest.raises(TypeError, match="optimizer"):
        EventBusDebugCallback(optimizer=None)


def test_integration_missing_framework_import_error_names_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib
    import sys

    monkeypatch.delitem(sys.modules, "eventbus_debug.integrations.ignite", raising=False)
    monkeypatch.setitem(sys.modules, "ignite", None)
    with pytest.raises(ImportError, match=r"eventbus-debug\[ignite\]"):
        importlib.import_module("eventbus_debug.integrations.ignite")


# --- more of docs/recovery.md -------------------------------------------------------------


def _vanished(step: int) -> Any:
    from eventbus_debug.events import GradientVanished

    return GradientVanished(step=step, mean_abs=None, threshold=1e-4, layers=("0.weight",))


def test_continue_only_step_does_not_restart_consecutive_counts(sync_bus: SyncEventBus) -> None:
    model, opt = _model()
    engine = RecoveryEngine(sync_bus)
    safe = SafePoint(engine, model, opt)
    runs = []
    for step, incident in enumerate([_nan(0), _vanished(1), _nan(2), _nan(3)]):
        runs.append(_kinds(engine.decide(incident)))
        safe.before_optimizer_step_sync(step)
    # dead layer reported (CONTINUE) at step 1: no good step, so step 3 is the 3rd NaN in a row
    assert runs[3] == [RecoveryAction.RESTORE_STATE, RecoveryAction.SKIP_STEP]


def test_clean_step_restarts_consecutive_counts(sync_bus: SyncEventBus) -> None:
    model, opt = _model()
    engine = RecoveryEngine(sync_bus)
    safe = SafePoint(engine, model, opt)
    runs = []
    for step in range(5):
        if step != 2:
            runs.append(_kinds(engine.decide(_nan(step))))
        _backward(model)
        safe.before_optimizer_step_sync(step)
    assert runs == [[RecoveryAction.SKIP_STEP]] * 4


def test_every_incident_of_a_step_one_skip_and_parameter_restore_same_step(
    sync_bus: SyncEventBus,
) -> None:
    model, opt = _model()
    engine = RecoveryEngine(sync_bus)
    safe = SafePoint(engine, model, opt, snapshots=StateSnapshots(every=1))
    _backward(model)
    assert safe.before_optimizer_step_sync(0).should_step
    loss = engine.decide(_nan(1, TensorRole.LOSS))
    grads = engine.decide(_nan(1, TensorRole.GRADIENT))
    param = engine.decide(_nan(1, TensorRole.PARAMETER))
    assert _kinds(loss) == [RecoveryAction.SKIP_STEP] and grads == ()
    assert _kinds(param) == [RecoveryAction.RESTORE_STATE]
    decision = safe.before_optimizer_step_sync(1)
    assert decision.actions == (RecoveryAction.RESTORE_STATE, RecoveryAction.SKIP_STEP)


def test_inline_safe_point_decides_healthy_step_none_when_catching_up() -> None:
    async def main() -> None:
        async with EventBus() as bus:
            model, opt = _model()
            engine = RecoveryEngine(bus)
            safe = SafePoint(engine, model, opt)
            healthy = safe.before_optimizer_step_inline(0)
            assert healthy is not None and healthy.should_step
            bus.publish_nowait(_nan(1))
            assert safe.before_optimizer_step_inline(1) is None
            with anyio.fail_after(10):
                decision = await safe.before_optimizer_step(1)
            assert not decision.should_step

    anyio.run(main)


def test_restore_listeners_called_after_restore(sync_bus: SyncEventBus) -> None:
    model, opt = _model()
    engine = RecoveryEngine(sync_bus)
    safe = SafePoint(engine, model, opt, snapshots=StateSnapshots(every=1))
    called: list[int] = []
    safe.add_restore_listener(lambda: called.append(1))
    _backward(model)
    safe.before_optimizer_step_sync(0)
    engine.decide(_nan(1, TensorRole.PARAMETER))
    safe.before_optimizer_step_sync(1)
    assert called == [1]


def test_skipped_step_records_scaler_inf_check_so_update_works(sync_bus: SyncEventBus) -> None:
    model, opt = _model()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    engine = RecoveryEngine(sync_bus)
    safe = SafePoint(engine, model, opt, scaler=scaler)
    model.zero_grad()
    scaler.scale(model(torch.randn(4, 4)).sum() * math.inf).backward()
    engine.decide(_nan(0, TensorRole.GRADIENT))
    assert not safe.before_optimizer_step_sync(0).should_step
    scaler.update()  # raised "No inf checks were recorded" before
    assert scaler.get_scale() < 1024.0


def test_scaler_in_trouble_and_sample_skipped_have_no_default_strategy(
    sync_bus: SyncEventBus,
) -> None:
    from eventbus_debug.events import SampleSkipped, ScalerInTrouble

    engine = RecoveryEngine(sync_bus)
    assert engine.decide(ScalerInTrouble(step=0, scale=0.5, floor=1.0, consecutive_skips=0)) == ()
    assert engine.decide(SampleSkipped(index=3, error_type="ValueError", message="x")) == ()
    assert engine.statistics().unmatched == 2


def test_report_vanishing_raises_lr_every_window_at_most_max_raises(
    sync_bus: SyncEventBus,
) -> None:
    from eventbus_debug.events import GradientVanished
    from eventbus_debug.recovery import ReportVanishing, StrategySpec

    engine = RecoveryEngine(
        sync_bus,
        strategies=[
            StrategySpec(
                strategy=ReportVanishing(window=2, lr_factor=2.0, max_raises=2),
                on=GradientVanished,
            )
        ],
    )
    runs = [_kinds(engine.decide(_vanished(s))) for s in range(8)]
    assert runs.count([RecoveryAction.SCALE_LR]) == 2
    assert runs[1] == [RecoveryAction.SCALE_LR] and runs[3] == [RecoveryAction.SCALE_LR]


def test_caught_retried_stop_does_not_keep_later_exhausted_incidents_from_stopping(
    sync_bus: SyncEventBus,
) -> None:
    model, opt = _model()
    engine = RecoveryEngine(sync_bus)
    safe = SafePoint(engine, model, opt, snapshots=StateSnapshots(every=1))

    @retrying(engine, state=CallState(batch_size=1), pass_state=True)
    def call(*, state: CallState) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(TrainingStopped):
        call()  # type: ignore[call-arg]
    _backward(model)
    safe.before_optimizer_step_sync(0)
    with pytest.raises(TrainingStopped):
        for step in range(1, 6):
            engine.decide(_nan(step, TensorRole.PARAMETER))
            safe.before_optimizer_step_sync(step)


@pytest.mark.parametrize(
    ("make", "arg"),
    [
        (
            lambda: __import__("eventbus_debug.recovery").recovery.ShrinkBatchOnOOM(factor=2.0),
            "factor",
        ),
        (lambda: __import__("eventbus_debug.recovery").recovery.ScaleLR(factor=0.0), "factor"),
        (
            lambda: __import__("eventbus_debug.recovery").recovery.ClipOnExplosion(min_ratio=0.5),
            "min_ratio",
        ),
        (lambda: StateSnapshots(every=0), "every"),
    ],
)
def test_strategy_and_action_bad_numbers_value_error_naming_argument(make: Any, arg: str) -> None:
    with pytest.raises(ValueError, match=arg):
        make()


def test_temporary_lr_undo_leaves_groups_added_since(sync_bus: SyncEventBus) -> None:
    from eventbus_debug.recovery import ScaleLR
    from eventbus_debug.recovery.actions import Decision

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    engine = RecoveryEngine(sync_bus)
    safe = SafePoint(engine, model, opt)
    _queue(engine, Decision(action=ScaleLR(factor=0.5, steps=3), reason="test"))
    safe.before_optimizer_step_sync(0)
    opt.add_param_group({"params": list(model[1].parameters()), "lr": 0.02})
    for step in range(1, 4):
        safe.before_optimizer_step_sync(step)
    assert [g["lr"] for g in opt.param_groups] == [pytest.approx(0.1), pytest.approx(0.02)]


# --- compat and extras (docs/seed-mapping.md) ------------------------------------------------


def test_compat_check_gradients_returns_gradient_report() -> None:
    from eventbus_debug.compat import GradientReport, check_gradients

    model, _ = _model()
    _backward(model)
    model[0].weight.grad[0, 0] = math.nan  # type: ignore[index, operator]
    report = check_gradients(model)
    assert isinstance(report, GradientReport)
    assert report.non_finite == ("0.weight",) and not report.finite


def test_compat_analyze_gradients_returns_per_parameter_stats() -> None:
    """seed-mapping.md says ``analyze_gradients(model)`` -> ``GradientReport``; it returns the
    per-parameter ``ParameterStats`` (``check_gradients`` returns the ``GradientReport``)."""
    from eventbus_debug.compat import ParameterStats, analyze_gradients

    model, _ = _model()
    _backward(model)
    stats = analyze_gradients(model)
    assert all(isinstance(s, ParameterStats) for s in stats)
    assert [s.name for s in stats] == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_compat_check_gradient_explosion_and_vanishing_name_parameters() -> None:
    from eventbus_debug.compat import check_gradient_explosion, check_gradient_vanishing

    model, _ = _model()
    _backward(model)
    model[2].weight.grad.mul_(1e6)  # type: ignore[operator, union-attr]
    model[0].bias.grad.zero_()  # type: ignore[operator, union-attr]
    assert check_gradient_explosion(model, threshold=10.0) == ("2.weight",)
    assert check_gradient_vanishing(model, threshold=1e-7) == ("0.bias",)
    with pytest.raises(ValueError, match="threshold"):
        check_gradient_explosion(model, threshold=0)


def test_compat_check_model_parameters_non_finite() -> None:
    from eventbus_debug.compat import check_model_parameters

    model, _ = _model()
    with torch.no_grad():
        model[2].bias.fill_(math.inf)  # type: ignore[operator]
    assert check_model_parameters(model).non_finite == ("2.bias",)


def test_compat_create_pytorch_debugger_returns_unstarted_session_with_modes() -> None:
    from eventbus_debug import DebugMode, Session
    from eventbus_debug.compat import create_pytorch_debugger, debug_training_session

    model, opt = _model()
    session = create_pytorch_debugger(model, opt, log_dir=None)
    assert isinstance(session, Session)
    assert isinstance(debug_training_session(model, opt, log_dir=None), Session)
    assert session.plan.anomaly_localization  # enable_anomaly_detection=True by default
    plain = create_pytorch_debugger(model, opt, log_dir=None, enable_anomaly_detection=False)
    assert not plain.plan.anomaly_localization
    assert DebugMode.ANOMALY_DETECTION.value == "anomaly_detection"


def test_compat_monitor_training_step_reports_non_finite_loss() -> None:
    from eventbus_debug.compat import monitor_training_step

    model, _ = _model()
    _backward(model)
    verdict = monitor_training_step(model, math.nan, 0)
    assert not verdict.finite


def test_compat_async_training_logger_needs_a_session() -> None:
    from eventbus_debug.compat import AsyncTrainingLogger

    with pytest.raises(TypeError, match="session"):
        AsyncTrainingLogger(object())  # type: ignore[arg-type]


def test_extras_debug_context_publishes_operation_completed() -> None:
    from eventbus_debug.events import OperationCompleted
    from eventbus_debug.extras import debug_context

    seen: list[object] = []
    with debug_context("forward", publish=seen.append, step=3) as op:
        pass
    assert isinstance(op.result, OperationCompleted) and seen == [op.result]
    assert (op.result.name, op.result.step) == ("forward", 3)


@pytest.mark.parametrize(
    ("kwargs", "arg"), [({"publish": SyncEventBus}, "publish"), ({"step": "3"}, "step")]
)
def test_extras_debug_context_bad_publish_or_step_type_error_at_once(
    kwargs: dict[str, Any], arg: str
) -> None:
    from eventbus_debug.extras import debug_context

    if arg == "publish":
        kwargs = {"publish": SyncEventBus()}
    ran: list[int] = []
    with pytest.raises(TypeError, match=arg):
        with debug_context("forward", **kwargs):
            ran.append(1)
    assert ran == []  # refused before the block ran


def test_extras_input_validator_raise_policy() -> None:
    from eventbus_debug.extras import (
        InputSpec,
        InputValidationError,
        InputValidator,
        ValidationPolicy,
        validate_input,
    )

    spec = InputSpec(ndim=2, max_abs=10.0)
    bad = torch.tensor([[math.nan, 100.0]])
    assert {v.rule for v in validate_input(bad, spec)} == {"non_finite", "range"}
    with pytest.raises(InputValidationError):
        InputValidator(spec, policy=ValidationPolicy.RAISE).check(bad)
    assert validate_input(torch.zeros(2, 2), spec) == ()


# --- docs/distributed.md, single process ---------------------------------------------------


def test_distributed_true_outside_group_is_an_error() -> None:
    from eventbus_debug import SyncSession

    model, opt = _model()
    with pytest.raises(RuntimeError, match="distributed=True"):
        with SyncSession(model, opt, log_dir=None, distributed=True):
            pass


def test_distributed_false_opts_out_no_agreement() -> None:
    from eventbus_debug import SyncSession

    model, opt = _model()
    with SyncSession(model, opt, log_dir=None, distributed=False) as session:
        assert session.agreement is None


def test_rank_agreement_default_timeout_300_and_bad_timeout_named() -> None:
    import inspect

    from eventbus_debug import RankAgreement

    assert inspect.signature(RankAgreement).parameters["timeout"].default == 300.0
    with pytest.raises(ValueError, match="timeout"):
        RankAgreement(timeout=-1.0)


def test_session_console_does_not_add_log_alert_default_rules(tmp_path: Path) -> None:
    from eventbus_debug import SyncSession
    from eventbus_debug.sinks import AlertSink, LogAlert

    model, opt = _model()
    with SyncSession(model, opt, log_dir=None, console=True, alerts=True) as session:
        assert isinstance(session.alerts, AlertSink) and session.alerts.rules == ()
    with SyncSession(model, opt, log_dir=None, console=False, alerts=True) as session:
        assert isinstance(session.alerts, AlertSink)
        pairs = session.alerts.rules
        assert len(pairs) == 4 and all(isinstance(h, LogAlert) for _, h in pairs)


def test_ignite_stop_ends_session_with_reason_stopped_and_message(tmp_path: Path) -> None:
    from ignite.engine import Events

    from eventbus_debug import read_events

    model, _, (handler, trainer), data = _ignite_setup(tmp_path)

    def poison(engine: Any) -> None:
        with torch.no_grad():
            model[0].weight.fill_(math.nan)  # type: ignore[operator]

    trainer.add_event_handler(Events.ITERATION_STARTED(once=1), poison)
    with pytest.raises(TrainingStopped):
        trainer.run(data, max_epochs=1)
    assert handler.session is None
    ended: Any = [e for e in read_events(tmp_path / "logs") if e.kind == "session_ended"]
    assert len(ended) == 1 and ended[0].reason == "stopped"
    assert "restore" in ended[0].detail or "good state" in ended[0].detail


def test_transformers_max_grad_norm_keeps_value_pickles_as_float_and_two_callbacks_refused(
    tmp_path: Path,
) -> None:
    import pickle

    transformers = pytest.importorskip("transformers")
    from eventbus_debug.integrations.transformers import EventBusDebugCallback

    torch.manual_seed(0)
    config = transformers.BertConfig(
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        vocab_size=50,
        num_labels=1,
    )
    model = transformers.BertForSequenceClassification(config)
    data = [{"input_ids": torch.randint(1, 50, (8,)), "labels": torch.randn(())} for _ in range(8)]
    args = transformers.TrainingArguments(
        str(tmp_path / "out"),
        max_steps=2,
        per_device_train_batch_size=4,
        max_grad_norm=1.0,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
    )
    seen: list[tuple[float, type, type]] = []

    class Peek(transformers.TrainerCallback):  # type: ignore[misc,name-defined]
        def on_step_end(self, a: Any, state: Any, control: Any, **kw: Any) -> None:
            value = a.max_grad_norm
            seen.append((value, type(pickle.loads(pickle.dumps(value))), type(value)))

    cb = EventBusDebugCallback(log_dir=tmp_path / "logs", alerts=False)
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=data, callbacks=[cb, Peek()]
    )
    trainer.train()
    assert seen and all(v == 1.0 and t is float for v, t, _ in seen)
    assert type(args.max_grad_norm) is float and args.max_grad_norm == 1.0
    assert cb.steps_checked == 2 and cb.session is None
    twice = transformers.Trainer(
        model=model,
        args=args,
        train_dataset=data,
        callbacks=[cb, EventBusDebugCallback(log_dir=None, alerts=False)],
    )
    with pytest.raises(ValueError, match="EventBusDebugCallback"):
        twice.train()
    assert args.max_grad_norm == 1.0 and type(args.max_grad_norm) is float


def test_aggressive_bounds_restore_two_in_a_row_then_stop(sync_bus: SyncEventBus) -> None:
    engine = RecoveryEngine(sync_bus, policy="aggressive")
    params = [_kinds(engine.decide(_nan(s, TensorRole.PARAMETER))) for s in range(3)]
    assert params == [[RecoveryAction.RESTORE_STATE]] * 2 + [[RecoveryAction.STOP]]
    engine = RecoveryEngine(sync_bus, policy="aggressive", name="recovery_2")
    losses = [_kinds(engine.decide(_nan(s))) for s in range(6)]
    assert losses[3:5] == [[RecoveryAction.RESTORE_STATE, RecoveryAction.SCALE_LR]] * 2
    assert losses[5] == [RecoveryAction.STOP]


def test_aggressive_rollback_on_loss_spike_three_in_a_row_then_stop(
    sync_bus: SyncEventBus,
) -> None:
    engine = RecoveryEngine(sync_bus, policy="aggressive")
    runs = [
        _kinds(
            engine.decide(
                LossSpiked(step=s, loss=100.0, running_mean=1.0, ratio=100.0, rule="sustained")
            )
        )
        for s in range(4)
    ]
    assert runs[2][0] is RecoveryAction.RESTORE_STATE and runs[3] == [RecoveryAction.STOP]
