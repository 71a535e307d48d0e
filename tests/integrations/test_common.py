"""The pieces every integration shares: the fit-long session, loss accumulation, batch sizes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from ignite.engine import create_supervised_trainer
from torch import nn

from eventbus_debug import read_events
from eventbus_debug.events import NonFiniteDetected, SessionEnded, StepSkipped
from eventbus_debug.integrations._common import (
    FitSession,
    LossAccumulator,
    SampleCounter,
    batch_size,
    clip_gradients,
    require,
)
from eventbus_debug.integrations.ignite import EventBusDebugHandler


def test_loss_accumulator_sums_or_averages_and_resets() -> None:
    """Micro-batch losses add up (Lightning's pre-divided ones) or average (raw ones)."""
    acc = LossAccumulator()
    assert acc.take() is None
    for v in (1.0, 2.0, 3.0):
        acc.add(torch.tensor(v, requires_grad=True) * 1)
    total = acc.take()
    assert total is not None and float(total) == 6.0 and not total.requires_grad
    assert acc.take() is None
    acc.add(torch.tensor([2.0, 4.0]))  # a non-scalar loss counts as its mean
    acc.add(torch.tensor(5.0))
    mean = acc.take(mean=True)
    assert mean is not None and float(mean) == 4.0
    acc.add(torch.tensor(math.nan))
    acc.add(torch.tensor(1.0))
    nan = acc.take()
    assert nan is not None and math.isnan(float(nan))


def test_loss_accumulator_counts_the_losses_of_the_window() -> None:
    """count says how many micro-batch losses the next take() covers (a short window)."""
    acc = LossAccumulator()
    acc.add(torch.tensor(1.0))
    acc.add(torch.tensor(3.0))
    assert acc.count == 2
    acc.take()
    assert acc.count == 0


def test_sample_counter_adds_up_a_window_and_an_unknown_size_makes_it_unknown() -> None:
    """The samples of a step's micro-batches; one of unknown size: the step's is unknown."""
    counter = SampleCounter()
    assert counter.take() is None
    counter.add(8)
    counter.add(3)
    assert counter.take() == 11
    assert counter.take() is None
    counter.add(8)
    counter.add(None)
    assert counter.take() is None
    counter.add(2)
    assert counter.take() == 2


def test_clip_gradients_is_torchs_clip_grad_norm_bit_for_bit() -> None:
    """The frameworks' own call: the same clipped gradients and the same returned norm."""
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 3)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    x = torch.randn(32, 16)
    for model in models:
        model(x).pow(2).sum().backward()
        model[0].bias.grad = None  # a parameter without a gradient is left alone
    expected = torch.nn.utils.clip_grad_norm_(models[0].parameters(), 0.01)
    got = clip_gradients(models[1].parameters(), 0.01)
    assert torch.equal(expected, got) and float(got) > 0.01
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert (a.grad is None and b.grad is None) or (
            a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad)
        )


def test_batch_size_finds_the_first_tensor() -> None:
    """The leading dimension of the first tensor in a batch of any common shape."""
    assert batch_size(torch.zeros(5, 2)) == 5
    assert batch_size((torch.zeros(3, 1), torch.zeros(3))) == 3
    assert batch_size({"input_ids": torch.zeros(7, 4, dtype=torch.long)}) == 7
    assert batch_size([{"a": "text"}, [torch.zeros(2)]]) == 2
    assert batch_size(torch.tensor(1.0)) is None
    assert batch_size("text") is None


def test_require_names_the_extra_to_install() -> None:
    """A missing framework is an ImportError naming the pip extra."""
    with pytest.raises(ImportError, match=r"eventbus-debug\[nosuchframework\]"):
        require("nosuchframework_xyz", "nosuchframework")
    require("torch", "torch")  # present: no error


def test_fit_session_refuses_checks_outside_a_fit_and_closes_idempotently(tmp_path: Path) -> None:
    """Checking before the fit started is a RuntimeError; close twice is harmless."""
    fit = FitSession("test", tmp_path, {"alerts": False})
    with pytest.raises(RuntimeError, match="not running"):
        fit.check(0, None)
    model = nn.Linear(2, 1)
    fit.open(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert fit.running and fit.session is not None and fit.session.name == "test"
    # a second open (the framework's previous fit died silently) ends the first one first
    fit.open(model, torch.optim.SGD(model.parameters(), lr=0.1))
    fit.close()
    fit.close()
    reasons = [e.reason for e in read_events(tmp_path) if isinstance(e, SessionEnded)]
    assert reasons == [
        "error: RuntimeError: test started a new fit before this one ended",
        "completed",
    ]


def test_session_options_must_be_keywords_and_not_reserved() -> None:
    """Options are keyword arguments; model/optimizer/log_dir are named as reserved."""
    with pytest.raises(TypeError, match="keyword arguments"):
        FitSession("test", None, [("level", "basic")])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="optimizer"):
        FitSession("test", None, {"optimizer": None})


def test_unknown_session_option_fails_at_fit_start_naming_it() -> None:
    """A misspelt session option surfaces as SyncSession's TypeError naming it."""
    model = nn.Linear(2, 1)
    fit = FitSession("test", None, {"levle": "basic"})
    with pytest.raises(TypeError, match="levle"):
        fit.open(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert not fit.running


def test_observe_policy_detects_without_skipping(tmp_path: Path) -> None:
    """policy="observe" passes through: the NaN is reported, the step is not skipped."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    handler = EventBusDebugHandler(
        model, optimizer, log_dir=tmp_path, alerts=False, policy="observe"
    )
    trainer = create_supervised_trainer(model, optimizer, handler.track_loss(nn.MSELoss()))
    handler.attach(trainer)
    x = torch.randn(16, 4)
    x[9, 0] = math.nan
    trainer.run([(x[:8], x[:8].sum(1, keepdim=True)), (x[8:], x[8:].sum(1, keepdim=True))])
    events = list(read_events(tmp_path))
    assert any(isinstance(e, NonFiniteDetected) and e.step == 1 for e in events)
    assert not any(isinstance(e, StepSkipped) for e in events)
    assert handler.steps_skipped == 0
