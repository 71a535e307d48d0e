"""What differs on trio, anyio's other backend, tested on trio itself (the rest of the suite
runs there with ``make test-trio``; every README and docs example runs there in
``tests/test_docs.py``)."""

from __future__ import annotations

import socket
from pathlib import Path

import anyio
import pytest
import torch
from torch import nn

from eventbus_debug import EventBus, Session, SyncSession, read_events
from eventbus_debug.events import StepCompleted
from eventbus_debug.sinks.http import DebugServer
from eventbus_debug.testing import RecordingSink


@pytest.fixture
def anyio_backend() -> str:
    return "trio"


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


async def test_debug_server_refuses_trio_before_opening_a_socket(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    opened: list[socket.socket] = []
    real = socket.socket

    def counting(*args: object, **kwargs: object) -> socket.socket:
        sock = real(*args, **kwargs)  # type: ignore[arg-type]
        opened.append(sock)
        return sock

    monkeypatch.setattr(socket, "socket", counting)
    server = DebugServer()
    with pytest.raises(RuntimeError, match="uvicorn, which runs only on asyncio"):
        async with server:
            pass
    assert opened == []


async def test_session_with_a_nan_batch(tmp_path: Path) -> None:
    """The quickstart's loop on trio: the NaN step is skipped, the log and report written."""
    model, optimizer = _model()
    async with Session(model, optimizer, log_dir=tmp_path) as session:
        for step in range(200):
            x = torch.randn(16, 8)
            if step == 120:
                x[0, 0] = float("nan")
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
            loss.backward()  # type: ignore[no-untyped-call]
            verdict = await session.check_step(step, loss=loss)
            assert verdict.should_step is (step != 120)
            if verdict.should_step:
                optimizer.step()
            await session.step_completed(step, loss=verdict.loss)
    kinds = [e.kind for e in read_events(tmp_path)]
    assert kinds.count("step_completed") == 200
    assert "non_finite_detected" in kinds and "step_skipped" in kinds
    assert (tmp_path / "report.json").exists()
    assert all(torch.isfinite(p).all() for p in model.parameters())


async def test_a_sync_session_built_inside_a_trio_program(tmp_path: Path) -> None:
    """Its thread runs asyncio: the bus's tasks run in that thread's context, not in the
    trio caller's (which made anyio take the bus's asyncio loop for trio)."""
    model, optimizer = _model()
    with SyncSession(model, optimizer, log_dir=tmp_path) as session:
        for step in range(20):
            optimizer.zero_grad(set_to_none=True)
            loss: torch.Tensor = model(torch.randn(4, 8)).pow(2).mean()
            loss.backward()  # type: ignore[no-untyped-call]
            if session.check_step(step, loss=loss).should_step:
                optimizer.step()
            session.step_completed(step, loss=loss.item())
    assert (tmp_path / "report.json").exists()
    assert sum(e.kind == "step_completed" for e in read_events(tmp_path)) == 20


async def test_a_slow_sink_delays_nobody_and_loses_nothing() -> None:
    """The bus's promise on trio: a sink that sleeps per event delays neither the publisher nor
    another sink, and the close delivers everything."""
    fast = RecordingSink()
    slow: list[int] = []

    async def sleepy(event: StepCompleted) -> None:
        await anyio.sleep(0.001)
        assert event.step is not None
        slow.append(event.step)

    async with EventBus(close_timeout=30) as bus:
        quick = bus.subscribe(fast, StepCompleted, capacity=4096)
        bus.subscribe(sleepy, StepCompleted, capacity=4096)
        with anyio.fail_after(1):
            for i in range(2000):
                bus.publish_nowait(StepCompleted(step=i))
        await bus.drain(quick)
        assert len(fast.of_type(StepCompleted)) == 2000
    assert slow == list(range(2000))
