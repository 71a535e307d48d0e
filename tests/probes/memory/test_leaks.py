"""Leak detection: graph-retaining losses, clean loops, samples and incidents."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from eventbus_debug import EventBus, read_events
from eventbus_debug.demo import DemoFaults, run_demo
from eventbus_debug.events import MemoryLeakSuspected, MemorySampled
from eventbus_debug.probes import LeakDetector, LeakThresholds
from eventbus_debug.testing import RecordingSink

from ..conftest import batch, make_mlp


def _losses(steps: int) -> Iterator[tuple[int, torch.Tensor]]:
    """Train the MLP for *steps* steps; yield each step with its loss (graph attached)."""
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(steps):
        x, y = batch(step)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        torch.autograd.backward(loss)
        optimizer.step()
        yield step, loss


def _train(steps: int, *, leak: bool, detector: LeakDetector) -> list[MemoryLeakSuspected]:
    kept: list[torch.Tensor] = []
    fired: list[MemoryLeakSuspected] = []
    for step, loss in _losses(steps):
        if leak:
            kept.append(loss)  # the bug: the loss keeps its autograd graph alive
        fired.extend(detector.observe(step))
    kept.clear()
    return fired


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


def _epochs(steps: int, epoch: int, detector: LeakDetector, *, clear: bool) -> list[str]:
    """A loop keeping each step's detached loss for its epoch's mean; the list is emptied at
    each epoch's end when *clear* (healthy), else kept (a slow leak of scalars)."""
    kept: list[torch.Tensor] = []
    fired: list[str] = []
    for step, loss in _losses(steps):
        kept.append(loss.detach())
        if clear and len(kept) == epoch:
            torch.stack(kept).mean().item()
            kept.clear()
        fired += [e.resource for e in detector.observe(step)]
    return fired


def test_a_list_emptied_every_epoch_is_reported_at_most_once() -> None:
    """Per-epoch accumulation rises like a leak within each epoch; a leak never gives memory
    back, so only a window ending above every earlier sample counts: once, in the first epoch
    (nothing tells it apart yet), never again at the same level."""
    gc.collect()
    detector = LeakDetector(every=20, thresholds=LeakThresholds(window=5, warmup=1))
    fired = _epochs(800, 200, detector, clear=True)
    assert fired.count("live_tensors") == 1, fired


def test_a_leak_that_goes_on_is_reported_window_after_window() -> None:
    gc.collect()
    detector = LeakDetector(every=20, thresholds=LeakThresholds(window=5, warmup=1))
    fired = _epochs(800, 200, detector, clear=False)
    assert fired.count("live_tensors") >= 6, fired
