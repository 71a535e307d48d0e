"""The command line on logs that hold your own event types, and on bad lines, as a user runs it.

A log of a session that published ``@event_type`` classes of the user's holds kinds that only
decode once the module defining them is imported: every reading command takes ``--import
MODULE`` (the current directory on the import path, as for ``python -m``), and without it fails
with a message saying so. ``tail`` decodes as strictly as ``summary`` and ``report``. Each run
is a fresh interpreter (the console script's ``main``), so the user's kinds are not already
registered by the test process.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from eventbus_debug import encode_event
from eventbus_debug.cli import LogFollower
from eventbus_debug.events import StepCompleted
from eventbus_debug.exceptions import EventDecodeError

EVENTS_MODULE = """
from typing import ClassVar

from eventbus_debug import Delivery, Event, Severity, event_type


@event_type
class BatchSkipped(Event):
    kind: ClassVar[str] = "s10cli.batch_skipped"
    delivery: ClassVar[Delivery] = Delivery.INCIDENT
    severity: Severity = Severity.WARNING
    batch_index: int
    reason: str = ""
"""

WRITE_LOG = """
import sys
from pathlib import Path

from eventbus_debug import encode_event
from eventbus_debug.events import SessionEnded, SessionStarted, StepCompleted
from s10cli_events import BatchSkipped

events = [SessionStarted(run_id="r1")]
for step in range(4):
    events.append(StepCompleted(step=step, loss=1.0 / (step + 1)))
    if step % 2:
        events.append(BatchSkipped(step=step, batch_index=step, reason="corrupt"))
events.append(SessionEnded(reason="completed", steps=4))
Path(sys.argv[1]).mkdir()
Path(sys.argv[1], "events.jsonl").write_bytes(b"".join(encode_event(e) for e in events))
"""


def _cli(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    code = "import sys; from eventbus_debug.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.fixture(name="project")
def _project(tmp_path: Path) -> Path:
    """A project directory with the user's event module and a log written by a run using it."""
    (tmp_path / "s10cli_events.py").write_text(EVENTS_MODULE)
    subprocess.run([sys.executable, "-c", WRITE_LOG, "log"], cwd=tmp_path, check=True, timeout=120)
    return tmp_path


@pytest.mark.parametrize("command", [["summary"], ["report", "--no-html"], ["tail", "--all"]])
def test_own_kinds_without_import_fail_saying_what_to_do(project: Path, command: list[str]) -> None:
    done = _cli(project, *command[:1], "log", *command[1:])
    assert done.returncode == 1
    assert "unknown event kind 's10cli.batch_skipped'" in done.stderr
    assert "--import MODULE" in done.stderr
    assert "log/events.jsonl:4" in done.stderr  # the file and the line
    assert "Traceback" not in done.stderr


def test_import_makes_every_reading_command_see_the_users_events(project: Path) -> None:
    summary = _cli(project, "summary", "log", "--json", "--import", "s10cli_events")
    assert summary.returncode == 0, summary.stderr
    assert '"events":8' in summary.stdout.replace(" ", "")
    tail = _cli(project, "tail", "log", "--all", "--import", "s10cli_events")
    assert tail.returncode == 0, tail.stderr
    assert len(tail.stdout.splitlines()) == 8
    warnings = _cli(
        project, "tail", "log", "--min-severity", "warning", "--import", "s10cli_events"
    )
    assert [line.split()[2] for line in warnings.stdout.splitlines()] == [
        "s10cli.batch_skipped"
    ] * 2
    kind = _cli(
        project, "tail", "log", "--kind", "s10cli.batch_skipped", "--import", "s10cli_events"
    )
    assert kind.returncode == 0, kind.stderr
    assert len(kind.stdout.splitlines()) == 2
    report = _cli(project, "report", "log", "--no-html", "--import", "s10cli_events")
    assert report.returncode == 0, report.stderr
    assert "8 events, 4 steps" in report.stdout and "2 incidents" in report.stdout


def test_unknown_kind_filter_names_the_import_option(project: Path) -> None:
    done = _cli(project, "tail", "log", "--kind", "s10cli.batch_skipped")
    assert done.returncode == 2
    assert "--import" in done.stderr


def test_a_module_that_cannot_be_imported_is_a_usage_error(project: Path) -> None:
    done = _cli(project, "summary", "log", "--import", "s10cli_no_such_module")
    assert done.returncode == 2
    assert "--import s10cli_no_such_module: ModuleNotFoundError" in done.stderr
    (project / "s10cli_broken.py").write_text("raise RuntimeError('broken on import')\n")
    broken = _cli(project, "summary", "log", "--import", "s10cli_broken")
    assert broken.returncode == 2
    assert "RuntimeError: broken on import" in broken.stderr


def _crafted(directory: Path) -> None:
    good = encode_event(StepCompleted(step=4, loss=0.5))
    bad = good.replace(b'"step":4', b'"step":"abc"')
    directory.mkdir()
    (directory / "events.jsonl").write_bytes(good + bad + b"not json at all\n" + good)


def test_tail_refuses_a_crafted_line_as_summary_does(tmp_path: Path) -> None:
    _crafted(tmp_path / "bad")
    for command in ("tail", "summary"):
        done = _cli(tmp_path, command, "bad")
        assert done.returncode == 1, command
        assert "bad/events.jsonl:2" in done.stderr and "'step'" in done.stderr


def test_tail_skip_bad_lines_shows_the_rest_and_says_what_it_skipped(tmp_path: Path) -> None:
    _crafted(tmp_path / "bad")
    done = _cli(tmp_path, "tail", "bad", "--skip-bad-lines", "--json")
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.splitlines()) == 2
    assert done.stderr.count("undecodable_log_line") == 2
    assert "line=2" in done.stderr and "line=3" in done.stderr


def test_follower_skips_a_torn_line_in_both_modes_and_names_bad_lines(tmp_path: Path) -> None:
    """A line cut by a crash is skipped (an event glued after it recovered), strict or not,
    as read_events does; a complete bad line is named by file and line when strict."""
    good = encode_event(StepCompleted(step=1, loss=0.5))
    torn = good[:20]  # the next run appended right after the cut
    d = tmp_path / "log"
    d.mkdir()
    (d / "events.jsonl").write_bytes(good + torn + encode_event(StepCompleted(step=2, loss=0.4)))
    assert [e.step for e in LogFollower(d, from_end=False, strict=True).poll()] == [1, 2]
    with (d / "events.jsonl").open("ab") as fh:
        fh.write(b'{"kind": "no_such_kind_s10"}\n')
    follower = LogFollower(d, from_end=False, strict=False)
    assert [e.step for e in follower.poll()] == [1, 2]
    assert follower.stats.invalid_lines == 1
    with pytest.raises(EventDecodeError, match=r"events\.jsonl:3: unknown event kind"):
        LogFollower(d, from_end=False, strict=True).poll()
