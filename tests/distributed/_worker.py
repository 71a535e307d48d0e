"""One rank of a DDP training run over gloo with a fault planted on some rank.

Run as ``python -m tests.distributed._worker SCENARIOS RANK WORLD INIT_FILE OUT_DIR`` where
SCENARIOS is a comma-separated list of ``name[:policy]`` run one after the other in the same
process group (starting processes is the expensive part); writes
``OUT_DIR/{name}-{policy}.rank{RANK}.json`` with what the rank saw, did and ended with.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from eventbus_debug import Cadence, CallState, Retrying, Session, TrainingStopped
from eventbus_debug.events import (
    GradientExploded,
    LossSpiked,
    MemoryLeakSuspected,
    RecoveryApplied,
    StepSkipped,
)
from eventbus_debug.recovery.actions import Decision, Stop
from eventbus_debug.recovery.agreement import RankAgreement
from eventbus_debug.recovery.safepoint import _placement
from eventbus_debug.testing import RecordingSink

STEPS = 40


def _fault(scenario: str, rank: int, step: int, loss: torch.Tensor, model: nn.Module) -> Any:
    """The planted fault of *scenario* at *step* on *rank* (returns the loss to use)."""
    nan_batch = ("nan_one_rank", "nan_one_rank_every5", "blocking_nan_one_rank_every5", "fsdp2")
    if scenario in nan_batch and rank == 1 and step == 12:
        return loss * math.nan
    if scenario == "nan_three_one_rank_every5" and rank == 1 and 12 <= step < 15:
        return loss * math.nan  # three in a row: the safe policy escalates to a restore
    if scenario == "nan_loss_only_one_rank" and rank == 1 and step == 12:
        return loss + math.nan  # the NaN is in the loss, not in its gradient
    if scenario == "spike_one_rank" and rank == 0 and step == 20:
        return loss * 1e4
    if scenario == "sustained_one_rank" and rank == 0 and 20 <= step < 30:
        return loss * 40
    if scenario == "explode_samples_one_rank" and step == 20:
        return loss * 1000  # on every rank: the all-reduced norm explodes
    if scenario == "nan_param_one_rank" and rank == 1 and step == 0:
        with torch.no_grad():
            next(model.parameters())[0, 0] = math.nan
    return loss


def _base(scenario: str) -> str:
    """*scenario* without its ``ov_`` prefix (which opts into the overlapped agreement) and its
    ``unheld_`` prefix (rank 1 has no memory for a snapshot: it holds no good state)."""
    return scenario.removeprefix("ov_").removeprefix("unheld_")


class TwoOutputs(nn.Module):
    """A model returning ``(features, prediction)``: its first output has no parameters of its own
    and is used in the loss on some ranks only, or on none (an auxiliary output)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 32), nn.Tanh())
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(x)
        return h * 1.0, self.head(h)


def _inf_hook(grad: torch.Tensor) -> torch.Tensor:
    """Make one gradient element infinite before DDP all-reduces it."""
    grad = grad.clone()
    grad[0, 0] = math.inf
    return grad


TWO_OUTPUTS: dict[str, dict[str, bool]] = {
    "aux_some_ranks": {},
    "first_unused_find_unused": {"find_unused_parameters": True},
    "first_unused_static": {"static_graph": True},
}
"""Scenarios of :class:`TwoOutputs` and their DDP options."""
NAN_PARAM_AT: dict[str, tuple[int, ...]] = {"nan_param_late": (20,), "nan_param_twice": (20, 23)}
"""Scenarios where rank 1's parameters become NaN, and the steps."""
JOIN: dict[str, int] = {"join_uneven": 5, "join_model_only": 5, "join_agreement_first": 5}
"""Scenarios run under a Join context, and how many fewer batches rank 1 has."""


def _leak(step: int) -> MemoryLeakSuspected:
    """A rank-local incident (this rank's memory grows)."""
    return MemoryLeakSuspected(
        source="test", step=step, resource="rss", slope=1e6, window=10, retained="test"
    )


def _stop_on_leak(incident: Any, history: Any) -> Decision:
    """A strategy that stops on a suspected leak (registered on every rank alike)."""
    return Decision(action=Stop(), reason=f"leak on this rank at step {incident.step}")


async def _train(scenario: str, rank: int, world: int, policy: str, out: Path) -> dict[str, Any]:
    torch.manual_seed(0)
    net: nn.Module = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    model: nn.Module
    base = _base(scenario)
    if scenario == "fsdp2":
        fully_shard(net)  # gradients become DTensor shards
        model = net
    elif base in TWO_OUTPUTS:
        net = TwoOutputs()
        options = TWO_OUTPUTS[base]
        model = DistributedDataParallel(
            net,
            find_unused_parameters=options.get("find_unused_parameters", False),
            static_graph=options.get("static_graph", False),
        )
    else:
        model = DistributedDataParallel(net)  # broadcasts rank 0's initial parameters
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(100 + rank)
    recorder = RecordingSink()
    every5 = ("nan_one_rank_every5", "nan_three_one_rank_every5")
    cadence = Cadence(grad_every=5) if base in every5 else None
    distributed: Any = None
    if scenario == "crash_one_rank":
        distributed = RankAgreement(timeout=5.0, overlap=False)
    elif scenario in ("crash_one_rank_overlapped", "blocking_nan_one_rank_every5"):
        distributed = RankAgreement(timeout=5.0, overlap=not scenario.startswith("blocking"))
    if scenario == "blocking_nan_one_rank_every5":
        cadence = Cadence(grad_every=5)
    if scenario.startswith("ov_"):
        distributed = RankAgreement(overlap=True)
    result: dict[str, Any] = {"rank": rank, "stopped_at": None, "reason": ""}
    step = -1
    host_available = _placement.host_available
    if "unheld_" in scenario and rank == 1:
        _placement.host_available = lambda: 16  # no room for a snapshot on this rank
    try:
        async with Session(
            model,
            opt,
            log_dir=out / f"logs-{scenario}-{policy}",
            alerts=False,
            system_interval=None,
            sinks=[recorder],
            cadence=cadence,
            policy=policy,
            distributed=distributed,
        ) as session:
            assert session.recovery is not None
            session.recovery.register(_stop_on_leak, on=MemoryLeakSuspected)
            retry = Retrying(session.recovery, state=CallState(batch_size=32))
            steps = STEPS - (JOIN.get(base, 0) if rank == 1 else 0)
            joinables: list[Any] = [model, session.agreement]
            if base == "join_agreement_first":
                joinables.reverse()
            join: Any = contextlib.nullcontext()
            if base == "join_model_only":
                join = model.join()  # type: ignore[operator]
            elif base in JOIN:
                join = Join(joinables)
            join.__enter__()
            for step in range(steps):
                if rank == 1 and step in NAN_PARAM_AT.get(base, ()):
                    with torch.no_grad():  # the last layer's weight, before the forward
                        [p for p in net.parameters() if p.dim() == 2][-1][0, 0] = math.nan
                if base == "level_off_inf_grad" and rank == 0 and step == 5:
                    session.set_level("off")  # this rank's probe no longer checks anything
                if base == "stop_early_one_rank" and rank == 1 and step == 15:
                    session.publish(_leak(step))  # before backward: rides in the launch
                # The retried block holds no collective (DDP's backward all-reduces): an
                # attempt that fails on one rank is agreed before any rank goes on.
                if base in JOIN:  # a retried call's agreement is not shadowed by a joined rank
                    x = torch.randn(32, 8, generator=gen)
                    opt.zero_grad(set_to_none=True)
                    loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
                else:
                    async for attempt in retry:
                        async with attempt:
                            size = attempt.state.batch_size or 32
                            x = torch.randn(size, 8, generator=gen)
                            y = x.sum(dim=1, keepdim=True)
                            opt.zero_grad(set_to_none=True)
                            if base == "oom_one_rank" and rank == 1 and step >= 5 and size > 8:
                                msg = "CUDA out of memory. Tried to allocate 2.00 GiB"
                                raise torch.OutOfMemoryError(msg)
                            if base == "no_sync_accumulate":  # a micro-batch, not all-reduced
                                with model.no_sync():  # type: ignore[operator]
                                    torch.autograd.backward(nn.functional.mse_loss(model(x), y))
                            if base in TWO_OUTPUTS:
                                features, pred = model(x)
                                loss = nn.functional.mse_loss(pred, y)
                                if base == "aux_some_ranks" and rank == 0:  # rank 0's aux labels
                                    loss = loss + 0.01 * features.pow(2).mean()
                            else:
                                loss = nn.functional.mse_loss(model(x), y)
                loss = _fault(base, rank, step, loss, model)
                bad_grad = base == "level_off_inf_grad" and rank == 1 and step == 21
                first = next(net.parameters())
                hook = first.register_hook(_inf_hook) if bad_grad else None  # type: ignore[no-untyped-call]
                loss.backward()
                if hook is not None:
                    hook.remove()
                if base == "inf_grad_after_one_rank" and rank == 1 and step == 21:
                    with torch.no_grad():  # after DDP's all-reduce: this rank's gradient only
                        assert first.grad is not None
                        first.grad[0, 0] = math.inf
                if scenario.startswith("crash_one_rank") and rank == 1 and step == 10:
                    os._exit(3)  # after DDP's all-reduce: the others meet it at the agreement
                if base == "stop_late_one_rank" and rank == 1 and step == 15:
                    session.publish(_leak(step))  # after the launch: agreed one step later
                told = None  # the samples: rank 0 calls step 20 a one-sample batch, rank 1 not
                if base == "explode_samples_one_rank":
                    told = 1 if rank == 0 and step == 20 else 320
                verdict = await session.check_step(step, loss=loss, samples=told)
                if step == 0 and scenario == "fsdp2":
                    grads = [p.grad for p in net.parameters() if p.grad is not None]
                    total = torch.nn.utils.get_total_norm(grads)
                    full = getattr(total, "full_tensor", None)
                    result["reference_norm"] = float(full() if callable(full) else total)
                    result["probe_norm"] = verdict.grad_norm
                if verdict.should_step:
                    opt.step()
                await session.step_completed(step, loss=verdict.loss)
            join.__exit__(None, None, None)
    except TrainingStopped as exc:
        result["stopped_at"] = step
        result["reason"] = str(exc)
    except RuntimeError as exc:  # a crashed peer met in DDP's own all-reduce (not ours)
        if scenario not in ("crash_one_rank_overlapped", "join_model_only", "join_agreement_first"):
            raise
        result["stopped_at"] = step
        result["reason"] = f"{type(exc).__name__}: {exc}"
    finally:
        _placement.host_available = host_available
    full = [getattr(p, "full_tensor", None) for p in net.parameters()]
    tensors = [f() if callable(f) else p for f, p in zip(full, net.parameters(), strict=True)]
    params = torch.cat([t.detach().reshape(-1) for t in tensors])
    result["finite"] = bool(torch.isfinite(params).all())
    result["params"] = hashlib.sha256(params.numpy().tobytes()).hexdigest()
    result["skipped"] = sorted(
        {e.step for e in recorder.of_type(StepSkipped) if e.step is not None}
    )
    result["applied"] = [
        [e.step, e.action.value, e.outcome] for e in recorder.of_type(RecoveryApplied)
    ]
    result["exploded"] = sorted(
        {e.step for e in recorder.of_type(GradientExploded) if e.step is not None}
    )
    result["lr"] = opt.param_groups[0]["lr"]
    result["spikes"] = sorted(
        [e.step, e.rule] for e in recorder.of_type(LossSpiked) if e.step is not None
    )
    result["batch_size"] = retry.state.batch_size if step >= 0 else None
    result["steps_completed"] = session.steps_completed
    result["restores"] = sum(a[1] == "restore_state" for a in result["applied"])
    agreement = session.agreement
    result["overlapped"] = agreement.overlapped if isinstance(agreement, RankAgreement) else 0
    launches = agreement.launches if isinstance(agreement, RankAgreement) else ()
    result["launches"] = [len(launches), all(0.0 <= s < 60.0 for s in launches)]
    return result


def main() -> None:
    scenarios, rank, world, init, out_dir = sys.argv[1:6]
    r, w = int(rank), int(world)
    dist.init_process_group(
        "gloo", init_method=f"file://{init}", rank=r, world_size=w, timeout=timedelta(seconds=30)
    )
    out = Path(out_dir)
    for item in scenarios.split(","):
        name, _, policy = item.partition(":")
        policy = policy or "safe"
        result = anyio.run(_train, name, r, w, policy, out)
        (out / f"{name}-{policy}.rank{r}.json").write_text(json.dumps(result))
    if "crash_one_rank" not in scenarios:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
