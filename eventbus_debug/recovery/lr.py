"""Scaling the learning rate so that it sticks, with or without an LR scheduler.

Multiplying ``group["lr"]`` is enough for an optimizer alone and for the *chainable* schedulers
(StepLR, ExponentialLR, MultiStepLR, ReduceLROnPlateau...), which update the current LR in place.
Schedulers that recompute the LR from stored base values — LambdaLR, MultiplicativeLR's closed
form, CosineAnnealingLR, OneCycleLR, CyclicLR, PolynomialLR — would overwrite it at their next
``step()``. So the base values are scaled too: the scheduler's ``base_lrs`` (and CyclicLR's
``max_lrs``), and the param-group keys ``initial_lr``, ``max_lr`` and ``min_lr`` (OneCycleLR
keeps its schedule there). SequentialLR and ChainedScheduler are followed into their children.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Final

import torch

from .._validate import positive_number

__all__ = ("GROUP_LR_KEYS", "SCHEDULER_LR_ATTRIBUTES", "lr_schedulers", "scale_learning_rate")

GROUP_LR_KEYS: Final = ("initial_lr", "max_lr", "min_lr")
"""Param-group keys holding a learning rate a scheduler recomputes from (scaled with ``lr``)."""

SCHEDULER_LR_ATTRIBUTES: Final = ("base_lrs", "max_lrs")
"""Scheduler attributes holding one learning rate per param group (scaled with ``lr``)."""


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
    optimizer: torch.optim.Optimizer, factor: float, schedulers: Sequence[Any] = ()
) -> str:
    """Multiply every param group's LR by *factor*, and the base LRs *schedulers* recompute from.

    *factor* is checked as :class:`~eventbus_debug.events.ScaleLR` checks it: a zero,
    negative, NaN or infinite factor would write a rate no optimizer recovers from.

    Returns:
        What changed, in words (``"lr x0.5: 0.1 -> 0.05 in 1 param group(s), 1 scheduler"``).

    Raises:
        TypeError: if *factor* is not a number.
        ValueError: if *factor* is not a finite number > 0 (nothing is changed).
    """
    positive_number("factor", factor)
    before = [float(g["lr"]) for g in optimizer.param_groups]
    for group in optimizer.param_groups:
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
                setattr(scheduler, attr, [v * factor for v in values])
                touched = True
        scaled += touched
    after = [float(g["lr"]) for g in optimizer.param_groups]
    detail = (
        f"lr x{factor:g}: {_fmt(before)} -> {_fmt(after)} "
        f"in {len(optimizer.param_groups)} param group(s)"
    )
    if scaled:
        detail += f", base LRs of {scaled} scheduler(s)"
    return detail


def _fmt(values: Sequence[float]) -> str:
    shown = sorted(set(values))
    if len(shown) == 1:
        return f"{shown[0]:.4g}"
    return "[" + ", ".join(f"{v:.4g}" for v in values) + "]"
