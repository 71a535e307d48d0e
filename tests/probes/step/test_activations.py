"""The EXTREME-level forward hooks: dead and saturated fractions, arming, and failures."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from torch import nn

from eventbus_debug.probes.step.activations import SATURATION, ActivationHooks, ActivationSlot


def _fractions(hooks: ActivationHooks) -> dict[str, float]:
    slots, counts = hooks.take()
    return {s.name: s.fraction(float(c)) for s, c in zip(slots, counts, strict=True)}


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.Sigmoid(), nn.Linear(32, 32), nn.Tanh()
    )
    with torch.no_grad():
        for p in model[4].parameters():
            p.mul_(20)  # some tanh outputs saturate, some do not
    return model


def test_fractions_match_a_direct_count() -> None:
    """Dead ReLU units, saturated sigmoid and tanh outputs: the fractions a direct count gives."""
    model = _model()
    hooks = ActivationHooks(model)
    hooks.arm()
    x = torch.randn(64, 8) * 4
    with torch.no_grad():
        relu = model[1](model[0](x))
        sig = model[3](model[2](relu))
        tanh = model[5](model[4](sig))
    model(x)
    got = _fractions(hooks)
    assert got["1"] == pytest.approx((relu <= 0).float().mean().item())
    low = 1.0 - SATURATION
    assert got["3"] == pytest.approx(((sig <= low) | (sig >= SATURATION)).float().mean().item())
    saturated = (tanh.abs() >= SATURATION).float().mean().item()
    assert got["5"] == pytest.approx(saturated) and 0.0 < saturated < 1.0
    assert set(got) == {"1", "3", "5"}


def test_slot_fraction_for_each_kind() -> None:
    """A dead slot counts non-zero outputs (so 1 - c/n), a saturated slot counts the saturated."""
    assert ActivationSlot("a", "dead", 10).fraction(4.0) == pytest.approx(0.6)
    assert ActivationSlot("b", "saturated", 10).fraction(4.0) == pytest.approx(0.4)


def test_arm_is_idempotent_and_disarm_forgets() -> None:
    """Arming twice adds one hook per module; disarming removes them and the last counts."""
    model = _model()
    hooks = ActivationHooks(model)
    hooks.arm()
    hooks.arm()
    assert hooks.armed and len(model[1]._forward_hooks) == 1
    model(torch.randn(4, 8))
    assert hooks.take()[0]
    hooks.disarm()
    assert not hooks.armed and not model[1]._forward_hooks
    assert hooks.take() == ((), [])


def test_unarmed_and_non_tensor_outputs_count_nothing() -> None:
    """No hooks, no counts; an empty output is skipped without error."""
    model = _model()
    hooks = ActivationHooks(model)
    model(torch.randn(4, 8))
    assert hooks.take() == ((), [])
    hooks.arm()
    model(torch.randn(0, 8))
    assert hooks.take() == ((), [])


def test_a_failing_count_never_reaches_the_forward(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A hook whose count raises logs a warning; the user's forward still returns."""
    model = _model()
    hooks = ActivationHooks(model)
    hooks.arm()

    def broken(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("count failed")

    monkeypatch.setattr(torch, "sign", broken)  # the ReLU count
    monkeypatch.setattr(torch, "count_nonzero", broken)  # the saturation counts
    with caplog.at_level(logging.WARNING, logger="eventbus_debug"):
        out = model(torch.randn(4, 8))
    assert out.shape == (4, 32)
    assert any("activation_hook_failed" in r.getMessage() for r in caplog.records)
    assert hooks.take() == ((), [])


def test_relu6_and_a_changing_batch_size_count_the_live_units() -> None:
    """ReLU6 counts like ReLU; a new output size gives a new slot (the fraction stays right)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU6())
    hooks = ActivationHooks(model)
    hooks.arm()
    for rows in (16, 16, 5):
        x = torch.randn(rows, 8) * 4
        model(x)
        with torch.no_grad():
            out = model(x)
        (slot,), (count,) = hooks.take()
        assert slot.numel == rows * 32
        assert count.item() == (out > 0).sum().item()
        assert slot.fraction(float(count)) == pytest.approx((out == 0).float().mean().item())


def test_the_count_records_no_autograd_graph() -> None:
    """The hook's count is detached from the user's graph (no grad mode switch needed)."""
    model = _model()
    hooks = ActivationHooks(model)
    hooks.arm()
    out = model(torch.randn(4, 8))
    assert out.requires_grad
    _, counts = hooks.take()
    assert counts and all(not c.requires_grad and c.grad_fn is None for c in counts)


def test_a_nan_output_is_not_counted_live() -> None:
    """On CPU a NaN among a ReLU's outputs is not a live unit (sign(NaN) is 0); no error."""
    model = nn.Sequential(nn.ReLU())
    hooks = ActivationHooks(model)
    hooks.arm()
    model(torch.tensor([[1.0, 0.0, math.nan, 2.0]]))
    assert _fractions(hooks)["0"] == pytest.approx(0.5)
    model(torch.tensor([[1.0, -1.0, 3.0, 2.0]]))
    assert _fractions(hooks)["0"] == pytest.approx(0.25)
