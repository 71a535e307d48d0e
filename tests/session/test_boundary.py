"""eventbus_debug.session.boundary: one body per step, driven async or blocking."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from eventbus_debug.events import StepCompleted, StepSkipped
from eventbus_debug.extras import InputSpec
from eventbus_debug.extras.validation import InputValidator, ValidationPolicy
from eventbus_debug.probes import StepProbe
from eventbus_debug.session.boundary import Body, StepBoundary, run, run_sync
from tests._doubles import RecordingPublisher

from ._helpers import batch, setup


def _body(log: list[str]) -> Body[tuple[str, str]]:
    async def wait_a() -> str:
        return "async-a"

    async def wait_b() -> str:
        return "async-b"

    try:
        first: str = yield (wait_a, lambda: "block-a")
        second: str = yield (wait_b, lambda: "block-b")
        return first, second
    finally:
        log.append("closed")


class TestDrivers:
    async def test_same_body_two_colours(self) -> None:
        """The async driver takes each wait's async side, the blocking one its blocking side."""
        log: list[str] = []
        assert await run(_body(log)) == ("async-a", "async-b")
        assert run_sync(_body(log)) == ("block-a", "block-b")
        assert log == ["closed", "closed"]

    async def test_failing_wait_propagates_and_closes(self) -> None:
        """An error raised by a wait reaches the caller, and the body is closed."""
        log: list[str] = []

        def fail() -> str:
            raise LookupError("gone")

        def body() -> Body[str]:
            try:
                value: str = yield (_never, fail)
                return value
            finally:
                log.append("closed")

        with pytest.raises(LookupError, match="gone"):
            run_sync(body())
        assert log == ["closed"]


async def _never() -> str:
    raise AssertionError("the blocking driver must not await")


def _boundary(
    *,
    optimizer: bool = True,
    skip_non_finite: bool = True,
    validator: InputValidator | None = None,
) -> tuple[StepBoundary, RecordingPublisher, list[int], nn.Module]:
    model, opt = setup()
    publisher = RecordingPublisher()
    flushes: list[int] = []
    boundary = StepBoundary(
        model=model,
        optimizer=opt if optimizer else None,
        name="t",
        publisher=publisher,
        probe=StepProbe(model),
        validator=validator,
        skip_non_finite=skip_non_finite,
        flush=lambda: flushes.append(1),
    )
    return boundary, publisher, flushes, model


def _backward(model: nn.Module, *, bad: bool = False) -> torch.Tensor:
    x, y = batch(bad=bad)
    loss = nn.functional.mse_loss(model(x), y)
    torch.autograd.backward(loss)
    return loss


class TestStepBoundary:
    async def test_async_and_blocking_checks_agree(self) -> None:
        """Both entries run the same checks and reach the same verdict on the same gradients."""
        boundary, _, _, model = _boundary()
        loss = _backward(model)
        blocking = boundary.check_sync(0, loss)
        awaited = await boundary.check(0, loss)
        assert blocking.should_step and awaited.should_step
        assert blocking.grad_norm == pytest.approx(awaited.grad_norm)
        assert boundary.step == 0

    @pytest.mark.parametrize(("skip", "should_step"), [(True, False), (False, True)])
    def test_non_finite_without_recovery(self, skip: bool, should_step: bool) -> None:
        """Without recovery a NaN step is advised skipped only when skip_non_finite is on."""
        boundary, _, _, model = _boundary(skip_non_finite=skip)
        loss = _backward(model, bad=True)
        verdict = boundary.check_sync(3, loss)
        assert not verdict.finite and verdict.should_step is should_step
        assert verdict.actions == (() if should_step else ("skip_step",))
        assert verdict.decision is None

    def test_completed_records_the_step(self) -> None:
        """completed_sync publishes StepCompleted (learning rate read, rate from the 2nd step) and flushes."""
        boundary, publisher, flushes, _ = _boundary()
        boundary.completed_sync(0, loss=torch.tensor(0.5), samples=6)
        boundary.completed_sync(1, loss=0.25, samples=6)
        done = [e for e in publisher.events if isinstance(e, StepCompleted)]
        assert [e.step for e in done] == [0, 1] and done[0].loss == 0.5
        assert done[0].learning_rate == pytest.approx(0.05)
        assert done[0].samples_per_s is None and done[1].samples_per_s is not None
        assert flushes == [1, 1] and boundary.steps_completed == 2

    async def test_training_step_runs_and_records(self) -> None:
        """The async training step checks, steps the optimizer and records the step once."""
        boundary, publisher, flushes, _ = _boundary()
        result = await boundary.training_step(*batch(), nn.functional.mse_loss)
        assert result.stepped and result.step == 0 and math.isfinite(result.loss)
        assert flushes == []  # the async entry hands over with publish_nowait + a checkpoint
        assert [type(e) for e in publisher.events][-1] is StepCompleted
        assert boundary.next_step(None) == 1

    def test_rejected_batch_never_runs(self) -> None:
        """A SKIP-policy validator rejects a bad batch before the forward pass."""
        validator = InputValidator(InputSpec(ndim=2, max_abs=3.0), policy=ValidationPolicy.SKIP)
        boundary, publisher, _, _ = _boundary(validator=validator)
        x, y = batch()
        x[0, 0] = 50.0
        result = boundary.training_step_sync(x, y, nn.functional.mse_loss, step=4)
        assert not result.stepped and math.isnan(result.loss)
        assert result.verdict.actions == ("reject_batch",)
        assert any(isinstance(e, StepSkipped) and e.step == 4 for e in publisher.events)

    def test_training_step_needs_an_optimizer(self) -> None:
        """Without an optimizer the training step refuses to run."""
        boundary, _, _, _ = _boundary(optimizer=False)
        with pytest.raises(RuntimeError, match="needs an optimizer"):
            boundary.training_step_sync(*batch(), nn.functional.mse_loss)


def test_a_session_that_did_not_agree_asks_for_a_process_group_every_64th_check() -> None:
    """Asking torch whether a group exists costs ~2 µs inside a loop: the lone session asks
    at its first check (a group initialized before it is found at once) and every
    LONE_EVERY-th after."""
    from eventbus_debug import SyncSession
    from eventbus_debug.session.boundary import LONE_EVERY

    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    asked: list[int] = []
    with SyncSession(model, opt, log_dir=None, report=False, alerts=False) as session:
        boundary = session._boundary
        assert boundary is not None and boundary.lone is not None  # distributed=None, no group
        boundary.lone = lambda: asked.append(session.steps_completed)
        for step in range(2 * LONE_EVERY + 1):
            session.check_step(step, loss=1.0)
            session.step_completed(step)
    assert asked == [0, LONE_EVERY, 2 * LONE_EVERY]
