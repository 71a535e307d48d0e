"""A model's memory profile: memory before, right after and after one forward pass, with a
thread sampling the RSS peak in between."""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import psutil
import torch
from torch import nn
from typing_extensions import Self

from .snapshot import MemorySnapshot, memory_snapshot

__all__ = ("MemoryProfile", "profile_memory")


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryProfile:
    """Memory around one forward pass.

    Attributes:
        initial: before the forward pass.
        after_forward: right after it, with the output still alive.
        final: after the output was released and the garbage collected.
        peak_rss_bytes: the largest RSS seen: the snapshots and a thread polling RSS every
            millisecond during the forward pass (psutil has no peak of its own).
        peak_cuda_bytes: the CUDA allocator's peak during the forward (None without CUDA).
        output_shapes: the shapes of the tensors the forward returned.
    """

    initial: MemorySnapshot
    after_forward: MemorySnapshot
    final: MemorySnapshot
    peak_rss_bytes: int
    peak_cuda_bytes: int | None
    output_shapes: tuple[tuple[int, ...], ...] = field(default=())

    @property
    def forward_rss_bytes(self) -> int:
        """RSS held by the forward's output and caches (``after_forward - initial``)."""
        return self.after_forward.rss_bytes - self.initial.rss_bytes


def _shapes(out: Any) -> tuple[tuple[int, ...], ...]:
    if isinstance(out, torch.Tensor):
        return (tuple(int(s) for s in out.shape),)
    if isinstance(out, Mapping):
        return tuple(s for v in out.values() for s in _shapes(v))
    if isinstance(out, list | tuple):
        return tuple(s for v in out for s in _shapes(v))
    return ()


class _RssPeak:
    """Poll the process RSS on a daemon thread until stopped; keep the largest value."""

    def __init__(self, interval: float = 0.001) -> None:
        self._interval = interval
        self._process = psutil.Process()
        self._stop = threading.Event()
        self.peak = int(self._process.memory_info().rss)
        self._thread = threading.Thread(
            target=self._poll, name="eventbus-debug-rss-peak", daemon=True
        )

    def _poll(self) -> None:
        while not self._stop.wait(self._interval):
            self.peak = max(self.peak, int(self._process.memory_info().rss))

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, int(self._process.memory_info().rss))


def profile_memory(model: nn.Module, inputs: Any, *, grad: bool = False) -> MemoryProfile:
    """Measure memory before, right after and after one forward pass of *model* on *inputs*.

    The forward runs under ``torch.no_grad()`` unless *grad* (then the autograd graph the
    output holds is part of ``after_forward``); no backward runs, the model is not changed.

    Args:
        model: the module to run.
        inputs: a tensor, or a tuple/list of positional arguments.
        grad: build the autograd graph as training would.

    Raises:
        TypeError: if *model* is not a torch.nn.Module.
    """
    if not isinstance(model, nn.Module):
        msg = f"model must be a torch.nn.Module, got {type(model).__qualname__}"
        raise TypeError(msg)
    args = tuple(inputs) if isinstance(inputs, list | tuple) else (inputs,)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    initial = memory_snapshot()
    ctx = contextlib.nullcontext() if grad else torch.no_grad()
    with _RssPeak() as peak, ctx:
        out = model(*args)
        if cuda:
            torch.cuda.synchronize()
    after = memory_snapshot()
    shapes = _shapes(out)
    del out
    gc.collect()
    final = memory_snapshot()
    return MemoryProfile(
        initial=initial,
        after_forward=after,
        final=final,
        peak_rss_bytes=max(peak.peak, initial.rss_bytes, after.rss_bytes, final.rss_bytes),
        peak_cuda_bytes=int(torch.cuda.max_memory_allocated()) if cuda else None,
        output_shapes=shapes,
    )
