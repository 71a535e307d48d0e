"""eventbus_debug.session.options: the knobs, validated once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from eventbus_debug import DebugLevel, DebugMode, RecoveryPolicy, SessionOptions
from eventbus_debug.session.options import SessionKnobs, level_of


class TestSessionOptions:
    def test_defaults_and_derived_values(self) -> None:
        """The defaults give a BASIC plan, the safe policy, no schedulers and a log path."""
        options = SessionOptions()
        assert options.plan.level is DebugLevel.BASIC and not options.plan.profiling
        assert options.recovery_policy is RecoveryPolicy.SAFE
        assert options.schedulers == ()
        assert options.log_path == Path("debug_logs")
        assert SessionOptions(log_dir=None).log_path is None

    def test_mode_and_level_names(self) -> None:
        """Names work for levels, modes and policies; a mode implies its level."""
        assert SessionOptions(level="Extreme").plan.level is DebugLevel.EXTREME
        full = SessionOptions(mode=[DebugMode.FULL])
        assert full.plan.level is DebugLevel.EXTREME and full.plan.memory_tracking
        assert full.wants_leak_detector and not SessionOptions().wants_leak_detector
        assert SessionOptions(policy="observe").recovery_policy is RecoveryPolicy.OBSERVE

    def test_keywords_are_the_fields(self) -> None:
        """The sessions' keywords (SessionKnobs) are exactly SessionOptions' fields."""
        assert SessionOptions.knobs() == frozenset(SessionKnobs.__annotations__)

    def test_frozen(self) -> None:
        """Options are values: assigning a field fails."""
        options = SessionOptions()
        with pytest.raises(AttributeError):
            options.name = "other"  # type: ignore[misc]

    @pytest.mark.parametrize(
        ("knobs", "error", "match"),
        [
            ({"level": "basic", "mode": "full"}, ValueError, "either level= or mode="),
            ({"level": "loud"}, ValueError, "level must be one of"),
            ({"mode": "fast"}, ValueError, "mode must be one of"),
            ({"policy": "reckless"}, ValueError, "reckless"),
            ({"system_interval": 0}, ValueError, "system_interval must be a positive"),
            ({"system_interval": True}, ValueError, "system_interval must be a positive"),
            ({"overhead_budget": 0}, ValueError, r"overhead_budget must be a number in \(0, 1\)"),
            ({"overhead_budget": 1.5}, ValueError, "overhead_budget"),
            ({"overhead_budget": "2%"}, ValueError, "overhead_budget"),
            ({"overhead_budget": True}, ValueError, "overhead_budget"),
            ({"overhead_budget": -0.02}, ValueError, "overhead_budget"),
            ({"log_dir": 3}, TypeError, "log_dir must be a path"),
            ({"log_dir": ""}, ValueError, "log_dir must not be empty .* None for no log"),
            ({"name": None}, TypeError, "name must be a str"),
            ({"report": "yes"}, TypeError, "report must be True, False or a sink"),
            ({"alerts": 1.0}, TypeError, "alerts must be True, False or a sink"),
            ({"console": 3}, TypeError, "console must be a bool, a text stream or a sink"),
            ({"recovery": "on"}, TypeError, "recovery must be True, False or a RecoveryEngine"),
            ({"skip_non_finite": 1}, TypeError, "skip_non_finite must be a bool"),
            ({"thresholds": {}}, TypeError, "thresholds must be a Thresholds"),
            ({"cadence": 5}, TypeError, "cadence must be a Cadence"),
            ({"input_spec": "2d"}, TypeError, "input_spec must be an InputSpec"),
            ({"output_checker": len}, TypeError, "output_checker must be an OutputChecker"),
            ({"scaler": object()}, TypeError, "scaler must be a torch.amp.GradScaler"),
            ({"leak_detector": "yes"}, TypeError, "leak_detector must be a LeakDetector"),
            ({"distributed": "nccl"}, TypeError, "distributed must be None, a bool"),
            ({"scheduler": object()}, TypeError, "step"),
        ],
    )
    def test_bad_values_refused(
        self, knobs: dict[str, Any], error: type[Exception], match: str
    ) -> None:
        """Each bad knob is refused at construction with a message naming it."""
        with pytest.raises(error, match=match):
            SessionOptions(**knobs)


def test_level_of() -> None:
    """level_of takes levels and names in any case, and lists the valid ones otherwise."""
    assert level_of(DebugLevel.OFF) is DebugLevel.OFF
    assert level_of("ADVANCED") is DebugLevel.ADVANCED
    with pytest.raises(ValueError, match="basic"):
        level_of("loud")
