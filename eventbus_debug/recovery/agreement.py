"""One decision per step for the whole process group, on torch.distributed.

Every rank calls :meth:`RankAgreement.agree` at every safe point, whatever its level, cadence or
incidents, before any local state changes. The ranks' pending decisions are encoded as one
small float64 vector — one flag per action, factors as maxima of negatives (a MIN), and the
rank's loss — and exchanged with a single ``all_gather`` on a dedicated gloo group whose timeout
is far below torch's 30-minute default; every rank takes the maximum of the flags and the mean of
the losses. Every rank then applies the same decisions: skip, restore, clip (the smallest max
norm of any rank), LR factor (the smallest), free memory, stop; and judges loss spikes on the
same mean loss, so spike decisions follow at the next safe point on every rank alike. Whether
any rank had an incident is agreed too, so "good steps" (consecutive counts, snapshots,
temporary LR changes) advance in lockstep and a restore lands every rank on the state of the
same step.

Never a bit mask reduced with MAX: "skip" on one rank and "clip" on another are two flags, and
both survive.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from enum import IntEnum
from typing import Any, Final, NoReturn, Protocol, final, runtime_checkable

import torch
import torch.distributed as dist

from .._validate import positive_seconds
from ..diagnostics import get_logger
from ..exceptions import TrainingStopped
from .actions import (
    Action,
    ClipGradients,
    DecidedAction,
    Decision,
    FreeMemory,
    RestoreState,
    ScaleLR,
    SkipStep,
    Stop,
)

__all__ = (
    "AGREE_TIMEOUT",
    "AgreedStep",
    "Agreement",
    "CallAgreed",
    "RankAgreement",
    "agreement_for",
    "distributed_active",
)

_log = get_logger(__name__)

AGREE_TIMEOUT: Final = 60.0
"""Seconds a rank waits for the others at an agreement (torch's default is 30 minutes)."""


class _F(IntEnum):
    """The slots of the agreement vector (all reduced with MAX)."""

    ANY = 0  # some rank has a decision
    NOTED = 1  # some rank had an incident this step
    SKIP = 2
    SKIP_BATCHES = 3
    RESTORE = 4
    RESTORE_REQUIRED = 5
    CLIP = 6
    NEG_MAX_NORM = 7  # -max_norm: MAX gives the smallest max norm
    TOTAL_NORM = 8
    NEG_LR_FACTOR = 9  # -factor: MAX gives the smallest factor
    LR_STEPS = 10
    FREE_MEMORY = 11
    STOP = 12
    STOP_RANK = 13  # rank + 1 of the highest rank that decided to stop
    LOSS = 14  # this rank's loss (NaN: none): averaged, not maximized


_SIZE: Final = len(_F)


@dataclass(frozen=True, slots=True)
class AgreedStep:
    """What the group agreed at one safe point.

    Attributes:
        decisions: the decisions every rank applies (the same on every rank).
        noted: True when some rank had an incident this step (no rank counts it as good).
        loss: the step's loss averaged over the ranks (``None`` when no rank gave one); the
            probe judges loss spikes on it.
    """

    decisions: tuple[DecidedAction, ...]
    noted: bool
    loss: float | None = None


@dataclass(frozen=True, slots=True)
class CallAgreed:
    """What the group agreed after one attempt of a retried call.

    Attributes:
        failed: some rank's attempt failed and will be retried: every rank re-runs.
        fatal: some rank's attempt failed for good (no strategy, or exhausted): every rank
            stops.
        batch_size: the smallest batch size any rank will use next (``None``: none set).
    """

    failed: bool
    fatal: bool
    batch_size: int | None


@runtime_checkable
class Agreement(Protocol):
    """Turns this rank's pending decisions into the decisions every rank applies."""

    def agree(
        self,
        step: int,
        decisions: Sequence[DecidedAction],
        noted: bool,
        /,
        *,
        loss: float | None = None,
    ) -> AgreedStep:
        """Agree with the other ranks; called at every safe point on every rank."""
        ...


def distributed_active() -> bool:
    """True inside an initialized torch.distributed process group of more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _encode(
    decisions: Sequence[DecidedAction], noted: bool, rank: int, loss: float | None = None
) -> torch.Tensor:
    v = torch.zeros(_SIZE, dtype=torch.float64)
    v[_F.NEG_MAX_NORM] = -math.inf
    v[_F.NEG_LR_FACTOR] = -1.0
    v[_F.NOTED] = float(noted)
    lr_factor = 1.0
    for d in decisions:
        v[_F.ANY] = 1.0
        action = d.action
        if isinstance(action, SkipStep):
            v[_F.SKIP] = 1.0
            v[_F.SKIP_BATCHES] = max(float(v[_F.SKIP_BATCHES]), float(action.batches))
        elif isinstance(action, RestoreState):
            v[_F.RESTORE] = 1.0
            v[_F.RESTORE_REQUIRED] = max(float(v[_F.RESTORE_REQUIRED]), float(action.required))
        elif isinstance(action, ClipGradients):
            v[_F.CLIP] = 1.0
            v[_F.NEG_MAX_NORM] = max(float(v[_F.NEG_MAX_NORM]), -action.max_norm)
            v[_F.TOTAL_NORM] = max(float(v[_F.TOTAL_NORM]), action.total_norm)
        elif isinstance(action, ScaleLR):
            lr_factor *= action.factor
            v[_F.LR_STEPS] = max(float(v[_F.LR_STEPS]), float(action.steps or 0))
        elif isinstance(action, FreeMemory):
            v[_F.FREE_MEMORY] = 1.0
        elif isinstance(action, Stop):
            v[_F.STOP] = 1.0
            v[_F.STOP_RANK] = float(rank + 1)
    v[_F.NEG_LR_FACTOR] = -lr_factor
    v[_F.LOSS] = math.nan if loss is None else float(loss)
    return v


def _decode(
    v: list[float], local: Sequence[DecidedAction], step: int, world: int
) -> tuple[DecidedAction, ...]:
    if not v[_F.ANY]:
        return ()
    mine = {d.kind: d for d in local}

    def make(action: Action, what: str) -> DecidedAction:
        own = mine.get(action.kind)
        reason = (
            own.reason
            if own is not None
            else f"agreed across {world} ranks: another rank decided to {what}"
        )
        return DecidedAction(
            decision=Decision(action=action, reason=reason),
            strategy=own.strategy if own is not None else "agreed",
            trigger_kind=own.trigger_kind if own is not None else "agreement",
            trigger_seq=own.trigger_seq if own is not None else -1,
            step=step,
        )

    out: list[DecidedAction] = []
    if v[_F.STOP]:
        stopper = int(v[_F.STOP_RANK]) - 1
        out.append(make(Stop(), f"stop (rank {stopper})"))
    if v[_F.RESTORE]:
        required = bool(v[_F.RESTORE_REQUIRED])
        out.append(make(RestoreState(required=required), "restore the last good state"))
    factor = -v[_F.NEG_LR_FACTOR]
    if factor != 1.0:
        steps = int(v[_F.LR_STEPS]) or None
        out.append(make(ScaleLR(factor=factor, steps=steps), f"scale the LR by {factor:g}"))
    if v[_F.FREE_MEMORY]:
        out.append(make(FreeMemory(), "free memory"))
    if v[_F.CLIP]:
        clip = ClipGradients(max_norm=-v[_F.NEG_MAX_NORM], total_norm=v[_F.TOTAL_NORM])
        out.append(make(clip, "clip the gradients"))
    if v[_F.SKIP]:
        out.append(make(SkipStep(batches=int(v[_F.SKIP_BATCHES])), "skip the step"))
    return tuple(out)


@final
class RankAgreement:
    """The :class:`Agreement` of a torch.distributed process group (one collective per step).

    Built by the session when it runs inside an initialized process group (opt out with
    ``Session(..., distributed=False)``). It must be constructed on every rank (it creates a gloo
    group collectively) and called at every safe point on every rank.

    Args:
        timeout: seconds a rank waits for the others before it stops, naming its own decision.
        group: the ranks that agree (``None``: a new gloo group over the default group's ranks).

    Raises:
        RuntimeError: if torch.distributed is not initialized.
        ValueError: if *timeout* is not a positive number.
    """

    def __init__(self, *, timeout: float = AGREE_TIMEOUT, group: Any = None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            msg = "RankAgreement needs an initialized torch.distributed process group"
            raise RuntimeError(msg)
        self.timeout = positive_seconds("timeout", timeout)
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.group = (
            group
            if group is not None
            else dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout))
        )
        self.agreements = 0
        """Agreements run (one per safe point)."""
        self.disagreements = 0
        """Agreements in which the ranks' pending decisions differed."""

    def agree_call(self, *, failed: bool, fatal: bool, batch_size: int | None) -> CallAgreed:
        """Agree on the outcome of one attempt of a retried call (one small collective).

        Every rank calls it after every attempt of a :class:`~eventbus_debug.recovery.Retrying`
        block (the retry does, when its engine has an agreement), so an OOM on one rank makes
        every rank re-run with the same, smallest batch size and step counts stay equal.

        Raises:
            TrainingStopped: if the other ranks do not answer within :attr:`timeout`.
        """
        v = torch.tensor(
            [float(failed), float(fatal), -float(batch_size) if batch_size else -math.inf],
            dtype=torch.float64,
        )
        self._reduce(v, dist.ReduceOp.MAX, f"a retried call (this rank failed: {failed})")
        any_failed, any_fatal, neg_batch = v.tolist()
        return CallAgreed(
            failed=bool(any_failed),
            fatal=bool(any_fatal),
            batch_size=int(-neg_batch) if math.isfinite(neg_batch) else None,
        )

    def agree(
        self,
        step: int,
        decisions: Sequence[DecidedAction],
        noted: bool,
        /,
        *,
        loss: float | None = None,
    ) -> AgreedStep:
        """Agree on *step*'s decisions, and average its loss, with every rank: one collective.

        Raises:
            TrainingStopped: if the other ranks do not answer within :attr:`timeout` (this
                rank's own pending decisions are named).
        """
        mine = _encode(decisions, noted, self.rank, loss)
        what = ", ".join(d.kind.value for d in decisions) or "nothing"
        everyone = [torch.empty_like(mine) for _ in range(self.world)]
        try:
            dist.all_gather(everyone, mine, group=self.group)
        except RuntimeError as exc:  # gloo raises on a timeout or a peer that left
            self._failed(f"step {step} (this rank decided: {what})", exc)
        self.agreements += 1
        stacked = torch.stack(everyone)
        losses = stacked[:, _F.LOSS].clone()
        stacked[:, _F.LOSS] = 0.0
        merged = stacked.max(dim=0).values
        agreed = merged.tolist()
        mean = None if bool(torch.isnan(losses).all()) else float(losses.nanmean())
        mine[_F.LOSS] = 0.0
        if not torch.equal(mine, merged):
            self.disagreements += 1
            _log.info(
                "ranks_agreed", step=step, rank=self.rank, local=what, agreed_any=agreed[_F.ANY]
            )
        return AgreedStep(
            decisions=_decode(agreed, decisions, step, self.world),
            noted=bool(agreed[_F.NOTED]),
            loss=mean,
        )

    def _reduce(self, tensor: torch.Tensor, op: Any, what: str) -> None:
        try:
            dist.all_reduce(tensor, op=op, group=self.group)
        except RuntimeError as exc:  # gloo raises on a timeout or a peer that left
            self._failed(what, exc)

    def _failed(self, what: str, exc: RuntimeError) -> NoReturn:
        msg = (
            f"rank {self.rank} of {self.world} could not agree on {what} within "
            f"{self.timeout:g} s: another rank stopped, crashed or hangs ({exc})"
        )
        _log.error("agreement_failed", rank=self.rank, what=what)
        raise TrainingStopped(msg) from exc


def agreement_for(distributed: bool | Agreement | None, timeout: float) -> Agreement | None:
    """The agreement a session uses: ``None`` alone, a :class:`RankAgreement` in a group.

    Args:
        distributed: ``None`` (default): agree when a process group of more than one rank is
            initialized; ``False``: never; ``True``: always (raises outside a group); or an
            :class:`Agreement` to use as it is.
        timeout: the agreement timeout in seconds.

    Raises:
        RuntimeError: if *distributed* is True and no process group is initialized.
        TypeError: if *distributed* is neither a bool, ``None`` nor an :class:`Agreement`.
    """
    if distributed is None:
        return RankAgreement(timeout=timeout) if distributed_active() else None
    if distributed is False:
        return None
    if distributed is True:
        return RankAgreement(timeout=timeout)
    if isinstance(distributed, Agreement):
        return distributed
    msg = f"distributed must be None, a bool or an Agreement, got {distributed!r}"
    raise TypeError(msg)
