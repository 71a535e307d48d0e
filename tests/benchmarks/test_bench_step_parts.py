"""Smoke test of ``benchmarks/bench_step_parts.py``: it runs at tiny sizes, prints every
variant and part, and leaves the library's methods as it found them."""

from __future__ import annotations

import re

import anyio
import pytest
import torch

from benchmarks.bench_step_parts import _PARTS, main


def test_tiny_run_prints_every_row_and_restores_the_wrapped_methods(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Five variants as ratios to the bare loop, seven parts in µs; the wrappers are removed."""
    before = [getattr(cls, name) for cls, name, _ in _PARTS]
    threads = torch.get_num_threads()
    try:
        anyio.run(main, 3, 1)
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    for row in ("bare", "floor", "off", "off, no safe pt", "basic"):
        assert re.search(rf"^  {re.escape(row)}\s+[\d.]+ us/step\s+[\d.]+x$", out, re.M), row
    for _, _, label in _PARTS:
        assert re.search(rf"^  {re.escape(label)}\s+[\d.]+$", out, re.M), label
    assert [getattr(cls, name) for cls, name, _ in _PARTS] == before
