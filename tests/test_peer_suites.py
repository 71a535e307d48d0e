"""Peer projects' own test cases, asked of our equivalents.

- Ignite ``tests/ignite/handlers/test_terminate_on_nan.py`` (``TerminateOnNan``): which outputs
  are non-finite, and which iteration a run stops at. Our ``EventBusDebugHandler`` reports a
  non-finite output (role OUTPUT) instead of terminating (documented in docs/integrations.md);
  with ``TerminateOnNan`` beside it the run stops where Ignite's tests say.
- Lightning ``tests/tests_pytorch/callbacks/test_spike.py`` (``SpikeDetection``): a 1/(i+1) loss
  with a spike (4, +Inf, -Inf, NaN) at batch 4 is an incident at step 4 and nowhere else.
- Composer ``tests/callbacks/test_nan_monitor.py`` (``NaNMonitor``): a huge learning rate drives
  the loss to NaN and is reported; a tiny one raises nothing.

The cases are written against our API; no peer code is used.
"""

from __future__ import annotations

import collections
import math
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from ignite.engine import Engine, Events
from ignite.handlers import TerminateOnNan
from torch import nn

from eventbus_debug import StepProbe, SyncEventBus, SyncSession, read_events
from eventbus_debug.events import (
    LossSpiked,
    NonFiniteDetected,
    SessionEnded,
    TensorRole,
)
from eventbus_debug.integrations.ignite import EventBusDebugHandler
from eventbus_debug.probes.finite import non_finite_counts
from eventbus_debug.testing import RecordingSink
from tests._doubles import ignite_terminate_on_nan_table

# -- Ignite: TerminateOnNan ----------------------------------------------------------------------


class _Pair(NamedTuple):
    loss: Any
    extra: Any


def _more_rows() -> list[tuple[object, bool]]:
    """What users of TerminateOnNan hand it, and what it cannot take (None, numpy)."""
    return [
        (float("-inf"), True),
        (torch.tensor(-math.inf), True),
        (torch.tensor([1, 2, 3]), False),  # integers hold no NaN
        (7, False),
        ({"loss": 0.5, "parts": [1.0, (2.0, torch.tensor([math.inf]))]}, True),
        ({"loss": 0.5, "parts": [1.0, (2.0, torch.ones(2))]}, False),
        (_Pair(torch.tensor(1.0), torch.tensor([math.nan])), True),
        (collections.deque([1.0, torch.tensor(math.nan)]), True),
        (collections.defaultdict(list, a=[math.nan]), True),
        (np.array([1.0, np.nan]), True),
        (np.float32("nan"), True),
        (torch.tensor([0.0, math.nan]).to_sparse(), True),
        (torch.tensor(1e39, dtype=torch.float64), False),  # finite in its own precision
        (None, False),  # an update function that returns nothing
        ({"loss": 0.5, "y_pred": None, "note": "ok"}, False),
        ([None, math.nan], True),
        ("abc", False),
    ]


def _output_run(
    tmp_path: Path,
    outputs: list[Any],
    *,
    max_epochs: int = 1,
    terminate: bool = False,
    **options: Any,
) -> tuple[Engine, list[int | None]]:
    """An engine whose update returns its batch (as Ignite's tests), with our handler."""
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    handler = EventBusDebugHandler(
        model, optimizer, log_dir=tmp_path, alerts=False, system_interval=None, **options
    )
    trainer = Engine(lambda engine, batch: batch)
    if terminate:
        trainer.add_event_handler(Events.ITERATION_COMPLETED, TerminateOnNan())
    handler.attach(trainer)
    trainer.run(outputs, max_epochs=max_epochs)
    steps = [
        e.step
        for e in read_events(tmp_path)
        if isinstance(e, NonFiniteDetected) and e.role is TensorRole.OUTPUT
    ]
    return trainer, steps


@pytest.mark.parametrize(("output", "bad"), ignite_terminate_on_nan_table() + _more_rows())
def test_terminate_on_nan_outputs(output: object, bad: bool) -> None:
    """Every row gets Ignite's answer (NaN, +Inf, -Inf alike), and nothing raises."""
    assert non_finite_counts(output, skip_unknown=True).finite is not bad


@pytest.mark.parametrize(
    ("output", "bad"), ignite_terminate_on_nan_table()[::2] + _more_rows()[-9:]
)
def test_handler_reports_what_terminate_on_nan_stops_on(
    tmp_path: Path, output: object, bad: bool
) -> None:
    """Through a real run: a non-finite output is one OUTPUT incident; no output type crashes."""
    trainer, steps = _output_run(tmp_path, [output])
    assert steps == ([0] if bad else [])
    assert trainer.state.iteration == 1


def test_numpy_output_through_an_output_transform(tmp_path: Path) -> None:
    """Ignite's numpy row needs ``output_transform=lambda x: x.tolist()``; ours takes both."""
    arrays = [np.array([1.0, 2.0]), np.array([np.inf, 2.0])]
    _, steps = _output_run(tmp_path, arrays, output_transform=lambda x: x.tolist())
    assert steps == [1]


def _nan_data() -> list[Any]:
    torch.manual_seed(12)
    return [
        1.0,
        0.8,
        (torch.rand(4, 4), torch.rand(4, 4)),
        torch.rand(5),
        torch.asin(torch.randn(4, 4)),
        0.0,
        1.0,
    ]


def _inf_data() -> list[Any]:
    torch.manual_seed(12)
    return [
        1.0,
        0.8,
        torch.rand(4, 4),
        (1.0 / torch.randint(0, 2, size=(4,)).type(torch.float), torch.tensor(1.234)),
        torch.rand(5),
        torch.asin(torch.randn(4, 4)),
        0.0,
        1.0,
    ]


@pytest.mark.parametrize(
    ("data", "stop_at", "reported"),
    [(_nan_data(), 5, [4, 11]), (_inf_data(), 4, [3, 5, 11, 13])],
    ids=["nan", "inf"],
)
def test_run_with_non_finite_outputs(
    tmp_path: Path, data: list[Any], stop_at: int, reported: list[int]
) -> None:
    """Ours alone reports every bad iteration of both epochs and lets the run finish (it
    skips, never stops); with TerminateOnNan beside it the run stops where Ignite's test says,
    and the session ends with it, reporting the one bad output seen."""
    trainer, steps = _output_run(tmp_path / "alone", data, max_epochs=2)
    assert trainer.state.iteration == 2 * len(data)
    assert steps == reported

    trainer, steps = _output_run(tmp_path / "both", data, max_epochs=2, terminate=True)
    assert trainer.state.iteration == stop_at
    assert steps == [stop_at - 1]
    ended = [e for e in read_events(tmp_path / "both") if isinstance(e, SessionEnded)]
    assert len(ended) == 1


def test_run_without_non_finite_outputs(tmp_path: Path) -> None:
    """Finite outputs only: every iteration of both epochs runs, nothing is reported."""
    data = [1.0, 0.8, torch.rand(4, 4), (torch.rand(5), torch.rand(5, 4)), 0.0, 1.0]
    trainer, steps = _output_run(tmp_path, data, max_epochs=2, terminate=True)
    assert trainer.state.iteration == 2 * len(data)
    assert steps == []


# -- Lightning: SpikeDetection ---------------------------------------------------------------------


def _lightning_losses(spike: float | None) -> list[float]:
    """Lightning's IdentityModule losses: 1/(i+1) over 10 batches, batch 4 replaced (None:
    the batch index, 4)."""
    losses = [1 / (i + 1) for i in range(10)]
    losses[4] = 4.0 if spike is None else spike
    return losses


@pytest.mark.parametrize(
    ("spike", "kind"),
    [
        (None, LossSpiked),
        (math.inf, NonFiniteDetected),
        (-math.inf, NonFiniteDetected),
        (math.nan, NonFiniteDetected),
    ],
    ids=["spike", "+inf", "-inf", "nan"],
)
def test_spike_detection_sequence(spike: float | None, kind: type[Any]) -> None:
    """Lightning raises at batch 4 with its default ``finite_only=True`` for all four; ours
    reports an incident at step 4 and at no other step (a non-finite loss is always a fault,
    never a spike: see the report for ``finite_only=False``)."""
    model = nn.Linear(1, 1, bias=False)
    recorder = RecordingSink()
    with SyncEventBus() as bus:
        bus.subscribe(recorder)
        probe = StepProbe(model, bus)
        for step, value in enumerate(_lightning_losses(spike)):
            model.zero_grad()
            with torch.no_grad():
                model.weight.fill_(1.0)  # output == input, with gradients
            loss = model(torch.tensor([[value]])).sum()
            loss.backward()
            probe.check_step_sync(step, loss=loss)
    incidents = [e for e in recorder.events if isinstance(e, LossSpiked | NonFiniteDetected)]
    assert {e.step for e in incidents} == {4}
    assert any(isinstance(e, kind) for e in incidents)
    if kind is NonFiniteDetected:
        roles = {e.role for e in incidents if isinstance(e, NonFiniteDetected)}
        assert TensorRole.LOSS in roles


# -- Composer: NaNMonitor ------------------------------------------------------------------------


@pytest.mark.parametrize("should_nan", [True, False])
def test_nan_monitor_huge_learning_rate(tmp_path: Path, should_nan: bool) -> None:
    """Composer's NaNMonitor raises on a run whose loss goes NaN (lr 1e20) and lets a tiny-lr
    run finish. Ours reports the non-finite loss and keeps the parameters finite (the step is
    skipped before it lands, or the model restored); the healthy run reports nothing."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e20 if should_nan else 1e-10)
    x = torch.randn(32, 8)
    y = torch.randint(0, 2, (32,))
    with SyncSession(model, optimizer, log_dir=tmp_path, alerts=False, system_interval=None) as s:
        for step in range(30):
            s.training_step(x, y, nn.functional.cross_entropy, step=step)
    non_finite = [e for e in read_events(tmp_path) if isinstance(e, NonFiniteDetected)]
    if should_nan:
        assert non_finite
        assert {TensorRole.LOSS, TensorRole.GRADIENT} & {e.role for e in non_finite}
    else:
        assert not non_finite
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
