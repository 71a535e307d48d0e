"""Smoke tests of the GPU session table (``benchmarks/bench_session_gpu.py``).

CI has no GPU: the script must say so and exit 0, and its ``--device cpu`` dry run runs the
same code path with tiny sizes, so that the first run on a real GPU is not its first run.
"""

from __future__ import annotations

import re

import pytest
import torch

from benchmarks.bench_session_gpu import NO_CUDA, VARIANTS, Row, main, render


def test_without_cuda_it_says_so_and_exits_0(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """No CUDA device: one line saying why nothing ran, and success."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main([]) == 0
    assert capsys.readouterr().out.strip() == NO_CUDA


def test_cpu_dry_run_prints_every_variant_of_both_workloads(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--device cpu runs both workloads' variants, the profiler count and the device_skip line."""
    threads = torch.get_num_threads()
    try:
        code = main(
            ["--device", "cpu", "--steps", "2", "--warmup", "1", "--rounds", "1", "--profile"]
        )
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert code == 0
    assert out.startswith("device: CPU (dry run, tiny sizes)")
    assert "W1 MLP" in out and "GPT-2" in out
    for variant in VARIANTS:
        expected = 1 if variant.kind == "seed" else 2  # the seed's per-parameter way: W1 only
        rows = re.findall(rf"^  {re.escape(variant.name)} +\d", out, re.MULTILINE)
        assert len(rows) == expected, variant.name
    baselines = [line for line in out.splitlines() if line.startswith(("  bare ", "  bare fused "))]
    assert len(baselines) == 4 and all(" 1.00x " in line for line in baselines)
    assert out.count("device_skip: session host time") == 2


def test_render_compares_device_skip_with_the_same_session_without_it() -> None:
    """The comparison line divides device_skip's host time and step time by the fused session's."""
    rows = [
        Row("bare fused", "bare fused", 2.0, 1.0, None, 10.0),
        Row("session fused", "bare fused", 2.5, 1.25, 400.0, 18.0),
        Row("device_skip", "bare fused", 2.2, 1.1, 200.0, 21.0),
    ]
    text = render("W", rows)
    assert "\n  device_skip        2.200   1.10x  bare fused      200      21.0\n" in text
    assert text.endswith(
        "device_skip: session host time 200 us/step vs 400 without (0.50x); step time 0.88x"
    )
