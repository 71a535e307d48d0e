"""Every benchmark runs: each script, at tiny sizes, exits 0 and prints its rows.

A benchmark nobody can run measures nothing: ``bench_safepoint.py`` imported a private helper
whose signature changed and crashed for four sessions before anyone noticed. The figures
printed here mean nothing (a few steps on a shared machine); only that every code path of
each script still runs against today's library. The scripts with their own smoke test
(``bench_ab``, ``bench_decisions``, ``bench_session_gpu``, ``bench_step_parts``) are not
repeated; ``bench_probe_overhead`` (25 s at its smallest) is marked slow.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
TIMEOUT_S = 100

RUNS = [
    pytest.param(
        "bench_safepoint.py",
        ["--repeats", "1", "--steps", "8"],
        [r"probe\+safe", r"caught-up check: [\d.]+ us", r"snapshot capture, W1 MLP"],
        id="safepoint",
    ),
    pytest.param(
        "bench_levels.py",
        ["--steps", "6", "--warmup", "2", "--rounds", "1", "--threads", "1"],
        [rf"^{row}\s+[\d.]+\s+[\d.]+x" for row in ("bare", "off", "basic", "extreme", "default")],
        id="levels",
    ),
    pytest.param(
        "bench_resume.py",
        ["--steps", "120", "--resume-at", "80", "--runs", "classifier"],
        [r"^classifier\s.*\syes$", r"1/1 workloads report exactly", r"state: [\d,]+-[\d,]+ bytes"],
        id="resume",
    ),
    pytest.param(
        "bench_file_sink.py",
        [
            *("--events", "2000", "--repeat", "1", "--volume", "2000", "--burst", "200"),
            *("--kill-trials", "1", "--steps", "10"),
        ],
        [r"RotatingFileSink", r"kill -9: 1 trials", r"0 incidents lost"],
        id="file_sink",
    ),
    pytest.param(
        "bench_optimization_modes.py",
        ["--steps", "6", "--no-compile"],
        [r"^none\s", r"^gradient_checkpointing\s", r"^amp\s"],
        id="optimization_modes",
    ),
    pytest.param(
        "bench_publish.py",
        ["--bursts", "5"],
        [r"publish_nowait / empty call\s+[\d.]+x", r"encode_events / orjson.dumps\(event\)"],
        id="publish",
    ),
    pytest.param(
        "bench_report_alerts.py",
        ["--steps", "10"],
        [r"render_html", r"AlertSink.handle\s+[\d.]+ us/event"],
        id="report_alerts",
    ),
    pytest.param(
        "bench_slow_sink.py",
        ["--steps", "5"],
        [r"fast sink got everything\s+True", r"slow queue <= capacity \+ 1\s+True"],
        id="slow_sink",
    ),
    pytest.param(
        "bench_step_loop.py",
        ["--steps", "10", "--rounds", "1"],
        [r"^bus\+log\+safepoint\s", r"safe point questions"],
        id="step_loop",
    ),
    pytest.param(
        "bench_distributed.py",
        ["--steps", "10", "--warmup", "2"],
        [r"the safe point waited\s+median", r"blocking: the collective took"],
        id="distributed",
    ),
    pytest.param(
        "bench_anomaly_arming.py",
        ["--steps", "4", "--repeats", "1"],
        [r"healthy with arming installed [\d.]+x; armed [\d.]+x"],
        id="anomaly_arming",
    ),
    pytest.param(
        "bench_long_run.py",
        ["--steps", "40"],
        [r"last tenth / first: [\d.]+x step time", r"published [\d,]+ events"],
        id="long_run",
    ),
    pytest.param(
        "bench_probe_overhead.py",
        ["--repeats", "1", "--only", "W1"],
        [r"probe call alone, default set"],
        id="probe_overhead",
        marks=pytest.mark.slow,
    ),
]


@pytest.mark.parametrize(("script", "args", "patterns"), RUNS)
def test_the_benchmark_runs_and_prints_its_rows(
    script: str, args: list[str], patterns: list[str], tmp_path: Path
) -> None:
    """Run from a scratch directory (what a benchmark writes stays out of the checkout)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, f"{script} exited {done.returncode}:\n{done.stderr[-3000:]}"
    for pattern in patterns:
        assert re.search(pattern, done.stdout, re.M), f"{script}: no {pattern!r} in\n{done.stdout}"
