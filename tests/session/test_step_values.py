"""What ``step_completed`` and ``training_step`` accept: a clear error naming the argument,
raised before anything is recorded, so a bad value never reaches (and spoils) the log."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from eventbus_debug import Session, SyncSession, read_events
from eventbus_debug.events import StepCompleted, UsageWarning
from eventbus_debug.testing import RecordingSink

from .._doubles import quiet
from ._helpers import batch, setup

BAD_VALUES: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"loss": "abc"}, TypeError, r"loss must be a one-element tensor or a number, got str"),
    ({"loss": True}, TypeError, r"loss must be"),
    ({"loss": torch.tensor([1.0, 2.0])}, ValueError, r"loss must be a scalar tensor .*\(2,\)"),
    ({"loss": torch.empty((), device="meta")}, ValueError, r"loss is a meta tensor"),
    ({"learning_rate": "x"}, TypeError, r"learning_rate must be a number, got str"),
    ({"learning_rate": -1}, ValueError, r"learning_rate must be >= 0, got -1"),
    ({"learning_rate": torch.ones(2)}, ValueError, r"learning_rate must be a number or a one"),
    ({"samples": 1.5}, TypeError, r"samples must be an int .*float 1\.5"),
    ({"samples": "4"}, TypeError, r"samples must be an int"),
    ({"samples": -5}, ValueError, r"samples must be >= 0, got -5"),
    ({"samples": 2**64}, ValueError, r"samples must fit in 64 bits"),
    ({"step": "1"}, TypeError, r"step must be an int, got str"),
    ({"step": np.int64(1)}, TypeError, r"step must be an int, got int64 .*pass int\(step\)"),
    ({"loss": np.array([1.0, 2.0])}, TypeError, r"loss must be a one-element tensor or a number"),
    ({"step": -1}, ValueError, r"step must be >= 0"),
    ({"step": 2**70}, ValueError, r"step must fit in 64 bits"),
    ({"loss": torch.tensor(1j)}, TypeError, r"loss must be real"),
]

GOOD_VALUES: list[tuple[dict[str, Any], dict[str, float | None]]] = [
    ({"loss": torch.tensor([0.5])}, {"loss": 0.5}),
    ({"loss": 2}, {"loss": 2.0}),
    ({"learning_rate": math.nan}, {"learning_rate": math.nan}),  # a fact worth logging
    ({"learning_rate": torch.tensor(0.25)}, {"learning_rate": 0.25}),
    ({"learning_rate": 1}, {"learning_rate": 1.0}),
    ({"samples": np.int64(0)}, {"samples_per_s": None}),
    ({"loss": np.array(0.75)}, {"loss": 0.75}),  # a 0-d array: np.mean of the batch's losses
    ({"loss": np.float32(0.5)}, {"loss": 0.5}),
    ({"samples": torch.tensor(3)}, {}),
]


def _same(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    return a == b or (math.isnan(a) and math.isnan(b))


class TestStepCompletedValues:
    @pytest.mark.parametrize(("kwargs", "error", "match"), BAD_VALUES)
    async def test_bad_value_refused_and_nothing_recorded(
        self, tmp_path: Path, kwargs: dict[str, Any], error: type[Exception], match: str
    ) -> None:
        """The async session: the error names the argument; the log stays readable."""
        model, opt = setup()
        async with Session(model, opt, log_dir=tmp_path, report=False) as session:
            await session.step_completed(0, loss=1.0)
            args = {"step": 1, **kwargs}
            with pytest.raises(error, match=match):
                await session.step_completed(**args)
            assert session.steps_completed == 1 and session.step == 0
        steps = [e.step for e in read_events(tmp_path) if isinstance(e, StepCompleted)]
        assert steps == [0]

    @pytest.mark.parametrize(("kwargs", "error", "match"), BAD_VALUES)
    def test_bad_value_refused_sync(
        self, kwargs: dict[str, Any], error: type[Exception], match: str
    ) -> None:
        """SyncSession runs the same checks."""
        model, opt = setup()
        recorder = RecordingSink()
        with SyncSession(model, opt, log_dir=None, sinks=[recorder]) as session:
            with pytest.raises(error, match=match):
                session.step_completed(**{"step": 1, **kwargs})
            assert session.steps_completed == 0
        assert recorder.of_type(StepCompleted) == []

    @pytest.mark.parametrize(("kwargs", "expected"), GOOD_VALUES)
    async def test_good_values_recorded(
        self, tmp_path: Path, kwargs: dict[str, Any], expected: dict[str, float | None]
    ) -> None:
        """Tensors and numpy numbers are converted; a NaN learning rate is kept, and the log
        reads it back."""
        model, opt = setup()
        async with Session(model, opt, log_dir=tmp_path, report=False) as session:
            await session.step_completed(0, **kwargs)
        (event,) = [e for e in read_events(tmp_path) if isinstance(e, StepCompleted)]
        for field, value in expected.items():
            assert _same(getattr(event, field), value), field


def _no_grad_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(outputs.detach(), targets)


class TestTrainingStepLossFn:
    @pytest.mark.parametrize(
        ("loss_fn", "error", "match"),
        [
            (None, TypeError, r"loss_fn must be a callable .* got NoneType None"),
            ("mse", TypeError, r"loss_fn must be a callable"),
            (lambda o, t: 1.0, TypeError, r"loss_fn '.*<lambda>' must return the loss as a tensor"),
            (
                lambda o, t: (o - t).pow(2),
                ValueError,
                r"loss_fn '.*<lambda>' must return a scalar loss .*\(6, 1\)",
            ),
            (_no_grad_loss, ValueError, r"loss_fn '_no_grad_loss' returned a loss that does not"),
        ],
    )
    async def test_bad_loss_fn_named(
        self, loss_fn: Callable[..., Any], error: type[Exception], match: str
    ) -> None:
        """A bad loss_fn, or a bad result of it, is named; the optimizer does not step and no
        step is recorded."""
        model, opt = setup()
        before = [p.detach().clone() for p in model.parameters()]
        async with Session(model, opt, log_dir=None) as session:
            with pytest.raises(error, match=match):
                await session.training_step(*batch(), loss_fn)
            assert session.steps_completed == 0
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))

    def test_bad_loss_fn_named_sync(self) -> None:
        model, opt = setup()
        with SyncSession(model, opt, log_dir=None) as session:
            with pytest.raises(TypeError, match=r"loss_fn must be a callable"):
                session.training_step(*batch(), None)  # type: ignore[arg-type]
            with pytest.raises(TypeError, match=r"must return the loss as a tensor"):
                session.training_step(*batch(), lambda o, t: 1.0)  # type: ignore[arg-type, return-value]

    async def test_bad_samples_refused_before_the_forward_pass(self) -> None:
        model, opt = setup()
        calls: list[int] = []

        def loss_fn(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            calls.append(1)
            return nn.functional.mse_loss(o, t)

        async with Session(model, opt, log_dir=None) as session:
            with pytest.raises(TypeError, match=r"samples must be an int"):
                await session.training_step(*batch(), loss_fn, samples=2.5)  # type: ignore[arg-type]
            result = await session.training_step(*batch(), loss_fn, samples=6)
        assert calls == [1] and result.stepped


def test_a_step_going_back_is_said_once(caplog: pytest.LogCaptureFixture) -> None:
    """A per-epoch batch index passed as the step (``for step, batch in enumerate(loader)``
    inside the epoch loop) restarts at 0: the run goes on, and the log says once what to pass."""
    model, opt = setup()
    recorder = RecordingSink()
    opts = quiet(sinks=[recorder])
    with SyncSession(model, opt, **opts) as session:
        for _ in range(3):
            for step in range(5):
                session.training_step(*batch(), nn.functional.mse_loss, step=step)
        session.training_step(*batch(), nn.functional.mse_loss, step=4)  # a retry: not back
    said = [(e.step, e.problem) for e in recorder.of_type(UsageWarning)]
    assert said == [(0, "step_went_back")]  # on the bus too: the log file, the report
    assert caplog.text.count("step_went_back") == 1
    assert "step 0 came after step 4" in caplog.text and "epoch * len(loader) + i" in caplog.text


def _check_out_of_place(
    opt: torch.optim.Optimizer, model: nn.Module, *, where: str
) -> list[tuple[int | None, str]]:
    """Three steps whose check_step is out of place, *where* ``"before_backward"`` or
    ``"after_step"`` (the optimizer's); the usage warnings the session published."""
    recorder = RecordingSink()
    with SyncSession(model, opt, **quiet(sinks=[recorder])) as session:
        for step in range(3):
            x, y = batch()
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(model(x), y)
            if where == "before_backward":
                session.check_step(step, loss=loss)  # the wrong place
            torch.autograd.backward(loss)
            opt.step()
            if where == "after_step":
                session.check_step(step, loss=loss)  # the wrong place
            session.step_completed(step)
    return [(e.step, e.problem) for e in recorder.of_type(UsageWarning)]


def test_a_check_before_backward_is_said_once(caplog: pytest.LogCaptureFixture) -> None:
    """check_step before loss.backward() (after zero_grad) sees no gradient: the gradient
    checks would see nothing for the whole run, so the log says where the call belongs."""
    model, opt = setup()
    said = _check_out_of_place(opt, model, where="before_backward")
    assert said == [(0, "no_gradients_at_check")]
    assert caplog.text.count("no_gradients_at_check") == 1
    assert "after loss.backward()" in caplog.text


def test_a_frozen_model_checks_without_a_word(caplog: pytest.LogCaptureFixture) -> None:
    """Nothing to train, nothing to say (an evaluation-only session)."""
    model, _ = setup()
    model.requires_grad_(False)
    with SyncSession(model, None, log_dir=None, report=False, alerts=False) as session:
        for step in range(3):
            session.check_step(step, loss=1.0)
            session.step_completed(step)
    assert "no_gradients_at_check" not in caplog.text


def test_a_check_after_the_optimizer_step_is_said_once(caplog: pytest.LogCaptureFixture) -> None:
    """backward, optimizer.step(), then check_step: every skip or clip would come after the
    step it was for; the first check says so, once, and the optimizer keeps no hook."""
    model, opt = setup()
    said = _check_out_of_place(opt, model, where="after_step")
    assert said == [(0, "check_after_optimizer_step")]
    assert caplog.text.count("check_after_optimizer_step") == 1
    assert not opt._optimizer_step_post_hooks


def test_checks_in_their_place_say_nothing_of_the_order(caplog: pytest.LogCaptureFixture) -> None:
    model, opt = setup()
    with SyncSession(model, opt, log_dir=None, report=False, alerts=False) as session:
        for step in range(3):
            session.training_step(*batch(), nn.functional.mse_loss, step=step)
    assert "check_after_optimizer_step" not in caplog.text and "no_gradients" not in caplog.text
    assert not opt._optimizer_step_post_hooks
