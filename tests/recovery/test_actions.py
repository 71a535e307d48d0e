"""Typed recovery actions: their checks, their kinds, and their trip through the log."""

from __future__ import annotations

import math

import pytest

from eventbus_debug.events import (
    CallSettings,
    ErrorCategory,
    ErrorRaised,
    RecoveryAction,
    RecoveryDecided,
)
from eventbus_debug.log import decode_event, encode_event
from eventbus_debug.recovery import (
    Action,
    ClipGradients,
    Continue,
    DecidedAction,
    Decision,
    Fallback,
    FreeMemory,
    RestoreState,
    Retry,
    ScaleLR,
    ShrinkBatch,
    SkipStep,
    Stop,
)

EVERY_ACTION: tuple[Action, ...] = (
    Continue(),
    SkipStep(batches=3),
    ClipGradients(max_norm=1.0, total_norm=250.0),
    ScaleLR(factor=0.5, steps=200),
    ScaleLR(factor=2.0),
    RestoreState(required=False),
    FreeMemory(),
    ShrinkBatch(size=16),
    Retry(free_memory=True),
    Fallback(num_workers=0, pin_memory=False, cpu=True),
    Stop(),
)


class TestKinds:
    def test_every_recovery_action_has_one_class(self) -> None:
        """Each RecoveryAction value is the kind of exactly one action class."""
        kinds = {type(a).kind for a in EVERY_ACTION}
        assert kinds == set(RecoveryAction)

    def test_a_decision_reports_its_action_kind(self) -> None:
        """Decision.kind and DecidedAction.kind/action/reason read through to the action."""
        decision = Decision(action=SkipStep(batches=2), reason="nan loss")
        decided = DecidedAction(
            decision=decision, strategy="s", trigger_kind="k", trigger_seq=3, step=7
        )
        assert decision.kind is RecoveryAction.SKIP_STEP
        assert decided.kind is RecoveryAction.SKIP_STEP
        assert decided.action == SkipStep(batches=2) and decided.reason == "nan loss"


class TestLogRoundTrip:
    @pytest.mark.parametrize("action", EVERY_ACTION, ids=lambda a: type(a).__name__)
    def test_recovery_decided_comes_back_with_its_typed_action(self, action: Action) -> None:
        """encode → decode gives the same event, the action as the same class and numbers."""
        event = RecoveryDecided(
            seq=4,
            step=9,
            action=action.kind,
            reason="why",
            strategy="s",
            trigger_kind="non_finite_detected",
            trigger_seq=3,
            decided=action,
        )
        back = decode_event(encode_event(event))
        assert back == event
        assert isinstance(back, RecoveryDecided) and type(back.decided) is type(action)

    def test_error_raised_keeps_its_typed_settings_and_retry_id(self) -> None:
        """CallSettings and retry_id survive the log: ints stay ints, flags stay bools."""
        settings = CallSettings(batch_size=64, num_workers=4, pin_memory=True, smaller_model=False)
        event = ErrorRaised(
            seq=1,
            error_type="torch.OutOfMemoryError",
            message="CUDA out of memory",
            category=ErrorCategory.MEMORY,
            settings=settings,
            retry_id="abc123",
        )
        line = encode_event(event)
        assert b'"batch_size":64' in line and b'"pin_memory":true' in line
        back = decode_event(line)
        assert back == event

    def test_a_non_finite_clip_norm_cannot_be_decided(self) -> None:
        """The log keeps NaN, but an action refuses one: a clip to an infinite norm is a bug."""
        with pytest.raises(ValueError, match=r"ClipGradients\.total_norm"):
            ClipGradients(max_norm=1.0, total_norm=math.inf)


class TestBadInput:
    @pytest.mark.parametrize(
        ("build", "match"),
        [
            (lambda: SkipStep(batches=0), r"SkipStep\.batches must be an int >= 1, got 0"),
            (lambda: SkipStep(batches=1.5), r"SkipStep\.batches must be an int"),  # type: ignore[arg-type]
            (lambda: ScaleLR(factor=0.0), r"ScaleLR\.factor must be a finite number > 0"),
            (lambda: ScaleLR(factor=True), r"ScaleLR\.factor"),
            (lambda: ScaleLR(factor=0.5, steps=0), r"ScaleLR\.steps must be an int >= 1"),
            (lambda: ClipGradients(max_norm=-1.0, total_norm=2.0), r"ClipGradients\.max_norm"),
            (lambda: ShrinkBatch(size=0), r"ShrinkBatch\.size must be an int >= 1"),
            (lambda: Fallback(num_workers=-1), r"Fallback\.num_workers must be an int >= 0"),
            (lambda: SkipStep(tag="stop"), r"SkipStep\.tag must be 'skip_step'"),  # type: ignore[arg-type]
        ],
    )
    def test_bad_numbers_are_value_errors_naming_the_field(self, build: object, match: str) -> None:
        """Each action checks its numbers at construction, naming the field and the value."""
        assert callable(build)
        with pytest.raises(ValueError, match=match):
            build()

    def test_flags_must_be_bools(self) -> None:
        """A 0/1 float where a flag belongs (the old parameters' habit) is a TypeError."""
        with pytest.raises(TypeError, match=r"RestoreState\.required must be a bool, got 0\.0"):
            RestoreState(required=0.0)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"Fallback\.cpu must be a bool"):
            Fallback(cpu=1)  # type: ignore[arg-type]

    def test_a_decision_needs_a_typed_action(self) -> None:
        """Decision(action=RecoveryAction.RETRY) (the old enum) is refused with the classes named."""
        with pytest.raises(TypeError, match=r"Decision\.action must be one of Continue, SkipStep"):
            Decision(action=RecoveryAction.RETRY, reason="x")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"Decision\.reason must be a string"):
            Decision(action=Retry(), reason=None)  # type: ignore[arg-type]
