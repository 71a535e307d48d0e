"""The command line audited from the user's side, on real logs: the demo's, a session's (reruns
into one directory, two ranks, a rotated and gzipped log), and what users give it — missing,
empty and wrong paths, torn and garbage lines, unknown kinds and runs, bad ``-n``, a file that
rotates while ``tail --follow`` reads it, a closed pipe, colours, JSON, non-ASCII and control
characters, an ``--out`` that cannot be written. Every wait is bounded.
"""

from __future__ import annotations

import gzip
import io
import json
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from eventbus_debug import decode_event, encode_event, read_events
from eventbus_debug.cli import main
from eventbus_debug.events import (
    ErrorCategory,
    ErrorRaised,
    Event,
    SessionEnded,
    SessionStarted,
    StepCompleted,
)

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = ("summary", "report", "tail")


def write_log(directory: Path, events: list[Event], name: str = "events.jsonl") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    with path.open("ab") as fh:
        fh.write(b"".join(encode_event(e) for e in events))
    return path


def _lines(directory: Path) -> int:
    """The complete lines of every log file in *directory*, gzipped backups included."""
    total = 0
    for path in directory.iterdir():
        if path.name.startswith("events") and ".jsonl" in path.name:
            data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
            total += data.count(b"\n")
    return total


def _strict_json(text: str) -> Any:
    """*text* decoded as standard JSON (no NaN / Infinity tokens)."""

    def refuse(token: str) -> None:
        raise ValueError(f"not standard JSON: {token}")

    return json.loads(text, parse_constant=refuse)


def _table(out: str) -> dict[str, str]:
    rows = {}
    for line in out.splitlines():
        key, _, value = line.partition("  ")
        rows[key.strip()] = value.strip()
    return rows


def _one_line_error(err: str, command: str) -> None:
    assert err.count("\n") == 1, err
    assert err.startswith(f"eventbus-debug {command}: error:"), err
    assert "Traceback" not in err


# -- real logs ------------------------------------------------------------------------------------


def _train(log_dir: Path | None, steps: int, *, nan_at: int | None = None, **options: Any) -> None:
    """A small SyncSession run (README Quickstart 1, as a plain loop)."""
    import torch
    from torch import nn

    from eventbus_debug import SyncSession

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    options.setdefault("system_interval", None)
    options.setdefault("alerts", False)
    with SyncSession(model, optimizer, log_dir=log_dir, **options) as session:
        for step in range(steps):
            x = torch.randn(8, 4)
            if step == nan_at:
                x[0, 0] = math.nan
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
            torch.autograd.backward(loss)
            verdict = session.check_step(step, loss=loss)
            if verdict.should_step:
                optimizer.step()
            session.step_completed(step, loss=verdict.loss)


@pytest.fixture(scope="module", name="demo_log")
def _demo_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`eventbus-debug demo --log-dir D --steps 25 --quiet` (faults at steps 12, 20 and 23)."""
    log_dir = tmp_path_factory.mktemp("demo") / "D"
    assert main(["demo", "--log-dir", str(log_dir), "--steps", "25", "--quiet"]) == 0
    return log_dir


@pytest.fixture(scope="module", name="reruns")
def _reruns(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two sessions run one after the other into one directory: two run ids."""
    log_dir = tmp_path_factory.mktemp("reruns")
    _train(log_dir, 8, nan_at=3, report=False)
    _train(log_dir, 5, report=False)
    return log_dir


@pytest.fixture(scope="module", name="job")
def _job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Rank 0 and rank 1 of one job (RANK, one EVENTBUS_DEBUG_RUN_ID): events.rank1.jsonl."""
    from eventbus_debug.events import refresh_rank

    log_dir = tmp_path_factory.mktemp("job")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EVENTBUS_DEBUG_RUN_ID", "audit-job")
        for rank in ("0", "1"):
            mp.setenv("RANK", rank)
            _train(log_dir, 6, report=False)
    refresh_rank()
    yield log_dir


@pytest.fixture(scope="module", name="rotated")
def _rotated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A session whose log rotated at 3,000 bytes into gzipped backups."""
    from eventbus_debug.sinks import RotatingFileSink

    log_dir = tmp_path_factory.mktemp("rotated")
    sink = RotatingFileSink(log_dir, max_bytes=3000, backup_count=50, compress=True)
    _train(None, 20, report=False, sinks=[sink])
    return log_dir


class TestRealLogs:
    def test_demo_log_every_command(
        self, demo_log: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """summary, tail and report agree on the demo's log; --json is standard JSON."""
        events = list(read_events(demo_log))
        assert main(["summary", str(demo_log)]) == 0
        rows = _table(capsys.readouterr().out)
        assert rows["events"] == str(len(events)) and rows["steps"] == "25 (0..24)"
        assert rows["steps skipped"] == "1" and rows["ended"] == "completed"
        assert main(["tail", str(demo_log), "--all", "--json"]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert len(lines) == len(events) == _lines(demo_log)
        assert all(isinstance(_strict_json(line), dict) for line in lines)
        assert main(["summary", str(demo_log), "--json"]) == 0
        assert _strict_json(capsys.readouterr().out)["events"] == len(events)
        out = tmp_path / "report"
        assert main(["report", str(demo_log), "--out", str(out)]) == 0
        printed = capsys.readouterr().out.splitlines()
        assert printed[:2] == [str(out / "report.json"), str(out / "report.html")]
        assert printed[2].startswith(f"{len(events)} events, 25 steps")
        assert (out / "report.html").read_text(encoding="utf-8").startswith("<!DOCTYPE html>")

    def test_tail_default_is_the_last_20_and_n(
        self, demo_log: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """tail shows the last 20 by default, -n N the last N, -n 0 none."""
        assert main(["tail", str(demo_log), "--json"]) == 0
        last20 = capsys.readouterr().out.splitlines()
        assert len(last20) == 20
        assert main(["tail", str(demo_log), "--json", "-n", "3"]) == 0
        assert capsys.readouterr().out.splitlines() == last20[-3:]
        assert main(["tail", str(demo_log), "-n", "0"]) == 0
        assert capsys.readouterr() == ("", "")

    def test_reruns_latest_other_all_and_unknown(
        self, reruns: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """Two sessions into one directory: the latest by default, --run ID, --run all, and an
        unknown id a usage error listing both runs (nothing written)."""
        assert main(["summary", str(reruns)]) == 0
        rows = _table(capsys.readouterr().out)
        latest, _, of = rows["run"].partition(" (the latest), ")
        assert of == "1 of 2" and rows["steps"] == "5 (0..4)"
        first = rows["other runs"].split(" (")[0]
        assert first != latest
        assert main(["summary", str(reruns), "--run", first]) == 0
        rows = _table(capsys.readouterr().out)
        assert rows["run"] == f"{first}, 1 of 2" and rows["steps"] == "8 (0..7)"
        assert rows["steps skipped"] == "1"
        assert main(["summary", str(reruns), "--run", "all", "--json"]) == 0
        data = _strict_json(capsys.readouterr().out)
        assert data["mixed_runs"] and [r["run_id"] for r in data["runs"]] == [first, latest]
        out = tmp_path / "r"
        for command in ("summary", "report"):
            extra = ["--out", str(out)] if command == "report" else []
            assert main([command, str(reruns), "--run", "nope", *extra]) == 2
            err = capsys.readouterr().err
            _one_line_error(err, command)
            assert "'nope'" in err and first in err and latest in err
        assert not out.exists()

    def test_two_ranks(self, job: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """Each rank's file is read: one run, both ranks, rank 1's lines marked."""
        assert sorted(p.name for p in job.iterdir()) == ["events.jsonl", "events.rank1.jsonl"]
        assert main(["summary", str(job)]) == 0
        rows = _table(capsys.readouterr().out)
        assert rows["run"] == "audit-job" and rows["ranks"] == "0, 1"
        assert rows["steps"] == "6 (0..5)"
        assert main(["tail", str(job), "--all", "--kind", "session_ended"]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert len(lines) == 2 and "rank=1" in lines[1] and "rank=" not in lines[0]

    def test_rotated_gzipped_log(
        self, rotated: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """Every line of the live file and of the gzipped backups is read, in order."""
        assert any(p.name.endswith(".gz") for p in rotated.iterdir())
        assert main(["tail", str(rotated), "--all", "--json", "--kind", "step_completed"]) == 0
        steps = [decode_event(line.encode()).step for line in capsys.readouterr().out.splitlines()]
        assert steps == list(range(20))
        assert main(["summary", str(rotated), "--json"]) == 0
        data = _strict_json(capsys.readouterr().out)
        assert data["events"] == _lines(rotated) and data["steps"] == 20
        assert main(["report", str(rotated), "--out", str(tmp_path / "r"), "--no-html"]) == 0
        assert "20 steps" in capsys.readouterr().out


# -- what users give ------------------------------------------------------------------------------


class TestBadPaths:
    @pytest.mark.parametrize("command", COMMANDS)
    def test_missing_empty_and_file(
        self, command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """A missing directory, an empty one and a file: exit 1, one line saying which."""
        (tmp_path / "empty").mkdir()
        log = write_log(tmp_path / "log", [StepCompleted(step=0)])
        for where, says in (
            (tmp_path / "nope", "does not exist"),
            (tmp_path / "empty", "no event log"),
            (log, "is not a directory"),
        ):
            assert main([command, str(where)]) == 1
            captured = capsys.readouterr()
            _one_line_error(captured.err, command)
            assert says in captured.err and captured.out == ""

    def test_follow_on_a_file_is_an_error_and_an_empty_directory_is_waited_for(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        log = write_log(tmp_path / "log", [StepCompleted(step=0)])
        assert main(["tail", str(log), "-f", "--timeout", "5"]) == 1
        assert "is not a directory" in capsys.readouterr().err
        (tmp_path / "empty").mkdir()
        assert main(["tail", str(tmp_path / "empty"), "-f", "--timeout", "0.05"]) == 0
        assert capsys.readouterr() == ("", "")

    @pytest.mark.parametrize(
        "argv",
        [
            ["summary", ""],
            ["tail", " "],
            ["report", "{log}", "--out", ""],
            ["demo", "--log-dir", ""],
        ],
    )
    def test_an_empty_path_is_a_usage_error(
        self,
        argv: list[str],
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str],
    ) -> None:
        """An empty path (an unset $LOGDIR) is refused, never taken for the current directory."""
        write_log(tmp_path / "log", [StepCompleted(step=0)])
        monkeypatch.chdir(tmp_path)  # where "" would have pointed
        assert main([a.format(log=tmp_path / "log") for a in argv]) == 2
        assert "must not be empty" in capsys.readouterr().err
        assert not (tmp_path / "report.json").exists() and not (tmp_path / "events.jsonl").exists()


class TestBadLines:
    @pytest.mark.parametrize("command", COMMANDS)
    def test_a_line_cut_by_a_crash_is_skipped(
        self, command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """A truncated last line (crash mid-write): exit 0, every whole event read."""
        path = write_log(tmp_path, [StepCompleted(step=s, loss=1.0) for s in range(5)])
        path.write_bytes(path.read_bytes() + encode_event(StepCompleted(step=5))[:40])
        extra = {"tail": ["--all", "--json"], "summary": ["--json"], "report": ["--no-html"]}
        assert main([command, str(tmp_path), *extra[command]]) == 0
        out = capsys.readouterr().out
        if command == "tail":
            assert [decode_event(line.encode()).step for line in out.splitlines()] == [
                0,
                1,
                2,
                3,
                4,
            ]
        elif command == "summary":
            assert _strict_json(out)["last_step"] == 4
        else:
            assert "5 events, 5 steps" in out

    @pytest.mark.parametrize("command", COMMANDS)
    def test_garbage_in_the_middle(
        self, command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """A garbage line: exit 1 naming file and line; --skip-bad-lines goes on and logs it."""
        good = [encode_event(StepCompleted(step=s, loss=1.0)) for s in range(4)]
        (tmp_path / "events.jsonl").write_bytes(
            b"".join(good[:2]) + b"garbage\n" + good[2] + good[3]
        )
        extra = ["--all"] if command == "tail" else ["--no-html"] if command == "report" else []
        assert main([command, str(tmp_path), *extra]) == 1
        captured = capsys.readouterr()
        _one_line_error(captured.err, command)
        assert "events.jsonl:3" in captured.err and captured.out == ""
        assert main([command, str(tmp_path), *extra, "--skip-bad-lines"]) == 0
        captured = capsys.readouterr()
        assert "undecodable_log_line" in captured.err and "Traceback" not in captured.err
        if command == "tail":
            assert len(captured.out.splitlines()) == 4

    def test_unknown_kind_with_and_without_import(self, tmp_path: Path) -> None:
        """Your own kind: exit 1 saying --import; --import MODULE reads it; a module that does
        not import is exit 2 (a fresh interpreter each: the kind is not registered here)."""
        (tmp_path / "audit_cli_kinds.py").write_text(
            "from typing import ClassVar\n"
            "from eventbus_debug import Event, Severity, event_type\n"
            "@event_type\n"
            "class Skipped(Event):\n"
            "    kind: ClassVar[str] = 'audit_cli.skipped'\n"
            "    severity: Severity = Severity.WARNING\n"
            "    reason: str = ''\n"
        )
        line = b'{"kind":"audit_cli.skipped","seq":0,"time_ns":1,"step":1,"rank":0,"source":"",'
        line += b'"severity":"warning","reason":"caf\xc3\xa9"}\n'
        write_log(tmp_path / "log", [StepCompleted(step=0)])
        with (tmp_path / "log" / "events.jsonl").open("ab") as fh:
            fh.write(line)
        code = "import sys; from eventbus_debug.cli import main; sys.exit(main(sys.argv[1:]))"

        def cli(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [sys.executable, "-c", code, *args],
                cwd=tmp_path,
                capture_output=True,
                text=True,
                encoding="utf-8",
                timeout=60,
                check=False,
            )

        done = cli("tail", "log", "--all")
        assert (
            done.returncode == 1 and "--import" in done.stderr and "events.jsonl:2" in done.stderr
        )
        assert done.stderr.count("\n") == 1
        done = cli("tail", "log", "--import", "audit_cli_kinds", "--kind", "audit_cli.skipped")
        assert done.returncode == 0, done.stderr
        assert "audit_cli.skipped" in done.stdout and "café" in done.stdout
        done = cli("summary", "log", "--import", "audit_cli_no_such_module")
        assert done.returncode == 2 and "ModuleNotFoundError" in done.stderr


class TestTailOptions:
    def test_bad_n(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """A negative -n and -n with --all are usage errors (the synopsis: [-n N | --all])."""
        write_log(tmp_path, [StepCompleted(step=0)])
        assert main(["tail", str(tmp_path), "-n", "-1"]) == 2
        err = capsys.readouterr().err
        _one_line_error(err, "tail")
        assert "-n/--lines must be >= 0" in err
        assert main(["tail", str(tmp_path), "-n", "3", "--all"]) == 2
        assert "not allowed with" in capsys.readouterr().err
        assert main(["tail", "--help"]) == 0
        assert "[-n N | --all]" in capsys.readouterr().out

    def test_colors(self, demo_log: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """--color always colours tail and summary, --color never does not."""
        for command in ("tail", "summary"):
            assert main([command, str(demo_log), "--color", "always"]) == 0
            assert "\x1b[" in capsys.readouterr().out
            assert main([command, str(demo_log), "--color", "never"]) == 0
            assert "\x1b[" not in capsys.readouterr().out

    def test_exit_on_end_follows_a_rerun_that_is_still_running(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """--exit-on-end stops at once on a log whose latest session ended, and follows one
        that a rerun is appending to (the previous run's session_ended is not the end)."""
        events: list[Event] = [
            SessionStarted(name="t", run_id="monday", time_ns=1),
            StepCompleted(step=0, time_ns=2),
            SessionEnded(name="t", steps=1, time_ns=3),
        ]
        write_log(tmp_path / "ended", events)
        args = ["-f", "--exit-on-end", "--poll-interval", "0.01", "--timeout", "30"]
        assert main(["tail", str(tmp_path / "ended"), *args]) == 0  # at once, not in 30 s
        assert "session_ended" in capsys.readouterr().out
        live = tmp_path / "live"
        write_log(live, [*events, SessionStarted(name="t", run_id="tuesday", time_ns=10)])
        result: list[int] = []
        thread = threading.Thread(target=lambda: result.append(main(["tail", str(live), *args])))
        thread.start()
        thread.join(0.3)
        assert thread.is_alive()  # still following tuesday
        write_log(live, [StepCompleted(step=0, time_ns=11), SessionEnded(name="t", time_ns=12)])
        thread.join(30)
        assert result == [0]
        out = capsys.readouterr().out
        assert "run=tuesday" in out and out.count("session_ended") == 2


class _Stepper:
    """The cli's `time`: each sleep between two polls of `tail --follow` waits for the test."""

    def __init__(self) -> None:
        self.go = threading.Semaphore(0)
        self.asleep = threading.Event()

    def sleep(self, seconds: float) -> None:
        self.asleep.set()
        if not self.go.acquire(timeout=30):
            raise KeyboardInterrupt  # the test gave up: tail ends quietly

    def monotonic(self) -> float:
        return time.monotonic()

    def poll(self) -> None:
        """Let tail poll once, and wait until it has."""
        self.asleep.clear()
        self.go.release()
        assert self.asleep.wait(30)


def _gzip_rotate(directory: Path) -> None:
    """What RotatingFileSink(compress=True) does: shift the backups, gzip the live file into
    ``.1.gz`` through a temporary name, remove it."""
    live = directory / "events.jsonl"
    backups = sorted(directory.glob("events.jsonl.*.gz"), key=lambda p: -int(p.name.split(".")[2]))
    for path in backups:
        n = int(path.name.split(".")[2])
        os.replace(path, directory / f"events.jsonl.{n + 1}.gz")
    tmp = directory / "events.jsonl.1.gz.tmp"
    tmp.write_bytes(gzip.compress(live.read_bytes()))
    os.replace(tmp, directory / "events.jsonl.1.gz")
    live.unlink()


def test_follow_across_gzip_rotation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """tail --follow prints every event once, in order, while the file rotates into gzipped
    backups between its polls (twice in one gap too), and stops at session_ended."""
    import eventbus_debug.cli as cli

    stepper = _Stepper()
    monkeypatch.setattr(cli, "time", stepper)
    d = tmp_path / "run"
    write_log(d, [StepCompleted(step=0, loss=1.0)])
    result: list[int] = []
    argv = ["tail", str(d), "-f", "--exit-on-end", "--json", "--timeout", "60"]
    thread = threading.Thread(target=lambda: result.append(main(argv)))
    thread.start()
    try:
        assert stepper.asleep.wait(30)
        step = 1
        for rotations in (1, 0, 2, 1):
            for _ in range(rotations):
                write_log(d, [StepCompleted(step=step, loss=1.0)])
                step += 1
                _gzip_rotate(d)
            write_log(d, [StepCompleted(step=step, loss=1.0)])
            step += 1
            stepper.poll()
        write_log(d, [SessionEnded(name="t", steps=step)])
        stepper.go.release()
        thread.join(30)
    finally:
        stepper.go.release()
        thread.join(30)
    assert result == [0]
    events = [decode_event(line.encode()) for line in capsys.readouterr().out.splitlines()]
    assert [e.step for e in events if isinstance(e, StepCompleted)] == list(range(step))
    assert isinstance(events[-1], SessionEnded)


# -- output ---------------------------------------------------------------------------------------


class TestOutput:
    def test_piped_into_head(self, tmp_path: Path) -> None:
        """`eventbus-debug tail DIR --all | head -1`: quiet, no BrokenPipe traceback."""
        write_log(tmp_path, [StepCompleted(step=s, loss=1.0) for s in range(5000)])
        for extra in ([], ["--json"]):
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "eventbus_debug.cli",
                    "tail",
                    str(tmp_path),
                    "--all",
                    *extra,
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=ROOT,
            )
            assert proc.stdout is not None and proc.stderr is not None
            assert proc.stdout.readline()  # head -1
            proc.stdout.close()
            err = proc.stderr.read().decode()
            proc.stderr.close()
            assert proc.wait(timeout=60) in (0, 141)
            assert err == ""

    @staticmethod
    def _crafted(directory: Path) -> None:
        write_log(
            directory,
            [
                SessionStarted(name="entraînement", run_id="répétition-日本\x1b]0;pwned\x07"),
                ErrorRaised(
                    step=1,
                    error_type="ValueError",
                    message="caf\u00e9 \x1b[2J\x1b[31mred 😀",
                    category=ErrorCategory.DATA,
                ),
                SessionEnded(name="t", steps=2, reason="stopped\x1b[2J"),
            ],
        )

    def test_non_ascii_and_control_characters(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """Non-ASCII is printed as it is; a logged control character is printed escaped,
        never raw (coloured output too); --json decodes back to the same strings."""
        self._crafted(tmp_path)
        for color in ("never", "always"):
            assert main(["tail", str(tmp_path), "--color", color]) == 0
            out = capsys.readouterr().out
            assert "café" in out and "😀" in out and "日本" in out
            assert "\\x1b[2J" in out and "\x1b[2J" not in out and "\x07" not in out
        assert main(["summary", str(tmp_path), "--color", "always"]) == 0
        out = capsys.readouterr().out
        assert "répétition-日本\\x1b]0;pwned\\x07" in out and "\x1b]0" not in out
        assert "\x1b[2J" not in out
        assert main(["tail", str(tmp_path), "--all", "--json"]) == 0
        decoded = [_strict_json(line) for line in capsys.readouterr().out.splitlines()]
        assert decoded[0]["run_id"] == "répétition-日本\x1b]0;pwned\x07"
        assert decoded[1]["message"] == "caf\u00e9 \x1b[2J\x1b[31mred 😀"

    def test_an_ascii_terminal(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """Standard output that cannot encode the text (PYTHONIOENCODING=ascii): the text lines
        show it escaped, --json stays valid JSON of the same strings; never a read error."""
        self._crafted(tmp_path)
        for argv, as_json in (
            (["tail", str(tmp_path)], False),
            (["summary", str(tmp_path)], False),
            (["tail", str(tmp_path), "--json"], True),
            (["summary", str(tmp_path), "--json"], True),
        ):
            raw = io.BytesIO()
            stdout = io.TextIOWrapper(raw, encoding="ascii", newline="")
            monkeypatch.setattr(sys, "stdout", stdout)
            assert main(argv) == 0, capsys.readouterr().err
            stdout.flush()
            assert stdout.errors == "strict"  # restored
            text = raw.getvalue().decode("ascii")
            if not as_json:
                assert "r\\xe9p\\xe9tition" in text
            elif argv[0] == "tail":
                lines = [_strict_json(line) for line in text.splitlines()]
                assert lines[1]["message"] == "caf\u00e9 \x1b[2J\x1b[31mred 😀"
            else:
                assert _strict_json(text)["run_id"] == "répétition-日本\x1b]0;pwned\x07"
        assert capsys.readouterr().err == ""


class TestReportOut:
    def test_out_that_cannot_be_created(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """--out under a file: exit 1, one line naming the --out directory."""
        log = write_log(tmp_path / "log", [StepCompleted(step=0)])
        target = log / "report"
        assert main(["report", str(log.parent), "--out", str(target)]) == 1
        err = capsys.readouterr().err
        _one_line_error(err, "report")
        assert f"cannot write the report in {str(target)!r}" in err

    @pytest.mark.skipif(
        not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root writes a 0555 directory"
    )
    def test_read_only_out(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """A read-only --out: exit 1, one line naming it (not a temporary file) and why."""
        write_log(tmp_path / "log", [StepCompleted(step=0)])
        out = tmp_path / "ro"
        out.mkdir()
        out.chmod(0o555)
        try:
            assert main(["report", str(tmp_path / "log"), "--out", str(out)]) == 1
        finally:
            out.chmod(0o755)
        err = capsys.readouterr().err
        _one_line_error(err, "report")
        assert f"cannot write the report in {str(out)!r}: Permission denied" in err
        assert list(out.iterdir()) == []


def test_json_of_a_nan_is_standard_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A NaN loss is written as the string "NaN": tail --json and summary --json stay JSON."""
    write_log(tmp_path, [StepCompleted(step=0, loss=float("nan")), StepCompleted(step=1, loss=1.0)])
    assert main(["tail", str(tmp_path), "--json"]) == 0
    first = _strict_json(capsys.readouterr().out.splitlines()[0])
    assert first["loss"] == "NaN"
    assert main(["summary", str(tmp_path), "--json"]) == 0
    assert orjson.loads(capsys.readouterr().out)["steps"] == 2
