"""Memory snapshots, the tensor census and before/after tracking."""

from __future__ import annotations

import pytest
import torch

from eventbus_debug import EventBus
from eventbus_debug.events import MemorySampled
from eventbus_debug.probes import memory_snapshot, memory_tracking, tensor_census
from eventbus_debug.testing import RecordingSink


def test_snapshot_reads_rss_and_counts_tensors() -> None:
    """RSS is positive; counting finds at least the tensor we hold; no CUDA here means None."""
    keep = torch.ones(3, requires_grad=True) * 2
    snap = memory_snapshot(count_tensors=True)
    assert snap.rss_bytes > 0
    assert snap.live_tensors is not None and snap.live_tensors >= 1
    assert snap.graph_tensors is not None and snap.graph_tensors >= 1
    if not torch.cuda.is_available():
        assert snap.cuda_allocated is None and snap.cuda_ooms is None
    del keep


def test_census_groups_graph_tensors_by_grad_fn_and_shape() -> None:
    """Tensors holding a graph are grouped by grad_fn name and shape."""
    w = torch.ones(2, 3, requires_grad=True)
    held = [(w * i).sum() for i in range(5)]
    census = tensor_census()
    assert (("SumBackward0", ()), 5) in census.graph_groups or any(
        name == "SumBackward0" and n >= 5 for (name, _), n in census.graph_groups
    )
    del held


async def test_memory_tracking_reports_the_delta_of_an_allocating_block(
    bus: EventBus, recorder: RecordingSink
) -> None:
    """A block that allocates 64 MiB and 10 tensors shows them in the delta and the events."""
    sub = bus.subscribe(recorder, MemorySampled)
    async with memory_tracking("alloc", bus, step=3, count_tensors=True) as tracked:
        big = torch.ones(16 << 20)  # 64 MiB, touched
        small = [torch.zeros(1) for _ in range(10)]
    assert tracked.delta.rss_bytes >= 32 << 20
    assert tracked.delta.live_tensors is not None and tracked.delta.live_tensors >= 11
    await bus.drain(sub)
    labels = [e.label for e in recorder.of_type(MemorySampled)]
    assert labels == ["alloc:before", "alloc:after"]
    assert all(e.step == 3 for e in recorder.of_type(MemorySampled))
    del big, small


def test_memory_tracking_sync_and_delta_before_exit() -> None:
    """The sync form works; asking for the delta inside the block is a clear error."""
    with memory_tracking("block") as tracked:
        with pytest.raises(RuntimeError, match="once the block exited"):
            _ = tracked.delta
    assert tracked.delta.name == "block" and tracked.delta.duration_s >= 0
