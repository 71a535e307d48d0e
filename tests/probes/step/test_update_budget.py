"""The weight-update measurement copies the weights: on an accelerator that copy may take at
most ``_memory.DEVICE_SHARE`` of the device's memory. Over it, the updates are measured on a
rotating window of parameters. The budget is injected here (a CPU has none)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from eventbus_debug import DebugLevel, StepProbe, _memory
from eventbus_debug.events import StepChecked
from tests._doubles import RecordingPublisher

BYTES = {"0.weight": 512, "0.bias": 64, "2.weight": 1024, "2.bias": 64, "4.weight": 256}
BYTES["4.bias"] = 16


def _measured(budget: int | None, steps: int, monkeypatch: pytest.MonkeyPatch) -> list[set[str]]:
    monkeypatch.setattr(_memory, "device_budget", lambda device: budget)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sink = RecordingPublisher()
    probe = StepProbe(model, sink, level=DebugLevel.EXTREME)  # updates measured every step
    for step in range(steps):
        x = torch.randn(32, 8)
        nn.functional.mse_loss(model(x), x[:, :4]).backward()  # type: ignore[no-untyped-call]
        probe.check_step_sync(step, loss=None)
        opt.step()
        opt.zero_grad()
    checked = [e for e in sink.events if isinstance(e, StepChecked)]
    return [set(e.update_ratios) for e in checked[1:]]  # the first step only takes a copy


def test_without_a_budget_every_update_is_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _measured(None, 4, monkeypatch) == [set(BYTES)] * 3


def test_over_the_budget_a_rotating_window_measures_every_parameter_in_turn(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="eventbus_debug"):
        windows = _measured(1100, 8, monkeypatch)
    assert all(sum(BYTES[n] for n in w) <= 1100 for w in windows)
    assert all(w for w in windows) and len({frozenset(w) for w in windows}) > 1
    assert set().union(*windows[:3]) == set(BYTES)  # a few measurements cover them all
    said = [r for r in caplog.records if "update_ratios_rotating" in r.getMessage()]
    assert len(said) == 1


def test_a_parameter_larger_than_the_budget_alone_is_never_measured(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    windows = _measured(600, 8, monkeypatch)
    assert all("2.weight" not in w for w in windows)
    assert set().union(*windows) == set(BYTES) - {"2.weight"}


def test_the_budget_is_a_share_of_an_accelerator_and_none_on_the_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert _memory.device_budget(torch.device("cpu")) is None
    gib = 1 << 30
    monkeypatch.setattr(torch.accelerator, "get_memory_info", lambda device: (gib, 80 * gib))
    assert _memory.device_budget(torch.device("cuda", 0)) == 4 * gib  # 5 % of 80 GiB

    def unreadable(device: torch.device) -> tuple[int, int]:
        raise RuntimeError("no memory query on this backend")

    monkeypatch.setattr(torch.accelerator, "get_memory_info", unreadable)
    assert _memory.device_budget(torch.device("cuda", 0)) is None
