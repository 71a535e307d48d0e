"""Memory probes: snapshots, before/after tracking, a model's memory profile, leak detection and
the CUDA allocator's history."""

from __future__ import annotations

from .history import cuda_memory_history
from .leaks import LeakDetector, LeakThresholds
from .profile import MemoryProfile, profile_memory
from .snapshot import (
    MemoryDelta,
    MemorySnapshot,
    TensorCensus,
    memory_snapshot,
    memory_tracking,
    tensor_census,
)

__all__: tuple[str, ...] = (
    "LeakDetector",
    "LeakThresholds",
    "MemoryDelta",
    "MemoryProfile",
    "MemorySnapshot",
    "TensorCensus",
    "cuda_memory_history",
    "memory_snapshot",
    "memory_tracking",
    "profile_memory",
    "tensor_census",
)
