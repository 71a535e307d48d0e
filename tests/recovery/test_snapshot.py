"""The last good state: preallocated copies that restore bit for bit."""

from __future__ import annotations

import math

import torch
from torch import nn

from eventbus_debug.recovery import StateSnapshots


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 4, generator=gen)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


NORM = nn.BatchNorm1d


def _model() -> tuple[nn.Sequential, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _first(model: nn.Sequential) -> nn.Linear:
    layer = model[0]
    assert isinstance(layer, nn.Linear)
    return layer


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = [t.detach().clone() for t in model.state_dict().values()]
    for entries in opt.state_dict()["state"].values():
        tensors += [v.clone() for v in entries.values() if isinstance(v, torch.Tensor)]
    return tensors


class TestRestore:
    def test_restore_after_many_captures_is_bit_identical(self) -> None:
        """After 20 captures into the same buffers, a restore brings back exactly the last one:
        parameters, BatchNorm buffers and every AdamW moment and step count."""
        model, opt = _model()
        snaps = StateSnapshots(every=1)
        _train(model, opt, 1, seed=1)
        assert snaps.capture(0, model, opt)
        buffers = list(snaps._model.values()) if snaps._model else []
        for step in range(1, 21):
            _train(model, opt, 3, seed=step)
            assert snaps.capture(step, model, opt)
        assert [id(t) for t in (snaps._model or {}).values()] == [id(t) for t in buffers]
        expected = _state(model, opt)
        _train(model, opt, 5, seed=99)
        assert snaps.restore(model, opt) == 20
        got = _state(model, opt)
        assert len(got) == len(expected)
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))

    def test_training_after_a_restore_does_not_touch_the_snapshot(self) -> None:
        """The optimizer gets its own copy of the state: steps after a restore leave it intact,
        so a second restore lands on the same values."""
        model, opt = _model()
        _train(model, opt, 2, seed=1)
        snaps = StateSnapshots(every=1)
        snaps.capture(2, model, opt)
        expected = _state(model, opt)
        snaps.restore(model, opt)
        _train(model, opt, 4, seed=2)
        snaps.restore(model, opt)
        assert all(torch.equal(a, b) for a, b in zip(_state(model, opt), expected, strict=True))

    def test_a_replaced_buffer_or_new_optimizer_state_is_picked_up(self) -> None:
        """A module that assigns a new buffer, and an optimizer that creates its state after
        the first capture, are copied from where they live now."""
        model, opt = _model()
        snaps = StateSnapshots(every=1)
        snaps.capture(0, model, opt)  # no optimizer state yet
        _train(model, opt, 2, seed=3)
        bn = model[1]
        assert isinstance(bn, NORM)
        bn.running_mean = torch.full((8,), 7.0)  # a new tensor, not an in-place update
        snaps.capture(1, model, opt)
        expected = _state(model, opt)
        _train(model, opt, 2, seed=4)
        bn.running_mean = torch.zeros(8)
        snaps.restore(model, opt)
        assert torch.equal(bn.running_mean, torch.full((8,), 7.0))
        assert all(torch.equal(a, b) for a, b in zip(_state(model, opt), expected, strict=True))

    def test_non_finite_parameters_are_never_captured(self) -> None:
        """A NaN weight refuses the capture; the held state stays the last finite one."""
        model, opt = _model()
        snaps = StateSnapshots(every=1)
        snaps.capture(0, model, opt)
        first = _first(model).weight.detach().clone()
        with torch.no_grad():
            _first(model).weight[0, 0] = math.nan
        assert not snaps.capture(1, model, opt)
        assert snaps.step == 0
        snaps.restore(model, opt)
        assert torch.equal(_first(model).weight, first)

    def test_a_reused_plan_still_refuses_non_finite_parameters_of_any_group(self) -> None:
        """Once the copies are planned, an Inf in a float64 parameter (a second group) still
        refuses the capture, as a NaN in the float32 ones does."""
        torch.manual_seed(0)
        first, second = nn.Linear(4, 4), nn.Linear(4, 2).double()
        model = nn.Sequential(first, second)
        snaps = StateSnapshots(every=1)
        assert snaps.capture(0, model, None) and snaps.capture(1, model, None)  # plan reused
        with torch.no_grad():
            second.bias[0] = math.inf
        assert not snaps.capture(2, model, None)
        with torch.no_grad():
            second.bias[0] = 0.0
            first.weight[1, 1] = math.nan
        assert not snaps.capture(3, model, None)
        with torch.no_grad():
            first.weight[1, 1] = 0.5
        assert snaps.capture(4, model, None) and snaps.step == 4
