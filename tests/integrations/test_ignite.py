"""Ignite: the handler checks inside optimizer.step(), skips as a no-op, checks outputs like
TerminateOnNan, and ends its session however the run ends."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from ignite.engine import (
    Engine,
    Events,
    create_supervised_trainer,
    supervised_training_step,
)
from torch import nn

from eventbus_debug import read_events
from eventbus_debug.events import (
    GradientExploded,
    NonFiniteDetected,
    SessionEnded,
    StepCompleted,
    StepSkipped,
    TensorRole,
)
from eventbus_debug.integrations.ignite import EventBusDebugHandler, _finite

BATCHES = 8
Batch = tuple[torch.Tensor, torch.Tensor]


def _setup() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def _batches(*, nan_at: int | None = None, explode_at: int | None = None) -> list[Batch]:
    x = torch.randn(BATCHES * 8, 4)
    y = x.sum(1, keepdim=True)
    out = [(x[i : i + 8].clone(), y[i : i + 8].clone()) for i in range(0, BATCHES * 8, 8)]
    if nan_at is not None:
        out[nan_at][0][0, 0] = math.nan
    if explode_at is not None:
        out[explode_at] = (out[explode_at][0], out[explode_at][1] * 1e5)
    return out


def _watch_parameters(engine: Engine, model: nn.Module) -> list[bool]:
    changed: list[bool] = []
    before: list[torch.Tensor] = []

    @engine.on(Events.ITERATION_STARTED)
    def snapshot(_: Engine) -> None:
        before[:] = [p.detach().clone() for p in model.parameters()]

    @engine.on(Events.ITERATION_COMPLETED)
    def compare(_: Engine) -> None:
        after = list(model.parameters())
        changed.append(any(not torch.equal(a, b) for a, b in zip(before, after, strict=True)))

    return changed


def _kinds(log_dir: Path, kind: type[Any]) -> list[Any]:
    return [e for e in read_events(log_dir) if isinstance(e, kind)]


def test_nan_skipped_and_explosion_detected_with_the_stock_trainer(tmp_path: Path) -> None:
    """create_supervised_trainer unchanged: a NaN step is a no-op, an explosion is detected."""
    model, optimizer = _setup()
    handler = EventBusDebugHandler(
        model, optimizer, log_dir=tmp_path, alerts=False, system_interval=None
    )
    trainer = create_supervised_trainer(model, optimizer, handler.track_loss(nn.MSELoss()))
    handler.attach(trainer)
    changed = _watch_parameters(trainer, model)
    trainer.run(_batches(nan_at=3, explode_at=6), max_epochs=1)

    assert changed == [i != 3 for i in range(BATCHES)]
    assert handler.steps_checked == BATCHES and handler.steps_skipped == 1
    nan = _kinds(tmp_path, NonFiniteDetected)
    assert {e.step for e in nan} == {3} and TensorRole.LOSS in {e.role for e in nan}
    assert [e.step for e in _kinds(tmp_path, StepSkipped)] == [3]
    assert [e.step for e in _kinds(tmp_path, GradientExploded)] == [6]
    completed = _kinds(tmp_path, StepCompleted)
    assert [e.step for e in completed] == list(range(BATCHES))
    ended = _kinds(tmp_path, SessionEnded)
    assert len(ended) == 1 and ended[0].reason == "completed"
    assert handler.session is None


def test_without_track_loss_the_gradients_still_decide(tmp_path: Path) -> None:
    """Without the loss wrapper the NaN gradients alone skip the step; the output is checked."""
    model, optimizer = _setup()
    handler = EventBusDebugHandler(model, optimizer, log_dir=tmp_path, alerts=False)
    trainer = create_supervised_trainer(model, optimizer, nn.MSELoss())
    trainer.add_event_handler(Events.STARTED, handler)  # the other documented form
    changed = _watch_parameters(trainer, model)
    trainer.run(_batches(nan_at=2), max_epochs=1)

    assert changed == [i != 2 for i in range(BATCHES)]
    nan = _kinds(tmp_path, NonFiniteDetected)
    assert {e.role for e in nan} == {TensorRole.GRADIENT} and {e.step for e in nan} == {2}
    completed = _kinds(tmp_path, StepCompleted)
    assert completed[0].loss is not None and math.isfinite(completed[0].loss)  # from the output


def test_non_finite_output_of_a_healthy_step_is_reported_not_acted_on(tmp_path: Path) -> None:
    """A NaN in a dict output whose step was finite becomes an OUTPUT incident, no skip."""
    model, optimizer = _setup()
    handler = EventBusDebugHandler(
        model, optimizer, log_dir=tmp_path, alerts=False, output_transform=lambda o: o["metrics"]
    )

    def update(engine: Engine, batch: Batch) -> dict[str, Any]:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(batch[0]), batch[1])
        torch.autograd.backward(loss)
        optimizer.step()
        bad = math.nan if engine.state.iteration == 5 else 1.0
        return {"loss": loss.item(), "metrics": {"ratio": [bad, torch.ones(2)]}}

    trainer = Engine(update)
    handler.attach(trainer)
    trainer.run(_batches(), max_epochs=1)

    nan = _kinds(tmp_path, NonFiniteDetected)
    assert [(e.step, e.role, e.names) for e in nan] == [
        (4, TensorRole.OUTPUT, ("engine.state.output",))
    ]
    assert not _kinds(tmp_path, StepSkipped) and handler.steps_skipped == 0


def test_gradient_accumulation_checks_only_real_steps(tmp_path: Path) -> None:
    """With Ignite's gradient_accumulation_steps=2 the hook runs at every second iteration."""
    model, optimizer = _setup()
    handler = EventBusDebugHandler(model, optimizer, log_dir=tmp_path, alerts=False)
    step = supervised_training_step(
        model, optimizer, handler.track_loss(nn.MSELoss()), gradient_accumulation_steps=2
    )
    trainer = Engine(step)
    handler.attach(trainer)
    trainer.run(_batches(), max_epochs=1)
    assert handler.steps_checked == BATCHES // 2
    assert [e.step for e in _kinds(tmp_path, StepCompleted)] == [1, 3, 5, 7]


def test_exception_ends_the_session_and_propagates(tmp_path: Path) -> None:
    """An error in the update function ends the session with its reason and still raises."""
    model, optimizer = _setup()
    handler = EventBusDebugHandler(model, optimizer, log_dir=tmp_path, alerts=False)

    def update(engine: Engine, batch: Batch) -> float:
        if engine.state.iteration == 3:
            raise RuntimeError("disk gone")
        return 0.0

    trainer = Engine(update)
    handler.attach(trainer)
    with pytest.raises(RuntimeError, match="disk gone"):
        trainer.run(_batches(), max_epochs=1)
    ended = _kinds(tmp_path, SessionEnded)
    assert len(ended) == 1 and "disk gone" in ended[0].reason
    assert handler.session is None


def test_a_users_exception_handler_still_decides(tmp_path: Path) -> None:
    """With the user's own EXCEPTION_RAISED handler, Ignite's choice (swallow) is kept."""
    model, optimizer = _setup()
    handler = EventBusDebugHandler(model, optimizer, log_dir=None, alerts=False)
    seen: list[BaseException] = []

    def update(engine: Engine, batch: Batch) -> float:
        raise RuntimeError("boom")

    trainer = Engine(update)
    trainer.add_event_handler(Events.EXCEPTION_RAISED, lambda _, e: seen.append(e))
    handler.attach(trainer)
    trainer.run(_batches(), max_epochs=1)  # swallowed by the user's handler, as without ours
    assert len(seen) == 1 and handler.session is None


def test_two_runs_two_sessions_and_terminate_ends_one(tmp_path: Path) -> None:
    """Each run gets its own session; a terminated run ends its session too."""
    model, optimizer = _setup()
    handler = EventBusDebugHandler(model, optimizer, log_dir=tmp_path, alerts=False)
    trainer = create_supervised_trainer(model, optimizer, nn.MSELoss())
    handler.attach(trainer)
    handler.attach(trainer)  # idempotent
    trainer.add_event_handler(Events.ITERATION_COMPLETED(once=2), lambda engine: engine.terminate())
    trainer.run(_batches(), max_epochs=1)
    trainer.run(_batches(), max_epochs=1)
    ended = _kinds(tmp_path, SessionEnded)
    assert [e.reason for e in ended] == ["completed", "completed"]


@pytest.mark.parametrize(
    ("output", "finite"),
    [
        (1.5, True),
        (math.nan, False),
        (math.inf, False),
        (3, True),
        (complex(1, math.inf), False),
        (torch.tensor(2.0), True),
        (torch.tensor([1.0, math.nan]), False),
        (torch.tensor([1, 2]), True),
        ((1.0, torch.ones(3)), True),
        ([1.0, [2.0, torch.tensor(math.inf)]], False),
        ({"loss": 0.5, "acc": torch.tensor(0.9)}, True),
        ({"loss": torch.tensor(math.nan)}, False),
        ("not a number", True),
    ],
)
def test_output_check_takes_what_terminate_on_nan_takes(output: Any, finite: bool) -> None:
    """Numbers, tensors, tuples, lists, dicts (and nesting) as Ignite's TerminateOnNan."""
    assert _finite(output) is finite


def test_one_fault_inside_an_accumulation_window_is_one_incident(tmp_path: Path) -> None:
    """A NaN micro-batch that does not step: the step closing its window skips and reports it
    (through the loss and the gradients), not a second OUTPUT incident of the same fault."""
    model, optimizer = _setup()
    handler = EventBusDebugHandler(model, optimizer, log_dir=tmp_path, alerts=False)
    step = supervised_training_step(
        model, optimizer, handler.track_loss(nn.MSELoss()), gradient_accumulation_steps=4
    )
    trainer = Engine(step)
    handler.attach(trainer)
    trainer.run(_batches(nan_at=1), max_epochs=1)
    nan = _kinds(tmp_path, NonFiniteDetected)
    assert {e.step for e in nan} == {3}
    assert TensorRole.OUTPUT not in {e.role for e in nan}
    assert [e.step for e in _kinds(tmp_path, StepSkipped)] == [3]


def test_a_non_finite_output_of_a_window_that_steps_healthily_is_reported_once(
    tmp_path: Path,
) -> None:
    """Accumulation, a NaN only in the reported metrics of a non-stepping iteration: one OUTPUT
    incident, at the iteration it came from, once its window's step is known to be finite."""
    model, optimizer = _setup()
    handler = EventBusDebugHandler(
        model, optimizer, log_dir=tmp_path, alerts=False, output_transform=lambda o: o["metric"]
    )

    def update(engine: Engine, batch: Batch) -> dict[str, Any]:
        loss = nn.functional.mse_loss(model(batch[0]), batch[1])
        torch.autograd.backward(loss)
        if engine.state.iteration % 4 == 0:
            optimizer.step()
            optimizer.zero_grad()
        bad = math.nan if engine.state.iteration in (2, 3) else 1.0
        return {"loss": loss.item(), "metric": bad}

    trainer = Engine(update)
    handler.attach(trainer)
    trainer.run(_batches(), max_epochs=1)
    nan = _kinds(tmp_path, NonFiniteDetected)
    assert [(e.step, e.role) for e in nan] == [(1, TensorRole.OUTPUT)]
    assert handler.steps_skipped == 0


def test_max_grad_norm_clips_after_the_check_which_sees_the_real_norm(tmp_path: Path) -> None:
    """``max_grad_norm=``: the explosion is seen at its real norm; the optimizer gets clipped
    gradients on every step it takes."""
    model, optimizer = _setup()
    handler = EventBusDebugHandler(
        model, optimizer, log_dir=tmp_path, alerts=False, max_grad_norm=1.0
    )
    trainer = create_supervised_trainer(model, optimizer, handler.track_loss(nn.MSELoss()))
    handler.attach(trainer)
    applied: list[float] = []

    def measure(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if grads:
            applied.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))

    @trainer.on(Events.STARTED)
    def after_the_handler(_: Engine) -> None:  # the handler's hook is installed before this one
        optimizer.register_step_pre_hook(measure)

    trainer.run(_batches(explode_at=6), max_epochs=1)
    exploded = _kinds(tmp_path, GradientExploded)
    assert [e.step for e in exploded] == [6] and exploded[0].total_norm > 1e3
    assert applied and all(n <= 1.0 + 1e-4 for n in applied)
    with pytest.raises(ValueError, match="max_grad_norm"):
        EventBusDebugHandler(model, optimizer, log_dir=None, max_grad_norm=0.0)
    with pytest.raises(ValueError, match="max_grad_norm"):
        EventBusDebugHandler(model, optimizer, log_dir=None, max_grad_norm="1")  # type: ignore[arg-type]


def test_bad_arguments_are_named() -> None:
    """Wrong types and a wrong event raise errors that say what was wrong."""
    model, optimizer = _setup()
    with pytest.raises(TypeError, match="model"):
        EventBusDebugHandler(object(), optimizer)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="optimizer"):
        EventBusDebugHandler(model, object())  # type: ignore[arg-type]
    handler = EventBusDebugHandler(model, optimizer, log_dir=None)
    with pytest.raises(TypeError, match="engine"):
        handler.attach(object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="loss_fn"):
        handler.track_loss(42)  # type: ignore[arg-type]
    trainer = Engine(lambda engine, batch: 0.0)
    trainer.add_event_handler(Events.ITERATION_COMPLETED, handler)
    with pytest.raises(ValueError, match=r"Events\.STARTED"):
        trainer.run([0, 1], max_epochs=1)
