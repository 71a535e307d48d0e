"""Same-process A/B of a session's per-step cost: the working tree against a git revision.

The revision's package is taken out of git (``git archive``) into a temporary directory and
imported under another name (``eventbus_debug_base``); sessions of both versions train
identical models (the 85 k-parameter MLP of ``bench_levels.py``, batch 128, AdamW, one torch
thread) in one loop, one step of each per iteration beside a bare loop, in an order that
rotates every iteration, so that drift on a shared machine hits every variant alike. Prints,
per variant, the median and mean step time, their ratios to the bare loop and the µs a step
over it, then the difference between the two versions at each level.

Sequential rounds (``bench_levels.py``) move by several points between runs on a shared
2-core machine; here two identical variants agree within about 4 µs a step, which resolves
the few-µs changes the per-step path is made of. The sessions share the event loop, so a
session's sinks may run during another variant's step: a few µs move between variants (log
only here: report and alerts off).

    .venv/bin/python benchmarks/bench_ab.py [--base HEAD] [--levels off,basic] [--steps 2500]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio
import anyio.lowlevel
import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_step_parts import _setup  # noqa: E402 - the same model as there

PACKAGE = "eventbus_debug"
BASE = "eventbus_debug_base"
_NAME = re.compile(rf"\b{PACKAGE}\b")


def extract(rev: str, dest: Path) -> Path:
    """The package as it is at *rev*, written under *dest* as ``eventbus_debug_base``.

    Raises:
        RuntimeError: if git cannot read *rev* (not a git checkout, unknown revision).
    """
    done = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", rev, PACKAGE],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        msg = f"git archive {rev} {PACKAGE} failed: {done.stderr.decode(errors='replace').strip()}"
        raise RuntimeError(msg)
    with tarfile.open(fileobj=io.BytesIO(done.stdout)) as tar:
        tar.extractall(dest, filter="data")
    target = dest / BASE
    (dest / PACKAGE).rename(target)
    for path in target.rglob("*.py"):  # its absolute imports and logger names
        path.write_text(_NAME.sub(BASE, path.read_text(encoding="utf-8")), encoding="utf-8")
    return target


async def compare(
    packages: dict[str, ModuleType], levels: list[str], steps: int, warmup: int
) -> dict[str, list[float]]:
    """Seconds of each step of every variant (``bare`` and ``<level>-<version>``)."""
    variants = [(f"{lv}-{tag}", pkg, lv) for lv in levels for tag, pkg in packages.items()]
    names = ["bare"] + [name for name, _, _ in variants]
    setups = {name: _setup() for name in names}
    times: dict[str, list[float]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as d:
        async with contextlib.AsyncExitStack() as stack:
            sessions: dict[str, Any] = {}
            for name, pkg, level in variants:
                model, opt, _, _ = setups[name]
                sessions[name] = await stack.enter_async_context(
                    pkg.Session(
                        model,
                        opt,
                        log_dir=f"{d}/{name}",
                        level=level,
                        report=False,
                        alerts=False,
                    )
                )
            for step in range(warmup + steps):
                shift = step % len(names)
                for name in names[shift:] + names[:shift]:
                    model, opt, x, y = setups[name]
                    t0 = time.perf_counter()
                    opt.zero_grad(set_to_none=True)
                    loss = nn.functional.cross_entropy(model(x), y)
                    torch.autograd.backward(loss)
                    if name == "bare":
                        opt.step()
                        float(loss.detach())  # the bare loop reads its loss too
                        await anyio.lowlevel.checkpoint()
                    else:
                        session = sessions[name]
                        verdict = await session.check_step(step, loss=loss)
                        if verdict.should_step:
                            opt.step()
                        await session.step_completed(step, loss=verdict.loss)
                    if step >= warmup:
                        times[name].append(time.perf_counter() - t0)
    return times


def report(times: dict[str, list[float]], levels: list[str], tags: list[str]) -> None:
    """Print each variant against the bare loop, then new minus base at each level."""
    bare_median = statistics.median(times["bare"])
    bare_mean = statistics.fmean(times["bare"])
    over: dict[str, tuple[float, float]] = {}
    print(
        f"{'variant':<16} {'median us':>10} {'ratio':>7} {'+us':>7}   {'mean us':>9} {'ratio':>7}"
    )
    for name, ts in times.items():
        median, mean = statistics.median(ts), statistics.fmean(ts)
        over[name] = (median - bare_median, mean - bare_mean)
        print(
            f"{name:<16} {median * 1e6:10.1f} {median / bare_median:6.3f}x "
            f"{(median - bare_median) * 1e6:+7.1f}   {mean * 1e6:9.1f} {mean / bare_mean:6.3f}x"
        )
    base, new = tags
    for level in levels:
        (bm, ba), (nm, na) = over[f"{level}-{base}"], over[f"{level}-{new}"]
        print(
            f"{level}: {new} - {base} = {(nm - bm) * 1e6:+.1f} us a step (median), "
            f"{(na - ba) * 1e6:+.1f} us (mean)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base", default="HEAD", help="the git revision to compare against")
    parser.add_argument("--levels", default="off,basic", help="debug levels, comma-separated")
    parser.add_argument("--steps", type=int, default=2500)
    parser.add_argument("--warmup", type=int, default=200)
    args = parser.parse_args()
    levels = [lv.strip() for lv in args.levels.split(",") if lv.strip()]
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        extract(args.base, Path(tmp))
        sys.path.insert(0, tmp)
        try:
            packages = {
                "base": importlib.import_module(BASE),
                "new": importlib.import_module(PACKAGE),
            }
            times = anyio.run(compare, packages, levels, args.steps, args.warmup)
        finally:
            sys.path.remove(tmp)
    print(
        f"MLP 85 k params, batch 128, AdamW, 1 torch thread; base = {args.base}, new = the "
        f"working tree; {args.steps} steps of each, interleaved"
    )
    report(times, levels, ["base", "new"])


if __name__ == "__main__":
    main()
