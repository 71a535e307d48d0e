"""The last good training state: an in-memory snapshot of model + optimizer, or a checkpoint.

Restoring never loads pickled code: checkpoint files are read with ``torch.load(...,
weights_only=True)``. A snapshot is only taken of finite parameters and optimizer moments and
of buffers free of NaN (an infinite buffer can be a mask), so a restore never brings NaN back.
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


@dataclass(slots=True)
class _Checks:
    """What a capture checks before it copies.

    Attributes:
        groups: the floating parameters and the optimizer state shaped like them, grouped by
            device and dtype (one reduction each): none may be NaN or infinite.
        buffers: the floating buffers, grouped the same way: none may be NaN. An infinite
            buffer can be by construction (a causal attention mask of ``-inf`` registered as a
            buffer).
    """

    groups: list[list[torch.Tensor]]
    buffers: list[list[torch.Tensor]]


def _finite_groups(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> _Checks:
    """What a snapshot must hold finite.

    The model's floating parameters; the optimizer's floating state shaped like its parameter
    (NaN moments turn the restored parameters NaN at the next step; scalars such as a custom
    optimizer's ``inf`` sentinel are not judged); and the floating buffers, for NaN (a NaN
    written into BatchNorm's running stats leaves a train-mode loss finite: captured, it
    would come back with every restore).
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    buffers: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}

    def add(
        into: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]], t: torch.Tensor
    ) -> None:
        if t.is_floating_point() or t.is_complex():
            into.setdefault((t.device, t.dtype), []).append(t.detach())

    for p in model.parameters():
        add(groups, p)
    if optimizer is not None:
        for param, state in optimizer.state.items():
            shape = getattr(param, "shape", None)
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.shape == shape:
                    add(groups, v)  # a moment of the parameter
    for b in model.buffers():
        add(buffers, b)
    return _Checks(list(groups.values()), list(buffers.values()))


def _all_finite(checks: _Checks) -> bool:
    """A few fused reductions and one host transfer: does *checks* hold no NaN/Inf (no NaN in
    the buffers)?

    One number per group (:func:`_norm_sum`; a model whose norms add up past the float32
    range is refused too: it is not healthy).
    """
    totals = [_norm_sum(ts) for ts in checks.groups]
    for ts in checks.buffers:
        # The norm of a tensor holding a NaN is NaN, whatever else it holds; an infinite one
        # (a -inf mask) or one past the float range is not: only the NaN counts (as inf here).
        total = _norm_sum(ts)
        totals.append(torch.where(total.isnan(), math.inf, 0.0))
    if not totals:
        return True
    if len(totals) == 1:
        return math.isfinite(totals[0].item())
    return bool(torch.isfinite(torch.stack([t.float().cpu() for t in totals])).all().item())


def _norm_sum(ts: list[torch.Tensor]) -> torch.Tensor:
    """The sum of the 2-norms of *ts* (one device and dtype), in one fused reduction: NaN or
    Inf as soon as one value is. Half precision norms are computed in float32, so a large
    half-precision model does not overflow its own dtype's range."""
    low = ts[0].is_floating_point() and ts[0].dtype.itemsize < 4
    norms = torch._foreach_norm(ts, 2, dtype=torch.float32) if low else torch._foreach_norm(ts)
    v = torch.stack(norms)
    full = getattr(v, "full_tensor", None)  # FSDP2 / DTensor: the norm over every shard
    return (full() if callable(full) else v).sum()


def _live_key(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[int, ...]:
    """Where the tensors a snapshot copies live now: a changed buffer or state shows here.

    A module that assigns a new buffer, ``param.data = ...``, ``model.to(...)`` or an optimizer
    that creates or replaces its state all change a storage address (or the count); an
    ``optimizer.add_param_group(...)`` (unfreezing layers) changes the groups' membership.
    """
    key = [t.data_ptr() for t in model.parameters()]
    key += [t.data_ptr() for t in model.buffers()]
    if optimizer is not None:
        for group in optimizer.param_groups:
            key.append(len(group["params"]))
            key += [id(p) for p in group["params"]]
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
        finite: the live tensors checked before a refresh (:class:`_Checks`).
        params: the optimizer's parameters in the order its state dict indexes them (a restore
            finds each one's state by identity, whatever groups the optimizer has by then).
    """

    key: tuple[int, ...]
    model: dict[str, torch.Tensor]
    model_src: list[torch.Tensor]
    model_dst: list[torch.Tensor]
    optimizer: dict[str, Any] | None
    opt_src: list[torch.Tensor]
    opt_dst: list[torch.Tensor]
    scalars: list[tuple[dict[str, Any], str, Mapping[str, Any]]]
    finite: _Checks
    params: list[torch.Tensor]

    @classmethod
    def build(
        cls,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        finite: _Checks,
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
        params: list[torch.Tensor] = []
        if optimizer is not None:
            params = [p for group in optimizer.param_groups for p in group["params"]]
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
            params,
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
        self._params: list[torch.Tensor] | None = None  # the optimizer's, at the capture
        self._step: int | None = None
        self._good_since = 0
        self.captures = 0
        self.refusals = 0
        """Captures refused (a non-finite state); the first of a streak is logged, its length
        at the next capture."""
        self._refused_since: int | None = None  # the step a streak of refusals started
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
        """Copy the state of *model* (and *optimizer*) now; refused when a parameter or an
        optimizer moment is not finite, or a buffer is NaN.

        Returns:
            True when captured, False when refused.
        """
        # Copy into preallocated buffers with two fused copies; walking state_dict() and
        # optimizer.state_dict() per tensor cost 490-610 us per capture (issue #13, item 7).
        # The plan also holds the parameters' grouping for the finite check (78 -> 30 us).
        plan = self._plan
        if plan is not None and plan.key != _live_key(model, optimizer):
            plan = None  # the live tensors changed: plan the copies again
        groups = plan.finite if plan is not None else _finite_groups(model, optimizer)
        if not _all_finite(groups):
            self.refusals += 1
            if self._refused_since is None:  # retried at every good step: said once a streak
                self._refused_since = step
                _log.warning(
                    "snapshot_refused",
                    step=step,
                    reason="non-finite parameters or optimizer moments, or NaN buffers",
                )
            return False
        if self._refused_since is not None:
            _log.info("snapshot_resumed", step=step, refused_since=self._refused_since)
            self._refused_since = None
        if plan is None:
            plan = self._plan = _Plan.build(model, optimizer, groups)
        else:
            plan.refresh(optimizer)
        self._model = plan.model
        self._optimizer = plan.optimizer
        self._params = plan.params
        self._step = step
        self._good_since = 0
        self.captures += 1
        return True

    def restore(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> int | None:
        """Load the held state into *model* and *optimizer*; returns its step.

        The learning rates the optimizer has now are kept, with the scheduler keys
        ``initial_lr``/``max_lr``/``min_lr`` (a restore undoes the weights and the optimizer's
        moments, not the LR decisions taken since). The optimizer keeps the param groups it has
        now: each parameter gets back the state it had at the capture (found by identity), a
        parameter added since (``add_param_group``) starts with no state, as it did when added.

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
            optimizer.load_state_dict(copy.deepcopy(self._remapped(optimizer, self._optimizer)))
            for group, kept in zip(optimizer.param_groups, lrs, strict=True):
                group.update(kept)
        self.restores += 1
        # Refresh at the next good step: the restored state is good, and the next snapshot
        # must not be `every` steps away (a second fault would go back further still).
        self._good_since = self.every
        _log.info("state_restored", step=self._step)
        return self._step

    def _remapped(self, optimizer: torch.optim.Optimizer, held: dict[str, Any]) -> dict[str, Any]:
        """The held optimizer state dict laid out on *optimizer*'s param groups as they are now.

        With the same group sizes as at the capture it is loaded by position, as torch loads a
        state dict. Otherwise (``add_param_group`` since) each parameter's state is found by
        identity; groups that hold the same parameters as at the capture keep their captured
        settings, a group added since keeps its live ones. A loaded checkpoint has no
        parameter identities: its indices are the optimizer's order, loaded as they are.
        """
        params = self._params
        if params is None:
            return held
        live_groups = optimizer.param_groups
        if [len(g["params"]) for g in held["param_groups"]] == [
            len(g["params"]) for g in live_groups
        ]:
            return held  # the same layout: by position, as torch loads a state dict
        index = {id(p): i for i, p in enumerate(params)}
        by_members = {tuple(id(params[i]) for i in g["params"]): g for g in held["param_groups"]}
        held_state = held["state"]
        state: dict[int, Any] = {}
        groups: list[dict[str, Any]] = []
        n = 0
        for live in live_groups:
            members = tuple(id(p) for p in live["params"])
            captured = by_members.get(members)
            groups.append(
                _group(captured if captured is not None else live, list(range(n, n + len(members))))
            )
            for j, pid in enumerate(members):
                old = index.get(pid)
                if old is not None and old in held_state:
                    state[n + j] = held_state[old]
            n += len(members)
        _log.info("optimizer_groups_changed_since_snapshot", step=self._step, groups=len(groups))
        return {"state": state, "param_groups": groups}

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

        The state is checked as a capture checks it: a model state dict that is not all
        tensors (a training checkpoint of another layout, such as Lightning's
        ``{"state_dict": ..., "epoch": ...}``), an optimizer entry that is not an optimizer
        state dict, a NaN in the model's entries or a NaN/Inf in the optimizer state is
        refused here, naming it, rather than when a fault needs the state.

        Raises:
            FileNotFoundError: if *path* does not exist.
            ValueError: if the file does not hold a state dict, or holds NaN (or, in the
                optimizer state, infinite) values; nothing is changed then.
        """
        where = os.fspath(path)
        data = torch.load(where, map_location="cpu", weights_only=True)
        if not isinstance(data, Mapping):
            msg = f"checkpoint {where!r} holds {type(data).__name__}, not a state dict"
            raise ValueError(msg)
        optimizer: dict[str, Any] | None = None
        step: int | None = None
        if "model" in data and isinstance(data["model"], Mapping):
            model = dict(data["model"])
            opt = data.get("optimizer")
            if opt is not None:
                if not (isinstance(opt, Mapping) and {"state", "param_groups"} <= opt.keys()):
                    msg = (
                        f"checkpoint {where!r}: 'optimizer' must be an optimizer's state_dict() "
                        f"(with 'state' and 'param_groups') or None, got {type(opt).__name__}"
                    )
                    raise ValueError(msg)
                optimizer = dict(opt)
            held = data.get("step")
            step = int(held) if isinstance(held, int) and not isinstance(held, bool) else None
        else:
            model = dict(data)
        _check_checkpoint(where, model, optimizer)
        self._plan = None
        self._params = None
        self._model = model
        self._optimizer = optimizer
        self._step = step
        _log.info("checkpoint_loaded", path=os.fspath(path), step=self._step)


def _check_checkpoint(
    where: str, model: Mapping[str, Any], optimizer: Mapping[str, Any] | None
) -> None:
    """Refuse a checkpoint no restore could load, or whose state is not good (not finite).

    Raises:
        ValueError: naming the entries.
    """
    if not model:
        msg = f"checkpoint {where!r} holds an empty model state dict"
        raise ValueError(msg)
    odd = [k for k, v in model.items() if not isinstance(v, torch.Tensor)]
    if odd:
        msg = (
            f"checkpoint {where!r} is not a model state dict: {', '.join(map(repr, odd[:5]))} "
            "are not tensors (save {'model': model.state_dict(), 'optimizer': "
            "optimizer.state_dict(), 'step': step}, or StateSnapshots.save())"
        )
        raise ValueError(msg)
    # NaN only in the model's entries: a state dict mixes parameters and buffers, and an
    # infinite buffer can be by construction (a -inf attention mask)
    bad = [
        k for k, v in model.items() if (v.is_floating_point() or v.is_complex()) and v.isnan().any()
    ]
    if optimizer is not None:
        state = optimizer.get("state")
        if isinstance(state, Mapping):
            for index, entries in state.items():
                if isinstance(entries, Mapping):
                    bad += [
                        f"optimizer state {index}.{name}"
                        for name, v in entries.items()
                        if isinstance(v, torch.Tensor) and _non_finite(v)
                    ]
    if bad:
        msg = (
            f"checkpoint {where!r} is not a good state: non-finite values in "
            f"{', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}"
        )
        raise ValueError(msg)


def _non_finite(t: torch.Tensor) -> bool:
    return (t.is_floating_point() or t.is_complex()) and not bool(torch.isfinite(t).all())
