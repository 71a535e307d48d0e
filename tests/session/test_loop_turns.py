"""A healthy session step turns the event loop once, as a bare ``await checkpoint()`` loop does.

Issue #13 ("one yield to the event loop per step, not several"): every extra turn costs a
selector call and a scheduling round on every step. The turns are counted by wrapping asyncio's
``BaseEventLoop._run_once`` (one call per loop iteration); a count, not a timing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from eventbus_debug import DebugLevel, Session

from ._helpers import setup

pytestmark = pytest.mark.asyncio_only("counts the turns of asyncio's event loop")

STEPS = 300


@pytest.fixture
def turns(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """A one-element list counting the event loop's iterations while the test runs."""
    count = [0]
    run_once = asyncio.base_events.BaseEventLoop._run_once  # type: ignore[attr-defined]

    def counted(loop: asyncio.AbstractEventLoop) -> None:
        count[0] += 1
        run_once(loop)

    monkeypatch.setattr(asyncio.base_events.BaseEventLoop, "_run_once", counted)
    yield count


@pytest.mark.parametrize("level", [DebugLevel.OFF, DebugLevel.BASIC, DebugLevel.EXTREME])
async def test_one_turn_per_healthy_step(
    tmp_path: Path, turns: list[int], level: DebugLevel
) -> None:
    """The default session (log, report, alerts, sampler on) over noisy healthy steps."""
    model, opt = setup()
    gen = torch.Generator().manual_seed(1)
    async with Session(model, opt, log_dir=tmp_path, level=level) as session:
        before = turns[0]
        for step in range(STEPS):
            x = torch.randn(32, 4, generator=gen)
            y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(32, 1, generator=gen)
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(model(x), y)
            torch.autograd.backward(loss)
            verdict = await session.check_step(step, loss=loss)
            assert verdict.should_step
            opt.step()
            await session.step_completed(step, loss=verdict.loss)
        during = turns[0] - before
    # the dispatcher, the sinks, the sampler and threads' callbacks run in the loop's turns the
    # training task already takes; a step that waited on something would add turns
    assert STEPS <= during <= STEPS + 3, f"{during} event-loop turns for {STEPS} steps"


async def test_counter_sees_extra_turns(turns: list[int]) -> None:
    """The counter is not blind: a loop that yields twice a step is counted twice."""
    before = turns[0]
    for _ in range(50):
        await asyncio.sleep(0)
        await asyncio.sleep(0)
    assert turns[0] - before >= 100
