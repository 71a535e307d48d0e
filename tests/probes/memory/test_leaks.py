"""Memory probes: snapshots, before/after tracking, the memory profile and leak detection."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from torch import nn

from eventbus_debug import EventBus, read_events
from eventbus_debug.demo import DemoFaults, run_demo
from eventbus_debug.events import MemoryLeakSuspected, MemorySampled
from eventbus_debug.probes import (
    LeakDetector,
    LeakThresholds,
    cuda_memory_history,
    memory_snapshot,
    memory_tracking,
    profile_memory,
    tensor_census,
)
from eventbus_debug.testing import RecordingSink

from .conftest import batch, make_mlp


def _train(steps: int, *, leak: bool, detector: LeakDetector) -> list[MemoryLeakSuspected]:
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    kept: list[torch.Tensor] = []
    fired: list[MemoryLeakSuspected] = []
    for step in range(steps):
        x, y = batch(step)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        torch.autograd.backward(loss)
        optimizer.step()
        if leak:
            kept.append(loss)  # the bug: the loss keeps its autograd graph alive
        fired.extend(detector.observe(step))
    kept.clear()
    return fired


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


def test_profile_memory_reports_initial_forward_final() -> None:
    """The profile holds the three snapshots, the peak and the output shapes."""
    model = make_mlp()
    profile = profile_memory(model, torch.randn(4, 8))
    assert profile.output_shapes == ((4, 1),)
    assert profile.peak_rss_bytes >= max(profile.initial.rss_bytes, profile.final.rss_bytes)
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        profile_memory("model", torch.randn(1))  # type: ignore[arg-type]


def test_a_graph_retaining_leak_is_detected_with_what_it_retains() -> None:
    """`losses.append(loss)`: the graph count of surviving tensors rises; the report names it."""
    gc.collect()
    detector = LeakDetector(every=2, thresholds=LeakThresholds(window=5, warmup=1))
    fired = _train(16, leak=True, detector=detector)
    graph = [e for e in fired if e.resource == "graph"]
    assert graph, fired
    first = graph[0]
    assert first.slope == pytest.approx(2.0)  # two more graphs per sample of every 2 steps
    assert first.window == 5
    assert "MseLossBackward0" in first.retained and "loss.item()" in first.retained
    assert first.step is not None and first.step <= 14


def test_a_clean_loop_raises_no_leak() -> None:
    """No false positive: the same loop without the leak fires nothing (warm-up included)."""
    gc.collect()
    detector = LeakDetector(every=2, thresholds=LeakThresholds(window=5, warmup=1))
    assert _train(24, leak=False, detector=detector) == []
    assert detector.samples == 12


def test_detector_validates_its_arguments() -> None:
    """Bad cadences and windows are rejected with the rule."""
    with pytest.raises(ValueError, match="every must be an int >= 1"):
        LeakDetector(every=0)
    with pytest.raises(ValueError, match="window must be >= 3"):
        LeakThresholds(window=2)


async def test_detector_publishes_samples_and_incidents(
    bus: EventBus, recorder: RecordingSink
) -> None:
    """Samples carry the live-tensor count; the incident reaches the bus."""
    sub = bus.subscribe(recorder, MemorySampled, MemoryLeakSuspected)
    detector = LeakDetector(bus, every=1, thresholds=LeakThresholds(window=6, warmup=0))
    _train(8, leak=True, detector=detector)
    await bus.drain(sub)
    samples = recorder.of_type(MemorySampled)
    assert len(samples) == 8 and all(s.live_tensors for s in samples)
    assert any(e.resource == "graph" for e in recorder.of_type(MemoryLeakSuspected))


def test_cuda_memory_history_is_a_no_op_without_cuda(tmp_path: Path) -> None:
    """Without CUDA nothing is recorded; max_entries must be bounded."""
    with pytest.raises(ValueError, match="max_entries"):
        with cuda_memory_history(str(tmp_path / "s.pickle"), max_entries=0):
            pass
    if not torch.cuda.is_available():
        with cuda_memory_history(str(tmp_path / "s.pickle")) as recording:
            assert recording is False


async def test_demo_leak_becomes_an_incident(tmp_path: Path) -> None:
    """The demo's leaking list of losses is reported as a MemoryLeakSuspected (graph)."""
    faults = DemoFaults(
        nan_step=None, explode_step=None, oom_step=None, leak_start=10, leak_stop=60
    )
    await run_demo(tmp_path, steps=64, width=8, faults=faults, console=False)
    leaks = [e for e in read_events(tmp_path) if isinstance(e, MemoryLeakSuspected)]
    graph = [e for e in leaks if e.resource == "graph"]
    assert graph and all(10 < e.step <= 60 for e in graph if e.step is not None)
    assert "MseLossBackward0" in graph[0].retained


def test_sync_session_runs_the_leak_detector(tmp_path: Path) -> None:
    """A SyncSession with a leak detector reports a leaking loop; memory mode builds one."""
    from eventbus_debug import Session, SyncSession

    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    detector = LeakDetector(every=1, thresholds=LeakThresholds(window=6, warmup=1))
    kept = []
    with SyncSession(
        model, optimizer, log_dir=tmp_path, system_interval=None, leak_detector=detector
    ) as session:
        for step in range(12):
            x, y = batch(step)
            result = session.training_step(x, y, nn.functional.mse_loss, step=step)
            kept.append(result)
            loss = nn.functional.mse_loss(model(x), y)
            kept.append(loss)  # type: ignore[arg-type]
    leaks = [e for e in read_events(tmp_path) if isinstance(e, MemoryLeakSuspected)]
    assert any(e.resource == "graph" for e in leaks)
    assert Session(model, mode="memory_profiling").leak_detector is not None
    assert Session(model).leak_detector is None


def test_profile_memory_peak_sees_a_transient_allocation() -> None:
    """A forward that allocates and frees 128 MiB inside shows it in the peak, not after."""

    class Transient(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            scratch = torch.ones(32 << 20)  # 128 MiB, touched, freed before returning
            total = scratch.sum()
            for _ in range(10):  # keep it alive long enough for the 1 ms poller
                total = total + scratch.sum()
            del scratch
            return x * (total > 0)

    profile = profile_memory(Transient(), torch.ones(2))
    assert profile.peak_rss_bytes - profile.initial.rss_bytes >= 64 << 20
