"""eventbus_debug.session.modes: what each DebugMode turns on."""

from __future__ import annotations

import pytest

from eventbus_debug import DebugLevel, DebugMode
from eventbus_debug.session import plan_for


class TestPlan:
    def test_modes_map_to_levels_and_instruments(self) -> None:
        """Modes combine: the highest level wins, instruments are the union."""
        plan = plan_for(DebugMode.ANOMALY_DETECTION, "memory_profiling")
        assert plan.level is DebugLevel.BASIC and plan.anomaly_localization and plan.memory_tracking
        assert plan_for(DebugMode.GRADIENT_CHECKING).level is DebugLevel.ADVANCED
        assert plan_for(DebugMode.FULL).level is DebugLevel.EXTREME
        assert plan_for(DebugMode.NONE).level is DebugLevel.OFF

    def test_unknown_mode_lists_valid_ones(self) -> None:
        """A bad mode name lists the valid ones."""
        with pytest.raises(ValueError, match="anomaly_detection"):
            plan_for("fast")
