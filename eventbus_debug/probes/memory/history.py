"""The CUDA caching allocator's history, recorded around a block and dumped for memory_viz."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Final

import torch

from ..._validate import positive_int

__all__ = ("cuda_memory_history",)

DEFAULT_HISTORY_ENTRIES: Final = 100_000
"""Allocator events kept by default (the history is a ring buffer of this size)."""


@contextlib.contextmanager
def cuda_memory_history(path: str, *, max_entries: int = DEFAULT_HISTORY_ENTRIES) -> Iterator[bool]:
    """Record the CUDA allocator's history inside the block and dump a snapshot to *path*.

    Wraps ``torch.cuda.memory._record_memory_history`` with a bounded *max_entries*; the
    snapshot opens in https://pytorch.org/memory_viz. Arm it only around the steps you need:
    recording stacks costs time on every allocation. Without CUDA it records nothing and
    yields False. (Not verified on a GPU in this project's test suite.)

    Raises:
        ValueError: if *max_entries* is below 1.
    """
    positive_int("max_entries", max_entries)
    if not torch.cuda.is_available():
        yield False
        return
    record = torch.cuda.memory._record_memory_history
    record(enabled="all", max_entries=max_entries)
    try:
        yield True
        torch.cuda.memory._dump_snapshot(path)  # type: ignore[no-untyped-call]
    finally:
        record(enabled=None)
