"""Ignite: ``max_grad_norm=`` clips bit for bit as an update function calling
``clip_grad_norm_``; a handler registered twice opens one session; one started by an evaluator
during the training run is a clear error; steps carry their samples."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from ignite.engine import (
    Engine,
    Events,
    create_supervised_evaluator,
    create_supervised_trainer,
    supervised_training_step,
)
from torch import nn

from eventbus_debug import read_events
from eventbus_debug.events import SessionEnded, SessionStarted, StepChecked, StepCompleted
from eventbus_debug.integrations.ignite import EventBusDebugHandler

Batch = tuple[torch.Tensor, torch.Tensor]
TINY_NORM = 1e-3  # below every gradient norm of the run: every step clips


def _setup() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.1), nn.Linear(32, 1))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _batches(n: int, size: int = 8) -> list[Batch]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n * size, 8, generator=gen)
    y = x[:, :3].sum(1, keepdim=True)
    return [(x[i : i + size], y[i : i + size]) for i in range(0, n * size, size)]


def _samples(event: StepCompleted) -> int | None:
    if event.samples_per_s is None or event.duration_s is None:
        return None
    return round(event.samples_per_s * event.duration_s)


def test_max_grad_norm_is_bit_for_bit_the_update_function_that_clips(tmp_path: Path) -> None:
    """300 steps, every one clipped: the handler's clip after the check leaves exactly the
    parameters of an update function calling clip_grad_norm_ itself (dropout on: no RNG
    used), while the check saw the norms before the clip."""
    steps = 300
    loss_fn = nn.MSELoss()

    model, optimizer = _setup()
    norms: list[float] = []

    def clipping_update(engine: Engine, batch: Batch) -> float:
        model.train()
        optimizer.zero_grad()
        loss = loss_fn(model(batch[0]), batch[1])
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), TINY_NORM)))
        optimizer.step()
        return float(loss.item())

    torch.manual_seed(2)
    Engine(clipping_update).run(_batches(steps), max_epochs=1)
    plain = [p.detach().clone() for p in model.parameters()]

    model, optimizer = _setup()
    handler = EventBusDebugHandler(
        model, optimizer, log_dir=tmp_path, alerts=False, max_grad_norm=TINY_NORM
    )
    trainer = create_supervised_trainer(model, optimizer, handler.track_loss(loss_fn))
    handler.attach(trainer)
    torch.manual_seed(2)
    trainer.run(_batches(steps), max_epochs=1)

    assert len(norms) == steps and min(norms) > TINY_NORM
    for a, b in zip(plain, model.parameters(), strict=True):
        assert torch.equal(a, b)
    checked = [e for e in read_events(tmp_path) if isinstance(e, StepChecked)]
    assert len(checked) == steps
    assert all(e.grad_norm is not None and e.grad_norm > 100 * TINY_NORM for e in checked)


def test_registered_twice_for_started_it_opens_one_session(tmp_path: Path) -> None:
    """attach() then add_event_handler(Events.STARTED, handler): one session, each step once."""
    model, optimizer = _setup()
    handler = EventBusDebugHandler(model, optimizer, log_dir=tmp_path, alerts=False)
    trainer = create_supervised_trainer(model, optimizer, nn.MSELoss())
    handler.attach(trainer)
    trainer.add_event_handler(Events.STARTED, handler)
    trainer.run(_batches(6), max_epochs=2)
    trainer.run(_batches(6), max_epochs=3)  # a later run still gets its own session
    events = list(read_events(tmp_path))
    assert sum(isinstance(e, SessionStarted) for e in events) == 2
    assert [e.reason for e in events if isinstance(e, SessionEnded)] == ["completed"] * 2
    checked = [e.step for e in events if isinstance(e, StepChecked)]
    assert checked == list(range(12)) + list(range(12, 18))


def test_started_by_an_evaluator_during_the_training_run_is_a_clear_error(
    tmp_path: Path,
) -> None:
    """Attached to the evaluator run inside the trainer's epoch: a ValueError naming the
    mistake ends the run and its session (which used to be closed silently)."""
    model, optimizer = _setup()
    handler = EventBusDebugHandler(model, optimizer, log_dir=tmp_path, alerts=False)
    trainer = create_supervised_trainer(model, optimizer, nn.MSELoss())
    evaluator = create_supervised_evaluator(model)
    handler.attach(trainer)
    handler.attach(evaluator)
    data = _batches(4)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda _: evaluator.run(data))
    with pytest.raises(ValueError, match="evaluator"):
        trainer.run(data, max_epochs=2)
    assert handler.session is None and handler.steps_checked == 4
    ended = [e for e in read_events(tmp_path) if isinstance(e, SessionEnded)]
    assert len(ended) == 1 and "evaluator" in ended[0].reason


def test_step_samples_are_the_batch_sizes_of_its_iterations(tmp_path: Path) -> None:
    """StepCompleted counts the samples of every iteration of its accumulation window."""
    model, optimizer = _setup()
    handler = EventBusDebugHandler(model, optimizer, log_dir=tmp_path, alerts=False)
    step = supervised_training_step(
        model, optimizer, handler.track_loss(nn.MSELoss()), gradient_accumulation_steps=2
    )
    trainer = Engine(step)
    handler.attach(trainer)
    data: list[Any] = _batches(4, size=8) + _batches(2, size=3)
    trainer.run(data, max_epochs=1)
    completed = [e for e in read_events(tmp_path) if isinstance(e, StepCompleted)]
    assert [e.step for e in completed] == [1, 3, 5]
    assert [_samples(e) for e in completed][1:] == [16, 6]  # the first has no duration
