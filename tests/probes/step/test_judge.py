"""The host-side judgement: a step's vector in, a verdict and its events out."""

from __future__ import annotations

import math

import pytest
import torch

from eventbus_debug.events import GradientVanished, NonFiniteDetected, StepChecked, TensorRole
from eventbus_debug.probes import Thresholds
from eventbus_debug.probes.levels import Checks
from eventbus_debug.probes.step._judge import Judge, Judgement
from eventbus_debug.probes.step._launch import Layout, Pending, _PinnedPool

NAMES = ("a", "b", "c")
GRADS = Checks(loss=True, grads=True)


def _judge(**th: object) -> Judge:
    return Judge(
        NAMES,
        (*NAMES, "bn.running_mean"),
        Thresholds(**th),  # type: ignore[arg-type]
        scaler=None,
        source="test",
        global_spikes=False,
    )


def _layout(step: int, **kw: object) -> Layout:
    fields: dict[str, object] = {
        "step": step,
        "checks": GRADS,
        "has_loss": True,
        "host_loss": None,
        "grad_slots": (0, 1, 2),
        "grad_numels": (100, 100, 100),
        "with_l1": False,
        "param_slots": (),
        "update_slots": (),
        "update_base": -1,
        "activations": (),
    }
    fields.update(kw)
    return Layout(**fields)  # type: ignore[arg-type]


def _run(judge: Judge, layout: Layout, values: list[float]) -> Judgement:
    pending = Pending(layout, [torch.tensor(values, dtype=torch.float64)], [], _PinnedPool())

    def recheck() -> tuple[list[float], tuple[int, ...]]:
        return [1.0, 1.0, 1.0, 1.0], (0, 1, 2, 3)

    return judge.judge(pending, pending.read(), deferred=False, recheck=recheck)


def test_healthy_step_publishes_only_telemetry() -> None:
    """Finite values: a finite verdict whose only event is the StepChecked, with the norm."""
    out = _run(_judge(), _layout(0), [0.5, 3.0, 4.0, 0.0])
    assert out.verdict.ok and out.verdict.grad_norm == pytest.approx(5.0)
    assert [type(e) for e in out.events] == [StepChecked]


def test_non_finite_loss_is_an_incident_before_the_telemetry() -> None:
    """A NaN loss: a LOSS incident, then the StepChecked naming it; the verdict is not finite."""
    out = _run(_judge(), _layout(0), [math.nan, 1.0, 1.0, 1.0])
    first, last = out.events
    assert isinstance(first, NonFiniteDetected) and first.role is TensorRole.LOSS
    assert isinstance(last, StepChecked) and last.fired == ("non_finite_detected",)
    assert not out.verdict.finite


def test_a_non_finite_buffer_is_named_as_a_buffer() -> None:
    """State slots past the parameters are buffers: their NaN is a BUFFER incident."""
    layout = _layout(0, checks=Checks(loss=True, grads=True, params=True), param_slots=(0, 1, 2, 3))
    out = _run(_judge(), layout, [0.5, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, math.nan])
    incidents = [e for e in out.events if isinstance(e, NonFiniteDetected)]
    assert [(e.role, e.names) for e in incidents] == [(TensorRole.BUFFER, ("bn.running_mean",))]
    assert out.verdict.param_norm == pytest.approx(math.sqrt(12.0))


def test_a_layer_that_goes_quiet_is_reported_once_and_again_after_reviving() -> None:
    """Dead after `patience` low checks, reported once; back to life resets it."""
    judge = _judge(vanishing_patience=3)
    healthy, quiet = [0.5, 1.0, 1.0, 1.0], [0.5, 1.0, 1.0, 0.0]
    fired: list[tuple[str, ...]] = []
    for step, values in enumerate([healthy] + [quiet] * 5 + [healthy] + [quiet] * 3):
        out = _run(judge, _layout(step), values)
        fired += [e.layers for e in out.events if isinstance(e, GradientVanished)]
    assert fired == [("c",), ("c",)]


def test_never_alive_layers_are_never_dead() -> None:
    """A gradient that was zero from the start is not a dead layer."""
    judge = _judge(vanishing_patience=2)
    for step in range(6):
        out = _run(judge, _layout(step), [0.5, 1.0, 1.0, 0.0])
        assert not any(isinstance(e, GradientVanished) for e in out.events)


def test_update_ratios_divide_by_the_snapshot_steps_parameter_norms() -> None:
    """‖Δw‖ of step 1 over the ‖w‖ judged at step 0; without that base, no ratios."""
    judge = _judge()
    params = Checks(loss=True, grads=True, params=True, updates=True)
    _run(judge, _layout(0, checks=params, param_slots=(0, 1, 2, 3)), [0.5, 1, 1, 1, 2, 4, 8, 1])
    out = _run(judge, _layout(1, update_slots=(0, 1, 2), update_base=0), [0.5, 1, 1, 1, 1, 1, 0])
    checked = out.events[-1]
    assert isinstance(checked, StepChecked)
    assert checked.update_ratios == {"a": 0.5, "b": 0.25, "c": 0.0}
    late = _run(judge, _layout(2, update_slots=(0, 1, 2), update_base=1), [0.5, 1, 1, 1, 1, 1, 1])
    last = late.events[-1]
    assert isinstance(last, StepChecked) and last.update_ratios == {}


def test_update_ratios_with_a_zero_norm_or_another_order(caplog: pytest.LogCaptureFixture) -> None:
    """A zero ‖w‖ gives inf (0 when ‖Δw‖ is 0 too), slots in another order are matched by slot;
    ratios out of bounds are logged."""
    params = Checks(loss=True, grads=True, params=True, updates=True)
    judge = _judge()
    _run(judge, _layout(0, checks=params, param_slots=(0, 1, 2, 3)), [0.5, 1, 1, 1, 0, 0, 8, 1])
    out = _run(judge, _layout(1, update_slots=(0, 1, 2), update_base=0), [0.5, 1, 1, 1, 3, 0, 4])
    checked = out.events[-1]
    assert isinstance(checked, StepChecked)
    assert checked.update_ratios == {"a": math.inf, "b": 0.0, "c": 0.5}
    assert "weight_update_ratio_out_of_bounds" in caplog.text
    judge = _judge()
    _run(judge, _layout(0, checks=params, param_slots=(2, 0, 1, 3)), [0.5, 1, 1, 1, 8, 2, 4, 1])
    out = _run(judge, _layout(1, update_slots=(0, 1, 2), update_base=0), [0.5, 1, 1, 1, 1, 1, 2])
    checked = out.events[-1]
    assert isinstance(checked, StepChecked)
    assert checked.update_ratios == {"a": 0.5, "b": 0.25, "c": 0.25}


def test_the_mean_abs_pass_is_wanted_only_when_the_bound_is_low() -> None:
    """Large gradients clear the bound (no L1 pass next); tiny ones ask for it; convergence not."""
    judge = _judge()
    assert judge.l1_wanted  # nothing judged yet: the first due step runs it
    _run(judge, _layout(0), [0.5, 1.0, 1.0, 1.0])
    assert not judge.l1_wanted
    _run(judge, _layout(1), [0.5, 1e-9, 1e-9, 1e-9])
    assert judge.l1_wanted
    _run(judge, _layout(2), [1e-12, 1e-9, 1e-9, 1e-9])  # the loss fell a millionfold
    assert not judge.l1_wanted


def test_the_whole_model_vanishes_from_the_mean_abs_values() -> None:
    """Mean |grad| below the threshold for `patience` L1 checks: one GradientVanished."""
    judge = _judge(vanishing_patience=2)
    fired = []
    for step in range(4):
        out = _run(judge, _layout(step, with_l1=True), [0.5, 1e-9, 1e-9, 1e-9, 1e-8, 1e-8, 1e-8])
        fired += [e for e in out.events if isinstance(e, GradientVanished)]
    assert len(fired) == 1 and not fired[0].all_zero and fired[0].step == 1
    assert fired[0].mean_abs == pytest.approx(1e-10) and fired[0].threshold == 1e-7
    assert fired[0].layers == ()


def _vanished(out: Judgement) -> list[GradientVanished]:
    return [e for e in out.events if isinstance(e, GradientVanished)]


def test_a_dead_layer_event_has_no_mean_abs_and_a_relative_threshold() -> None:
    """Dead layers alone: mean_abs None (the model did not vanish), even on a mean |grad| step;
    the threshold is the share every named layer fell below."""
    judge = _judge(vanishing_patience=2)
    _run(judge, _layout(0), [0.5, 1.0, 1.0, 1.0])
    _run(judge, _layout(1), [0.5, 1.0, 1.0, 0.0])
    out = _run(judge, _layout(2, with_l1=True), [0.5, 1.0, 1.0, 0.0, 10.0, 10.0, 0.0])
    (event,) = _vanished(out)
    assert (event.layers, event.mean_abs, event.all_zero) == (("c",), None, False)
    assert event.threshold == pytest.approx(1e-4)  # min(vanishing_relative, 1e-3 x share 1)


def test_a_quiet_layer_is_judged_against_its_own_history() -> None:
    """c's gradient wanders over 0.2..1.5e-4 of the model's RMS (an attention query at
    Hugging Face's init), crossing vanishing_relative both ways: never dead. Once it falls to
    zero it is dead after the patience."""
    judge = _judge(vanishing_patience=3)
    fired: list[GradientVanished] = []
    for step in range(400):
        c = (0.2e-4 + 1.3e-4 * ((step * 7919) % 101) / 100) * 0.8165  # share -> 2-norm
        fired += _vanished(_run(judge, _layout(step), [0.5, 1.0, 1.0, c]))
    assert fired == []
    for step in range(400, 403):
        fired += _vanished(_run(judge, _layout(step), [0.5, 1.0, 1.0, 0.0]))
    assert [(e.step, e.layers) for e in fired] == [(402, ("c",))]


def test_new_thresholds_keep_the_dead_layer_history() -> None:
    """Assigning thresholds restarts the spike and explosion windows, not the layers' history:
    c, alive before, dies after the new patience."""
    judge = _judge()
    _run(judge, _layout(0), [0.5, 1.0, 1.0, 1.0])
    judge.thresholds = Thresholds(vanishing_patience=2)
    fired = [e for s in (1, 2) for e in _vanished(_run(judge, _layout(s), [0.5, 1.0, 1.0, 0.0]))]
    assert [(e.step, e.layers) for e in fired] == [(2, ("c",))]


def test_no_dead_layers_when_per_layer_checks_are_off() -> None:
    """vanishing_per_layer=False: a layer going to zero is not reported."""
    judge = _judge(vanishing_patience=2, vanishing_per_layer=False)
    for step, c in enumerate([1.0, 0.0, 0.0, 0.0]):
        assert _vanished(_run(judge, _layout(step), [0.5, 1.0, 1.0, c])) == []


def test_out_of_bounds_update_ratios_are_logged_once_per_change(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A parameter that stays stalled (an lr=0 group, a bias before BatchNorm) is said once,
    not at every check; a new set is said again, and so is a return after a healthy check.
    A zero ‖w‖ at the snapshot (inf) has no scale and is not "too large"."""
    params = Checks(loss=True, grads=True, params=True, updates=True)
    judge = _judge()

    def check(step: int, updates: list[float]) -> None:
        _run(
            judge,
            _layout(step, checks=params, param_slots=(0, 1, 2, 3)),
            [0.5, 1, 1, 1, 0, 1, 1, 1],
        )
        _run(
            judge,
            _layout(step + 1, update_slots=(0, 1, 2), update_base=step),
            [0.5, 1, 1, 1, *updates],
        )

    with caplog.at_level("WARNING"):
        for step in range(0, 20, 2):  # "b" stalled at every check; "a" (norm 0) moves
            check(step, [0.5, 0.0, 0.1])
        assert caplog.text.count("weight_update_ratio_out_of_bounds") == 1
        check(20, [0.5, 0.0, 0.0])  # "c" stalls too: a new set
        check(22, [0.5, 0.1, 0.1])  # healthy
        check(24, [0.5, 0.0, 0.1])  # "b" again after a healthy check
    said = [r.getMessage() for r in caplog.records if "weight_update_ratio" in r.getMessage()]
    assert len(said) == 3 and all('too_large=""' in m for m in said)
    assert ["stalled=b " in said[0], "stalled=b,c " in said[1], "stalled=b " in said[2]] == [
        True
    ] * 3


def test_non_finite_gradients_under_a_finite_loss_hint_at_scaler_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Without scaler=, a GradScaler's overflow steps look like non-finite gradients under a
    finite loss: still an incident, and the log says once how to tell the session."""
    judge = _judge()
    with caplog.at_level("WARNING"):
        _run(judge, _layout(0), [math.nan, 1.0, math.nan, 1.0])  # the loss itself: no hint
        assert "non_finite_gradients_with_finite_loss" not in caplog.text
        for step in (1, 2, 3):
            out = _run(judge, _layout(step), [0.5, 1.0, math.inf, 1.0])
            assert any(isinstance(e, NonFiniteDetected) for e in out.events)
    said = [r.getMessage() for r in caplog.records if "finite_loss" in r.getMessage()]
    assert len(said) == 1 and "scaler=" in said[0] and "step=1" in said[0]
