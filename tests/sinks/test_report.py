from __future__ import annotations

import dataclasses
import math
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest

from eventbus_debug import (
    ErrorCategory,
    ErrorRaised,
    EventBus,
    GradientExploded,
    GradientVanished,
    LossSpiked,
    MemorySampled,
    NonFiniteDetected,
    RecoveryAction,
    RecoveryApplied,
    RecoveryDecided,
    StepChecked,
    StepSkipped,
    SystemSampled,
    TensorRole,
    encode_event,
    read_events,
)
from eventbus_debug.events import Event, EventsDropped, StepCompleted
from sinks import (
    ReportWriter,
    RunAggregator,
    build_report,
    render_html,
    summarize,
    summary_to_dict,
)

T0 = 1_700_000_000_000_000_000
NAN = math.nan
MiB = 1024 * 1024


def scripted_events(steps: int = 20) -> list[Event]:
    """A run of *steps* steps, 10 ms apart, with faults at known steps.

    step 5: NaN loss -> NonFiniteDetected(LOSS), RecoveryDecided(SKIP_STEP), applied, skipped.
    step 8: GradientExploded -> RecoveryDecided(CLIP_GRADIENTS), applied.
    step 12: LossSpiked; step 13: GradientVanished; step 15: ErrorRaised(MEMORY).
    Memory grows 1 MiB per step from 100 MiB; system samples every 5 steps at 10/20/30 % CPU.
    """
    out: list[Event] = []
    seq = 0

    def add(event_cls: type[Event], step: int | None, at: int = -1, **fields: Any) -> None:
        nonlocal seq
        seq += 1
        at = step if step is not None else max(at, 0)
        out.append(event_cls(seq=seq, time_ns=T0 + at * 10_000_000 + seq, step=step, **fields))

    for step in range(steps):
        loss = NAN if step == 5 else 1.0 / (step + 1)
        grad = 500.0 if step == 8 else 1.0 + step * 0.1
        fired: tuple[str, ...] = ()
        if step == 5:
            fired = ("non_finite_detected",)
            add(NonFiniteDetected, step, role=TensorRole.LOSS, names=("loss",), nan_count=1)
            add(
                RecoveryDecided,
                step,
                action=RecoveryAction.SKIP_STEP,
                reason="NaN loss",
                strategy="skip_non_finite",
                trigger_kind="non_finite_detected",
                trigger_seq=seq,
            )
            add(RecoveryApplied, step, action=RecoveryAction.SKIP_STEP, detail="zeroed grads")
            add(StepSkipped, step, reason="NaN loss")
        if step == 8:
            add(
                GradientExploded,
                step,
                total_norm=500.0,
                threshold=10.0,
                top=(("fc.weight", 499.0),),
            )
            add(
                RecoveryDecided,
                step,
                action=RecoveryAction.CLIP_GRADIENTS,
                reason="explosion",
                strategy="clip",
                trigger_kind="gradient_exploded",
                trigger_seq=seq,
                parameters={"max_norm": 1.0},
            )
            add(
                RecoveryApplied, step, action=RecoveryAction.CLIP_GRADIENTS, detail="clipped to 1.0"
            )
        if step == 12:
            add(LossSpiked, step, loss=5.0, running_mean=0.1, ratio=50.0, rule="ratio")
        if step == 13:
            add(GradientVanished, step, mean_abs=1e-9, threshold=1e-6, layers=("fc.bias",))
        if step == 15:
            add(
                ErrorRaised,
                step,
                error_type="torch.OutOfMemoryError",
                message="CUDA out of memory",
                category=ErrorCategory.MEMORY,
            )
        add(StepChecked, step, loss=loss, grad_norm=grad, finite=step != 5, fired=fired)
        add(StepCompleted, step, loss=loss)
        add(MemorySampled, step, rss_bytes=(100 + step) * MiB)
        if step % 5 == 0:
            add(
                SystemSampled,
                None,
                at=step,
                cpu_percent=10.0 * (step // 5 + 1),
                memory_percent=50.0,
                disk_percent=70.0,
            )
    add(EventsDropped, None, sink="slow", dropped=7, total_dropped=7, by_kind={"step_checked": 7})
    return out


class TestRunAggregator:
    def test_numbers_of_a_scripted_stream(self) -> None:
        """Every figure of the summary matches what the scripted stream contains."""
        events = scripted_events(20)
        s = summarize(events)
        assert s.events == len(events)
        assert s.steps == 20
        assert (s.first_step, s.last_step) == (0, 19)
        assert s.anomalies == 5
        assert s.anomaly_steps == 5
        assert s.anomaly_rate == pytest.approx(5 / 20)
        assert s.loss_anomalies == 2  # the NaN loss and the spike
        assert s.loss_anomaly_rate == pytest.approx(2 / 20)
        assert s.gradient_explosions == 1
        assert s.gradient_explosion_rate == pytest.approx(1 / 20)
        assert s.gradient_vanishings == 1
        assert s.non_finite == 1
        assert (s.first_anomaly_step, s.last_anomaly_step) == (5, 15)
        assert s.recovery_decisions == {"clip_gradients": 1, "skip_step": 1}
        assert s.recovery_outcomes == {"clip_gradients:applied": 1, "skip_step:applied": 1}
        assert s.steps_skipped == 1
        assert s.errors_by_category == {"memory": 1}
        assert s.counts_by_kind["step_checked"] == 20
        assert s.counts_by_kind["system_sampled"] == 4
        assert s.counts_by_severity["error"] == 2  # NaN + OOM
        assert s.memory.peak_rss_bytes == 119 * MiB
        assert s.memory.first_rss_bytes == 100 * MiB
        assert s.memory.rss_trend_bytes_per_step == pytest.approx(MiB)
        assert s.system.samples == 4
        assert s.system.cpu_percent.mean == pytest.approx(25.0)
        assert (s.system.cpu_percent.min, s.system.cpu_percent.max) == (10.0, 40.0)
        assert s.system.span_s == pytest.approx(0.15, abs=1e-6)
        assert s.sinks.dropped == {"slow": 7}
        times = [e.time_ns for e in events]
        assert s.duration_s == pytest.approx((max(times) - min(times)) / 1e9)
        assert s.steps_per_s == pytest.approx(20 / s.duration_s)
        assert len(s.loss) == 20
        assert s.loss[5].mean is None and s.loss[5].nonfinite == 1
        assert s.grad_norm[8].max == 500.0
        assert [m.step for m in s.markers if not m.recovery] == [5, 8, 12, 13, 15]
        assert {m.label for m in s.markers if m.recovery} == {"skip_step", "clip_gradients", "skip"}
        assert s.incidents_total == sum(1 for e in events if e.is_incident)
        assert s.training_summary()["gradient_explosions"] == 1

    def test_series_memory_is_bounded(self) -> None:
        """A long run keeps at most max_points buckets per series; extremes survive merging."""
        agg = RunAggregator(max_points=16, max_incidents=4)
        for step in range(10_000):
            agg.add(StepChecked(step=step, loss=1000.0 if step == 4321 else 1.0, grad_norm=1.0))
        s = agg.summary()
        assert 8 <= len(s.loss) <= 16
        assert sum(p.count for p in s.loss) == 10_000
        assert max(p.max or 0.0 for p in s.loss) == 1000.0
        assert s.steps == 10_000

    def test_clear_forgets_everything(self) -> None:
        """clear() resets the aggregate to that of an empty run."""
        agg = RunAggregator()
        agg.add_all(scripted_events(6))
        agg.clear()
        assert agg.summary() == RunAggregator().summary()

    def test_summary_json_keeps_non_finite(self) -> None:
        """Non-finite floats in the summary become tokens, never invalid JSON."""
        agg = RunAggregator()
        agg.add(StepChecked(step=0, loss=math.inf, grad_norm=NAN))
        data = orjson.loads(orjson.dumps(summary_to_dict(agg.summary())))
        assert data["loss"][0]["nonfinite"] == 1
        assert data["grad_norm"][0]["mean"] is None


class TestHtml:
    def test_self_contained_with_charts_and_table(self) -> None:
        """The page holds the three charts, markers, NaN crosses and the incident table, and
        loads nothing from the network."""
        page = render_html(summarize(scripted_events(20)))
        for chart in ("chart-loss", "chart-grad-norm", "chart-memory"):
            assert f'id="{chart}"' in page
        assert "marker-anomaly" in page and "marker-recovery" in page
        assert "marker-nonfinite" in page
        assert "<table id='incidents'>" in page
        assert "gradient norm 500 &gt; 10" in page
        assert "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
        assert "https://" not in page and "<script" not in page

    def test_empty_and_all_nan_runs_render(self) -> None:
        """A run without events, and one whose every loss is NaN, still render."""
        assert "no data for this chart" in render_html(summarize([]))
        agg = RunAggregator()
        for step in range(5):
            agg.add(StepChecked(step=step, loss=NAN, grad_norm=math.inf))
        page = render_html(agg.summary())
        assert page.count("marker-nonfinite") == 10


class _LogWriter:
    """A minimal JSON-lines writer, so the replay test does not depend on another sink."""

    def __init__(self, path: Path) -> None:
        self.path = path

    async def handle_batch(self, events: Sequence[Event]) -> None:
        with self.path.open("ab") as fh:
            fh.write(b"".join(encode_event(e) for e in events))


class TestReportWriter:
    async def test_live_report_equals_replayed_report(self, tmp_path: Path) -> None:
        """The report written at close equals the one rebuilt from the log of the same run."""
        live_dir, log_dir = tmp_path / "live", tmp_path / "log"
        log_dir.mkdir()
        writer = ReportWriter(live_dir, interval=None)
        async with EventBus(close_timeout=5.0) as bus:
            bus.subscribe(_LogWriter(log_dir / "events.jsonl"), capacity=1 << 20)
            bus.subscribe(writer, capacity=1 << 20)
            for event in scripted_events(30):
                # drop the scripted seq: the bus assigns its own, as in a real run
                bus.publish_nowait(dataclasses.replace(event, seq=-1))
        live = orjson.loads((live_dir / "report.json").read_bytes())
        summary, paths = build_report(log_dir, tmp_path / "replayed")
        replayed = orjson.loads(paths.json.read_bytes())
        assert live["generated_ns"] != 0
        del live["generated_ns"], replayed["generated_ns"]
        assert live == replayed
        assert summary == writer.summary()
        assert summary.events == len(list(read_events(log_dir)))
        assert (tmp_path / "replayed" / "report.html").read_text().startswith("<!DOCTYPE html>")

    async def test_periodic_writes_follow_the_clock(self, tmp_path: Path) -> None:
        """With a fake clock, the report is rewritten once the interval elapsed, and at close."""
        now = [0.0]
        writer = ReportWriter(tmp_path, interval=10.0, clock=lambda: now[0])
        await writer.handle_batch([StepCompleted(step=0, loss=1.0)])
        assert writer.writes == 0
        now[0] = 10.0
        await writer.handle_batch([StepCompleted(step=1, loss=1.0)])
        assert writer.writes == 1
        assert orjson.loads((tmp_path / "report.json").read_bytes())["summary"]["steps"] == 2
        await writer.aclose()
        await writer.aclose()
        assert writer.writes == 2

    async def test_clear_resets_summary(self, tmp_path: Path) -> None:
        """clear() empties the live summary."""
        writer = ReportWriter(tmp_path, interval=None)
        await writer.handle_batch(scripted_events(3))
        assert writer.summary().steps == 3
        writer.clear()
        assert writer.summary().events == 0

    def test_rejects_bad_interval(self, tmp_path: Path) -> None:
        """A non-positive interval is refused with a message naming it."""
        with pytest.raises(ValueError, match="interval must be"):
            ReportWriter(tmp_path, interval=0)


CHROMIUM = shutil.which("chromium") or (
    "/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None
)


@pytest.mark.skipif(
    CHROMIUM is None,
    reason="needs Debian's chromium for a headless browser: apt-get update && apt-get install -y chromium",
)
def test_report_opens_in_headless_browser(tmp_path: Path) -> None:
    """A real browser loads report.html offline and renders its charts and incident table."""
    assert CHROMIUM is not None
    events = scripted_events(40)
    summary = summarize(events)
    from sinks import write_report

    paths = write_report(summary, tmp_path / "report")
    assert paths.html is not None
    profile = tmp_path / "profile"
    base = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
    ]
    dom = subprocess.run(
        [*base, "--dump-dom", paths.html.as_uri()],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert 'id="chart-loss"' in dom and 'id="chart-grad-norm"' in dom and 'id="chart-memory"' in dom
    assert "<polyline" in dom and 'class="marker-anomaly"' in dom
    assert 'id="incidents"' in dom and "non-finite loss" in dom
    shot = tmp_path / "report.png"
    subprocess.run(
        [
            *base,
            "--hide-scrollbars",
            "--window-size=1200,2200",
            f"--screenshot={shot}",
            paths.html.as_uri(),
        ],
        capture_output=True,
        timeout=60,
        check=True,
    )
    assert shot.stat().st_size > 10_000
