"""The agreement's vector: one flag per action, factors as maxima of negatives, one loss per rank.

Every slot is reduced with MAX, so one ``all_reduce`` agrees on everything: "skip" on one rank
and "clip" on another are two flags and both survive (never a bit mask reduced with MAX); the
smallest clip norm and LR factor win (their negatives are maximized); each rank writes its loss
in its own slot (the others hold ``-inf``), so the maximum holds every rank's loss and each rank
averages them alike. Slots for the overlapped agreement: whether some rank's loss gradient was
non-finite, and what each rank applied at the previous safe point (as ``x`` and ``-x``, so the
maximum gives both the largest and the smallest: the ranks applied the same iff they match).
Whether some rank holds no good state to restore (its snapshot did not fit in memory, or none
was captured yet) rides along, so that a restore is applied on every rank or on none.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import IntEnum
from functools import cache
from typing import Final

import numpy as np
import numpy.typing as npt
import torch

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
    "NOTHING_APPLIED",
    "SIZE",
    "Slot",
    "decode",
    "digest_mismatch",
    "encode",
    "mean_loss",
    "steps_apart",
    "vector",
)


class Slot(IntEnum):
    """The slots of the agreement vector (all reduced with MAX); the losses follow them."""

    ANY = 0  # some rank has a decision
    NOTED = 1  # some rank had an incident
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
    LOSS_GRAD_BAD = 14  # overlapped: some rank's loss gradient was non-finite
    APPLIED_SKIP = 15  # overlapped: what each rank applied at the previous safe point ...
    NEG_APPLIED_SKIP = 16  # ... as x and -x (MAX of both: largest and smallest)
    APPLIED_CLIP = 17
    NEG_APPLIED_CLIP = 18
    APPLIED_NOTED = 19
    NEG_APPLIED_NOTED = 20
    STEP = 21  # blocking: the step each rank passed to check_step ...
    NEG_STEP = 22  # ... as x and -x: the ranks passed the same iff both maxima match
    UNHELD = 23  # some rank holds no good state to restore


SIZE: Final = len(Slot)
"""Slots before the per-rank losses."""

NOTHING_APPLIED: Final = (False, False, False)
"""What a safe point that applied nothing reports in the next agreement."""
_DIGEST: Final = (
    (Slot.APPLIED_SKIP, Slot.NEG_APPLIED_SKIP, "skipped"),
    (Slot.APPLIED_CLIP, Slot.NEG_APPLIED_CLIP, "clipped"),
    (Slot.APPLIED_NOTED, Slot.NEG_APPLIED_NOTED, "had an incident"),
)


def vector(world: int) -> torch.Tensor:
    """A fresh agreement vector for *world* ranks (filled by :func:`encode`)."""
    return torch.empty(SIZE + world, dtype=torch.float64)


def encode(
    v: torch.Tensor,
    decisions: Sequence[DecidedAction],
    noted: bool,
    rank: int,
    loss: float | None = None,
    *,
    loss_grad_bad: bool = False,
    applied: tuple[bool, bool, bool] = NOTHING_APPLIED,
    step: int | None = None,
    held: bool = True,
) -> torch.Tensor:
    """Write this rank's part into *v* (in place, returned): its decisions, flags and loss.

    A non-finite or missing *loss* leaves the rank's loss slot at ``-inf`` (not averaged); a
    missing *step* (an overlapped launch, before the step is known) leaves the step slots at
    ``-inf`` (not compared); *held*: whether this rank holds a good state to restore.
    A rank with nothing to say (no decision, no incident, no flag: a healthy step) copies a
    cached vector and writes its loss, without building the head slot by slot.
    """
    if not decisions and not noted and not loss_grad_bad and applied == NOTHING_APPLIED:
        slots = v.numpy()  # the same memory: numpy writes are cheaper than torch indexing
        slots[:] = _quiet(len(slots))
        if loss is not None and math.isfinite(loss):
            slots[SIZE + rank] = loss
        if step is not None:
            slots[Slot.STEP] = step
            slots[Slot.NEG_STEP] = -step
        if not held:
            slots[Slot.UNHELD] = 1.0
        return v
    head = _head(decisions, noted, rank, loss_grad_bad, applied)
    head[Slot.UNHELD] = float(not held)
    if step is not None:
        head[Slot.STEP], head[Slot.NEG_STEP] = float(step), -float(step)
    losses = [-math.inf] * (len(v) - SIZE)
    if loss is not None and math.isfinite(loss):
        losses[rank] = float(loss)
    v.copy_(torch.tensor(head + losses, dtype=torch.float64))
    return v


def _head(
    decisions: Sequence[DecidedAction],
    noted: bool,
    rank: int,
    loss_grad_bad: bool,
    applied: tuple[bool, bool, bool],
) -> list[float]:
    """The slots before the losses: one flag per action, the factors, the flags, the digest."""
    head = [0.0] * SIZE
    head[Slot.NEG_MAX_NORM] = -math.inf
    head[Slot.STEP] = head[Slot.NEG_STEP] = -math.inf
    head[Slot.NOTED] = float(noted)
    head[Slot.LOSS_GRAD_BAD] = float(loss_grad_bad)
    for (pos, neg, _), flag in zip(_DIGEST, applied, strict=True):
        head[pos] = float(flag)
        head[neg] = -float(flag)
    lr_factor = 1.0
    for d in decisions:
        head[Slot.ANY] = 1.0
        action = d.action
        if isinstance(action, SkipStep):
            head[Slot.SKIP] = 1.0
            head[Slot.SKIP_BATCHES] = max(head[Slot.SKIP_BATCHES], float(action.batches))
        elif isinstance(action, RestoreState):
            head[Slot.RESTORE] = 1.0
            head[Slot.RESTORE_REQUIRED] = max(head[Slot.RESTORE_REQUIRED], float(action.required))
        elif isinstance(action, ClipGradients):
            head[Slot.CLIP] = 1.0
            head[Slot.NEG_MAX_NORM] = max(head[Slot.NEG_MAX_NORM], -action.max_norm)
            head[Slot.TOTAL_NORM] = max(head[Slot.TOTAL_NORM], action.total_norm)
        elif isinstance(action, ScaleLR):
            lr_factor *= action.factor
            head[Slot.LR_STEPS] = max(head[Slot.LR_STEPS], float(action.steps or 0))
        elif isinstance(action, FreeMemory):
            head[Slot.FREE_MEMORY] = 1.0
        elif isinstance(action, Stop):
            head[Slot.STOP] = 1.0
            head[Slot.STOP_RANK] = float(rank + 1)
    head[Slot.NEG_LR_FACTOR] = -lr_factor
    return head


@cache
def _quiet(length: int) -> npt.NDArray[np.float64]:
    """The vector of a rank with nothing to say and no loss (*length* slots in all)."""
    head = _head((), False, 0, False, NOTHING_APPLIED)
    quiet = np.array(head + [-math.inf] * (length - SIZE), dtype=np.float64)
    quiet.flags.writeable = False
    return quiet


def mean_loss(agreed: Sequence[float]) -> float | None:
    """The mean of the ranks' finite losses in an agreed vector (``None`` when none gave one)."""
    losses = [x for x in agreed[SIZE:] if math.isfinite(x)]
    return sum(losses) / len(losses) if losses else None


def digest_mismatch(agreed: Sequence[float]) -> str | None:
    """What the ranks applied differently at the previous safe point (``None``: the same)."""
    differ = [what for pos, neg, what in _DIGEST if agreed[pos] != -agreed[neg]]
    return ", ".join(differ) if differ else None


def steps_apart(agreed: Sequence[float]) -> tuple[int, int] | None:
    """The smallest and largest step the ranks passed, when they differ (``None``: the same,
    or no rank said its step)."""
    largest, smallest = agreed[Slot.STEP], -agreed[Slot.NEG_STEP]
    if not math.isfinite(largest) or largest == smallest:
        return None
    return int(smallest), int(largest)


def decode(
    agreed: Sequence[float], local: Sequence[DecidedAction], step: int, world: int
) -> tuple[DecidedAction, ...]:
    """The decisions every rank applies, from an agreed vector (this rank's reasons kept)."""
    bad_grad = bool(agreed[Slot.LOSS_GRAD_BAD])
    if not agreed[Slot.ANY] and not bad_grad:
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
    if agreed[Slot.STOP]:
        stopper = int(agreed[Slot.STOP_RANK]) - 1
        out.append(make(Stop(), f"stop (rank {stopper})"))
    unheld = False
    if agreed[Slot.RESTORE]:
        required = bool(agreed[Slot.RESTORE_REQUIRED])
        if not agreed[Slot.UNHELD]:
            out.append(make(RestoreState(required=required), "restore the last good state"))
        elif required and not agreed[Slot.STOP]:
            # restored on some ranks only, the replicas would differ: every rank stops instead
            out.insert(0, _agreed(Stop(), world, step, _UNHELD_STOP))
        else:
            unheld = True  # a precaution: no rank restores, every rank skips the step
    factor = -agreed[Slot.NEG_LR_FACTOR]
    if factor != 1.0:
        steps = int(agreed[Slot.LR_STEPS]) or None
        out.append(make(ScaleLR(factor=factor, steps=steps), f"scale the LR by {factor:g}"))
    if agreed[Slot.FREE_MEMORY]:
        out.append(make(FreeMemory(), "free memory"))
    if agreed[Slot.CLIP]:
        clip = ClipGradients(
            max_norm=-agreed[Slot.NEG_MAX_NORM], total_norm=agreed[Slot.TOTAL_NORM]
        )
        out.append(make(clip, "clip the gradients"))
    if agreed[Slot.SKIP]:
        out.append(make(SkipStep(batches=int(agreed[Slot.SKIP_BATCHES])), "skip the step"))
    elif bad_grad:
        out.append(_agreed(SkipStep(), world, step, _BAD_GRAD))
    elif unheld:
        out.append(_agreed(SkipStep(), world, step, _UNHELD_SKIP))
    return tuple(out)


_BAD_GRAD: Final = "a rank's loss gradient is non-finite (DDP spreads it to every rank's gradients)"
_UNHELD_STOP: Final = (
    "a restore is required and some rank holds no good state to restore (its snapshot did not "
    "fit in memory, or none was captured yet): restored on the others only, the replicas would "
    "differ, so every rank stops"
)
_UNHELD_SKIP: Final = (
    "a precautionary restore was decided and some rank holds no good state: no rank restores "
    "(the replicas stay equal), every rank skips the step"
)


def _agreed(action: Action, world: int, step: int, why: str) -> DecidedAction:
    """A decision no rank took itself: the agreement's own."""
    return DecidedAction(
        decision=Decision(action=action, reason=f"agreed across {world} ranks: {why}"),
        strategy="agreed",
        trigger_kind="agreement",
        trigger_seq=-1,
        step=step,
    )
