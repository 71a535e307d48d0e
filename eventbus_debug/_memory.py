"""Memory figures the debugging copies are sized against (no other import from the library).

A debugger's own copies (the last good state, the weights before an update measurement) must
never take the memory training needs: what they may take is a share of the device's total
memory, of the host's available memory, split among this machine's training processes.
"""

from __future__ import annotations

import os
from typing import Final

import psutil
import torch

__all__ = (
    "DEVICE_SHARE",
    "device_budget",
    "device_total",
    "host_available",
    "local_processes",
    "nbytes",
)

DEVICE_SHARE: Final = 0.05
"""The largest share of an accelerator's total memory one debugging copy may take there."""


def host_available() -> int:
    """The host memory available to new allocations, in bytes (psutil)."""
    return int(psutil.virtual_memory().available)


def device_total(device: torch.device) -> int | None:
    """*device*'s total memory in bytes, or ``None`` when it cannot be read (the host, or an
    accelerator without a memory query)."""
    if device.type in ("cpu", "meta"):
        return None
    try:
        return int(torch.accelerator.get_memory_info(device)[1])
    except (RuntimeError, ValueError, AssertionError, AttributeError):
        return None


def device_budget(device: torch.device) -> int | None:
    """The bytes a debugging copy may take on *device* (``DEVICE_SHARE`` of its memory);
    ``None``: no bound (the host, whose memory is bounded by its own rules, or an accelerator
    whose memory cannot be read)."""
    total = device_total(device)
    return None if total is None else int(DEVICE_SHARE * total)


def local_processes() -> int:
    """The training processes on this machine that each keep their copies (torchrun's
    ``LOCAL_WORLD_SIZE``; 1 outside a launcher)."""
    try:
        n = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        return 1
    return max(n, 1)


def nbytes(t: torch.Tensor) -> int:
    """The bytes a copy of *t* takes: a DTensor's local shard; a sparse COO tensor's stored
    values and indices, not its dense size."""
    local = t.to_local() if hasattr(t, "to_local") else t
    if local.layout is torch.sparse_coo:
        return int(local._values().numel() * local.element_size() + local._indices().numel() * 8)
    return int(local.numel() * local.element_size())
