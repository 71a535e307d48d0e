from __future__ import annotations

import io
from pathlib import Path

from eventbus_debug import (
    ErrorRaised,
    GradientExploded,
    NonFiniteDetected,
    StepSkipped,
    read_events,
)
from eventbus_debug.demo import DemoFaults, run_demo


async def test_demo_injects_faults_and_recovers(tmp_path: Path) -> None:
    """Each injected fault is detected and acted on; the report and log are written."""
    stream = io.StringIO()
    faults = DemoFaults(nan_step=20, explode_step=40, oom_step=50, leak_start=55, leak_stop=60)
    result = await run_demo(tmp_path, steps=70, width=16, faults=faults, stream=stream)
    assert result.steps == 70 and result.batch_size == 64
    assert 20 in result.skipped_steps and 40 in result.skipped_steps
    events = list(read_events(tmp_path))
    nan = [e for e in events if isinstance(e, NonFiniteDetected)]
    assert nan and nan[0].step == 20
    assert any(isinstance(e, GradientExploded) and e.step == 40 for e in events)
    assert any(
        isinstance(e, ErrorRaised) and e.error_type.endswith("OutOfMemoryError") for e in events
    )
    assert {e.step for e in events if isinstance(e, StepSkipped)} >= {20, 40}
    assert result.report_html is not None and result.report_html.exists()
    assert "demo finished: 70 steps" in stream.getvalue()


async def test_demo_is_deterministic(tmp_path: Path) -> None:
    """Two runs with the same seed give the same losses."""
    a = await run_demo(tmp_path / "a", steps=8, width=8, console=False)
    b = await run_demo(tmp_path / "b", steps=8, width=8, console=False)
    assert (a.first_loss, a.final_loss) == (b.first_loss, b.final_loss)
