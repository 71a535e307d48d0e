"""Copies of FSDP2 models: snapshots and the probe's weight-update buffer with DTensors.

``torch._foreach_copy_`` has no sharding rule for DTensor, so the second capture of a
``fully_shard`` model (the first refresh of the preallocated copies) used to raise
``NotImplementedError`` on every healthy FSDP2 run at its 50th good step, and the ADVANCED probe
at its second weight-update measurement. A one-rank gloo group is enough to make DTensors
in-process.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator, Mapping
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from eventbus_debug import DebugLevel, StepProbe
from eventbus_debug.events import StepChecked
from eventbus_debug.recovery import StateSnapshots
from tests._doubles import RecordingPublisher, needs_fsdp2_on_cpu

fsdp = pytest.importorskip("torch.distributed.fsdp")


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{Path(d) / 'store'}",
            rank=0,
            world_size=1,
            timeout=timedelta(seconds=30),
        )
        try:
            yield
        finally:
            dist.destroy_process_group()


def _is_dtensor(t: torch.Tensor) -> bool:
    return t.__class__ is not torch.Tensor and hasattr(t, "full_tensor")


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if _is_dtensor(t) else t  # type: ignore[no-any-return, attr-defined, unused-ignore]


def _values(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [_full(p.detach()).clone() for p in model.parameters()]
    for state in opt.state.values():
        out += [_full(v).clone() for v in state.values() if isinstance(v, torch.Tensor)]
    return out


def _step(model: nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator) -> None:
    opt.zero_grad(set_to_none=True)
    x = torch.randn(8, 6, generator=gen)
    torch.autograd.backward(model(x).pow(2).mean())
    opt.step()


@pytest.mark.usefixtures("one_rank_group")
@needs_fsdp2_on_cpu
def test_fully_shard_model_captures_twice_and_restores_bit_for_bit() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    fsdp.fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert all(_is_dtensor(p) for p in model.parameters())  # the premise
    gen = torch.Generator().manual_seed(1)
    snaps = StateSnapshots(every=1)
    _step(model, opt, gen)
    assert snaps.capture(1, model, opt)  # the first capture allocates the copies
    _step(model, opt, gen)
    assert snaps.capture(2, model, opt)  # the refresh: raised NotImplementedError before
    good = _values(model, opt)
    for _ in range(3):
        _step(model, opt, gen)
    assert not all(torch.equal(a, b) for a, b in zip(good, _values(model, opt), strict=True))
    assert snaps.restore(model, opt) == 2
    assert all(torch.equal(a, b) for a, b in zip(good, _values(model, opt), strict=True))


def _update_ratios(shard: bool) -> list[Mapping[str, float]]:
    """The ADVANCED probe's weight-update ratios over 25 SGD steps (measured every 10)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    if shard:
        fsdp.fully_shard(model)
        assert all(_is_dtensor(p) for p in model.parameters())  # the premise
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sink = RecordingPublisher()
    probe = StepProbe(model, sink, level=DebugLevel.ADVANCED)
    gen = torch.Generator().manual_seed(1)
    for step in range(25):
        opt.zero_grad(set_to_none=True)
        loss = model(torch.randn(8, 6, generator=gen)).pow(2).mean()
        torch.autograd.backward(loss)
        probe.check_step_sync(step, loss=loss)
        opt.step()
    probe.close()
    return [e.update_ratios for e in sink.events if isinstance(e, StepChecked) and e.update_ratios]


@pytest.mark.usefixtures("one_rank_group")
@needs_fsdp2_on_cpu
def test_advanced_probe_measures_weight_updates_of_a_fully_shard_model() -> None:
    """The second measurement refreshes the update buffer (raised NotImplementedError before);
    the ratios are those of the same model unsharded."""
    sharded, plain = _update_ratios(True), _update_ratios(False)
    assert len(sharded) >= 2 and len(sharded) == len(plain)
    for got, want in zip(sharded, plain, strict=True):
        assert got.keys() == want.keys()
        assert all(got[k] == pytest.approx(want[k], rel=1e-4) for k in want)
