"""Smoke tests of the decisions battery (``benchmarks/bench_decisions.py``).

They check that the battery runs and measures what it says, not the targets themselves: the
targets are what the battery is for, and the full-length runs belong to the benchmark.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from benchmarks.bench_decisions import (
    QUICK_STEPS,
    RUN_NAMES,
    Action,
    Battery,
    Fault,
    FaultKind,
    Incident,
    RunKind,
    RunResult,
    fault_steps_for,
    judge,
    main,
    render,
    row,
    run_battery,
)


@pytest.fixture(scope="module", name="battery")
def _battery() -> Battery:
    # One healthy run (the fp16 AMP classifier: the scaler path too) and one faulty run with
    # its plain and clean companions, at the --quick length.
    return run_battery(["amp_fp16", "nan_input"], QUICK_STEPS)


def _result(**overrides: object) -> RunResult:
    fields: dict[str, object] = {
        "name": "r",
        "kind": RunKind.HEALTHY,
        "steps": 1000,
        "steps_run": 1000,
        "planted_at": None,
        "detected_at": None,
        "incidents": (),
        "actions": (),
        "skipped_steps": 0,
        "scaler_skips": 0,
        "stopped_at": None,
        "stop_reason": "",
        "crash": None,
        "lr_end": 1e-3,
        "lr_reference": 1e-3,
        "final_loss": 1.0,
        "final_loss_clean": None,
        "final_loss_plain": None,
        "recovery_claimed": False,
        "wall_s": 0.1,
    }
    fields.update(overrides)
    return RunResult(**fields)  # type: ignore[arg-type]


def test_quick_battery_runs_every_requested_run_in_order(battery: Battery) -> None:
    """The battery runs the named runs in the battery's order, healthy ones --quick long."""
    assert [r.name for r in battery.results] == ["amp_fp16", "nan_input"]
    assert battery.steps == QUICK_STEPS
    assert battery.fault_steps == fault_steps_for(QUICK_STEPS)
    healthy = [r for r in battery.results if r.kind is RunKind.HEALTHY]
    assert [r.steps for r in healthy] == [QUICK_STEPS]
    for r in healthy:
        assert r.planted_at is None and r.detected_at is None and r.detection_delay is None
        assert 0 < r.steps_run <= r.steps
        assert r.stopped == (r.stopped_at is not None)
        assert r.lr_reference == pytest.approx(3e-3)
        assert r.final_loss_clean is None and r.loss_ratio is None
        per_10k = r.false_alarms_per_10k
        assert per_10k is not None
        assert per_10k == pytest.approx(len(r.incidents) * 10_000 / r.steps_run)
        assert r.wall_s > 0


def test_quick_battery_measures_the_planted_fault(battery: Battery) -> None:
    """A faulty run records where the fault was planted and compares with the clean run."""
    (r,) = [r for r in battery.results if r.kind is RunKind.FAULTY]
    assert r.steps == fault_steps_for(QUICK_STEPS)
    assert r.planted_at == r.steps // 3
    assert r.detected_at is None or r.detected_at >= r.planted_at
    assert all(isinstance(i, Incident) for i in r.incidents)
    assert all(isinstance(a, Action) and a.action != "continue" for a in r.actions)
    assert r.recovery_claimed
    clean, plain = r.final_loss_clean, r.final_loss_plain
    assert clean is not None and math.isfinite(clean) and clean > 0
    # The fault is real: the plain loop that steps on a NaN batch ends with NaN weights.
    assert plain is not None and math.isnan(plain)
    ratio = r.loss_ratio
    assert ratio is not None
    assert ratio == r.final_loss / clean or (math.isnan(ratio) and math.isnan(r.final_loss))


def test_quick_battery_judges_three_targets_and_renders_a_row_per_run(battery: Battery) -> None:
    """The three issue-9 targets are judged, and the table has one row per run."""
    assert [t.name for t in battery.targets] == [
        "0 actions and 0 stops on every healthy run",
        "every planted fault detected within 2 steps",
        "final loss within 10% of clean where recovery is claimed",
    ]
    assert battery.passed == all(t.passed for t in battery.targets)
    text = render(battery)
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + len(battery.results)  # the header, then one row per run
    assert all(row.count("|") == rows[0].count("|") for row in rows)
    assert sum(line.startswith(("- PASS", "- FAIL")) for line in text.splitlines()) == 3


def test_amp_run_counts_the_scalers_own_skips(battery: Battery) -> None:
    """The fp16 run's summed loss overflows at the scaler's initial scale: a skip is counted."""
    (amp,) = [r for r in battery.results if r.name == "amp_fp16"]
    if amp.skipped_steps == 0 and not amp.stopped:
        assert amp.scaler_skips >= 1
    else:  # the library skipped the overflow step itself: the scaler never saw it
        assert amp.skipped_steps >= 1 or amp.stopped


def test_judge_fails_a_healthy_run_with_an_action_and_passes_a_quiet_one() -> None:
    """An applied action or a stop on a healthy run fails the first target."""
    quiet = _result(incidents=(Incident(step=3, kind="loss_spiked"),))
    assert judge([quiet])[0].passed
    acted = _result(name="acted", actions=(Action(step=4, action="scale_lr"),))
    stopped = _result(name="stopped", stopped_at=9, stop_reason="exhausted")
    for r in (acted, stopped):
        target = judge([quiet, r])[0]
        assert not target.passed
        assert r.name in target.detail


def test_judge_detection_window_and_loss_tolerance() -> None:
    """Detection later than 2 steps, or a final loss 10 % off the clean one, fails."""
    on_time = _result(kind=RunKind.FAULTY, planted_at=10, detected_at=12)
    late = _result(kind=RunKind.FAULTY, planted_at=10, detected_at=13)
    missed = _result(kind=RunKind.FAULTY, planted_at=10, detected_at=None)
    assert judge([on_time])[1].passed
    assert not judge([on_time, late])[1].passed
    assert not judge([missed])[1].passed
    close = _result(
        kind=RunKind.FAULTY, recovery_claimed=True, final_loss=1.09, final_loss_clean=1.0
    )
    far = _result(kind=RunKind.FAULTY, recovery_claimed=True, final_loss=1.11, final_loss_clean=1.0)
    nan = _result(
        kind=RunKind.FAULTY, recovery_claimed=True, final_loss=math.nan, final_loss_clean=1.0
    )
    assert judge([close])[2].passed
    assert not judge([far])[2].passed
    assert not judge([nan])[2].passed


def test_false_alarms_of_a_faulty_run_count_only_steps_before_the_fault() -> None:
    """Incidents before the planted step are false alarms; those at or after it are not."""
    incidents = (
        Incident(step=2, kind="loss_spiked"),
        Incident(step=50, kind="non_finite_detected"),
        Incident(step=None, kind="error_raised"),
    )
    r = _result(kind=RunKind.FAULTY, planted_at=50, detected_at=50, incidents=incidents)
    assert r.false_alarms == 1
    assert r.false_alarms_per_10k == pytest.approx(200.0)
    assert _result(incidents=incidents).false_alarms == 3


def test_faults_touch_only_their_step() -> None:
    """Each planted fault changes its own step (or window) and leaves the others alone."""
    x, y = torch.ones(4, 3), torch.tensor([0, 1, 2, 3])
    nan = Fault(FaultKind.NAN_INPUT, 5)
    assert torch.isnan(nan.batch(5, x, y, 4)[0]).sum() == 1
    assert torch.isfinite(nan.batch(4, x, y, 4)[0]).all()
    spike = Fault(FaultKind.SUSTAINED_SPIKE, 5)
    for step in (5, 54):
        assert (spike.batch(step, x, y, 4)[1] != y).all()
    assert torch.equal(spike.batch(55, x, y, 4)[1], y)
    boom = Fault(FaultKind.EXPLOSION, 5)
    assert float(boom.loss(5, torch.tensor(2.0))) == 2e6
    assert float(boom.loss(6, torch.tensor(2.0))) == 2.0
    assert Fault(FaultKind.LR_TOO_HIGH, 0).lr_scale == 1000.0
    model = nn.Linear(3, 2)
    Fault(FaultKind.NAN_PARAM, 5).before_forward(4, model)
    assert torch.isfinite(model.weight).all()
    Fault(FaultKind.NAN_PARAM, 5).before_forward(5, model)
    assert torch.isnan(model.weight).sum() == 1


def test_row_reports_crashes_and_stops_in_the_stopped_column() -> None:
    """A library crash reads "crash: <error>", a stop names its step; pipes cannot break the row."""
    ok = row(_result())
    crashed = row(_result(crash="RuntimeError: a|b"))
    stopped = row(_result(stopped_at=9, stop_reason="strategies exhausted"))
    assert "| crash: RuntimeError: a/b |" in crashed
    assert "| yes @ 9: strategies exhausted |" in stopped
    assert "| no |" in ok
    assert crashed.count("|") == stopped.count("|") == ok.count("|")


def test_run_battery_rejects_unknown_runs_and_short_runs() -> None:
    """A bad run name or a run too short to average the final loss is a clear ValueError."""
    with pytest.raises(ValueError, match=r"unknown run.*nope.*valid: classifier"):
        run_battery(["nope"], QUICK_STEPS)
    with pytest.raises(ValueError, match="steps must be an int >= 200"):
        run_battery(["classifier"], 50)
    assert "classifier" in RUN_NAMES


def test_main_prints_the_table_and_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    """The command line prints the markdown table and, without --check, exits 0."""
    assert main(["--runs", "regression_to_zero", "--steps", "200"]) == 0
    out = capsys.readouterr().out
    assert "| regression_to_zero | healthy | " in out
    assert "- PASS: every planted fault detected within 2 steps" in out  # no faulty run
