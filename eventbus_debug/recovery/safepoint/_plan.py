"""The copy plan of a state snapshot: what a capture checks finite, where the live tensors
are (a changed key: plan again), and the preallocated copies refreshed with two fused copies
(on the live tensors' device, or in pinned host memory, as :mod:`._placement` chose)."""

from __future__ import annotations

import copy
import math
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import _EXTRA_STATE_KEY_SUFFIX

from ..._tensors import copy_all
from ._placement import plain

__all__ = (
    "Checks",
    "Plan",
    "all_finite",
    "copied_tensors",
    "extra_states",
    "frozen",
    "finite_groups",
    "group_settings",
    "in_place_ok",
    "live_key",
    "loose_parameters",
)


@dataclass(slots=True)
class Checks:
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


def finite_groups(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Checks:
    """What a snapshot must hold finite.

    The model's floating parameters (and the optimizer's others: :func:`loose_parameters`); the
    optimizer's floating state shaped like its parameter
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
    for loose in loose_parameters(model, optimizer):
        add(groups, loose)
    if optimizer is not None:
        for param, state in optimizer.state.items():
            shape = getattr(param, "shape", None)
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.shape == shape:
                    add(groups, v)  # a moment of the parameter
    for b in model.buffers():
        add(buffers, b)
    return Checks(list(groups.values()), list(buffers.values()))


def all_finite(checks: Checks) -> bool:
    """A few fused reductions and one host transfer: does *checks* hold no NaN/Inf (no NaN in
    the buffers)?

    One number per group (:func:`norm_sum`; a model whose norms add up past the float32
    range is refused too: it is not healthy).
    """
    totals = [norm_sum(ts) for ts in checks.groups]
    for ts in checks.buffers:
        # The norm of a tensor holding a NaN is NaN, whatever else it holds; an infinite one
        # (a -inf mask) or one past the float range is not: only the NaN counts (as inf here).
        total = norm_sum(ts)
        totals.append(torch.where(total.isnan(), math.inf, 0.0))
    if not totals:
        return True
    if len(totals) == 1:
        return math.isfinite(totals[0].item())
    return bool(torch.isfinite(torch.stack([t.float().cpu() for t in totals])).all().item())


def norm_sum(ts: list[torch.Tensor]) -> torch.Tensor:
    """The sum of the 2-norms of *ts* (one device and dtype), in one fused reduction: NaN or
    Inf as soon as one value is. Half precision norms are computed in float32, so a large
    half-precision model does not overflow its own dtype's range."""
    low = ts[0].is_floating_point() and ts[0].dtype.itemsize < 4
    norms = torch._foreach_norm(ts, 2, dtype=torch.float32) if low else torch._foreach_norm(ts)
    v = torch.stack(norms)
    full = getattr(v, "full_tensor", None)  # FSDP2 / DTensor: the norm over every shard
    return (full() if callable(full) else v).sum()


def live_key(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[int, ...]:
    """Where the tensors a snapshot copies live now: a changed buffer or state shows here.

    A module that assigns a new buffer, ``param.data = ...``, ``model.to(...)`` or an optimizer
    that creates or replaces its state all change a storage address (or the count); an
    ``optimizer.add_param_group(...)`` (unfreezing layers) changes the groups' membership.
    """
    # a frozen parameter's address is written negated (~): freezing or unfreezing shows
    key = [t.data_ptr() if t.requires_grad else ~t.data_ptr() for t in model.parameters()]
    key += [t.data_ptr() for t in model.buffers()]
    if optimizer is not None:
        for group in optimizer.param_groups:
            key.append(len(group["params"]))
            key += [id(p) for p in group["params"]]
            key += [p.data_ptr() for p in group["params"]]  # a loose one's storage, too
        for state in optimizer.state.values():
            key.append(len(state))
            key += [v.data_ptr() for v in state.values() if isinstance(v, torch.Tensor)]
    return tuple(key)


def frozen(t: object) -> bool:
    """Whether *t* is a frozen parameter (``requires_grad=False``): training does not change
    it, so a snapshot does not copy it (a LoRA fine-tune's base model is most of the model)."""
    return isinstance(t, nn.Parameter) and not t.requires_grad


def _local_state_dict(optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any] | None, str]:
    """*optimizer*'s state dict (its "state" holds the optimizer's own dicts), or ``None`` and
    why, when one rank cannot take it alone: ``ZeroRedundancyOptimizer.state_dict()`` needs a
    collective first (``consolidate_state_dict``), and a capture must never be one (it raised
    out of the safe point at the first good step). The snapshot then holds the model alone."""
    try:
        return optimizer.state_dict(), ""
    except RuntimeError as exc:
        return None, f"{type(optimizer).__name__}.state_dict(): {exc}"


def extra_states(model: nn.Module) -> dict[str, nn.Module]:
    """The state dict keys of *model*'s modules that define ``get_extra_state``, with them."""
    return {
        f"{name}.{_EXTRA_STATE_KEY_SUFFIX}" if name else _EXTRA_STATE_KEY_SUFFIX: module
        for name, module in model.named_modules()
        if type(module).get_extra_state is not nn.Module.get_extra_state
    }


def loose_parameters(
    model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> list[torch.Tensor]:
    """The optimizer's parameters that are not the model's (a learnable temperature kept
    beside it): in no state dict of the model, yet trained, so a snapshot copies them too."""
    if optimizer is None:
        return []
    own = {id(p) for p in model.parameters()}
    seen: set[int] = set()
    out: list[torch.Tensor] = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in own and id(p) not in seen and p.requires_grad:
                seen.add(id(p))
                out.append(p)
    return out


def copied_tensors(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """The tensors a snapshot copies: the model's state dict entries but its frozen
    parameters, and the optimizer's state (to size the copy before it is made)."""
    live = model.state_dict(keep_vars=True).values()
    out = [t.detach() for t in live if isinstance(t, torch.Tensor) and not frozen(t)]
    out += [p.detach() for p in loose_parameters(model, optimizer)]
    if optimizer is not None:
        for state in optimizer.state.values():
            out += [v.detach() for v in state.values() if isinstance(v, torch.Tensor)]
    return out


def _on_accelerator(t: torch.Tensor) -> bool:
    return t.device.type not in ("cpu", "meta")


def _copy_of(t: torch.Tensor, host: bool) -> torch.Tensor:
    """A copy of *t*: beside it, or (*host*, a plain accelerator tensor) in pinned host
    memory (pageable when no pinned memory can be had)."""
    if not (host and plain(t) and _on_accelerator(t)):
        return t.clone()
    try:
        dst = torch.empty_like(t, device="cpu", pin_memory=True)
    except RuntimeError:  # no pinned memory allocator, or none left
        dst = torch.empty_like(t, device="cpu")
    dst.copy_(t)
    return dst


@dataclass(slots=True)
class Plan:
    """Preallocated copies of one model + optimizer, refreshed with two ``_foreach_copy_``.

    Attributes:
        key: :func:`live_key` when the plan was built (a different key: build again).
        model: the model snapshot (a state dict of the buffers in *model_dst*, and of copies
            of the modules' extra states).
        extra: the state dict keys of the modules' extra states (``get_extra_state()``, any
            picklable object, made anew at each ``state_dict()``) and their modules.
        loose_src: the optimizer's parameters that are not the model's
            (:func:`loose_parameters`), themselves (a restore finds them by identity).
        loose_dst: their copies.
        model_src: the live parameters and buffers, in the order of *model_dst*.
        model_dst: the preallocated copies.
        optimizer: the optimizer snapshot (a state dict whose tensors are in *opt_dst*).
        opt_src: the live optimizer state tensors, in the order of *opt_dst*.
        opt_dst: the preallocated copies.
        scalars: ``(snapshot state, key, live state)`` of the non-tensor state entries.
        finite: the live tensors checked before a refresh (:class:`Checks`).
        params: the optimizer's parameters in the order its state dict indexes them (a restore
            finds each one's state by identity, whatever groups the optimizer has by then).
        shapes: their shapes when the plan was built (a restore tells the state tensors shaped
            like their parameter, whose shape must still be the parameter's).
        host: whether the copies are in host memory (those of accelerator tensors are
            refreshed without blocking the host; :meth:`settle` before reading them).
        without_optimizer: why the optimizer's state is not in the snapshot ("": it is).
        devices: the accelerators whose tensors are copied to the host.
        pending: the events of the last refresh's copies to the host, one per accelerator.
    """

    key: tuple[int, ...]
    model: dict[str, Any]
    extra: list[tuple[str, nn.Module]]
    loose_src: list[torch.Tensor]
    loose_dst: list[torch.Tensor]
    model_src: list[torch.Tensor]
    model_dst: list[torch.Tensor]
    optimizer: dict[str, Any] | None
    opt_src: list[torch.Tensor]
    opt_dst: list[torch.Tensor]
    scalars: list[tuple[dict[str, Any], str, Mapping[str, Any]]]
    finite: Checks
    params: list[torch.Tensor]
    shapes: list[torch.Size]
    host: bool = False
    without_optimizer: str = ""
    devices: tuple[torch.device, ...] = ()
    pending: list[torch.Event] = field(default_factory=list)

    @classmethod
    def build(
        cls,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        finite: Checks,
        *,
        host: bool = False,
    ) -> Plan:
        """Allocate the copies (the first capture, or after the live tensors changed);
        *finite* is :func:`finite_groups` of *model*, already computed by the caller; *host*:
        the accelerator tensors' copies go to host memory."""
        key = live_key(model, optimizer)
        live_model = model.state_dict(keep_vars=True)
        extra = extra_states(model)
        snapshot: dict[str, Any] = OrderedDict()
        model_src: list[torch.Tensor] = []
        model_dst: list[torch.Tensor] = []
        for name, value in live_model.items():
            if name in extra:  # a module's get_extra_state(): made anew at each state_dict()
                snapshot[name] = copy.deepcopy(value)
                continue
            if frozen(value):  # not copied (live_key changes when one is unfrozen)
                continue
            model_src.append(value.detach())
            model_dst.append(_copy_of(model_src[-1], host))
            snapshot[name] = model_dst[-1]
        # the modules' state versions (BatchNorm's, ...): without them load_state_dict takes
        # the snapshot for one of an old format, and a module that loads by version misreads it
        metadata = getattr(live_model, "_metadata", None)
        if metadata is not None:
            snapshot._metadata = copy.deepcopy(metadata)  # type: ignore[attr-defined]
        opt_src: list[torch.Tensor] = []
        opt_dst: list[torch.Tensor] = []
        scalars: list[tuple[dict[str, Any], str, Mapping[str, Any]]] = []
        opt_snapshot: dict[str, Any] | None = None
        params: list[torch.Tensor] = []
        loose_src = loose_parameters(model, optimizer)  # the parameters: found by identity
        live, without = _local_state_dict(optimizer) if optimizer is not None else (None, "")
        if optimizer is not None and live is not None:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            state: dict[Any, dict[str, Any]] = {}
            for index, entries in live["state"].items():
                copied: dict[str, Any] = {}
                for name, value in entries.items():
                    if isinstance(value, torch.Tensor):
                        opt_src.append(value.detach())
                        copied[name] = _copy_of(value.detach(), host)
                        opt_dst.append(copied[name])
                    else:
                        copied[name] = copy.deepcopy(value)
                        scalars.append((copied, name, entries))
                state[index] = copied
            opt_snapshot = {"state": state, "param_groups": groups_settings(live["param_groups"])}
        return cls(
            key,
            snapshot,
            [(name, extra[name]) for name in live_model if name in extra],
            loose_src,
            [_copy_of(p.detach(), host) for p in loose_src],
            model_src,
            model_dst,
            opt_snapshot,
            opt_src,
            opt_dst,
            scalars,
            finite,
            params,
            [p.shape for p in params],
            host,
            without,
            tuple(
                {
                    t.device: None
                    for t in (*model_src, *loose_src, *opt_src)
                    if host and plain(t) and _on_accelerator(t)
                }
            ),
        )

    def refresh(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Copy the live values into the preallocated buffers (no allocation, no tree walk).

        Copies to the host do not block it: they run in order on the accelerator's current
        stream (before the optimizer step that follows changes the live tensors), and
        :meth:`settle` waits for them before the host reads the copies."""
        to_host = bool(self.devices)
        with torch.no_grad():
            copy_all(self.model_dst, self.model_src, non_blocking=to_host)
            copy_all(self.loose_dst, self.loose_src, non_blocking=to_host)
            copy_all(self.opt_dst, self.opt_src, non_blocking=to_host)
        if to_host:
            self.pending = [_recorded(d) for d in self.devices]
        for name, module in self.extra:
            self.model[name] = copy.deepcopy(module.get_extra_state())
        for copied, name, entries in self.scalars:
            copied[name] = copy.deepcopy(entries[name])
        if optimizer is not None and self.optimizer is not None:
            groups = self.optimizer["param_groups"]
            for group, live in zip(groups, optimizer.param_groups, strict=True):
                group.update(group_settings(live, group["params"]))

    def load_loose_back(self) -> None:
        """Put the copies of :attr:`loose_src` back into those parameters (a restore), each
        that still has its shape."""
        self.settle()
        pairs = [
            (p, c)
            for p, c in zip(self.loose_src, self.loose_dst, strict=True)
            if p.shape == c.shape
        ]
        with torch.no_grad():
            copy_all([p for p, _ in pairs], [c for _, c in pairs])

    def model_to_load(self) -> dict[str, Any]:
        """The model snapshot for ``load_state_dict``: its extra states copied again, so that a
        module that keeps the object it is given cannot change the snapshot."""
        if not self.extra:
            return self.model
        state = OrderedDict(self.model)
        for name, _ in self.extra:
            state[name] = copy.deepcopy(state[name])
        metadata = getattr(self.model, "_metadata", None)
        if metadata is not None:
            state._metadata = metadata  # type: ignore[attr-defined]
        return state

    def load_optimizer_back(self, optimizer: torch.optim.Optimizer, keep: tuple[str, ...]) -> None:
        """Restore the optimizer's copies into the live state tensors they were taken from, in
        place: ``load_state_dict`` builds a second optimizer state on the device before it
        drops the first (twice the parameters' size for Adam), so a model that fills its GPU
        could not be restored. Only while the plan is current (:func:`live_key` unchanged)
        and the optimizer has no load hooks (:func:`in_place_ok`). The param groups get their
        captured settings back, except the *keep* keys (the learning rates now)."""
        self.settle()
        with torch.no_grad():
            copy_all(self.opt_src, self.opt_dst)
        for copied, name, entries in self.scalars:
            entries[name] = copy.deepcopy(copied[name])  # type: ignore[index]
        if self.optimizer is None:
            return
        for live, held in zip(optimizer.param_groups, self.optimizer["param_groups"], strict=True):
            settings = group_settings(held, live["params"])  # copies of the captured values
            live.update({k: v for k, v in settings.items() if k not in keep})

    def settle(self) -> None:
        """Wait for the last refresh's copies to the host (nothing to wait for otherwise)."""
        pending, self.pending = self.pending, []
        for event in pending:
            event.synchronize()


def in_place_ok(optimizer: torch.optim.Optimizer) -> bool:
    """Whether *optimizer* may be restored in place: it has no ``load_state_dict`` hooks (which
    only its own ``load_state_dict`` runs; unknown hook storage counts as hooks)."""
    for name in ("_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks"):
        hooks = getattr(optimizer, name, None)
        if not isinstance(hooks, Mapping) or hooks:
            return False
    return True


def _recorded(device: torch.device) -> torch.Event:
    event = torch.Event(device=device)
    event.record(torch.accelerator.current_stream(device))
    return event


def group_settings(live: Mapping[str, Any], params: list[int]) -> dict[str, Any]:
    """A param group's settings as a snapshot holds them (tensors copied, indices kept)."""
    out = {
        k: (v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v))
        for k, v in live.items()
        if k != "params"
    }
    out["params"] = params
    return out


def groups_settings(packed: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [group_settings(g, list(g["params"])) for g in packed]
