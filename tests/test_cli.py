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
