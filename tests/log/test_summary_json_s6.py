"""The JSON of a summary (``summary --json``, ``report.json``) holds every documented field,
the computed ones (``mixed_runs``) included, for a log rebuilt into a report."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import orjson
import pytest

from eventbus_debug import encode_event
from eventbus_debug.cli import main
from eventbus_debug.events import Event, SessionStarted, StepCompleted
from eventbus_debug.sinks.report import RunAggregator, RunSummary, summary_to_dict

DOCS = Path(__file__).resolve().parents[2] / "docs" / "reports.md"


def _rerun_log(directory: Path) -> Path:
    """Two runs appended to one log: 'monday' (3 steps) then 'tuesday' (2 steps)."""
    events: list[Event] = []
    for run_id, steps, t0 in (("monday", 3, 1), ("tuesday", 2, 10**15)):
        events.append(SessionStarted(name="train", run_id=run_id, time_ns=t0))
        events += [StepCompleted(step=s, loss=1.0, time_ns=t0 + s + 1) for s in range(steps)]
    directory.mkdir(parents=True)
    (directory / "events.jsonl").write_bytes(b"".join(encode_event(e) for e in events))
    return directory


def _documented_fields() -> list[str]:
    """The field names of the summary table in docs/reports.md (its first column)."""
    text = DOCS.read_text(encoding="utf-8")
    table = text[text.index("| field | meaning |") :].split("\n\n", 1)[0]
    names: list[str] = []
    for row in table.splitlines()[2:]:
        first = row.split("|")[1]
        names += [n for n in re.findall(r"`([a-z_]+)`", first) if not n.startswith("_")]
    return names


class TestSummaryToDict:
    def test_every_documented_field_is_in_the_json(self) -> None:
        """The reference table's fields, computed ones included, are all keys of the JSON."""
        documented = _documented_fields()
        assert "mixed_runs" in documented and len(documented) > 40
        data = summary_to_dict(RunAggregator().summary())
        missing = [name for name in documented if name not in data]
        assert missing == []

    def test_every_property_of_the_summary_is_in_the_json(self) -> None:
        """Whatever RunSummary computes as a property is written like a field."""
        properties = [
            name
            for name, value in vars(RunSummary).items()
            if isinstance(value, property) and not name.startswith("_")
        ]
        assert properties == ["mixed_runs"]
        data = summary_to_dict(RunAggregator().summary())
        assert all(name in data for name in properties)

    def test_mixed_runs_follows_runs(self) -> None:
        """mixed_runs is written right after the runs it is computed from, as a bool."""
        summary = RunAggregator().summary()
        keys = list(summary_to_dict(summary))
        assert keys[keys.index("runs") + 1] == "mixed_runs"
        assert [k for k in keys if k != "mixed_runs"] == [
            f.name for f in dataclasses.fields(summary)
        ]
        assert summary_to_dict(summary)["mixed_runs"] is False


class TestCommands:
    @pytest.mark.parametrize(("choice", "mixed"), [(None, False), ("monday", False), ("all", True)])
    def test_summary_json_and_report_json_hold_mixed_runs(
        self,
        tmp_path: Path,
        capsys: pytest.CaptureFixture[str],
        choice: str | None,
        mixed: bool,
    ) -> None:
        """summary --json and report.json say whether several runs were folded together."""
        log = _rerun_log(tmp_path / "log")
        extra = [] if choice is None else ["--run", choice]
        assert main(["summary", str(log), "--json", *extra]) == 0
        from_summary = orjson.loads(capsys.readouterr().out)
        out = tmp_path / "report"
        assert main(["report", str(log), "--out", str(out), "--no-html", *extra]) == 0
        from_report = orjson.loads((out / "report.json").read_bytes())["summary"]
        assert from_summary["mixed_runs"] is mixed
        assert from_report == from_summary
