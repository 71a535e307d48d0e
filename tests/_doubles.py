"""Test doubles shared across the test tree."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from eventbus_debug.events import Event

FSDP2_ON_CPU = hasattr(torch.cpu.current_stream(), "record_event")
"""Whether this torch runs FSDP2 (``fully_shard``) on CPU/gloo: torch 2.6 lacks the CPU
stream's ``record_event`` that FSDP2's all-gather calls (the library's DTensor path is then
tested wherever a newer torch runs the suite)."""

needs_fsdp2_on_cpu = pytest.mark.skipif(
    not FSDP2_ON_CPU, reason=f"torch {torch.__version__} cannot run FSDP2 on CPU"
)


class RecordingPublisher:
    """A Publisher test double: no bus, the events it was given in a list."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def publish_nowait(self, event: Event, /) -> None:
        self.events.append(event)

    def publish_many_nowait(self, events: Iterable[Event], /) -> None:
        self.events.extend(events)


def small_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    """A two-layer MLP (4 -> 8 -> 1) and its SGD optimizer, for tests of one step."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def backward_once(model: nn.Module) -> None:
    """One backward pass of :func:`small_model`'s model on a random batch."""
    model(torch.randn(6, 4)).pow(2).mean().backward()


def quiet(**knobs: Any) -> dict[str, Any]:
    """Session keywords for a session with no log, report, alerts or system sampler."""
    return {"log_dir": None, "report": False, "alerts": False, "system_interval": None, **knobs}


def ignite_terminate_on_nan_table() -> list[tuple[object, bool]]:
    """Ignite's own table for ``TerminateOnNan`` (tests/ignite/handlers/test_terminate_on_nan.py:
    an engine output, and whether it holds a NaN or Inf), seeded as there."""
    torch.manual_seed(12)
    return [
        (1.0, False),
        (torch.tensor(123.45), False),
        (torch.asin(torch.tensor([1.0, 2.0, 0.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0])), True),
        (torch.asin(torch.randn(4, 4)), True),
        ((10.0, 1.0 / torch.tensor([1.0, 2.0, 0.0, 3.0]), 1.0), True),
        ((1.0, torch.tensor(1.0), "abc"), False),
        (1.0 / torch.randint(0, 2, size=(4, 4)).type(torch.float), True),
        ((float("nan"), 10.0), True),
        (float("inf"), True),
        ([float("nan"), 10.0], True),
        (np.array([1.0, 2.0]), False),
    ]
