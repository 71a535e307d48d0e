from __future__ import annotations

import io
from collections import Counter
from pathlib import Path

import pytest

from eventbus_debug import read_events
from eventbus_debug.demo import DemoFaults, run_demo
from eventbus_debug.events import (
    ErrorRaised,
    GradientExploded,
    NonFiniteDetected,
    RecoveryApplied,
    StepSkipped,
)


async def test_demo_injects_faults_and_recovers(tmp_path: Path) -> None:
    """Each injected fault is detected and acted on; the report and log are written."""
    stream = io.StringIO()
    faults = DemoFaults(nan_step=20, explode_step=40, oom_step=50, leak_start=55, leak_stop=60)
    result = await run_demo(tmp_path, steps=70, width=16, faults=faults, stream=stream)
    assert result.steps == 70 and result.batch_size == 64
    assert 20 in result.skipped_steps  # the NaN step is skipped; the explosion is acted on
    events = list(read_events(tmp_path))
    nan = [e for e in events if isinstance(e, NonFiniteDetected)]
    assert nan and nan[0].step == 20
    assert any(isinstance(e, GradientExploded) and e.step == 40 for e in events)
    assert any(
        isinstance(e, ErrorRaised) and e.error_type.endswith("OutOfMemoryError") for e in events
    )
    assert {e.step for e in events if isinstance(e, StepSkipped)} >= {20}
    assert any(isinstance(e, RecoveryApplied) and e.step == 40 for e in events)
    assert result.report_html is not None and result.report_html.exists()
    out = stream.getvalue()
    assert "demo finished: 70 steps" in out
    # One voice: every incident of the log is one console line (kind and step), no more.
    shown = Counter(
        (line.split()[2], line.split()[3])
        for line in out.splitlines()
        if line[:2].isdigit() and " step=" in line
    )
    logged = Counter(
        (e.kind, f"step={e.step}") for e in events if e.is_incident and e.step is not None
    )
    assert shown == logged
    assert shown[("non_finite_detected", "step=20")] == sum(1 for e in nan if e.step == 20)
    # No per-step telemetry on the console: the progress bar shows the steps.
    assert "step_completed" not in out and "system_sampled" not in out
    assert "70/70" in out  # the finished progress bar


async def test_demo_is_deterministic(tmp_path: Path) -> None:
    """Two runs with the same seed give the same losses."""
    a = await run_demo(tmp_path / "a", steps=8, width=8, console=False)
    b = await run_demo(tmp_path / "b", steps=8, width=8, console=False)
    assert (a.first_loss, a.final_loss) == (b.first_loss, b.final_loss)


async def test_demo_quiet_prints_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """console=False writes nothing to stdout or stderr (the log and report are still written)."""
    result = await run_demo(tmp_path, steps=5, width=8, console=False)
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", "")
    assert result.report_html is not None


async def test_demo_progress_without_rich_or_tqdm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without rich and tqdm the demo falls back to a plain progress line, at most one per tenth
    of the run (telemetry arrives in batches, so some tenths may share a line)."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name in ("rich", "tqdm") else real(name, *a),
    )
    stream = io.StringIO()
    await run_demo(tmp_path, steps=20, width=8, stream=stream)
    progress = [line for line in stream.getvalue().splitlines() if line.startswith("demo: step")]
    done = [int(line.split()[2].split("/")[0]) for line in progress]
    assert 1 <= len(done) <= 10 and done == sorted(set(done)) and done[0] >= 2
    assert progress[-1].startswith("demo: step 20/20")
