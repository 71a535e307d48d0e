"""Whether a held state still fits the model and optimizer a restore loads it into, and the
undo of a load that fails part-way (a restore is all or nothing)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from eventbus_debug.diagnostics import get_logger

from ..._tensors import copy_all

__all__ = ("PER_PARAMETER", "SHOWN", "Layout", "Undo", "model_changes")

_log = get_logger(__name__)

SHOWN: Final = 8
"""The changes a refused restore names (then ``...``)."""

PER_PARAMETER: Final = frozenset(
    {
        "exp_avg",
        "exp_avg_sq",
        "max_exp_avg_sq",
        "exp_inf",
        "momentum_buffer",
        "square_avg",
        "grad_avg",
        "acc_delta",
        "sum",
        "ax",
        "prev",
        "step_size",
    }
)
"""The state of torch's own optimizers that is shaped like its parameter (Adam, AdamW, NAdam,
RAdam, Adamax, SGD, RMSprop, Adagrad, Adadelta, ASGD, Rprop): what a restore from a checkpoint
checks against the parameter's shape (an in-memory snapshot knows each parameter's shape at the
capture)."""


@dataclass(slots=True)
class Layout:
    """The optimizer state dict a restore loads, and where its entries come from.

    Attributes:
        state_dict: laid out on the optimizer's param groups as they are now.
        origins: the index each state entry had at the capture, when it differs (the groups
            changed since); ``None`` when every index is the captured one.
    """

    state_dict: dict[str, Any]
    origins: dict[int, int] | None = None


def dtype_kind(t: torch.Tensor) -> str:
    if t.is_complex():
        return "complex"
    if t.is_floating_point():
        return "floating"
    return "bool" if t.dtype == torch.bool else "integer"


def key_list(keys: list[str]) -> str:
    shown = ", ".join(map(repr, keys[:SHOWN]))
    return shown + (f" ... ({len(keys)} in all)" if len(keys) > SHOWN else "")


def model_changes(
    held: Mapping[str, torch.Tensor], model: nn.Module, frozen: frozenset[str] = frozenset()
) -> list[str]:
    """What keeps the held model state dict from loading into *model* as it is now, in words:
    entries added or removed since, a shape changed, or a dtype of another kind (a floating
    entry copied into an integer buffer would be truncated; a precision change is loaded
    cast, as ``load_state_dict`` casts it). A lazy parameter takes any shape, as torch's.
    The *frozen* parameters were left out of the snapshot: not missing."""
    live = model.state_dict(keep_vars=True)
    out: list[str] = []
    added = [k for k in live if k not in held and k not in frozen]
    if added:
        out.append(f"model entries added since: {key_list(added)}")
    removed = [k for k in held if k not in live]
    if removed:
        out.append(f"model entries removed since: {key_list(removed)}")
    for key, saved in held.items():
        now = live.get(key)
        if not isinstance(now, torch.Tensor) or is_lazy(now):
            continue
        if saved.shape != now.shape:
            out.append(
                f"{key!r}: shape {tuple(saved.shape)} at the snapshot, {tuple(now.shape)} now"
            )
        elif dtype_kind(saved) != dtype_kind(now):
            out.append(f"{key!r}: dtype {saved.dtype} at the snapshot, {now.dtype} now")
    return out


@dataclass(slots=True)
class Undo:
    """What a restore puts back when its load fails part-way.

    Attributes:
        live: the model's parameters and buffers (``load_state_dict`` copies into them).
        saved: their values when the restore began (a copy on their own device), or ``None``
            when there was no memory for it.
        state: the optimizer's ``state`` when the restore began: ``load_state_dict`` replaces
            it (and the groups) with new objects, it does not write into them.
        groups: the optimizer's ``param_groups`` then.
    """

    live: list[torch.Tensor]
    saved: list[torch.Tensor] | None
    state: Any = None
    groups: list[dict[str, Any]] | None = None

    @classmethod
    def take(
        cls,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        host: bool = False,
        skip: frozenset[str] = frozenset(),
    ) -> Undo:
        """Copy the model's values (in host memory with *host*: a snapshot kept there because
        the device has no room would not find room for this copy either), but the *skip*
        entries (frozen parameters the restore does not load)."""
        live = [
            t.detach()
            for k, t in model.state_dict(keep_vars=True).items()
            if isinstance(t, torch.Tensor) and k not in skip
        ]
        saved: list[torch.Tensor] | None
        try:
            with torch.no_grad():
                saved = [
                    t.to("cpu", copy=True) if host and t.__class__ is torch.Tensor else t.clone()
                    for t in live
                ]
        except RuntimeError:  # torch.OutOfMemoryError; the host allocator's is a RuntimeError
            saved = None
            _log.warning(
                "restore_without_undo",
                reason="no memory for a copy of the model: a load that fails part-way cannot "
                "be undone",
            )
        if optimizer is None:
            return cls(live, saved)
        return cls(live, saved, optimizer.state, optimizer.param_groups)

    def put_back(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> bool:
        """Put everything back; False when the model's values could not be (no copy)."""
        if optimizer is not None and self.groups is not None:
            optimizer.state = self.state
            optimizer.param_groups = self.groups
        if self.saved is None:
            return False
        with torch.no_grad():
            copy_all(self.live, self.saved)
        return True
