"""extras.validation: input specs, the validator's policies and the output checker."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from eventbus_debug import EventBus, Session, SyncSession
from eventbus_debug.events import InputValidationFailed, OutputAnomalyDetected, StepSkipped
from eventbus_debug.extras.validation import (
    InputSpec,
    InputValidationError,
    InputValidator,
    OutputChecker,
    ValidationPolicy,
    validate_input,
)
from eventbus_debug.testing import RecordingSink


class TestValidateInput:
    def test_valid_batch_has_no_violation(self) -> None:
        """A batch matching every rule gives an empty tuple."""
        spec = InputSpec(ndim=2, shape=(None, 3), dtype=torch.float32, min_value=-5, max_value=5)
        assert validate_input(torch.zeros(4, 3), spec) == ()

    @pytest.mark.parametrize(
        ("tensor", "spec", "rule"),
        [
            (torch.tensor([1.0, math.nan]), InputSpec(), "non_finite"),
            (torch.tensor([1.0, math.inf]), InputSpec(), "non_finite"),
            (torch.tensor([1.0, -math.inf]), InputSpec(), "non_finite"),
            (torch.tensor([1.0, 2e4]), InputSpec(max_abs=1e3), "range"),
            (torch.tensor([-1.0, 0.5]), InputSpec(min_value=0.0), "range"),
            (torch.zeros(2, 3), InputSpec(ndim=3), "shape"),
            (torch.zeros(2, 3), InputSpec(shape=(None, 4)), "shape"),
            (torch.zeros(2, dtype=torch.int64), InputSpec(dtype=torch.float32), "dtype"),
        ],
    )
    def test_each_rule(self, tensor: torch.Tensor, spec: InputSpec, rule: str) -> None:
        """Each broken rule is reported once, by name."""
        assert [v.rule for v in validate_input(tensor, spec)] == [rule]

    def test_counts_and_finite_range(self) -> None:
        """NaN/Inf are counted and the range is that of the finite values."""
        (v,) = validate_input(torch.tensor([math.nan, math.nan, math.inf, 2.0, -3.0]), InputSpec())
        assert (v.nan_count, v.inf_count, v.min_value, v.max_value) == (2, 1, -3.0, 2.0)

    def test_allow_non_finite(self) -> None:
        """allow_non_finite turns the non-finite rule off."""
        assert validate_input(torch.tensor([math.nan]), InputSpec(allow_non_finite=True)) == ()

    def test_not_a_tensor(self) -> None:
        """A list is rejected with a message naming the argument."""
        with pytest.raises(TypeError, match=r"inputs must be a torch\.Tensor, got list"):
            validate_input([1.0], InputSpec())  # type: ignore[arg-type]

    def test_bad_spec(self) -> None:
        """An inverted range is rejected at construction."""
        with pytest.raises(ValueError, match="min_value"):
            InputSpec(min_value=2, max_value=1)


class TestInputValidator:
    async def test_report_policy_publishes_incidents(
        self, bus: EventBus, recorder: RecordingSink
    ) -> None:
        """Under REPORT each violation is an InputValidationFailed incident; nothing raises."""
        bus.subscribe(recorder)
        validator = InputValidator(
            InputSpec(max_abs=10), policy=ValidationPolicy.REPORT, name="flows"
        )
        out = validator.check(torch.tensor([math.nan, 100.0]), publish=bus.publish_nowait, step=7)
        await bus.drain()
        events = recorder.of_type(InputValidationFailed)
        assert [e.rule for e in events] == [v.rule for v in out] == ["non_finite", "range"]
        assert all(e.step == 7 and e.name == "flows" and e.shape == (2,) for e in events)
        assert events[0].dtype == "float32"

    def test_raise_policy(self) -> None:
        """Under RAISE an invalid batch raises with every violation in the message."""
        validator = InputValidator(InputSpec(ndim=2, max_abs=1.0))
        with pytest.raises(InputValidationError, match=r"dimensions.*range") as info:
            validator.check(torch.tensor([5.0]))
        assert len(info.value.violations) == 2
        assert isinstance(info.value, ValueError)


class TestOutputChecker:
    def test_healthy_outputs(self) -> None:
        """Varied, finite, in-range outputs give no incident."""
        assert OutputChecker(expected_range=(0, 1)).check(torch.rand(8, 3)) == ()

    def test_collapsed_predictions(self) -> None:
        """Identical predictions for every sample are 'collapsed'."""
        (e,) = OutputChecker().check(torch.tensor([[0.2, 0.8]] * 5))
        assert e.rule == "collapsed" and e.std == 0.0

    def test_non_finite_and_range(
        self,
    ) -> None:
        """NaN outputs and out-of-range values are separate incidents."""
        events = OutputChecker(expected_range=(0, 1)).check(
            torch.tensor([[math.nan], [3.0], [0.5]])
        )
        assert [e.rule for e in events] == ["non_finite", "range"]
        assert events[0].nonfinite_count == 1 and events[1].max_value == 3.0

    async def test_publishes(self, bus: EventBus, recorder: RecordingSink) -> None:
        """With publish the incidents reach the bus."""
        bus.subscribe(recorder)
        OutputChecker().check(torch.ones(3, 2), publish=bus.publish_nowait)
        await bus.drain()
        assert len(recorder.of_type(OutputAnomalyDetected)) == 1


def _quiet_csr(dense: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Sparse CSR tensor support is in beta"
        return dense.to_sparse_csr()


class TestEveryInput:
    def test_complex_nan_and_inf_fail_validation(self) -> None:
        """A complex batch holding NaN and Inf is caught; max_abs bounds |z|."""
        x = torch.tensor([complex(1, 1), complex(math.nan, 0), complex(0, math.inf)])
        (v,) = validate_input(x, InputSpec())
        assert (v.rule, v.nan_count, v.inf_count) == ("non_finite", 1, 1)
        (r,) = validate_input(torch.tensor([complex(3, 4)]), InputSpec(max_abs=4.0))
        assert r.rule == "range" and r.max_value == 5.0

    def test_complex_with_an_order_bound_is_a_dtype_violation(self) -> None:
        """min_value/max_value need real values: a complex batch breaks the dtype rule."""
        rules = [
            v.rule
            for v in validate_input(torch.zeros(2, dtype=torch.cfloat), InputSpec(min_value=0))
        ]
        assert rules == ["dtype"]

    @pytest.mark.parametrize(
        "make",
        [
            lambda d: d.to_sparse(),
            _quiet_csr,
            lambda d: d.to_sparse_csc(),
        ],
    )
    def test_sparse_batches_are_validated(
        self, make: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        """Sparse COO/CSR/CSC batches: their stored values are validated, no crash."""
        bad = make(torch.tensor([[0.0, math.nan], [50.0, 0.0]]))
        rules = [v.rule for v in validate_input(bad, InputSpec(max_abs=10.0, shape=(None, 2)))]
        assert rules == ["non_finite", "range"]
        good = make(torch.tensor([[0.0, 1.0], [2.0, 0.0]]))
        assert validate_input(good, InputSpec(max_abs=10.0)) == ()

    def test_sparse_and_structured_outputs(self) -> None:
        """OutputChecker takes sparse tensors, dicts, tuples and numbers (no AttributeError)."""
        checker = OutputChecker(expected_range=(0, 1))
        sparse = torch.tensor([[0.0, 5.0], [math.nan, 0.0]]).to_sparse()
        assert [e.rule for e in checker.check(sparse)] == ["non_finite", "range"]
        events = checker.check(
            {"logits": torch.rand(4, 2), "loss": math.nan, "aux": (torch.full((3, 1), 2.0),)}
        )
        assert [(e.name, e.rule) for e in events] == [
            ("outputs", "non_finite"),
            ("outputs['aux'][0]", "range"),
            ("outputs['aux'][0]", "collapsed"),
        ]
        assert "outputs['loss']" in events[0].message
        assert checker.check(0.5) == ()
        with pytest.raises(TypeError, match="got str"):
            checker.check("logits")

    def test_meta_tensors_are_a_clear_error(self) -> None:
        """A meta batch or output has no values: ValueError, not a crash inside torch."""
        with pytest.raises(ValueError, match="meta tensor"):
            validate_input(torch.empty(2, device="meta"), InputSpec())
        with pytest.raises(ValueError, match="meta tensor"):
            OutputChecker().check(torch.empty(2, device="meta"))

    @pytest.mark.parametrize(
        ("kwargs", "error"),
        [
            ({"min_value": math.nan}, ValueError),
            ({"max_abs": math.nan}, ValueError),
            ({"max_value": "1"}, TypeError),
        ],
    )
    def test_spec_bounds_are_checked(self, kwargs: dict[str, Any], error: type[Exception]) -> None:
        """NaN or non-number bounds are rejected when the spec is built."""
        with pytest.raises(error):
            InputSpec(**kwargs)

    def test_output_checker_arguments(self) -> None:
        """NaN range bounds and a NaN or negative collapse_std are rejected."""
        with pytest.raises(ValueError, match="expected_range"):
            OutputChecker(expected_range=(math.nan, 1.0))
        with pytest.raises(TypeError, match="expected_range"):
            OutputChecker(expected_range=(0.0,))  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="collapse_std"):
            OutputChecker(collapse_std=math.nan)


class _BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(3)
        self.lin = nn.Linear(3, 1)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        out: torch.Tensor = self.lin(self.bn(x))
        return out


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, y)


class TestRejectedBatchHasNoEffect:
    async def test_skip_policy_runs_no_forward_and_keeps_batchnorm_finite(
        self, recorder: RecordingSink
    ) -> None:
        """A NaN batch under SKIP never reaches the model: BatchNorm stats stay finite, no
        optimizer step, a StepSkipped with the session's step; the next batch trains."""
        model = _BNNet()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        weight = model.lin.weight.detach().clone()
        async with EventBus() as bus:
            bus.subscribe(recorder)
            async with Session(model, opt, bus=bus, log_dir=None, recovery=False) as s:
                s.validator = InputValidator(InputSpec(), policy=ValidationPolicy.SKIP)
                bad = torch.randn(8, 3)
                bad[2, 1] = math.nan
                result = await s.training_step(bad, torch.randn(8, 1), _mse, step=4)
                assert model.calls == 0 and not result.stepped
                assert result.verdict.actions == ("reject_batch",) and math.isnan(result.loss)
                mean, var = model.bn.running_mean, model.bn.running_var
                assert mean is not None and var is not None
                assert torch.isfinite(mean).all() and torch.isfinite(var).all()
                assert torch.equal(model.lin.weight, weight)
                ok = await s.training_step(torch.randn(8, 3), torch.randn(8, 1), _mse)
                assert ok.step == 5 and ok.stepped and model.calls == 1
            await bus.drain()
        (skipped,) = recorder.of_type(StepSkipped)
        assert skipped.step == 4 and "before the forward pass" in skipped.reason
        (failed,) = recorder.of_type(InputValidationFailed)
        assert failed.step == 4 and failed.rule == "non_finite"

    def test_sync_session_skips_too_and_report_policy_still_runs(self) -> None:
        """SyncSession under SKIP rejects; under REPORT (the session default) the batch runs."""
        model = _BNNet()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        bad = torch.full((4, 3), math.inf)
        with SyncSession(model, opt, log_dir=None, recovery=False, input_spec=InputSpec()) as s:
            assert s.validator is not None and s.validator.policy is ValidationPolicy.REPORT
            s.training_step(bad, torch.zeros(4, 1), _mse, step=0)
            assert model.calls == 1  # REPORT: reported, then run
            s.validator = InputValidator(InputSpec(), policy=ValidationPolicy.SKIP)
            result = s.training_step(bad, torch.zeros(4, 1), _mse, step=1)
            assert model.calls == 1 and not result.stepped

    def test_policy_rejects(self) -> None:
        """RAISE and SKIP reject a batch; REPORT does not."""
        assert ValidationPolicy.SKIP.rejects and ValidationPolicy.RAISE.rejects
        assert not ValidationPolicy.REPORT.rejects
