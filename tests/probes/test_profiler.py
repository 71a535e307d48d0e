"""The profiler: a profiled block, an armed step window, the trace store's caps."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import anyio
import pytest
import torch
from torch import nn

from eventbus_debug import EventBus
from eventbus_debug.events import GradientExploded, ProfileCaptured
from eventbus_debug.probes import ProfileSchedule, StepProfiler, TraceStore, profiling
from eventbus_debug.testing import RecordingSink

from .conftest import batch, make_mlp


def _step(model: nn.Module, step: int) -> None:
    x, y = batch(step)
    torch.autograd.backward(nn.functional.mse_loss(model(x), y))


async def test_profiling_block_writes_a_gzipped_trace(
    tmp_path: Path, bus: EventBus, recorder: RecordingSink
) -> None:
    """The block's trace is a gzipped Chrome trace; the event names it and the top operators."""
    sub = bus.subscribe(recorder, ProfileCaptured)
    model = make_mlp()
    with anyio.fail_after(30):
        async with profiling(tmp_path / "traces", bus, step=5) as prof:
            for i in range(2):
                _step(model, i)
                prof.step()
    event = prof.captured
    assert event.path.endswith(".pt.trace.json.gz") and event.steps == 2 and event.step == 5
    with gzip.open(event.path, "rt") as f:
        trace = json.load(f)
    assert trace["traceEvents"]
    assert Path(event.path).stat().st_size == event.size_bytes > 0
    names = [name for name, _ in event.top_ops]
    assert "aten::addmm" in names or any(n.startswith("aten::") for n in names)
    assert all(t >= 0 for _, t in event.top_ops)
    await bus.drain(sub)
    assert recorder.of_type(ProfileCaptured) == [event]


async def test_step_profiler_costs_nothing_until_armed_then_captures_the_window(
    tmp_path: Path, bus: EventBus, recorder: RecordingSink
) -> None:
    """Disarmed: no capture. Armed by an incident: one trace of `active` steps, trigger named."""
    sub = bus.subscribe(recorder, ProfileCaptured)
    model = make_mlp()
    with anyio.fail_after(30):
        async with StepProfiler(
            bus, tmp_path, schedule=ProfileSchedule(wait=0, warmup=1, active=2)
        ) as profiler:
            for step in range(3):
                _step(model, step)
                profiler.step(step)
            assert not profiler.armed and profiler.captures == []
            await profiler.handle(GradientExploded(step=3, total_norm=1e6, threshold=10.0))
            assert profiler.armed
            assert not profiler.arm()  # already armed: ignored
            for step in range(3, 10):
                _step(model, step)
                profiler.step(step)
    assert len(profiler.captures) == 1
    event = profiler.captures[0]
    assert event.trigger == "gradient_exploded" and event.steps == 2
    assert Path(event.path).exists() and event.top_ops
    await bus.drain(sub)
    assert recorder.of_type(ProfileCaptured) == [event]


async def test_exit_inside_the_window_writes_what_was_recorded(tmp_path: Path) -> None:
    """Leaving mid-capture stops the profiler and still writes the recorded steps."""
    model = make_mlp()
    with anyio.fail_after(30):
        async with StepProfiler(
            None, tmp_path, schedule=ProfileSchedule(wait=0, warmup=1, active=50)
        ) as profiler:
            profiler.arm(trigger="manual")
            for step in range(3):
                _step(model, step)
                profiler.step(step)
    assert len(profiler.captures) == 1 and Path(profiler.captures[0].path).exists()


def test_trace_store_deletes_the_oldest_beyond_its_caps(tmp_path: Path) -> None:
    """At most max_traces files and max_bytes in total; the newest is kept."""
    store = TraceStore(tmp_path, max_traces=2, max_bytes=10_000_000)
    written = []
    for i in range(4):
        raw = tmp_path / f"raw{i}.json"
        raw.write_text(json.dumps({"traceEvents": [{"i": i}] * 50}))
        written.append(store.add(raw, f"t{i}"))
        assert not raw.exists()
    assert store.traces() == written[-2:]
    tiny = TraceStore(tmp_path, max_traces=10, max_bytes=1)
    raw = tmp_path / "raw.json"
    raw.write_text("{}")
    newest = tiny.add(raw, "t9")
    assert tiny.traces() == [newest]


def test_arguments_are_validated(tmp_path: Path) -> None:
    """Bad schedules and caps are rejected with the rule."""
    with pytest.raises(ValueError, match="active must be an int >= 1"):
        ProfileSchedule(active=0)
    with pytest.raises(ValueError, match="max_traces"):
        TraceStore(tmp_path, max_traces=0)
    assert torch.get_num_threads() >= 1


async def test_session_profiling_mode_captures_a_window_at_start(tmp_path: Path) -> None:
    """mode="profiling": the first steps are profiled; the trace lands in log_dir/traces."""
    from eventbus_debug import Session, read_events

    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with anyio.fail_after(60):
        async with Session(
            model, optimizer, log_dir=tmp_path, mode="profiling", system_interval=None
        ) as session:
            for step in range(6):
                x, y = batch(step)
                await session.training_step(x, y, nn.functional.mse_loss, step=step)
    captured = [e for e in read_events(tmp_path) if isinstance(e, ProfileCaptured)]
    assert len(captured) == 1 and captured[0].trigger == "session_start"
    assert Path(captured[0].path).parent == tmp_path / "traces"
    assert Path(captured[0].path).exists()
