from __future__ import annotations

import gzip
import os
import subprocess
import sys
import threading
from pathlib import Path

import anyio
import orjson
import pytest

from eventbus_debug import encode_event
from eventbus_debug.cli import LogFollower, format_event, main
from eventbus_debug.events import Event, SessionEnded, StepCompleted
from tests.sinks.test_report import scripted_events

ROOT = Path(__file__).resolve().parent.parent


def write_log(directory: Path, events: list[Event], name: str = "events.jsonl") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    with path.open("ab") as fh:
        fh.write(b"".join(encode_event(e) for e in events))
    return path


@pytest.fixture(name="logdir")
def _logdir(tmp_path: Path) -> Path:
    """A log split over a gzipped backup, a plain backup and the live file, as rotation does."""
    events = scripted_events(20)
    d = tmp_path / "run"
    d.mkdir()
    third = len(events) // 3
    with gzip.open(d / "events.jsonl.2.gz", "wb") as fh:
        fh.write(b"".join(encode_event(e) for e in events[:third]))
    write_log(d, events[third : 2 * third], "events.jsonl.1")
    write_log(d, events[2 * third :])
    return d


class TestHelp:
    @pytest.mark.parametrize("command", [[], ["demo"], ["report"], ["tail"], ["summary"]])
    def test_help_on_each_command(
        self, command: list[str], capsys: pytest.CaptureFixture[str]
    ) -> None:
        """--help works for the program and every command, and exits 0."""
        assert main([*command, "--help"]) == 0
        assert "usage: eventbus-debug" in capsys.readouterr().out

    def test_usage_error_exits_2(self, capsys: pytest.CaptureFixture[str]) -> None:
        """An unknown command is a usage error."""
        assert main(["frobnicate"]) == 2
        assert "invalid choice" in capsys.readouterr().err


class TestReport:
    def test_report_rebuilds_from_rotated_files(
        self, logdir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """report reads every file (gzipped backups too) and writes JSON and HTML."""
        out = tmp_path / "out"
        assert main(["report", str(logdir), "--out", str(out)]) == 0
        printed = capsys.readouterr().out
        assert str(out / "report.json") in printed and str(out / "report.html") in printed
        data = orjson.loads((out / "report.json").read_bytes())
        assert data["summary"]["events"] == len(scripted_events(20))
        assert data["summary"]["gradient_explosions"] == 1
        assert (out / "report.html").read_text().startswith("<!DOCTYPE html>")

    def test_report_defaults_to_logdir(self, logdir: Path) -> None:
        """Without --out the report lands next to the log; --no-html skips the page."""
        assert main(["report", str(logdir), "--no-html"]) == 0
        assert (logdir / "report.json").exists() and not (logdir / "report.html").exists()

    def test_report_merges_ranks(self, tmp_path: Path) -> None:
        """Every rank's file is read; the summary lists both ranks."""
        write_log(tmp_path, [StepCompleted(step=0, rank=0, loss=1.0)])
        write_log(tmp_path, [StepCompleted(step=0, rank=1, loss=2.0)], "events.rank1.jsonl")
        assert main(["report", str(tmp_path), "--no-html"]) == 0
        data = orjson.loads((tmp_path / "report.json").read_bytes())
        assert data["summary"]["ranks"] == [0, 1] and data["summary"]["events"] == 2


class TestSummary:
    def test_table(self, logdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """summary prints an aligned table of the key figures."""
        assert main(["summary", str(logdir)]) == 0
        out = capsys.readouterr().out
        assert "gradient explosions      1 (rate 5.00%)" in out
        assert "recovery decisions       clip_gradients=1, skip_step=1" in out

    def test_json(self, logdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """summary --json prints the whole summary as JSON, and nothing else on stdout."""
        assert main(["summary", str(logdir), "--json"]) == 0
        data = orjson.loads(capsys.readouterr().out)
        assert data["steps"] == 20 and data["errors_by_category"] == {"memory": 1}


class TestErrors:
    def test_missing_directory(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """A missing directory is one line on stderr and exit status 1."""
        assert main(["summary", str(tmp_path / "nope")]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "does not exist" in err

    @pytest.mark.parametrize("command", ["report", "tail", "summary"])
    def test_no_log_inside(
        self, command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """A directory without events*.jsonl is reported, for every command."""
        (tmp_path / "other.txt").write_text("x")
        assert main([command, str(tmp_path)]) == 1
        assert "no event log" in capsys.readouterr().err

    def test_unreadable_file(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """A backup that is not really gzip is named in a one-line error."""
        write_log(tmp_path, scripted_events(2))
        (tmp_path / "events.jsonl.1.gz").write_bytes(b"this is not gzip data\n")
        assert main(["report", str(tmp_path)]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "events.jsonl.1.gz" in err

    def test_undecodable_line(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """A corrupt line fails with its file and line number; --skip-bad-lines goes on."""
        path = write_log(tmp_path, scripted_events(2))
        with path.open("ab") as fh:
            fh.write(b'{"kind": "no_such_kind"}\n')
        write_log(tmp_path, [StepCompleted(step=99, loss=1.0)])
        assert main(["summary", str(tmp_path)]) == 1
        assert "events.jsonl:" in capsys.readouterr().err
        assert main(["summary", str(tmp_path), "--skip-bad-lines", "--json"]) == 0
        assert orjson.loads(capsys.readouterr().out)["last_step"] == 99

    def test_not_a_directory(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """A file given instead of a directory is refused."""
        path = write_log(tmp_path, scripted_events(1))
        assert main(["tail", str(path)]) == 1
        assert "not a directory" in capsys.readouterr().err


class TestTail:
    def test_last_events_filtered(self, logdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """tail shows the last N events that pass the kind and severity filters."""
        assert main(["tail", str(logdir), "-n", "2", "--min-severity", "warning"]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert len(lines) == 2
        assert "events_dropped" in lines[1] and "error_raised" in lines[0]
        assert main(["tail", str(logdir), "--all", "--kind", "gradient_exploded"]) == 0
        [line] = capsys.readouterr().out.splitlines()
        assert "step=8" in line and "gradient norm 500 > 10" in line

    async def test_follow_across_rotation(self, tmp_path: Path) -> None:
        """--follow prints events as a writer appends them, across a rotation, and stops at
        session_ended (--exit-on-end)."""
        d = tmp_path / "run"
        write_log(d, [StepCompleted(step=0, loss=1.0)])
        out_path = tmp_path / "out.txt"
        written = threading.Event()

        def run_tail() -> int:
            with out_path.open("w") as out:
                saved, sys.stdout = sys.stdout, out
                try:
                    return main(
                        [
                            "tail",
                            str(d),
                            "--follow",
                            "--exit-on-end",
                            "--poll-interval",
                            "0.02",
                            "--timeout",
                            "20",
                            "--kind",
                            "step_completed",
                            "--kind",
                            "session_ended",
                        ]
                    )
                finally:
                    sys.stdout = saved

        async def writer() -> None:
            for step in range(1, 4):
                write_log(d, [StepCompleted(step=step, loss=1.0 / step)])
                await anyio.sleep(0.05)
            os.replace(d / "events.jsonl", d / "events.jsonl.1")  # rotate
            write_log(d, [StepCompleted(step=4, loss=0.2)])
            await anyio.sleep(0.05)
            # a line written in two pieces is printed once, whole
            line = encode_event(StepCompleted(step=5, loss=0.1))
            with (d / "events.jsonl").open("ab") as fh:
                fh.write(line[:10])
            await anyio.sleep(0.05)
            with (d / "events.jsonl").open("ab") as fh:
                fh.write(line[10:])
            write_log(d, [SessionEnded(name="t", steps=6)])
            written.set()

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(writer)
                rc = await anyio.to_thread.run_sync(run_tail)
        assert rc == 0 and written.is_set()
        lines = out_path.read_text().splitlines()
        steps = [
            int(part[5:]) for line in lines for part in line.split() if part.startswith("step=")
        ]
        assert steps == [0, 1, 2, 3, 4, 5]
        assert "session_ended" in lines[-1]

    def test_follower_reads_each_line_once(self, tmp_path: Path) -> None:
        """LogFollower returns only new events at each poll; from_end skips the past."""
        write_log(tmp_path, [StepCompleted(step=0)])
        follower = LogFollower(tmp_path, from_end=False)
        fresh = LogFollower(tmp_path, from_end=True)
        assert [e.step for e in follower.poll()] == [0]
        assert follower.poll() == [] and fresh.poll() == []
        write_log(tmp_path, [StepCompleted(step=1), StepCompleted(step=2)])
        assert [e.step for e in follower.poll()] == [1, 2]
        assert [e.step for e in fresh.poll()] == [1, 2]

    def test_format_event(self) -> None:
        """A formatted line carries the severity, kind, step and the compact fields."""
        line = format_event(StepCompleted(step=3, loss=float("nan"), rank=2))
        assert "DEBUG" in line and "step_completed" in line
        assert "step=3" in line and "rank=2" in line and "loss=nan" in line


def test_demo_subcommand_writes_a_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """demo runs the training loop and ends by printing where the report is."""
    log_dir = tmp_path / "demo"
    assert main(["demo", "--log-dir", str(log_dir), "--steps", "30", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert f"report: {log_dir / 'report.html'}" in out
    assert (log_dir / "report.html").exists()


def test_demo_unavailable_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without the demo module, demo fails with one line instead of a traceback."""
    monkeypatch.setitem(sys.modules, "eventbus_debug.demo", None)
    assert main(["demo", "--log-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "demo is not available" in err


def test_console_script_subprocess(logdir: Path) -> None:
    """The installed console script runs as its own process."""
    script = Path(sys.executable).parent / "eventbus-debug"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "eventbus_debug.cli"]
    done = subprocess.run(
        [*command, "summary", str(logdir), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert orjson.loads(done.stdout)["steps"] == 20
