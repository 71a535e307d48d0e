"""Snapshots of FSDP2 models: DTensor parameters and optimizer state refresh and restore.

``torch._foreach_copy_`` has no sharding rule for DTensor, so the second capture of a
``fully_shard`` model (the first refresh of the preallocated copies) used to raise
``NotImplementedError`` on every healthy FSDP2 run at its 50th good step. A one-rank gloo group
is enough to make DTensors in-process.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from eventbus_debug.recovery import StateSnapshots

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
