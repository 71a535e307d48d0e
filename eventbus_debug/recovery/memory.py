"""Freeing memory: garbage collection and the CUDA caching allocator, measured before and after."""

from __future__ import annotations

import gc
from dataclasses import dataclass

import psutil
import torch

__all__ = ("FreedMemory", "free_memory")

_MIB = float(1 << 20)


@dataclass(frozen=True, slots=True, kw_only=True)
class FreedMemory:
    """What :func:`free_memory` did.

    Attributes:
        collected: unreachable objects found by ``gc.collect()``.
        rss_before: the process's resident set size before, in bytes.
        rss_after: after.
        cuda_reserved_before: bytes reserved by the CUDA caching allocator before (``None``
            without CUDA).
        cuda_reserved_after: after ``torch.cuda.empty_cache()``.
    """

    collected: int
    rss_before: int
    rss_after: int
    cuda_reserved_before: int | None = None
    cuda_reserved_after: int | None = None

    def describe(self) -> str:
        """One line for the log: ``"gc collected 12 objects; rss 812.0 -> 790.3 MiB"``."""
        text = (
            f"gc collected {self.collected} objects; rss {self.rss_before / _MIB:.1f} -> "
            f"{self.rss_after / _MIB:.1f} MiB"
        )
        if self.cuda_reserved_before is not None and self.cuda_reserved_after is not None:
            text += (
                f"; CUDA cache emptied, reserved {self.cuda_reserved_before / _MIB:.1f} -> "
                f"{self.cuda_reserved_after / _MIB:.1f} MiB"
            )
        return text


def free_memory() -> FreedMemory:
    """Run ``gc.collect()`` and, when CUDA is initialized, ``torch.cuda.empty_cache()``.

    Blocks for the duration of a full collection (milliseconds to a second on big heaps); call it
    at a safe point or between attempts, never per step.
    """
    process = psutil.Process()
    rss_before = int(process.memory_info().rss)
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    reserved_before = int(torch.cuda.memory_reserved()) if cuda else None
    collected = gc.collect()
    reserved_after: int | None = None
    if cuda:
        torch.cuda.empty_cache()
        reserved_after = int(torch.cuda.memory_reserved())
    return FreedMemory(
        collected=collected,
        rss_before=rss_before,
        rss_after=int(process.memory_info().rss),
        cuda_reserved_before=reserved_before,
        cuda_reserved_after=reserved_after,
    )
