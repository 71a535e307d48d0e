from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest

from eventbus_debug import EventBus, encode_event, read_events
from eventbus_debug.events import (
    ErrorCategory,
    ErrorRaised,
    Event,
    EventsDropped,
    GradientExploded,
    GradientVanished,
    LossSpiked,
    MemorySampled,
    NonFiniteDetected,
    RecoveryAction,
    RecoveryApplied,
    RecoveryDecided,
    SessionStarted,
    StepChecked,
    StepCompleted,
    StepSkipped,
    SystemSampled,
    TensorRole,
)
from eventbus_debug.events.recovery import ClipGradients
from eventbus_debug.sinks import (
    ReportWriter,
    RunAggregator,
    build_report,
    render_html,
    summarize,
    summarize_runs,
    summary_to_dict,
    write_report,
)
from tests.sinks._chromium import dump_dom, needs_chromium, screenshot

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
                decided=ClipGradients(max_norm=1.0, total_norm=5.0),
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


def practitioner_events(steps: int = 40, layers: int = 6) -> list[Event]:
    """A run with everything a practitioner looks at: a session start, LR schedule,
    throughput, per-layer gradient norms and update ratios (ADVANCED), CUDA memory, and the
    scripted incidents with their recovery decisions and applied actions."""
    out: list[Event] = [SessionStarted(seq=0, time_ns=T0 - 1, name="train", run_id="run-1")]
    for event in scripted_events(steps):
        step = event.step
        if isinstance(event, StepCompleted) and step is not None:
            event = dataclasses.replace(
                event,
                learning_rate=0.1 * (0.5 ** (step // 10)),
                samples_per_s=1000.0 - step,
                duration_s=0.032 + 0.001 * (step % 3),
            )
        elif isinstance(event, StepChecked) and step is not None:
            event = dataclasses.replace(
                event,
                layer_grad_norms={f"block{i}.weight": 10.0 ** (i - 3) for i in range(layers)},
                update_ratios={f"block{i}.weight": 1e-3 * (i + 1) for i in range(layers)},
            )
        elif isinstance(event, MemorySampled) and step is not None:
            event = dataclasses.replace(
                event,
                cuda_allocated=(200 + step) * MiB,
                cuda_reserved=512 * MiB,
                cuda_peak=(300 + step) * MiB,
            )
        out.append(event)
    return out


class TestPractitionerViews:
    def test_learning_rate_throughput_and_layer_series(self) -> None:
        """LR, samples/s, step time and per-layer series come from the events, with the last
        values for the cards and /metrics."""
        s = summarize(practitioner_events(40, layers=6))
        assert [p.mean for p in s.learning_rate][:11] == [0.1] * 10 + [0.05]
        assert s.samples_per_s[0].mean == 1000.0 and s.samples_per_s[-1].mean == 961.0
        assert s.step_duration_s[1].mean == pytest.approx(0.033)
        assert [layer.name for layer in s.layer_grad_norms] == [
            f"block{i}.weight" for i in range(6)
        ]
        assert s.layer_grad_norms[5].points[0].mean == pytest.approx(100.0)
        assert s.update_ratios[1].points[-1].mean == pytest.approx(2e-3)
        assert s.latest.learning_rate == pytest.approx(0.1 * 0.5**3)
        assert s.latest.samples_per_s == 961.0 and s.latest.step == 39
        assert s.memory.peak_cuda_allocated_bytes == 339 * MiB  # the allocator's peak
        assert len(s.cuda_reserved_bytes) == 40
        page = render_html(s)
        for ident in ("chart-lr", "chart-throughput", "chart-step-time", "chart-cuda"):
            assert f'id="{ident}"' in page and "no data" not in page.split(f'id="{ident}"')[1][:300]
        assert page.count('<rect x="') > 6 * 40  # two heatmaps of 6 layers
        assert "block5.weight" in page

    def test_layer_views_stay_bounded(self) -> None:
        """Beyond max_layers the other layers are counted, not kept; buckets are bounded."""
        agg = RunAggregator(max_layers=4, layer_points=8)
        for step in range(200):
            agg.add(StepChecked(step=step, layer_grad_norms={f"l{i}": 1.0 for i in range(10)}))
        s = agg.summary()
        assert [layer.name for layer in s.layer_grad_norms] == ["l0", "l1", "l2", "l3"]
        assert s.layers_omitted == 6
        assert all(len(layer.points) <= 8 for layer in s.layer_grad_norms)
        assert sum(p.count for p in s.layer_grad_norms[0].points) == 200
        assert "6 more layer(s) not shown" in render_html(s)
        with pytest.raises(ValueError, match="max_layers"):
            RunAggregator(max_layers=1)

    def test_incidents_link_to_decisions_and_actions_both_ways(self) -> None:
        """Each incident lists the decisions it triggered; each decision its trigger and the
        action applied for it; each applied action its decision."""
        events = scripted_events(20)
        rows = {r.seq: r for r in summarize(events).incidents}
        by_kind = {(r.kind, r.step): r for r in rows.values()}
        nan = by_kind[("non_finite_detected", 5)]
        skip = by_kind[("recovery_decided", 5)]
        skip_done = by_kind[("recovery_applied", 5)]
        assert nan.led_to == (skip.seq,) and nan.caused_by is None
        assert skip.caused_by == nan.seq and skip.led_to == (skip_done.seq,)
        assert skip_done.caused_by == skip.seq and skip_done.led_to == ()
        boom = by_kind[("gradient_exploded", 8)]
        clip = by_kind[("recovery_decided", 8)]
        assert boom.led_to == (clip.seq,)
        assert rows[clip.led_to[0]].kind == "recovery_applied"
        page = render_html(summarize(events))
        for r in (nan, skip, skip_done, boom, clip):
            assert f"id='ev-0-{r.seq}'" in page
        assert f"href='#ev-0-{skip.seq}'" in page and f"href='#ev-0-{nan.seq}'" in page
        chain = page.split("id='recovery-chain'")[1].split("</table>")[0]
        assert chain.count("<tr>") == 3  # header + two decisions
        assert "clipped to 1.0" in chain and "zeroed grads" in chain

    def test_an_applied_action_without_a_decision_links_nothing(self) -> None:
        """A RecoveryApplied with no decision pending (or unsequenced events) is not linked."""
        s = summarize(
            [
                RecoveryApplied(seq=1, step=0, action=RecoveryAction.SKIP_STEP, detail="x"),
                RecoveryDecided(
                    step=1,
                    action=RecoveryAction.SKIP_STEP,
                    reason="r",
                    strategy="s",
                    trigger_kind="k",
                    trigger_seq=-1,
                ),
            ]
        )
        assert [(r.caused_by, r.led_to) for r in s.incidents] == [(None, ()), (None, ())]
        assert "not applied (yet)" in render_html(s)


def _run(run_id: str, t0: int, steps: int, *, rank: int = 0, name: str = "train") -> list[Event]:
    out: list[Event] = [SessionStarted(seq=1, time_ns=t0, rank=rank, name=name, run_id=run_id)]
    for step in range(steps):
        out.append(
            StepCompleted(seq=step + 2, time_ns=t0 + step + 1, rank=rank, step=step, loss=1.0)
        )
    return out


class TestRuns:
    def test_reruns_into_one_log_are_not_merged(self, tmp_path: Path) -> None:
        """Two runs appended to one log: the report shows the latest and lists both; a run
        id or 'all' picks another view; an unknown id names the runs the log holds."""
        log = tmp_path / "log"
        log.mkdir()
        first, second = _run("run-a", T0, 30), _run("run-b", T0 + 10**12, 12)
        (log / "events.jsonl").write_bytes(b"".join(encode_event(e) for e in first + second))
        summary, paths = build_report(log, tmp_path / "out")
        assert summary.run_id == "run-b" and summary.steps == 12
        assert [(r.run_id, r.events, r.shown) for r in summary.runs] == [
            ("run-a", 31, False),
            ("run-b", 13, True),
        ]
        assert not summary.mixed_runs
        assert orjson.loads(paths.json.read_bytes())["run_id"] == "run-b"
        page = paths.html.read_text() if paths.html else ""
        assert "holds <strong>2 runs</strong>" in page and "(the latest)" in page
        older, _ = build_report(log, tmp_path / "a", run="run-a")
        assert older.steps == 30 and older.run_id == "run-a"
        everything, _ = build_report(log, tmp_path / "all", run="all")
        assert everything.steps == 42 and everything.mixed_runs and everything.run_id is None
        assert "mixes 2 runs" in render_html(everything)
        with pytest.raises(ValueError, match="'run-a', 'run-b'"):
            build_report(log, tmp_path / "x", run="run-c")

    def test_ranks_of_one_job_are_one_run(self) -> None:
        """Ranks whose sessions start together under one name are one run, even without a
        shared run id; a rank restarting much later is another run."""
        events = sorted(
            _run("r0", T0, 5)
            + _run("r1", T0 + 2 * 10**9, 5, rank=1)
            + _run("later", T0 + 3600 * 10**9, 3, rank=1),
            key=lambda e: e.time_ns,
        )
        latest = summarize_runs(events)
        assert latest.run_id == "later" and latest.ranks == (1,)
        job = summarize_runs(events, run="r0")
        assert job.ranks == (0, 1) and job.steps == 5  # two ranks of the same 5 steps
        assert job.steps_by_rank == {0: 5, 1: 5}
        assert [r.run_id for r in job.runs] == ["r0", "later"]

    def test_live_writer_sees_its_session(self) -> None:
        """A live aggregator records the run id of the session it saw."""
        s = summarize(_run("live-1", T0, 3))
        assert s.run_id == "live-1"
        assert [(r.run_id, r.events, r.shown) for r in s.runs] == [("live-1", 4, True)]
        assert "id='run-id'>live-1</code>" in render_html(s)

    def test_run_argument_is_checked(self) -> None:
        """An empty run selector is a clear error."""
        with pytest.raises(ValueError, match="run must be"):
            summarize_runs([], run="")

    def test_session_started_gets_a_fresh_run_id(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Every SessionStarted has its own id, unless the environment fixes one for a job."""
        a, b = SessionStarted(name="x"), SessionStarted(name="x")
        assert a.run_id and b.run_id and a.run_id != b.run_id
        monkeypatch.setenv("EVENTBUS_DEBUG_RUN_ID", "job-42")
        assert SessionStarted().run_id == "job-42"
        monkeypatch.delenv("EVENTBUS_DEBUG_RUN_ID")
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
        assert SessionStarted().run_id != "none"


def test_report_files_are_world_readable(tmp_path: Path) -> None:
    """report.json and report.html are written 0644, so colleagues can open them."""
    paths = write_report(summarize(scripted_events(3)), tmp_path)
    assert paths.html is not None
    for path in (paths.json, paths.html):
        assert path.stat().st_mode & 0o777 == 0o644


@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_memory_for_both_session_kinds(tmp_path: Path, kind: str) -> None:
    """Session and SyncSession both put memory in the report: RSS samples and chart."""
    import torch
    from torch import nn

    from eventbus_debug import Session, SyncSession
    from eventbus_debug.probes import LeakDetector

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    report = ReportWriter(tmp_path / "report", interval=None)
    options: dict[str, Any] = {
        "log_dir": None,
        "report": report,
        "console": False,
        "alerts": False,
        "leak_detector": LeakDetector(every=1, count_tensors=False),
    }

    def step_once() -> torch.Tensor:
        x = torch.randn(8, 4)
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        loss.backward()  # type: ignore[no-untyped-call]
        return loss

    if kind == "async":
        async with Session(model, optimizer, **options) as session:
            for step in range(6):
                loss = step_once()
                await session.check_step(step, loss=loss)
                optimizer.step()
                await session.step_completed(step, loss=loss)
    else:
        with SyncSession(model, optimizer, **options) as sync:
            for step in range(6):
                loss = step_once()
                sync.check_step(step, loss=loss)
                optimizer.step()
                sync.step_completed(step, loss=loss)
    s = report.summary()
    assert s.memory.samples >= 5 and s.memory.peak_rss_bytes
    assert s.run_id and s.latest.learning_rate == pytest.approx(0.05)
    page = (tmp_path / "report" / "report.html").read_text()
    memory_chart = page.split('id="chart-memory"')[1].split("</figure>")[0]
    assert "<polyline" in memory_chart


@needs_chromium
def test_report_opens_in_headless_browser(tmp_path: Path) -> None:
    """A real browser loads report.html offline and renders its charts (loss, LR,
    throughput, memory with the CUDA peak), the per-layer heatmaps, the incident table with
    working links to the recovery decisions and actions, and the run id."""
    summary = summarize(practitioner_events(40))
    paths = write_report(summary, tmp_path / "report")
    assert paths.html is not None
    dom = dump_dom(paths.html.as_uri(), tmp_path / "profile", budget_ms=500)
    for chart in (
        "chart-loss",
        "chart-grad-norm",
        "chart-lr",
        "chart-throughput",
        "chart-step-time",
        "chart-memory",
        "chart-cuda",
    ):
        figure = dom.split(f'id="{chart}"')[1].split("</figure>")[0]
        assert "<polyline" in figure, chart
    assert 'class="marker-anomaly"' in dom and 'class="marker-recovery"' in dom
    for heat in ("heat-grad-norms", "heat-update-ratios"):
        figure = dom.split(f'id="{heat}"')[1].split("</figure>")[0]
        assert figure.count("<rect") >= 6 * 40 and "block5.weight" in figure
    assert 'id="incidents"' in dom and "non-finite loss" in dom
    hrefs = set(re.findall(r'href="#(ev-[0-9]+-[0-9]+)"', dom))
    ids = set(re.findall(r'id="(ev-[0-9]+-[0-9]+)"', dom))
    assert len(hrefs) >= 5 and hrefs <= ids  # every link lands on a row
    chain = dom.split('id="recovery-chain"')[1].split("</table>")[0]
    assert "clipped to 1.0" in chain and "zeroed grads" in chain
    assert '<code class="rid" id="run-id">run-1</code>' in dom
    assert "339.0 MiB" in dom.split('id="card-cuda-peak"')[1][:200]
    shot = screenshot(paths.html.as_uri(), tmp_path / "profile", tmp_path / "report.png")
    assert shot.stat().st_size > 10_000
    followed = dump_dom(f"{paths.html.as_uri()}#{sorted(hrefs)[0]}", tmp_path / "p2", budget_ms=500)
    assert sorted(hrefs)[0] in followed


def test_a_writer_reused_by_a_run_on_another_backend_writes_there_too(tmp_path: Path) -> None:
    """Its write lock is made where it first writes; a later run on trio (after one on asyncio)
    used to fail on that asyncio lock ("no running event loop")."""
    import anyio

    writer = ReportWriter(tmp_path)
    written: list[Path] = []

    async def write() -> None:
        written.append((await writer.write()).json)

    anyio.run(write)
    anyio.run(write, backend="trio")
    anyio.run(write)
    assert written == [tmp_path / "report.json"] * 3
    assert (tmp_path / "report.json").exists()
