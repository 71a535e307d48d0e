from __future__ import annotations

import math

import pytest
import torch

from eventbus_debug import EventBus
from eventbus_debug.testing import RecordingSink
from eventbus_debug.validation import (
    InputSpec,
    InputValidationError,
    InputValidationFailed,
    InputValidator,
    OutputAnomalyDetected,
    OutputChecker,
    ValidationPolicy,
    validate_input,
)


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
