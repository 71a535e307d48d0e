"""The merged report of a torch.distributed job: one step per step, one row per incident.

Each rank writes its own log (``events.jsonl``, ``events.rank1.jsonl``, ...); the report
rebuilt from the directory must count the job's steps, not ranks × steps, sum the throughput
over the ranks, average the curves over them, and list an incident that several ranks had
once, naming the ranks.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from eventbus_debug import encode_event, read_events
from eventbus_debug.events import (
    ErrorCategory,
    ErrorRaised,
    Event,
    GradientExploded,
    LossSpiked,
    MemorySampled,
    NonFiniteDetected,
    RecoveryAction,
    RecoveryApplied,
    RecoveryDecided,
    SessionEnded,
    SessionStarted,
    SinkFailed,
    StepChecked,
    StepCompleted,
    StepSkipped,
    TensorRole,
)
from eventbus_debug.log import log_file_name
from eventbus_debug.sinks import (
    IncidentRow,
    RunAggregator,
    build_report,
    render_html,
    summarize,
)
from eventbus_debug.sinks.report import _stats, aggregate

T0 = 1_700_000_000_000_000_000
STEP_NS = 20_000_000
STEPS = 30
EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def rank_events(rank: int, steps: int = STEPS, *, lead: int = 0) -> list[Event]:
    """What one rank of a lockstep data-parallel job logs, with its own sequence numbers.

    Rank *r* logs *lead* + r memory samples first, so the ranks' seqs differ. Every step:
    loss 1.0 + r, throughput 100·(r+1) samples/s, step time 0.02 + 0.01·r s. Step 10: a NaN
    loss on every rank (the agreed skip: decision, action, skipped step, linked by seq).
    Step 15: two non-finite incidents on every rank (loss, then gradients). Step 20: an OOM
    on rank 1 only.
    """
    out: list[Event] = []
    seq = 0

    def add(cls: type[Event], step: int | None, at: int, **fields: Any) -> int:
        nonlocal seq
        seq += 1
        out.append(
            cls(
                seq=seq,
                time_ns=T0 + at * STEP_NS + rank * 1000 + seq,
                rank=rank,
                step=step,
                **fields,
            )
        )
        return seq

    add(SessionStarted, None, 0, name="train", run_id="job-1")
    for _ in range(lead + rank):
        add(MemorySampled, 0, 0, rss_bytes=100 * 1024 * 1024)
    for step in range(steps):
        loss = 1.0 + rank
        add(StepChecked, step, step, loss=loss, grad_norm=2.0 + rank)
        if step == 10:
            nan = add(
                NonFiniteDetected, step, step, role=TensorRole.LOSS, names=("loss",), nan_count=1
            )
            add(
                RecoveryDecided,
                step,
                step,
                action=RecoveryAction.SKIP_STEP,
                reason="NaN loss",
                strategy="skip_non_finite",
                trigger_kind="non_finite_detected",
                trigger_seq=nan,
            )
            add(
                RecoveryApplied,
                step,
                step,
                action=RecoveryAction.SKIP_STEP,
                outcome="applied",
                detail="skipped",
            )
            add(StepSkipped, step, step, reason="NaN loss")
        if step == 15:
            add(NonFiniteDetected, step, step, role=TensorRole.LOSS, names=("loss",))
            add(NonFiniteDetected, step, step, role=TensorRole.GRADIENT, names=("w",))
        if step == 20 and rank == 1:
            add(
                ErrorRaised,
                step,
                step,
                category=ErrorCategory.MEMORY,
                error_type="OutOfMemoryError",
                message="CUDA out of memory",
            )
        add(
            StepCompleted,
            step,
            step,
            loss=loss,
            learning_rate=0.1,
            samples_per_s=100.0 * (rank + 1),
            duration_s=0.02 + 0.01 * rank,
        )
    return out


def write_logs(directory: Path, per_rank: dict[int, list[Event]]) -> Path:
    """Each rank's events in its own log file, as the file sink names them."""
    directory.mkdir(parents=True, exist_ok=True)
    for rank, events in per_rank.items():
        (directory / log_file_name(rank)).write_bytes(b"".join(encode_event(e) for e in events))
    return directory


def job(tmp_path: Path, world: int, steps: int = STEPS) -> Path:
    return write_logs(tmp_path / f"log{world}", {r: rank_events(r, steps) for r in range(world)})


def rows_at(rows: tuple[IncidentRow, ...], step: int) -> list[tuple[str, tuple[int, ...]]]:
    return [(r.kind, r.ranks) for r in rows if r.step == step]


@pytest.mark.parametrize("world", [2, 3])
class TestMergedLog:
    def test_steps_are_counted_once(self, tmp_path: Path, world: int) -> None:
        """30 steps on N ranks are 30 steps (each rank's 30 listed apart), not N × 30."""
        s, _ = build_report(job(tmp_path, world), tmp_path / "out")
        assert s.ranks == tuple(range(world))
        assert s.steps == STEPS and (s.first_step, s.last_step) == (0, STEPS - 1)
        assert s.steps_by_rank == dict.fromkeys(range(world), STEPS)
        assert s.steps_per_s == pytest.approx(STEPS / s.duration_s)
        assert s.training_summary()["total_steps"] == STEPS

    def test_throughput_is_summed_and_step_time_averaged(self, tmp_path: Path, world: int) -> None:
        """samples/s at a step is the sum over the ranks (the job's throughput); the step time
        and the loss are the mean over the ranks, one point per step."""
        s, _ = build_report(job(tmp_path, world), tmp_path / "out")
        total = sum(100.0 * (r + 1) for r in range(world))
        assert [p.step for p in s.samples_per_s] == list(range(STEPS))
        assert all(p.mean == total and p.count == 1 for p in s.samples_per_s)
        assert s.latest.samples_per_s == total
        mean_time = sum(0.02 + 0.01 * r for r in range(world)) / world
        assert all(p.mean == pytest.approx(mean_time) for p in s.step_duration_s)
        mean_loss = sum(1.0 + r for r in range(world)) / world
        assert [p.step for p in s.loss] == list(range(STEPS))  # no zig-zag between ranks
        assert all(p.mean == pytest.approx(mean_loss) for p in s.loss)
        assert all((p.min, p.max) == (1.0, float(world)) for p in s.loss)  # the ranks' spread

    def test_incidents_of_several_ranks_are_one_row(self, tmp_path: Path, world: int) -> None:
        """The agreed skip at step 10 is one row per kind naming every rank; step 15's two
        non-finite incidents stay two rows; rank 1's OOM names rank 1 only."""
        s, _ = build_report(job(tmp_path, world), tmp_path / "out")
        everyone = tuple(range(world))
        assert rows_at(s.incidents, 10) == [
            ("non_finite_detected", everyone),
            ("recovery_decided", everyone),
            ("recovery_applied", everyone),
            ("step_skipped", everyone),
        ]
        assert rows_at(s.incidents, 15) == [("non_finite_detected", everyone)] * 2
        assert rows_at(s.incidents, 20) == [("error_raised", (1,))]
        assert s.incidents_total == len(s.incidents) == 7
        assert s.incidents_by_rank == {r: 7 if r == 1 else 6 for r in everyone}

    def test_counts_are_those_of_one_rank(self, tmp_path: Path, world: int) -> None:
        """Anomaly, recovery and skip counts of the merged log equal those of the job (rank 1
        alone, which saw every incident), not N times them."""
        merged, _ = build_report(job(tmp_path, world), tmp_path / "out")
        alone = summarize(rank_events(1))
        for field in (
            "steps",
            "anomalies",
            "anomaly_steps",
            "anomaly_rate",
            "non_finite",
            "loss_anomalies",
            "anomalies_by_kind",
            "recovery_decisions",
            "recovery_outcomes",
            "steps_skipped",
            "errors_by_category",
            "first_anomaly_step",
            "last_anomaly_step",
        ):
            assert getattr(merged, field) == getattr(alone, field), field
        assert merged.anomaly_steps == 3 and merged.non_finite == 3
        assert len(merged.markers) == len(alone.markers)

    def test_recovery_chain_links_across_different_seqs(self, tmp_path: Path, world: int) -> None:
        """The ranks' seqs differ; the merged rows still link incident -> decision -> action."""
        s, _ = build_report(job(tmp_path, world), tmp_path / "out")
        nan, decided, applied, skipped = (r for r in s.incidents if r.step == 10)
        assert decided.caused_by == nan.seq and nan.led_to == (decided.seq,)
        assert decided.led_to == (applied.seq,) and applied.caused_by == decided.seq
        assert len({nan.rank, decided.rank, applied.rank}) == 1 and skipped.led_to == ()

    def test_page_names_the_ranks(self, tmp_path: Path, world: int) -> None:
        """The page: one table row per incident naming its ranks, the per-rank table, the
        summed throughput and the curves said to be means over the ranks."""
        _, paths = build_report(job(tmp_path, world), tmp_path / "out")
        assert paths.html is not None
        page = paths.html.read_text()
        names = ", ".join(str(r) for r in range(world))
        table = page.split("<table id='incidents'>")[1].split("</table>")[0]
        assert table.count("<tr id=") == 7
        assert "<th>ranks</th>" in table and table.count(f"<td class='num'>{names}</td>") == 6
        chain = page.split("<table id='recovery-chain'>")[1].split("</table>")[0]
        assert f"<td class='num'>{names}</td>" in chain
        ranks = page.split("<table id='ranks-table'>")[1].split("</table>")[0]
        assert re.findall(r"<tr><td class='num'>(\d+)</td><td class='num'>(\d+)</td>", ranks) == [
            (str(r), str(STEPS)) for r in range(world)
        ]
        assert "Throughput (samples / s, summed over the ranks)" in page
        assert "Loss, mean over the ranks" in page and "mean over the ranks (and over" in page
        cards = page.split("id='cards'>")[1].split("</div></div><h2")[0]
        assert f'<div class="v">{STEPS}</div><div class="l">steps</div>' in cards


class TestOneRank:
    def test_one_rank_shows_no_rank_views(self, tmp_path: Path) -> None:
        """A single rank's page has no ranks table, the 'rank' header and plain titles."""
        s, paths = build_report(write_logs(tmp_path / "one", {0: rank_events(0)}), tmp_path)
        assert s.steps == STEPS and s.steps_by_rank == {0: STEPS}
        assert all(r.ranks == (0,) for r in s.incidents)
        page = paths.html.read_text() if paths.html else ""
        assert "ranks-table" not in page and "<th>ranks</th>" not in page
        assert "<th>rank</th>" in page and "Throughput (samples / s)</figcaption>" in page
        assert "mean over the ranks" not in page

    def test_same_incident_twice_on_one_rank_is_two_rows(self) -> None:
        """One rank's two incidents of one kind at one step are two rows, counted twice."""
        events = [
            LossSpiked(seq=1, step=3, loss=9.0, running_mean=1.0, ratio=9.0, rule="spike"),
            LossSpiked(seq=2, step=3, loss=8.0, running_mean=1.0, ratio=8.0, rule="spike"),
        ]
        s = summarize(events)
        assert [r.seq for r in s.incidents] == [1, 2] and s.loss_anomalies == 2

    def test_replayed_steps_count_as_before(self) -> None:
        """A rank that replays steps 5-9 (a restore) counts 35 steps, throughput unsummed."""
        steps = [*range(10), *range(5, 30)]
        events = [StepCompleted(step=k, samples_per_s=50.0, seq=i + 1) for i, k in enumerate(steps)]
        s = summarize(events)
        assert s.steps == 35
        assert all(p.mean == 50.0 for p in s.samples_per_s)
        assert sum(p.count for p in s.samples_per_s) == 35


class TestEdges:
    def test_a_rank_that_stopped_early(self, tmp_path: Path) -> None:
        """Rank 1 logged 20 of the 30 steps: 30 steps, each rank's count shown apart."""
        log = write_logs(tmp_path / "log", {0: rank_events(0), 1: rank_events(1, steps=20)})
        s, _ = build_report(log, tmp_path / "out")
        assert s.steps == STEPS and s.steps_by_rank == {0: STEPS, 1: 20}
        assert s.samples_per_s[5].mean == 300.0 and s.samples_per_s[25].mean == 100.0

    def test_incidents_without_a_step_stay_per_rank(self) -> None:
        """A sink failure has no step: each rank's is its own row, and both are counted."""
        events = [
            SinkFailed(
                seq=1,
                rank=r,
                sink="tb",
                event_kind="step_checked",
                error_type="OSError",
                message="disk full",
            )
            for r in (0, 1)
        ]
        s = summarize(events)
        assert [r.ranks for r in s.incidents] == [(0,), (1,)]
        assert s.sinks.failures == {"tb": 2}

    def test_different_kinds_at_one_step_are_not_merged(self) -> None:
        """Rank 0's spike and rank 1's NaN at the same step are two rows of one rank each."""
        events = [
            LossSpiked(seq=1, rank=0, step=4, loss=9.0, running_mean=1.0, ratio=9.0, rule="s"),
            NonFiniteDetected(seq=1, rank=1, step=4, role=TensorRole.LOSS, names=("loss",)),
        ]
        s = summarize(events)
        assert [(r.kind, r.ranks) for r in s.incidents] == [
            ("loss_spiked", (0,)),
            ("non_finite_detected", (1,)),
        ]
        assert s.anomalies == 2 and s.anomaly_steps == 1

    def test_a_long_run_keeps_its_first_incidents_beside_the_most_recent(self) -> None:
        """3,000 clipped explosions after one NaN: the table keeps the run's first tenth (the
        NaN that began it) and the most recent rest; the page says how many are left out and
        where."""
        aggregator = RunAggregator(max_incidents=50)
        aggregator.add(NonFiniteDetected(seq=1, step=0, role=TensorRole.LOSS, names=("loss",)))
        for step in range(1, 3000):
            aggregator.add(
                GradientExploded(seq=step + 1, step=step, total_norm=1e6, threshold=10.0)
            )
        s = aggregator.summary()
        assert s.incidents_total == 3000 and len(s.incidents) == 50 and s.incidents_first == 5
        assert [r.step for r in s.incidents] == [*range(5), *range(2955, 3000)]
        assert s.incidents[0].kind == "non_finite_detected"
        page = render_html(s)
        assert "showing the first 5 and the 45 most recent of 3000 incidents" in page
        table = page[page.index("<table id='incidents'>") :]
        gap = table.index("2950 incidents not listed")
        rows = [table.index(f"<tr id='ev-0-{seq}'>") for seq in (3000, 2956, 5, 1)]
        assert rows[0] < rows[1] < gap < rows[2] < rows[3]  # newest first, the gap between

    def test_a_run_within_the_table_lists_everything_without_a_gap(self) -> None:
        aggregator = RunAggregator(max_incidents=50)
        for step in range(50):
            aggregator.add(
                NonFiniteDetected(seq=step + 1, step=step, role=TensorRole.LOSS, names=("loss",))
            )
        s = aggregator.summary()
        assert [r.step for r in s.incidents] == list(range(50)) and s.incidents_first == 5
        page = render_html(s)
        assert "not listed" not in page and "showing" not in page

    def test_merging_memory_is_bounded(self) -> None:
        """Thousands of incidents on 3 ranks: the merge's bookkeeping stays within its caps."""
        aggregator = RunAggregator(max_incidents=50)
        for step in range(3000):
            for rank in range(3):
                aggregator.add(
                    LossSpiked(
                        seq=step + 1,
                        rank=rank,
                        step=step,
                        loss=5.0,
                        running_mean=1.0,
                        ratio=5.0,
                        rule="spike",
                    )
                )
        s = aggregator.summary()
        assert s.loss_anomalies == 3000 and s.incidents_total == 3000
        assert len(s.incidents) == 50 and all(r.ranks == (0, 1, 2) for r in s.incidents)
        cap = aggregate._MAX_GROUPS
        assert len(aggregator._groups) <= cap and len(aggregator._occurrences) <= cap
        assert len(aggregator._alias) <= aggregate._MAX_LINKS

    def test_throughput_window_is_bounded(self) -> None:
        """Two ranks' values wait for each other among a bounded window of recent steps, and
        every step's sum reaches the series."""
        aggregator = RunAggregator()
        for step in range(1000):
            for rank in (0, 1):
                aggregator.add(StepCompleted(step=step, samples_per_s=10.0, rank=rank))
            assert len(aggregator._throughput.pending) <= _stats.RANK_SUM_WINDOW
        points = aggregator.summary().samples_per_s
        assert len(points) == 1000 and all(p.mean == 20.0 and p.count == 1 for p in points)
        assert aggregator.summary().latest.samples_per_s == 20.0

    def test_live_report_of_rank_zero_agrees_with_the_merged_one(self, tmp_path: Path) -> None:
        """Rank 0's own (live) summary and the merged log's agree on steps and incidents."""
        merged, _ = build_report(job(tmp_path, 2), tmp_path / "out")
        live = summarize(rank_events(0))
        assert (live.steps, live.non_finite, live.steps_skipped) == (
            merged.steps,
            merged.non_finite,
            merged.steps_skipped,
        )
        assert render_html(merged).count("<tr id=") == render_html(live).count("<tr id=") + 1


def _torchrun_example(log: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run examples/ddp_training.py on 2 CPU ranks under torchrun, logging into *log*."""
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [
            str(torchrun),
            "--standalone",
            "--nproc-per-node",
            "2",
            str(EXAMPLES / "ddp_training.py"),
            "--log-dir",
            str(log),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        check=False,
        cwd=cwd,
    )


@pytest.mark.timeout(300)
def test_ddp_example_report_counts_its_300_steps(tmp_path: Path) -> None:
    """torchrun --nproc-per-node 2 examples/ddp_training.py (the example's own test): the ranks
    skip together, report the spike together (the safe policy does not roll back on a loss
    signal alone) with equal parameters; the merged report says 300 steps and the agreed skip
    at step 100 is one row per kind naming ranks 0 and 1."""
    log = tmp_path / "ddp"
    done = _torchrun_example(log, tmp_path)
    # No rerun: an abort at exit (gloo's "terminate called without an active exception") fails.
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    # the example itself: both ranks skipped together, parameters equal
    assert "parameters identical on every rank: True" in done.stdout
    assert done.stdout.count("'skipped': [100], 'applied': [(100, 'skip_step')]") == 2
    # the spike, planted at 200 on rank 0: judged on the mean loss at that step, by both
    assert done.stdout.count("'spikes': [200, 201, 202, 203, 204]") == 2
    assert sorted(p.name for p in log.glob("events*.jsonl")) == [
        "events.jsonl",
        "events.rank1.jsonl",
    ]
    live = summarize(read_events(log / "events.jsonl"))
    s, paths = build_report(log, tmp_path / "merged")
    assert s.ranks == (0, 1) and s.steps == 300 and s.steps_by_rank == {0: 300, 1: 300}
    assert s.steps_per_s == pytest.approx(300 / s.duration_s)
    assert s.steps_skipped == live.steps_skipped == 1
    # The NaN batch was rank 1's: its loss is non-finite there only, its gradients everywhere
    # (DDP all-reduces them). Each rank decided its skip on what it saw first (rank 1 on its
    # loss, rank 0 on the gradients): two decision rows, each with its own applied row, for the
    # one step both ranks skipped. Rank 0's own log has the gradient's three rows.
    assert s.recovery_decisions == {**live.recovery_decisions, "skip_step": 2}
    assert s.incidents_total == live.incidents_total + 3
    at_100 = rows_at(s.incidents, 100)
    assert ("non_finite_detected", (1,)) in at_100
    assert ("non_finite_detected", (0, 1)) in at_100
    assert sorted(r for r in at_100 if r[0] != "non_finite_detected") == [
        ("recovery_applied", (0,)),
        ("recovery_applied", (1,)),
        ("recovery_decided", (0,)),
        ("recovery_decided", (1,)),
        ("step_skipped", (0, 1)),
    ]
    assert all(r.ranks == (0, 1) for r in s.incidents if r.step != 100)
    page = paths.html.read_text() if paths.html else ""
    assert '<div class="v">300</div><div class="l">steps</div>' in page


class TestOverhead:
    def test_the_report_states_the_measured_overhead(self) -> None:
        """SessionEnded's overhead (largest over ranks) and budget reach the summary and page."""
        events: list[Event] = [
            SessionStarted(name="s", rank=0),
            StepCompleted(step=0, loss=1.0, rank=0),
            SessionEnded(name="s", rank=0, overhead=0.013, overhead_budget=0.02),
            SessionEnded(name="s", rank=1, overhead=0.031, overhead_budget=0.02),
        ]
        summary = summarize(events)
        assert summary.overhead == 0.031 and summary.overhead_budget == 0.02
        page = render_html(summary)
        assert 'id="overhead"' in page and "3.10 %" in page and "budget 2.00 %" in page

    def test_no_overhead_card_when_unmeasured(self) -> None:
        """A log without a measured overhead gets no overhead card (and None in the summary)."""
        summary = summarize([StepCompleted(step=0, loss=1.0)])
        assert summary.overhead is None
        assert 'id="overhead"' not in render_html(summary)
