"""Smoke test of ``benchmarks/bench_ab.py``: the base revision is imported under its own name
beside the working tree, both run a few interleaved steps, and every row is printed."""

from __future__ import annotations

import importlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
import torch

from benchmarks import bench_ab


def _in_git_checkout() -> bool:
    if shutil.which("git") is None:
        return False
    done = subprocess.run(
        ["git", "-C", str(bench_ab.ROOT), "rev-parse", "HEAD"], capture_output=True, check=False
    )
    return done.returncode == 0


pytestmark = pytest.mark.skipif(not _in_git_checkout(), reason="needs a git checkout")


def test_base_revision_runs_beside_the_working_tree(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """HEAD's package imports as eventbus_debug_base, with no import of the working tree's."""
    target = bench_ab.extract("HEAD", tmp_path)
    assert (target / "__init__.py").is_file()
    stale = [p.name for p in target.rglob("*.py") if bench_ab._NAME.search(p.read_text())]
    assert stale == []  # every import and logger name points at the base copy
    sys.path.insert(0, str(tmp_path))
    threads = torch.get_num_threads()
    try:
        base = importlib.import_module(bench_ab.BASE)
        new = importlib.import_module(bench_ab.PACKAGE)
        assert base.Session is not new.Session
        times = anyio.run(bench_ab.compare, {"base": base, "new": new}, ["off"], 3, 1)
    finally:
        sys.path.remove(str(tmp_path))
        for name in [m for m in sys.modules if m.split(".")[0] == bench_ab.BASE]:
            del sys.modules[name]
        torch.set_num_threads(threads)
    assert {name: len(ts) for name, ts in times.items()} == {"bare": 3, "off-base": 3, "off-new": 3}
    bench_ab.report(times, ["off"], ["base", "new"])
    out = capsys.readouterr().out
    for row in ("bare", "off-base", "off-new"):
        assert re.search(rf"^{row}\s+[\d.]+\s+[\d.]+x\s+[+-][\d.]+\s+[\d.]+\s+[\d.]+x$", out, re.M)
    assert re.search(r"^off: new - base = [+-][\d.]+ us a step \(median\)", out, re.M)


def test_unknown_revision_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="git archive no-such-revision"):
        bench_ab.extract("no-such-revision", tmp_path)
