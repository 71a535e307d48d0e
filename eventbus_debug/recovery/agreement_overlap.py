"""The overlapped agreement's two halves: the launch during backward, the split at the safe point.

Under DDP the gradients are the same on every rank once ``backward()`` returns, so what the
probe finds in them (non-finite values, an explosion of the global norm) and what is judged on
the ranks' mean loss (spikes) is the same on every rank; what is rank-local is the loss and the
incidents published on one rank. The loss's own fault reaches the model through the gradient of
its output, which exists at the very start of ``backward()``: :class:`OutputGradLaunch` hooks the
first output of each forward of a :class:`~torch.nn.parallel.DistributedDataParallel` model and,
when its gradient arrives, launches the agreement asynchronously with whether that gradient is
finite and everything decided so far; the rest of ``backward()`` hides the collective.

What is decided after that launch (at the safe point) is split by :func:`split_late`: decisions
on incidents that are the same on every rank act at once where they must (a skip, a clip: about
this step's gradients) and the rest of every decision rides in the next agreement, which every
rank applies at the next safe point.

Opt-in (``RankAgreement(overlap=True)``): it holds only when the hooked output is used in the
loss on every rank or on none, every rank's probe checks the same steps, and no rank changes its
gradients after ``backward()``. The default agreement blocks at the safe point instead.
"""

from __future__ import annotations

import cmath
from collections.abc import Callable, Sequence
from typing import Any, Final, final

import torch
from torch import nn

from .actions import ClipGradients, DecidedAction, Decision, RestoreState, SkipStep, Stop

__all__ = (
    "GLOBAL_TRIGGERS",
    "SHARED_STRATEGY_TRIGGERS",
    "OutputGradLaunch",
    "finite",
    "split_late",
)

SHARED_STRATEGY_TRIGGERS: Final = frozenset(
    {"gradient_exploded", "gradient_vanished", "loss_spiked"}
)
"""Incident kinds that are the same on every rank under DDP (judged on the all-reduced
gradients or on the ranks' mean loss) and that are answered by strategies seeing nothing else:
their strategies' states stay equal on every rank, so their whole decisions act at once."""
GLOBAL_TRIGGERS: Final = SHARED_STRATEGY_TRIGGERS | {"non_finite_detected"}
"""Incident kinds that are the same on every rank under DDP. Non-finite values are answered by
strategies that also see the rank-local loss, so their consecutive counts may differ between
ranks: only the part about this step's gradients acts at once. A non-finite *loss* is local; it
counts as the same everywhere only when its gradient was non-finite too (then every rank skips
on the agreed flag)."""


def _first_grad_tensor(output: Any) -> torch.Tensor | None:
    """The first tensor of a forward's output that will receive a gradient (or None)."""
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    items: Any = output.values() if isinstance(output, dict) else output
    if isinstance(items, list | tuple) or isinstance(output, dict):
        for item in items:
            found = _first_grad_tensor(item)
            if found is not None:
                return found
    return None


def finite(tensor: torch.Tensor) -> bool:
    """Whether every element of *tensor* is finite, without a mask as large as *tensor*.

    Its sum is finite exactly when every element is, unless finite elements overflow the sum;
    only then (or when some element is not finite) is each element checked. A sum is a few
    times cheaper than ``isfinite(t).all()``: 3 us instead of 14 for a 128x10 output, 0.3 ms
    instead of 11 for a 4M-element one (CPU, one thread).
    """
    return cmath.isfinite(tensor.sum().item()) or bool(torch.isfinite(tensor).all())


@final
class OutputGradLaunch:
    """Calls ``launch(loss_grad_bad)`` when the gradient of a DDP model's output arrives.

    A forward hook on *model* hooks the first output tensor that requires a gradient; the
    hook runs at the start of that output's backward, with whether that gradient has a
    non-finite element (``False`` when it is ``None``) (see :func:`finite`: the output's gradient, not the parameters').
    Steps under DDP's ``no_sync()`` are not hooked (their gradients are this rank's own). The
    gradient itself is never changed.

    Raises:
        TypeError: if *launch* is not callable.
    """

    def __init__(self, model: nn.Module, launch: Callable[[bool], None]) -> None:
        if not callable(launch):
            msg = f"launch must be callable, got {launch!r}"
            raise TypeError(msg)
        self._launch = launch
        self._handle = model.register_forward_hook(self._forward)

    def remove(self) -> None:
        """Remove the hook (idempotent)."""
        self._handle.remove()

    def _forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled() or not getattr(module, "require_backward_grad_sync", True):
            return
        tensor = _first_grad_tensor(output)
        if tensor is not None:
            tensor.register_hook(self._arrived)  # type: ignore[no-untyped-call]

    def _arrived(self, grad: torch.Tensor | None) -> None:
        # None: the output is not in this rank's loss (DDP with find_unused_parameters or
        # static_graph still runs the hook): nothing non-finite reached the model through it.
        self._launch(grad is not None and not finite(grad))


def _with(d: DecidedAction, action: SkipStep) -> DecidedAction:
    return DecidedAction(
        decision=Decision(action=action, reason=d.reason),
        strategy=d.strategy,
        trigger_kind=d.trigger_kind,
        trigger_seq=d.trigger_seq,
        step=d.step,
    )


def split_late(
    late: Sequence[DecidedAction], *, local_loss_uncovered: bool
) -> tuple[tuple[DecidedAction, ...], tuple[DecidedAction, ...]]:
    """Split the decisions taken after the launch into (act now, ride in the next agreement).

    A decision on an incident of :data:`SHARED_STRATEGY_TRIGGERS` acts now, whole. Of a
    decision on a non-finite value found in the all-reduced gradients, the part about this
    step's gradients acts now: a skip, a clip; a restore or a stop skips now and acts at the
    next safe point. Learning-rate and memory decisions, and every decision on a
    rank-local incident, act at the next safe point on every rank, except what only made sense
    for this step: a clip is dropped, a skip of ``n`` batches skips the ``n - 1`` after.

    Args:
        late: the decisions taken at this safe point (after the launch).
        local_loss_uncovered: this rank's loss is non-finite while its gradient was finite (the
            other ranks do not know): its non-finite decisions are rank-local.
    """
    now: list[DecidedAction] = []
    later: list[DecidedAction] = []
    for d in late:
        action = d.action
        shared = d.trigger_kind in GLOBAL_TRIGGERS and not (
            local_loss_uncovered and d.trigger_kind == "non_finite_detected"
        )
        if d.trigger_kind in SHARED_STRATEGY_TRIGGERS:
            now.append(d)
        elif shared:
            if isinstance(action, SkipStep | ClipGradients):
                now.append(d)
            elif isinstance(action, RestoreState | Stop):
                now.append(_with(d, SkipStep()))
                later.append(d)
            else:
                later.append(d)
        elif isinstance(action, SkipStep):
            if action.batches > 1:
                later.append(_with(d, SkipStep(batches=action.batches - 1)))
        elif not isinstance(action, ClipGradients):
            later.append(d)
    return tuple(now), tuple(later)
