from __future__ import annotations

import gzip
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import anyio
import orjson
import pytest

from eventbus_debug import encode_event
from eventbus_debug.cli import LogFollower, format_event, main
from eventbus_debug.events import Event, SessionEnded, StepCompleted
from tests.sinks.report.test_writer import scripted_events

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


@pytest.mark.parametrize("as_json", [False, True])
def test_summary_imports_no_torch_nor_writing_sinks(logdir: Path, as_json: bool) -> None:
    """``summary`` on a log imports neither torch, the session nor the sinks that write."""
    heavy = ("torch", "eventbus_debug.session", "eventbus_debug.sinks.alerts.sink")
    argv = ["summary", str(logdir), *(["--json"] if as_json else [])]
    code = (
        "import sys\n"
        "from eventbus_debug.cli import main\n"
        f"code = main({argv!r})\n"
        f"loaded = sorted(m for m in {heavy!r} if m in sys.modules)\n"
        "print('LOADED', loaded, file=sys.stderr)\n"
        "raise SystemExit(code)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert "LOADED []" in done.stderr, done.stderr
    assert ("steps" in done.stdout) and ("20" in done.stdout)


class TestVersionAndKinds:
    def test_version(self, capsys: pytest.CaptureFixture[str]) -> None:
        """--version prints the program name and the package version, exit 0."""
        from eventbus_debug import __version__

        assert main(["--version"]) == 0
        assert capsys.readouterr().out.strip() == f"eventbus-debug {__version__}"

    def test_unknown_kind_is_an_error(
        self, logdir: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """A typo in --kind exits 2 with one line listing the valid kinds."""
        assert main(["tail", str(logdir), "--kind", "step_complted"]) == 2
        captured = capsys.readouterr()
        assert captured.out == ""
        assert captured.err.count("\n") == 1
        assert "unknown --kind step_complted" in captured.err
        assert "step_completed" in captured.err and "non_finite_detected" in captured.err

    def test_tail_json_lines_decode(self, logdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """tail --json prints each event as its log line, decodable back to the same event."""
        from eventbus_debug import decode_event, read_events

        assert main(["tail", str(logdir), "--all", "--json"]) == 0
        lines = capsys.readouterr().out.splitlines()
        decoded = [decode_event(line.encode()) for line in lines]
        assert [(e.kind, e.seq) for e in decoded] == [(e.kind, e.seq) for e in read_events(logdir)]


class TestColors:
    def test_tail_colors(self, logdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """--color always colours severities; auto on a non-terminal does not."""
        assert main(["tail", str(logdir), "--all", "--color", "always"]) == 0
        assert "\x1b[31m" in capsys.readouterr().out
        assert main(["tail", str(logdir), "--all"]) == 0
        assert "\x1b[" not in capsys.readouterr().out

    def test_summary_colors(self, logdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """summary --color always makes the labels bold and non-zero anomalies red."""
        assert main(["summary", str(logdir), "--color", "always"]) == 0
        out = capsys.readouterr().out
        assert "\x1b[1mevents" in out and "\x1b[31m" in out
        assert main(["summary", str(logdir), "--color", "never"]) == 0
        assert "\x1b[" not in capsys.readouterr().out


class _Clock:
    """The cli's view of `time`, telling the test when tail starts waiting."""

    def __init__(self) -> None:
        self.waiting = threading.Event()

    def sleep(self, seconds: float) -> None:
        self.waiting.set()
        time.sleep(seconds)

    def monotonic(self) -> float:
        return time.monotonic()


class TestFollowWaits:
    def test_follow_waits_for_the_directory(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """tail --follow on a run that has not created its directory yet waits for it."""
        import eventbus_debug.cli as cli

        clock = _Clock()
        monkeypatch.setattr(cli, "time", clock)
        d = tmp_path / "not-yet"
        result: list[int] = []
        args = ["tail", str(d), "--follow", "--exit-on-end", "--poll-interval", "0.01"]
        thread = threading.Thread(target=lambda: result.append(main([*args, "--timeout", "30"])))
        thread.start()
        assert clock.waiting.wait(30)  # tail is polling for a directory that does not exist
        assert not d.exists() and thread.is_alive()
        write_log(d, [StepCompleted(step=0, loss=1.0), SessionEnded(name="late", steps=1)])
        thread.join(30)
        assert result == [0]
        out = capsys.readouterr().out
        assert "step_completed" in out and "session_ended" in out

    def test_follow_gives_up_at_the_timeout(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """With --timeout, waiting for a directory that never appears ends with exit 0."""
        assert main(["tail", str(tmp_path / "never"), "--follow", "--timeout", "0.05"]) == 0
        assert capsys.readouterr().err == ""

    def test_without_follow_a_missing_directory_is_an_error(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """Without --follow the missing directory is an error at once."""
        assert main(["tail", str(tmp_path / "never")]) == 1
        assert "does not exist" in capsys.readouterr().err


CRAFTED = [
    b'{"kind": "step_completed", "seq": 1, "time_ns": 1, "step": "abc", "rank": 0}\n',
    b'{"kind": "step_completed", "seq": "x", "time_ns": [], "rank": {}}\n',
    b"[1, 2, 3]\n",
    b'{"kind": "no_such_kind", "seq": 1}\n',
    b"\xff\xfe not json at all\n",
]


class TestBadLogs:
    @pytest.mark.parametrize("line", CRAFTED, ids=range(len(CRAFTED)))
    @pytest.mark.parametrize("command", ["summary", "report", "tail"])
    def test_one_line_no_traceback(
        self, tmp_path: Path, command: str, line: bytes, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """A crafted line makes summary, report and tail fail with one line, never a traceback."""
        d = tmp_path / "bad"
        good = encode_event(StepCompleted(step=0, loss=1.0))
        d.mkdir()
        (d / "events.jsonl").write_bytes(good + line + good)
        extra = ["--all"] if command == "tail" else []
        code = main([command, str(d), *extra])
        err = capsys.readouterr().err
        if command == "tail" and code == 0:  # tail skips undecodable lines, as `tail` would
            assert err == ""
            return
        assert code == 1
        assert err.count("\n") == 1 and err.startswith(f"eventbus-debug {command}: error:")
        assert "Traceback" not in err

    def test_tail_into_a_closed_pipe(self, logdir: Path) -> None:
        """`eventbus-debug tail ... | head -0`: a quiet exit, no traceback."""
        proc = subprocess.Popen(
            [sys.executable, "-m", "eventbus_debug.cli", "tail", str(logdir), "--all"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=ROOT,
        )
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()
        err = proc.stderr.read().decode()
        proc.stderr.close()
        assert proc.wait(timeout=60) in (0, 141)
        assert "Traceback" not in err and "BrokenPipe" not in err


def _rerun_log(directory: Path) -> Path:
    """Two runs appended to one log, as a rerun into the same directory writes it: 'monday'
    (30 steps, two explosions) then 'tuesday' (12 steps, one explosion)."""
    from eventbus_debug.events import GradientExploded, SessionStarted

    events: list[Event] = []
    for run_id, steps, t0 in (("monday", 30, 1), ("tuesday", 12, 10**15)):
        events.append(SessionStarted(name="train", run_id=run_id, time_ns=t0))
        for step in range(steps):
            events.append(StepCompleted(step=step, loss=1.0, time_ns=t0 + 2 * step + 1))
            if step in ((3, 20) if run_id == "monday" else (5,)):
                events.append(
                    GradientExploded(
                        step=step, total_norm=500.0, threshold=10.0, time_ns=t0 + 2 * step + 2
                    )
                )
    write_log(directory, events)
    return directory


def _table(out: str) -> dict[str, str]:
    rows = {}
    for line in out.splitlines():
        key, _, value = line.partition("  ")
        rows[key.strip()] = value.strip()
    return rows


class TestRuns:
    """summary and report choose the run of a rerun log the same way (never merged silently)."""

    def test_summary_shows_the_latest_run_and_names_the_others(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """By default summary shows the latest run, as report does, and lists the others."""
        log = _rerun_log(tmp_path / "log")
        assert main(["summary", str(log)]) == 0
        rows = _table(capsys.readouterr().out)
        assert rows["run"] == "tuesday (the latest), 1 of 2"
        assert rows["other runs"].startswith("monday (") and "--run ID" in rows["other runs"]
        assert rows["steps"] == "12 (0..11)" and rows["incidents"] == "1"

    def test_run_option_picks_one_or_folds_all(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """--run ID shows that run; --run all folds every run and says so."""
        log = _rerun_log(tmp_path / "log")
        assert main(["summary", str(log), "--run", "monday"]) == 0
        rows = _table(capsys.readouterr().out)
        assert rows["run"] == "monday, 1 of 2" and rows["other runs"].startswith("tuesday (")
        assert rows["steps"] == "30 (0..29)" and rows["incidents"] == "2"
        assert main(["summary", str(log), "--run", "all"]) == 0
        rows = _table(capsys.readouterr().out)
        assert rows["runs"] == "2 folded together (--run all): monday, tuesday"
        assert rows["incidents"] == "3" and "run" not in rows

    def test_summary_json_matches_the_report_for_each_choice(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """summary --json and report.json hold the same summary, whichever run is chosen."""
        log = _rerun_log(tmp_path / "log")
        for choice in (None, "monday", "tuesday", "all"):
            extra = [] if choice is None else ["--run", choice]
            out = tmp_path / f"report-{choice}"
            assert main(["report", str(log), "--out", str(out), "--no-html", *extra]) == 0
            capsys.readouterr()
            assert main(["summary", str(log), "--json", *extra]) == 0
            from_summary = orjson.loads(capsys.readouterr().out)
            from_report = orjson.loads((out / "report.json").read_bytes())["summary"]
            assert from_summary == from_report, choice
            shown = [r["run_id"] for r in from_summary["runs"] if r["shown"]]
            expected = {None: ["tuesday"], "all": ["monday", "tuesday"]}.get(choice, [choice])
            assert shown == expected

    def test_report_prints_which_run_it_shows(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """report's output says which run the files show and which others the log holds."""
        log = _rerun_log(tmp_path / "log")
        assert main(["report", str(log), "--out", str(tmp_path / "r"), "--no-html"]) == 0
        out = capsys.readouterr().out
        assert "run: tuesday (the latest), 1 of 2\n" in out
        assert "other runs: monday (" in out
        assert "12 steps" in out

    @pytest.mark.parametrize("command", ["summary", "report"])
    def test_unknown_run_is_a_usage_error_listing_the_runs(
        self, tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """An unknown --run id exits 2 with one line naming the log's runs; nothing written."""
        log = _rerun_log(tmp_path / "log")
        out = tmp_path / "r"
        extra = ["--out", str(out)] if command == "report" else []
        assert main([command, str(log), "--run", "friday", *extra]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"eventbus-debug {command}: error: --run")
        assert "'friday'" in err and "'monday'" in err and "'tuesday'" in err
        assert not out.exists()

    @pytest.mark.parametrize("command", ["summary", "report"])
    def test_empty_run_is_a_usage_error(
        self, tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """--run '' is refused before the log is read."""
        assert main([command, str(_rerun_log(tmp_path / "log")), "--run", " "]) == 2
        assert "--run must be" in capsys.readouterr().err

    def test_a_one_run_log_has_no_other_runs_row(
        self, tmp_path: Path, logdir: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """One run: its id is shown and no 'other runs' row; a log without a session start
        shows neither."""
        from eventbus_debug.events import SessionStarted

        one = tmp_path / "one"
        write_log(one, [SessionStarted(name="t", run_id="only"), StepCompleted(step=0, loss=1.0)])
        assert main(["summary", str(one)]) == 0
        rows = _table(capsys.readouterr().out)
        assert rows["run"] == "only" and "other runs" not in rows
        assert main(["report", str(one), "--no-html"]) == 0
        assert len(capsys.readouterr().out.splitlines()) == 2  # report.json, the counts
        assert main(["summary", str(logdir)]) == 0
        rows = _table(capsys.readouterr().out)
        assert "run" not in rows and "other runs" not in rows
        assert main(["summary", str(logdir), "--run", "nope"]) == 2
        assert "none" in capsys.readouterr().err
