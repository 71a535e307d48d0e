"""Every fault is caught at the step it was planted, at every level, on the healthy-step path.

The probe's every-step path is lean (issue #13: no stacking on CPU, no per-parameter work on a
healthy step); these runs plant one fault in a real training loop and check the step, the kind
and the names of the first incident at BASIC, ADVANCED and EXTREME, immediate and deferred.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch import nn

from eventbus_debug import DebugLevel, StepProbe
from eventbus_debug.events import (
    Event,
    GradientExploded,
    GradientVanished,
    LossSpiked,
    NonFiniteDetected,
    StepChecked,
    TensorRole,
)
from tests._doubles import RecordingPublisher

from ..conftest import batch, grad_of, linear_at, make_mlp

AT = 30
"""The step every fault is planted at (after a healthy warm-up of the detectors)."""
STEPS = 45
PATIENCE = 10
"""Thresholds().vanishing_patience: a dead layer is reported after this many checks."""

Fault = Callable[[nn.Sequential, int, torch.Tensor], torch.Tensor]
"""Plants a fault at a step: gets the model, the step and the loss (after backward), returns
the loss handed to the probe. Faults in the forward are planted by the loop (see _train)."""


def _healthy(model: nn.Sequential, step: int, loss: torch.Tensor) -> torch.Tensor:
    return loss


def _nan_loss(model: nn.Sequential, step: int, loss: torch.Tensor) -> torch.Tensor:
    return loss + math.nan if step == AT else loss


def _inf_gradient(model: nn.Sequential, step: int, loss: torch.Tensor) -> torch.Tensor:
    if step == AT:
        grad_of(linear_at(model, 0).weight)[0, 0] = math.inf
    return loss


def _spike(model: nn.Sequential, step: int, loss: torch.Tensor) -> torch.Tensor:
    return loss.detach() * 100.0 if step == AT else loss


def _explosion(model: nn.Sequential, step: int, loss: torch.Tensor) -> torch.Tensor:
    if step == AT:
        for p in model.parameters():
            grad_of(p).mul_(1e4)
    return loss


def _dead_layer(model: nn.Sequential, step: int, loss: torch.Tensor) -> torch.Tensor:
    if step >= AT:
        grad_of(linear_at(model, 0).weight).zero_()
    return loss


def _train(
    level: DebugLevel, fault: Fault, *, deferred: bool, nan_param: bool = False
) -> list[Event]:
    model = make_mlp(0)
    sink = RecordingPublisher()
    probe = StepProbe(model, sink, level=level, deferred=deferred)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(STEPS):
        if nan_param and step == AT:
            with torch.no_grad():
                linear_at(model, 2).bias.fill_(math.nan)
        opt.zero_grad(set_to_none=True)
        x, y = batch(step)
        loss = nn.functional.mse_loss(model(x), y)
        torch.autograd.backward(loss)
        verdict = probe.check_step_sync(step, loss=fault(model, step, loss))
        if verdict.finite and step != AT:
            opt.step()
    probe.flush_sync()
    probe.close()
    return sink.events


def _incidents(events: list[Event]) -> list[Event]:
    return [e for e in events if not isinstance(e, StepChecked)]


LEVELS = [DebugLevel.BASIC, DebugLevel.ADVANCED, DebugLevel.EXTREME]
MODES = [pytest.param(False, id="immediate"), pytest.param(True, id="deferred")]


@pytest.mark.parametrize("deferred", MODES)
@pytest.mark.parametrize("level", LEVELS)
class TestFirstIncident:
    def test_healthy_run_has_no_incident(self, level: DebugLevel, deferred: bool) -> None:
        """The same loop without a fault: telemetry every step, no incident."""
        events = _train(level, _healthy, deferred=deferred)
        assert _incidents(events) == []
        assert [e.step for e in events] == list(range(STEPS))

    def test_nan_loss(self, level: DebugLevel, deferred: bool) -> None:
        """A NaN loss is a LOSS incident at its step, and the telemetry says not finite."""
        events = _train(level, _nan_loss, deferred=deferred)
        first = _incidents(events)[0]
        assert isinstance(first, NonFiniteDetected)
        assert (first.step, first.role, first.nan_count) == (AT, TensorRole.LOSS, 1)
        checked = [e for e in events if isinstance(e, StepChecked) and e.step == AT]
        assert len(checked) == 1 and not checked[0].finite

    def test_inf_gradient(self, level: DebugLevel, deferred: bool) -> None:
        """One Inf gradient element is a GRADIENT incident naming its parameter, at its step."""
        first = _incidents(_train(level, _inf_gradient, deferred=deferred))[0]
        assert isinstance(first, NonFiniteDetected)
        assert (first.step, first.role, first.names) == (AT, TensorRole.GRADIENT, ("0.weight",))
        if not deferred:  # deferred: that step's gradients are gone, the counts are unknown
            assert (first.nan_count, first.inf_count) == (0, 1)

    def test_nan_parameter(self, level: DebugLevel, deferred: bool) -> None:
        """A NaN bias is named as a PARAMETER at the step it appeared, parameters due or not."""
        incidents = _incidents(_train(level, _healthy, deferred=deferred, nan_param=True))
        at = [e for e in incidents if e.step == AT]
        assert min(e.step for e in incidents if e.step is not None) == AT
        params = [
            e for e in at if isinstance(e, NonFiniteDetected) and e.role is TensorRole.PARAMETER
        ]
        assert [e.names for e in params] == [("2.bias",)]

    def test_loss_spike(self, level: DebugLevel, deferred: bool) -> None:
        """A loss 100x its baseline is a spike at its step, and only that."""
        incidents = _incidents(_train(level, _spike, deferred=deferred))
        assert len(incidents) == 1
        assert isinstance(incidents[0], LossSpiked) and incidents[0].step == AT

    def test_gradient_explosion(self, level: DebugLevel, deferred: bool) -> None:
        """Gradients 1e4x their baseline explode at their step, the largest norms listed first."""
        incidents = _incidents(_train(level, _explosion, deferred=deferred))
        assert len(incidents) == 1
        first = incidents[0]
        assert isinstance(first, GradientExploded) and first.step == AT
        norms = [norm for _, norm in first.top]
        assert first.rule == "growth" and len(norms) == 4 and norms == sorted(norms, reverse=True)

    def test_dead_layer(self, level: DebugLevel, deferred: bool) -> None:
        """A layer whose gradient turns exactly zero is reported once, after patience checks."""
        incidents = _incidents(_train(level, _dead_layer, deferred=deferred))
        assert len(incidents) == 1
        first = incidents[0]
        assert isinstance(first, GradientVanished)
        assert (first.step, first.layers, first.all_zero) == (
            AT + PATIENCE - 1,
            ("0.weight",),
            False,
        )


def test_a_deferred_step_keeps_no_graph_alive() -> None:
    """The pieces a deferred step waits with are detached (the loss's graph is not kept)."""
    model = make_mlp(0)
    probe = StepProbe(model, None, deferred=True)
    x, y = batch(0)
    loss = nn.functional.mse_loss(model(x), y)
    torch.autograd.backward(loss)
    assert loss.grad_fn is not None
    probe.check_step_sync(0, loss=loss)
    (pending,) = probe._in_flight
    assert all(p.grad_fn is None and not p.requires_grad for p in pending._pieces)
    verdict = probe.flush_sync()
    assert verdict is not None and verdict.step == 0 and verdict.loss == pytest.approx(loss.item())
