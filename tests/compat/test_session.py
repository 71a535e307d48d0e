"""eventbus_debug.compat.session: seed 001's factories over the Session."""

from __future__ import annotations

import pytest
from torch import nn

from eventbus_debug import DebugLevel, DebugMode
from eventbus_debug.compat import (
    create_pytorch_debugger,
    debug_training_session,
    debug_training_step,
)

from ..session._helpers import batch, setup


class TestSeedFactories:
    async def test_seed_factory_and_one_shot_step(self) -> None:
        """create_pytorch_debugger maps the seed switches; debug_training_step runs one step."""
        model, opt = setup()
        dbg = create_pytorch_debugger(model, opt, enable_gradient_checking=True, log_dir=None)
        assert dbg.level is DebugLevel.ADVANCED
        r = await debug_training_step(model, *batch(), nn.functional.mse_loss, opt)
        assert r.stepped and r.verdict.finite

    def test_switches_become_modes(self) -> None:
        """Every switch off means DebugMode.NONE (the probe is off); profiling is a mode."""
        model, opt = setup()
        off = debug_training_session(
            model,
            opt,
            enable_anomaly_detection=False,
            enable_gradient_checking=False,
            log_dir=None,
        )
        assert off.level is DebugLevel.OFF
        prof = create_pytorch_debugger(model, enable_profiling=True, log_dir=None)
        assert prof.plan.profiling and DebugMode.PROFILING.value == "profiling"

    async def test_foreign_session_refused(self) -> None:
        """debug_training_step refuses a session built for another model."""
        model, opt = setup()
        other, _ = setup()
        session = create_pytorch_debugger(other, opt, log_dir=None)
        with pytest.raises(ValueError, match="another model"):
            await debug_training_step(model, *batch(), nn.functional.mse_loss, opt, session=session)
