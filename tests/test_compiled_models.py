"""A ``torch.compile``\\ d model is debugged as the model it wraps.

``torch.compile(model)`` returns an ``OptimizedModule`` whose parameters and submodules are the
model's own, named ``_orig_mod.<name>``, and whose compiled forward does not run hooks added
after compiling. The session names what it reports as the model does, and localizes a NaN to
its layer by replaying the failed step eagerly. The tests compile with ``backend="eager"``
(dynamo's graph capture, the part that wraps the model and skips late hooks, without a C++
compiler).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from eventbus_debug import Session
from eventbus_debug._modules import named_root
from eventbus_debug.events import (
    AnomalyLocalized,
    Event,
    NonFiniteDetected,
    SessionStarted,
    StepChecked,
    TensorRole,
)
from eventbus_debug.probes import debug_backward_pass, debug_forward_pass
from tests._doubles import quiet

NAMES = ("0.weight", "0.bias", "2.weight", "2.bias")


class _Log(nn.Module):
    """``log`` of its input: NaN wherever the input is negative."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


def _model(*, nan_layer: bool = False) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)]
    if nan_layer:
        layers.append(_Log())
    return nn.Sequential(*layers)


def _compiled(model: nn.Module) -> Any:
    return torch.compile(model, backend="eager")


class _Collect:
    def __init__(self) -> None:
        self.events: list[Event] = []

    async def handle(self, event: Event) -> None:
        self.events.append(event)

    def of(self, kind: type[Event]) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind)]


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_named_root_is_the_compiled_model_or_the_module_itself() -> None:
    model = _model()
    assert named_root(model) is model
    assert named_root(_compiled(model)) is model


async def test_incidents_and_telemetry_name_the_models_parameters(tmp_path: Path) -> None:
    """A NaN batch on a compiled model, at EXTREME (per-layer norms, activation hooks): every
    name is the model's (``0.weight``), none has ``_orig_mod.``; the start names the class."""
    model = _compiled(_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sink = _Collect()
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    async with Session(
        model, optimizer, log_dir=None, level="extreme", sinks=[sink], system_interval=None
    ) as session:
        for step in range(6):
            batch = x.clone()
            if step == 4:
                batch[0, 0] = float("nan")
            loss = nn.functional.cross_entropy(model(batch), y)
            torch.autograd.backward(loss)
            verdict = await session.check_step(step, loss=loss)
            if verdict.should_step:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            await session.step_completed(step, loss=verdict.loss)
        assert not verdict.probe.fired
    (started,) = sink.of(SessionStarted)
    assert started.config["model"] == "Sequential (compiled)"
    grads = [e for e in sink.of(NonFiniteDetected) if e.role is TensorRole.GRADIENT]
    assert [e.step for e in grads] == [4]
    assert grads[0].names == NAMES
    checked = sink.of(StepChecked)
    assert set(checked[0].layer_grad_norms) == set(NAMES)
    assert set(checked[2].dead_fractions) == {"1"}  # the ReLU, by its name in the model
    named = {
        name for e in checked for name in (*e.layer_grad_norms, *e.update_ratios, *e.dead_fractions)
    }
    assert named and not any("_orig_mod" in n for n in named)


@pytest.mark.parametrize("how", ["eager", "torch.compile", "Module.compile"])
async def test_a_nan_is_localized_to_its_layer(how: str) -> None:
    """``training_step`` replays a failed step with the localizer's hooks: eagerly, so a
    compiled model's NaN is found in its layer (``3``, the log), as an eager model's is,
    whether the model was wrapped (``torch.compile(model)``) or compiled in place."""
    model = _model(nan_layer=True)
    run = _compiled(model) if how == "torch.compile" else model
    if how == "Module.compile":
        model.compile(backend="eager")
    optimizer = torch.optim.SGD(run.parameters(), lr=1e-3)
    sink = _Collect()
    torch.manual_seed(1)
    async with Session(run, optimizer, **quiet(mode="anomaly_detection", sinks=[sink])) as session:
        for step in range(3):
            result = await session.training_step(
                torch.rand(4, 8), torch.zeros(4), lambda out, _: out.exp().mean(), step=step
            )
            assert not result.stepped  # the log of a negative output: NaN every step
    found = sink.of(AnomalyLocalized)
    assert found, "nothing localized"
    assert {(e.module, e.phase) for e in found} == {("3", "forward")}


def test_debug_passes_name_and_hook_the_models_layers() -> None:
    """``debug_forward_pass`` runs a compiled model's layers eagerly (its hooks see each
    layer); ``debug_backward_pass`` names the gradients as the model does."""
    model = _model()
    compiled = _compiled(model)
    x = torch.randn(4, 8)
    out, report = debug_forward_pass(compiled, x)
    assert torch.equal(out, model(x))
    assert [row.module for row in report.layers] == ["0", "1", "2", ""]  # completion order
    model.compile(backend="eager")
    _, in_place = debug_forward_pass(model, x)
    assert [row.module for row in in_place.layers] == ["0", "1", "2", ""]
    loss = out.sum()
    backward = debug_backward_pass(loss, compiled)
    assert set(backward.grad_norms) == set(NAMES)


def test_one_shot_checks_name_the_models_parameters() -> None:
    """The seed-named one-shot checks (``check_gradients`` & co.) report a compiled model's
    parameters under the model's own names, as the session does, with the same figures."""
    from eventbus_debug.compat import (
        analyze_gradients,
        analyze_model_parameters,
        check_gradient_explosion,
        check_gradients,
    )

    model = _model()
    compiled = _compiled(model)
    compiled(torch.randn(4, 8)).pow(2).sum().backward()
    assert tuple(s.name for s in analyze_model_parameters(compiled)) == NAMES
    assert analyze_gradients(compiled) == analyze_gradients(model)
    report = check_gradients(compiled, gradient_threshold=1e-9)
    assert report.above == NAMES and report.finite
    assert check_gradient_explosion(compiled, threshold=1e-9) == NAMES
