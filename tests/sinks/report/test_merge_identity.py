"""Merged rows name exactly the ranks that had the same incident, and a stopped run says why.

The ranks' incidents at one step, of one kind, are one row only when they are the same
incident (the same tensors of a non-finite check, a decision for the same trigger): a rank's
non-finite loss is never folded into another rank's non-finite gradients. A session that
stopped is listed with its reason, and the last step shown is the last one completed.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from eventbus_debug import encode_event
from eventbus_debug.cli import _ended_line, _steps_line, main
from eventbus_debug.events import (
    Event,
    NonFiniteDetected,
    RecoveryAction,
    RecoveryApplied,
    RecoveryDecided,
    SessionEnded,
    StepChecked,
    StepCompleted,
    TensorRole,
)
from eventbus_debug.log import log_file_name
from eventbus_debug.sinks import RunAggregator, render_html, summarize
from eventbus_debug.sinks.report import aggregate

GRADS = ("w", "b")


class _Rank:
    """One rank's events, with its own seqs and times."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.events: list[Event] = []

    def add(self, cls: type[Event], step: int | None, **fields: Any) -> int:
        seq = len(self.events) + 1 + 3 * self.rank  # the ranks' seqs differ
        self.events.append(
            cls(seq=seq, time_ns=1000 * seq + self.rank, rank=self.rank, step=step, **fields)
        )
        return seq

    def non_finite(self, step: int, role: TensorRole, *, decide: bool = True) -> None:
        names = ("loss",) if role is TensorRole.LOSS else GRADS
        seq = self.add(NonFiniteDetected, step, role=role, names=names, nan_count=1 + self.rank)
        if decide:
            self.add(
                RecoveryDecided,
                step,
                action=RecoveryAction.SKIP_STEP,
                reason=f"non-finite {role.value}",
                strategy="skip_non_finite",
                trigger_kind="non_finite_detected",
                trigger_seq=seq,
            )
            self.add(RecoveryApplied, step, action=RecoveryAction.SKIP_STEP, detail="skipped")


def merged(*ranks: _Rank) -> list[Event]:
    return sorted((e for r in ranks for e in r.events), key=lambda e: (e.time_ns, e.rank, e.seq))


def rows(events: list[Event]) -> list[tuple[str, str, tuple[int, ...]]]:
    return [(r.kind, r.message, r.ranks) for r in summarize(events).incidents]


LOSS = "non-finite loss: loss (1 NaN)"


class TestSameStepSameKind:
    def test_two_ranks_gradient_and_loss_are_two_rows(self) -> None:
        """Rank 0: NaN gradients; rank 1: a NaN loss, then NaN gradients, at step 100: the
        gradient row names ranks 0 and 1, the loss row rank 1 only (was: two gradient rows,
        the loss lost)."""
        r0, r1 = _Rank(0), _Rank(1)
        r0.non_finite(100, TensorRole.GRADIENT, decide=False)
        r1.non_finite(100, TensorRole.LOSS, decide=False)
        r1.non_finite(100, TensorRole.GRADIENT, decide=False)
        got = sorted((m.split(":")[0], ranks) for _, m, ranks in rows(merged(r0, r1)))
        assert got == [("non-finite gradient", (0, 1)), ("non-finite loss", (1,))]
        s = summarize(merged(r0, r1))
        assert s.non_finite == 2 and s.loss_anomalies == 1 and s.incidents_by_rank == {0: 1, 1: 2}

    def test_three_ranks_one_loss(self) -> None:
        """Three ranks had NaN gradients, one of them a NaN loss too: the loss row names that
        rank alone (was: all three)."""
        ranks = [_Rank(r) for r in range(3)]
        ranks[2].non_finite(155, TensorRole.LOSS, decide=False)
        for r in ranks:
            r.non_finite(155, TensorRole.GRADIENT, decide=False)
        by_message = {m.split(":")[0]: rk for _, m, rk in rows(merged(*ranks))}
        assert by_message == {"non-finite loss": (2,), "non-finite gradient": (0, 1, 2)}

    def test_different_tensors_of_one_role_are_not_merged(self) -> None:
        """NaN in different parameters on two ranks: two rows (the names differ)."""
        a = NonFiniteDetected(seq=1, rank=0, step=7, role=TensorRole.PARAMETER, names=("w",))
        b = NonFiniteDetected(seq=1, rank=1, step=7, role=TensorRole.PARAMETER, names=("b",))
        assert [r.ranks for r in summarize([a, b]).incidents] == [(0,), (1,)]

    def test_measurements_do_not_split_a_row(self) -> None:
        """The same incident with per-rank counts (NaN counts differ) is one row."""
        events = [
            NonFiniteDetected(
                seq=1, rank=r, step=7, role=TensorRole.GRADIENT, names=GRADS, nan_count=r + 1
            )
            for r in range(3)
        ]
        assert [r.ranks for r in summarize(events).incidents] == [(0, 1, 2)]

    @pytest.mark.parametrize("world", [2, 3])
    def test_decisions_follow_their_trigger(self, world: int) -> None:
        """Every rank skips for NaN gradients, the last rank also for its NaN loss (first):
        the decision rows are one per trigger, naming the ranks of their trigger, each linked
        to it and with its own reason (was: the loss decision merged into the gradient one)."""
        ranks = [_Rank(r) for r in range(world)]
        last = ranks[-1]
        last.non_finite(100, TensorRole.LOSS)
        for r in ranks:
            r.non_finite(100, TensorRole.GRADIENT)
        s = summarize(merged(*ranks))
        by_seq = {(r.rank, r.seq): r for r in s.incidents}
        decided = [r for r in s.incidents if r.kind == "recovery_decided"]
        assert sorted((d.message, d.ranks) for d in decided) == sorted(
            [
                ("decided skip_step for non_finite_detected: non-finite loss", (last.rank,)),
                (
                    "decided skip_step for non_finite_detected: non-finite gradient",
                    tuple(range(world)),
                ),
            ]
        )
        for d in decided:
            assert d.caused_by is not None
            trigger = by_seq[(d.rank, d.caused_by)]
            assert trigger.ranks == d.ranks and trigger.message.split(":")[0] in d.message
            (applied_seq,) = d.led_to
            assert by_seq[(d.rank, applied_seq)].ranks == d.ranks
        assert s.recovery_decisions == {"skip_step": 2}
        assert s.recovery_outcomes == {"skip_step:applied": 2}

    def test_identity_memory_is_bounded(self) -> None:
        """Many incidents: the trigger-key map stays within its cap."""
        aggregator = RunAggregator(max_incidents=10)
        for step in range(aggregate._MAX_LINKS + 100):
            aggregator.add(
                NonFiniteDetected(seq=step + 1, step=step, role=TensorRole.LOSS, names=("loss",))
            )
        assert len(aggregator._keys) <= aggregate._MAX_LINKS

    def test_unknown_event_types_merge_on_their_text_fields(self) -> None:
        """An event kind without an identity entry: its text, enum and flag fields decide."""
        from eventbus_debug.events import OutputAnomalyDetected

        def out(rank: int, name: str, value: float) -> OutputAnomalyDetected:
            return OutputAnomalyDetected(
                seq=1, rank=rank, step=3, name=name, rule="range", message="m", max_value=value
            )

        s = summarize([out(0, "logits", 1.0), out(1, "logits", 2.0), out(2, "probs", 1.0)])
        assert [r.ranks for r in s.incidents] == [(0, 1), (2,)]


def _stopped_run() -> list[Event]:
    """Two ranks complete steps 0..99; rank 0 begins step 100 and stops there (the ranks could
    not agree), rank 1 completed."""
    r0, r1 = _Rank(0), _Rank(1)
    for step in range(100):
        for r in (r0, r1):
            r.add(StepChecked, step, loss=1.0)
            r.add(StepCompleted, step, loss=1.0)
    r1.add(SessionEnded, 99, name="training", reason="completed", steps=100)
    r0.add(StepChecked, 100, loss=1.0)
    why = "rank 0 of 2 could not agree on step 100 within 60 s"
    r0.add(SessionEnded, 100, name="training", reason="stopped", detail=why, steps=100)
    return merged(r0, r1)


class TestStoppedRun:
    def test_stop_is_listed_with_its_reason(self) -> None:
        """The stop is an incident row saying why; each rank's end reason is kept."""
        s = summarize(_stopped_run())
        assert [(r.kind, r.step, r.ranks) for r in s.incidents] == [("session_ended", 100, (0,))]
        assert "could not agree on step 100" in s.incidents[0].message
        assert s.ended == {
            0: "stopped: rank 0 of 2 could not agree on step 100 within 60 s",
            1: "completed",
        }
        assert s.incidents_total == 1 and s.anomalies == 0

    def test_last_step_is_the_last_completed(self) -> None:
        """The summary's steps: 100 (0..99), step 100 named as begun, not completed."""
        s = summarize(_stopped_run())
        assert s.steps == 100 and s.last_step == 100 and s.last_completed_step == 99
        assert _steps_line(s) == "100 (0..99), step 100 begun, not completed"
        assert _ended_line(s).startswith("rank 0: stopped: rank 0 of 2 could not agree")

    def test_page_says_why_and_the_last_completed_step(self) -> None:
        page = render_html(summarize(_stopped_run()))
        assert "id='ended-banner'" in page and "could not agree on step 100" in page
        assert "steps 0–99" in page and "the last step completed was 99" in page

    def test_completed_run_has_no_banner_nor_row(self) -> None:
        events = [
            StepCompleted(seq=1, step=0),
            SessionEnded(seq=2, step=0, reason="completed", steps=1),
        ]
        s = summarize(events)
        assert s.incidents == () and s.ended == {0: "completed"} and _ended_line(s) == "completed"
        assert "ended-banner" not in render_html(s) and _steps_line(s) == "1 (0..0)"

    def test_no_session_end_in_the_log(self) -> None:
        s = summarize([StepCompleted(seq=1, step=0)])
        assert s.ended == {} and _ended_line(s) == "-"


def test_summary_command_shows_the_stop(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``eventbus-debug summary`` on the stopped run: the completed steps, each rank's end."""
    by_rank: dict[int, list[Event]] = {}
    for event in _stopped_run():
        by_rank.setdefault(event.rank, []).append(event)
    for rank, events in by_rank.items():
        (tmp_path / log_file_name(rank)).write_bytes(b"".join(encode_event(e) for e in events))
    assert main(["summary", str(tmp_path), "--color", "never"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in lines)
    assert rows["steps"].strip() == "100 (0..99), step 100 begun, not completed"
    assert rows["ended"].strip().startswith("rank 0: stopped: rank 0 of 2 could not agree")
    assert rows["incidents"].strip() == "1"
