"""Two sessions on one bus (a GAN's two models): each session's recovery acts on its own
incidents. Before, session A skipped its healthy step because session B's loss was NaN."""

from __future__ import annotations

import math

import anyio
import pytest
import torch
from torch import nn

from eventbus_debug import EventBus, Session
from eventbus_debug.events import NonFiniteDetected, StepSkipped, TensorRole
from eventbus_debug.exceptions import SubscriptionError
from eventbus_debug.testing import RecordingSink


def _model(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


async def test_each_session_recovers_from_its_own_incidents_only() -> None:
    x = torch.randn(32, 4)
    y = x.sum(1, keepdim=True)
    recorder = RecordingSink()
    skipped: dict[str, list[int]] = {"gen": [], "gen.disc": []}
    async with EventBus() as bus:
        bus.subscribe(recorder)
        models = {name: _model(seed) for seed, name in enumerate(skipped)}
        async with (
            Session(*models["gen"], bus=bus, name="gen", log_dir=None, report=False) as a,
            Session(*models["gen.disc"], bus=bus, name="gen.disc", log_dir=None) as b,
        ):
            for step in range(8):
                for session, name in ((a, "gen"), (b, "gen.disc")):
                    model, opt = models[name]
                    opt.zero_grad(set_to_none=True)
                    loss = nn.functional.mse_loss(model(x), y)
                    torch.autograd.backward(loss)
                    if name == "gen.disc" and step == 3:
                        loss = loss * math.nan  # only the second model's step is bad
                    with anyio.fail_after(10):
                        verdict = await session.check_step(step, loss=loss)
                    if verdict.should_step:
                        opt.step()
                    else:
                        skipped[name].append(step)
                    await session.step_completed(step, loss=verdict.loss)
            # an incident of no session (a user's own check) is still every session's
            bus.publish_nowait(
                NonFiniteDetected(step=8, source="my_check", role=TensorRole.LOSS, names=("x",))
            )
            for session, name in ((a, "gen"), (b, "gen.disc")):
                with anyio.fail_after(10):
                    verdict = await session.check_step(8)
                if not verdict.should_step:
                    skipped[name].append(8)
        await bus.drain()
    assert skipped == {"gen": [8], "gen.disc": [3, 8]}
    assert sorted((e.step, e.source) for e in recorder.of_type(StepSkipped))[:1] == [
        (3, "recovery.safe_point")
    ]


async def test_a_second_session_of_the_same_name_on_a_bus_is_refused_first() -> None:
    """Two sessions named alike would take each other's incidents for their own (each engine
    skipping or restoring its model for the other model's faults): the second is refused, with
    a message naming the way out, before it subscribes anything."""
    async with EventBus() as bus:
        async with Session(*_model(0), bus=bus, log_dir=None, report=False) as first:
            before = sorted(sub.name for sub in bus.subscriptions)
            second = Session(*_model(1), bus=bus, log_dir=None, report=False)
            with pytest.raises(SubscriptionError, match=r"named 'training' is already running"):
                await second.__aenter__()
            assert sorted(sub.name for sub in bus.subscriptions) == before  # nothing left behind
            # the refused session may be entered under its own name later; the first runs on
            verdict = await first.check_step(0, loss=1.0)
            assert verdict.should_step
        # the name is free again once the first session left
        async with Session(*_model(1), bus=bus, log_dir=None, report=False) as again:
            assert (await again.check_step(0, loss=1.0)).should_step
