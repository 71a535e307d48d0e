"""Scaling the learning rate so that it sticks, with or without an LR scheduler.

Multiplying ``group["lr"]`` is enough for an optimizer alone and for the *chainable* schedulers
(StepLR, ExponentialLR, MultiStepLR, ReduceLROnPlateau...), which update the current LR in place.
Schedulers that recompute the LR from stored base values — LambdaLR, MultiplicativeLR's closed
form, CosineAnnealingLR, OneCycleLR, CyclicLR, PolynomialLR — would overwrite it at their next
``step()``. So the base values are scaled too: the scheduler's ``base_lrs`` (and CyclicLR's
``max_lrs``), and the param-group keys ``initial_lr``, ``max_lr`` and ``min_lr`` (OneCycleLR
keeps its schedule there). SequentialLR and ChainedScheduler are followed into their children.

The floors a schedule approaches are scaled with it: CosineAnnealingLR's and
CosineAnnealingWarmRestarts' ``eta_min``, ReduceLROnPlateau's ``min_lrs``. Otherwise the
schedule is no longer proportional: cosine's recursive form ``eta_min + r * (lr - eta_min)``
pulls a halved LR back toward the unscaled floor (and undoing the change leaves the LR above
its schedule for good), and ReduceLROnPlateau's ``max(lr * factor, min_lr)`` raises a halved LR
that sits at the floor straight back to it. With the floors scaled, a scheduler keeps running
exactly *factor* times the schedule it would have run, and undoing the change is exact.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Final

import torch

from .._validate import positive_number

__all__ = (
    "GROUP_LR_KEYS",
    "SCHEDULER_LR_ATTRIBUTES",
    "SCHEDULER_LR_FLOORS",
    "lr_schedulers",
    "scale_learning_rate",
)

GROUP_LR_KEYS: Final = ("initial_lr", "max_lr", "min_lr")
"""Param-group keys holding a learning rate a scheduler recomputes from (scaled with ``lr``)."""

SCHEDULER_LR_ATTRIBUTES: Final = ("base_lrs", "max_lrs", "min_lrs")
"""Scheduler attributes holding one learning rate per param group (scaled with ``lr``)."""

SCHEDULER_LR_FLOORS: Final = ("eta_min", "default_min_lr")
"""Scheduler attributes holding one learning rate for every group (scaled with ``lr``)."""


def lr_schedulers(scheduler: Any) -> tuple[Any, ...]:
    """*scheduler* (one LR scheduler, a sequence of them, or ``None``) as a tuple.

    Raises:
        TypeError: if an item has no ``step()`` method (the message names it).
    """
    if scheduler is None:
        return ()
    items = tuple(scheduler) if isinstance(scheduler, list | tuple) else (scheduler,)
    for item in items:
        if not callable(getattr(item, "step", None)):
            msg = f"LR schedulers must have a step() method, got {item!r}"
            raise TypeError(msg)
    return items


def _schedulers(schedulers: Iterable[Any]) -> list[Any]:
    out: list[Any] = []
    for s in schedulers:
        out.append(s)
        children = getattr(s, "_schedulers", None)
        if isinstance(children, (list, tuple)):
            out.extend(_schedulers(children))
    return out


def scale_learning_rate(
    optimizer: torch.optim.Optimizer,
    factor: float,
    schedulers: Sequence[Any] = (),
    *,
    groups: Sequence[int] | None = None,
) -> str:
    """Multiply every param group's LR by *factor*, and the base LRs *schedulers* recompute from.

    *factor* is checked as :class:`~eventbus_debug.events.ScaleLR` checks it: a zero,
    negative, NaN or infinite factor would write a rate no optimizer recovers from.

    *groups* (indices into ``optimizer.param_groups``) limits the change to those groups and
    to their entries of the schedulers' per-group lists (the shared floors, ``eta_min``, are
    scaled all the same); ``None``: every group. Undoing a temporary change uses it, so a group
    added since (``add_param_group``) is left alone.

    Returns:
        What changed, in words (``"lr x0.5: 0.1 -> 0.05 in 1 param group(s), 1 scheduler"``).

    Raises:
        TypeError: if *factor* is not a number.
        ValueError: if *factor* is not a finite number > 0, or *groups* names a group the
            optimizer does not have (nothing is changed).
    """
    positive_number("factor", factor)
    everything = groups is None
    count = len(optimizer.param_groups)
    chosen = range(count) if groups is None else sorted(set(groups))
    if any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < count for i in chosen):
        msg = f"groups must be indices of the optimizer's {count} param groups, got {groups!r}"
        raise ValueError(msg)
    before = [float(g["lr"]) for g in optimizer.param_groups]
    for i in chosen:
        group = optimizer.param_groups[i]
        group["lr"] = group["lr"] * factor
        for key in GROUP_LR_KEYS:
            value = group.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                group[key] = value * factor
    scaled = 0
    for scheduler in _schedulers(schedulers):
        touched = False
        for attr in SCHEDULER_LR_ATTRIBUTES:
            values = getattr(scheduler, attr, None)
            if isinstance(values, list) and all(isinstance(v, (int, float)) for v in values):
                setattr(
                    scheduler,
                    attr,
                    [v * factor if everything or j in chosen else v for j, v in enumerate(values)],
                )
                touched = True
        for attr in SCHEDULER_LR_FLOORS:
            value = getattr(scheduler, attr, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value:
                setattr(scheduler, attr, value * factor)
        scaled += touched
    after = [float(g["lr"]) for g in optimizer.param_groups]
    detail = f"lr x{factor:g}: {_fmt(before)} -> {_fmt(after)} in {len(chosen)} param group(s)"
    if not everything and len(chosen) < len(optimizer.param_groups):
        detail += f" of {len(optimizer.param_groups)}"
    if scaled:
        detail += f", base LRs of {scaled} scheduler(s)"
    return detail


def _fmt(values: Sequence[float]) -> str:
    shown = sorted(set(values))
    if len(shown) == 1:
        return f"{shown[0]:.4g}"
    return "[" + ", ".join(f"{v:.4g}" for v in values) + "]"
