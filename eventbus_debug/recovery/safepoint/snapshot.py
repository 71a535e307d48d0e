"""The last good training state: an in-memory snapshot of model + optimizer, or a checkpoint.

Restoring never loads pickled code: checkpoint files are read with ``torch.load(...,
weights_only=True)``. A snapshot is only taken of finite parameters, so a restore never brings
NaN back.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, final

import torch
from torch import nn

from eventbus_debug.diagnostics import get_logger

from ..._tensors import copy_all
from ..._validate import positive_int
from ..lr import GROUP_LR_KEYS

__all__ = ("NoGoodStateError", "StateSnapshots")

_log = get_logger(__name__)

DEFAULT_EVERY: Final = 50


class NoGoodStateError(RuntimeError):
    """Raised by :meth:`StateSnapshots.restore` when no good state was captured or loaded."""


def _finite_groups(model: nn.Module) -> list[list[torch.Tensor]]:
    """The model's floating parameters, grouped by device and dtype (one reduction each)."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p in model.parameters():
        if p.is_floating_point() or p.is_complex():
            groups.setdefault((p.device, p.dtype), []).append(p.detach())
    return list(groups.values())


def _all_finite(groups: list[list[torch.Tensor]]) -> bool:
    """One fused reduction per group and one host transfer: are all of *groups* finite?

    Each group's norms are summed into one number, NaN or Inf as soon as one value is (a
    finite model whose norms add up past the float range is refused too: it is not healthy).
    """
    if not groups:
        return True
    totals = []
    for ts in groups:
        v = torch.stack(torch._foreach_norm(ts))
        full = getattr(v, "full_tensor", None)  # FSDP2 / DTensor: the norm over every shard
        totals.append((full() if callable(full) else v).sum())
    if len(totals) == 1:
        return math.isfinite(totals[0].item())
    return bool(torch.isfinite(torch.stack([t.float().cpu() for t in totals])).all().item())


def _live_key(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[int, ...]:
    """Where the tensors a snapshot copies live now: a changed buffer or state shows here.

    A module that assigns a new buffer, ``param.data = ...``, ``model.to(...)`` or an optimizer
    that creates or replaces its state all change a storage address (or the count).
    """
    key = [t.data_ptr() for t in model.parameters()]
    key += [t.data_ptr() for t in model.buffers()]
    if optimizer is not None:
        for state in optimizer.state.values():
            key.append(len(state))
            key += [v.data_ptr() for v in state.values() if isinstance(v, torch.Tensor)]
    return tuple(key)


@dataclass(slots=True)
class _Plan:
    """Preallocated copies of one model + optimizer, refreshed with two ``_foreach_copy_``.

    Attributes:
        key: :func:`_live_key` when the plan was built (a different key: build again).
        model: the model snapshot (a state dict of the buffers in *model_dst*).
        model_src: the live parameters and buffers, in the order of *model_dst*.
        model_dst: the preallocated copies.
        optimizer: the optimizer snapshot (a state dict whose tensors are in *opt_dst*).
        opt_src: the live optimizer state tensors, in the order of *opt_dst*.
        opt_dst: the preallocated copies.
        scalars: ``(snapshot state, key, live state)`` of the non-tensor state entries.
        finite: the live floating parameters, grouped for the finite check before a refresh.
    """

    key: tuple[int, ...]
    model: dict[str, torch.Tensor]
    model_src: list[torch.Tensor]
    model_dst: list[torch.Tensor]
    optimizer: dict[str, Any] | None
    opt_src: list[torch.Tensor]
    opt_dst: list[torch.Tensor]
    scalars: list[tuple[dict[str, Any], str, Mapping[str, Any]]]
    finite: list[list[torch.Tensor]]

    @classmethod
    def build(
        cls,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        finite: list[list[torch.Tensor]],
    ) -> _Plan:
        """Allocate the copies (the first capture, or after the live tensors changed);
        *finite* is :func:`_finite_groups` of *model*, already computed by the caller."""
        key = _live_key(model, optimizer)
        live_model = model.state_dict(keep_vars=True)
        model_src = [t.detach() for t in live_model.values()]
        model_dst = [t.clone() for t in model_src]
        snapshot = dict(zip(live_model, model_dst, strict=True))
        opt_src: list[torch.Tensor] = []
        opt_dst: list[torch.Tensor] = []
        scalars: list[tuple[dict[str, Any], str, Mapping[str, Any]]] = []
        opt_snapshot: dict[str, Any] | None = None
        if optimizer is not None:
            live = optimizer.state_dict()  # its "state" holds the optimizer's own dicts
            state: dict[Any, dict[str, Any]] = {}
            for index, entries in live["state"].items():
                copied: dict[str, Any] = {}
                for name, value in entries.items():
                    if isinstance(value, torch.Tensor):
                        opt_src.append(value.detach())
                        copied[name] = value.detach().clone()
                        opt_dst.append(copied[name])
                    else:
                        copied[name] = copy.deepcopy(value)
                        scalars.append((copied, name, entries))
                state[index] = copied
            opt_snapshot = {"state": state, "param_groups": _groups(live["param_groups"])}
        return cls(
            key,
            snapshot,
            model_src,
            model_dst,
            opt_snapshot,
            opt_src,
            opt_dst,
            scalars,
            finite,
        )

    def refresh(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Copy the live values into the preallocated buffers (no allocation, no tree walk)."""
        with torch.no_grad():
            copy_all(self.model_dst, self.model_src)
            copy_all(self.opt_dst, self.opt_src)
        for copied, name, entries in self.scalars:
            copied[name] = copy.deepcopy(entries[name])
        if optimizer is not None and self.optimizer is not None:
            groups = self.optimizer["param_groups"]
            for group, live in zip(groups, optimizer.param_groups, strict=True):
                group.update(_group(live, group["params"]))


def _group(live: Mapping[str, Any], params: list[int]) -> dict[str, Any]:
    """A param group's settings as a snapshot holds them (tensors copied, indices kept)."""
    out = {
        k: (v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v))
        for k, v in live.items()
        if k != "params"
    }
    out["params"] = params
    return out


def _groups(packed: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [_group(g, list(g["params"])) for g in packed]


@final
class StateSnapshots:
    """Keeps the last good state of a model and its optimizer, to restore after a fault.

    :class:`~eventbus_debug.recovery.SafePoint` calls :meth:`maybe_capture` on good steps; a
    snapshot is taken every *every* good steps (the first good step always captures). Memory
    cost: one copy of the parameters, buffers and optimizer state.

    Args:
        every: capture every this many good steps.
        checkpoint: a file written by :meth:`save` (or any ``{"model": ..., "optimizer": ...}``
            dict of tensors) loaded as the initial good state, with ``weights_only=True``.

    Raises:
        ArgumentTypeError: if *every* is not an int (a ``TypeError`` and a ``ValueError``).
        ValueError: if *every* < 1.
        FileNotFoundError: if *checkpoint* does not exist.
    """

    def __init__(
        self, *, every: int = DEFAULT_EVERY, checkpoint: str | os.PathLike[str] | None = None
    ) -> None:
        try:
            self.every = positive_int("every", every)
        except ValueError as exc:  # an ArgumentTypeError keeps its type
            raise type(exc)(f"{exc} (good steps between snapshots)") from None
        self._model: dict[str, torch.Tensor] | None = None
        self._optimizer: dict[str, Any] | None = None
        self._plan: _Plan | None = None
        self._step: int | None = None
        self._good_since = 0
        self.captures = 0
        self.restores = 0
        if checkpoint is not None:
            self.load(checkpoint)

    @property
    def step(self) -> int | None:
        """The step of the state held now, or ``None`` when none is."""
        return self._step

    def age(self, step: int) -> int | None:
        """How many steps old the held state is at *step* (``None`` when none is held)."""
        return None if self._step is None else step - self._step

    @property
    def available(self) -> bool:
        """Whether a good state is held."""
        return self._model is not None

    def maybe_capture(
        self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None
    ) -> bool:
        """Count a good step; capture when *every* good steps passed (or none is held yet)."""
        self._good_since += 1
        if self._model is not None and self._good_since < self.every:
            return False
        return self.capture(step, model, optimizer)

    def capture(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> bool:
        """Copy the state of *model* (and *optimizer*) now; refused when a parameter is not finite.

        Returns:
            True when captured, False when refused.
        """
        # Copy into preallocated buffers with two fused copies; walking state_dict() and
        # optimizer.state_dict() per tensor cost 490-610 us per capture (issue #13, item 7).
        # The plan also holds the parameters' grouping for the finite check (78 -> 30 us).
        plan = self._plan
        if plan is not None and plan.key != _live_key(model, optimizer):
            plan = None  # the live tensors changed: plan the copies again
        groups = plan.finite if plan is not None else _finite_groups(model)
        if not _all_finite(groups):
            _log.warning("snapshot_refused", step=step, reason="non-finite parameters")
            return False
        if plan is None:
            plan = self._plan = _Plan.build(model, optimizer, groups)
        else:
            plan.refresh(optimizer)
        self._model = plan.model
        self._optimizer = plan.optimizer
        self._step = step
        self._good_since = 0
        self.captures += 1
        return True

    def restore(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> int | None:
        """Load the held state into *model* and *optimizer*; returns its step.

        The learning rates the optimizer has now are kept, with the scheduler keys
        ``initial_lr``/``max_lr``/``min_lr`` (a restore undoes the weights and the optimizer's
        moments, not the LR decisions taken since).

        Raises:
            NoGoodStateError: if no good state was captured or loaded.
        """
        if self._model is None:
            msg = (
                "no good state to restore: none was captured yet (StateSnapshots captures on the "
                "first good safe point) and no checkpoint was given"
            )
            raise NoGoodStateError(msg)
        model.load_state_dict(self._model)
        if optimizer is not None and self._optimizer is not None:
            keys = ("lr", *GROUP_LR_KEYS)
            lrs = [{k: g[k] for k in keys if k in g} for g in optimizer.param_groups]
            optimizer.load_state_dict(copy.deepcopy(self._optimizer))
            for group, kept in zip(optimizer.param_groups, lrs, strict=True):
                group.update(kept)
        self.restores += 1
        # Refresh at the next good step: the restored state is good, and the next snapshot
        # must not be `every` steps away (a second fault would go back further still).
        self._good_since = self.every
        _log.info("state_restored", step=self._step)
        return self._step

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the held state to *path* (loadable with ``weights_only=True``).

        Raises:
            NoGoodStateError: if no state is held.
        """
        if self._model is None:
            msg = "no state to save: capture() first"
            raise NoGoodStateError(msg)
        torch.save({"model": self._model, "optimizer": self._optimizer, "step": self._step}, path)

    def load(self, path: str | os.PathLike[str]) -> None:
        """Read a checkpoint as the good state, with ``weights_only=True`` (no pickled code).

        Accepts ``{"model": state_dict, "optimizer": state_dict | None, "step": int}`` or a bare
        model state dict.

        Raises:
            FileNotFoundError: if *path* does not exist.
            ValueError: if the file does not hold a state dict.
        """
        data = torch.load(os.fspath(path), map_location="cpu", weights_only=True)
        self._plan = None
        if not isinstance(data, Mapping):
            msg = f"checkpoint {os.fspath(path)!r} holds {type(data).__name__}, not a state dict"
            raise ValueError(msg)
        if "model" in data and isinstance(data["model"], Mapping):
            self._model = dict(data["model"])
            opt = data.get("optimizer")
            self._optimizer = dict(opt) if isinstance(opt, Mapping) else None
            step = data.get("step")
            self._step = int(step) if isinstance(step, int) else None
        else:
            self._model = dict(data)
            self._optimizer = None
            self._step = None
        _log.info("checkpoint_loaded", path=os.fspath(path), step=self._step)
