"""The last good training state: an in-memory snapshot of model + optimizer, or a checkpoint.

Restoring never loads pickled code: checkpoint files are read with ``torch.load(...,
weights_only=True)``. A snapshot is only taken of finite parameters and optimizer moments and
of buffers free of NaN (an infinite buffer can be a mask), so a restore never brings NaN back.
Where it is kept (beside the model, in host memory, or not at all when it would not fit) is
chosen by :mod:`._placement`.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from typing import Any, Final, final

import torch
from torch import nn
from torch.nn.modules.module import _EXTRA_STATE_KEY_SUFFIX

from eventbus_debug.diagnostics import get_logger

from ..._tensors import non_finite
from ..._validate import positive_int
from ...exceptions import EventBusError
from ..lr import GROUP_LR_KEYS
from ._fit import PER_PARAMETER, SHOWN, Layout, Undo, key_list, model_changes
from ._placement import Location, Placement, choose, location_of, sizes
from ._plan import (
    Plan,
    all_finite,
    copied_tensors,
    finite_groups,
    frozen,
    group_settings,
    in_place_ok,
    live_key,
)

__all__ = ("NoGoodStateError", "StateSnapshots")

_log = get_logger(__name__)

DEFAULT_EVERY: Final = 50


class NoGoodStateError(EventBusError, RuntimeError):
    """Raised by :meth:`StateSnapshots.restore` when no good state was captured or loaded, or
    when the one held cannot be restored into the model and optimizer as they are now (their
    structure changed since it was taken, or the load failed part-way and was undone): in every
    case nothing was restored, and the model and optimizer are as they were."""


@final
class StateSnapshots:
    """Keeps the last good state of a model and its optimizer, to restore after a fault.

    :class:`~eventbus_debug.recovery.SafePoint` calls :meth:`maybe_capture` on good steps; a
    snapshot is taken every *every* good steps (the first good step always captures). Memory
    cost: one copy of the trainable parameters, buffers, modules' extra states and optimizer
    state (16 bytes a parameter for fp32 AdamW), kept where *location* says. Frozen parameters
    (``requires_grad=False``) are not copied: training does not change them; a restore leaves
    them as they are and refuses, naming them, when one is non-finite.

    Args:
        every: capture every this many good steps.
        checkpoint: a file written by :meth:`save` (or any ``{"model": ..., "optimizer": ...}``
            dict of tensors) loaded as the initial good state, with ``weights_only=True``.
        location: where the copy is kept. ``"auto"`` (default): beside the model while it
            takes at most 5 % of each accelerator's memory (a CPU model's copy is in host
            memory anyway), else in pinned host memory, refreshed without blocking the host;
            and not at all when that would take more than half of the host's available memory
            (shared among torchrun's ``LOCAL_WORLD_SIZE`` processes): then a warning
            (``snapshot_not_kept``) says so, and a restore is impossible (recovery stops a
            run whose parameters turned non-finite). ``"device"``: beside the model, always.
            ``"host"``: in host memory when it fits there, else not at all. Tensor subclasses
            (FSDP2's DTensor shards) are copied on their own device.

    Raises:
        ArgumentTypeError: if *every* is not an int (a ``TypeError`` and a ``ValueError``).
        ValueError: if *every* < 1 or *location* is not one of the three.
        TypeError: if *location* is not a str.
        FileNotFoundError: if *checkpoint* does not exist.
    """

    def __init__(
        self,
        *,
        every: int = DEFAULT_EVERY,
        checkpoint: str | os.PathLike[str] | None = None,
        location: Location = "auto",
    ) -> None:
        try:
            self.every = positive_int("every", every)
        except ValueError as exc:  # an ArgumentTypeError keeps its type
            raise type(exc)(f"{exc} (good steps between snapshots)") from None
        self.location: Location = location_of(location)
        self.placement: Placement | None = None
        """Where the last planned snapshot went and why (``None`` before the first capture)."""
        self._said_without = False  # a snapshot without the optimizer's state was said
        self._model: dict[str, torch.Tensor] | None = None
        self._optimizer: dict[str, Any] | None = None
        self._plan: Plan | None = None
        self._params: list[torch.Tensor] | None = None  # the optimizer's, at the capture
        self._shapes: list[torch.Size] | None = None  # their shapes, at the capture
        self._step: int | None = None
        self._good_since = 0
        self.captures = 0
        self.refusals = 0
        """Captures refused (a non-finite state); the first of a streak is logged, its length
        at the next capture."""
        self._refused_since: int | None = None  # the step a streak of refusals started
        self.restores = 0
        self.failed_restores = 0
        """Restores that raised :class:`NoGoodStateError` with a state held (it did not fit the
        model or optimizer, or its load failed part-way and was undone)."""
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
    def _unkept(self) -> bool:
        """Whether the last placement found no room (tried again every *every* good steps)."""
        return self.placement is not None and self.placement.where == "none"

    @property
    def available(self) -> bool:
        """Whether a good state is held."""
        return self._model is not None

    def maybe_capture(
        self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None
    ) -> bool:
        """Count a good step; capture when *every* good steps passed (or none is held yet;
        one that did not fit is tried again after *every* good steps)."""
        self._good_since += 1
        if (self._model is not None or self._unkept) and self._good_since < self.every:
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
        if plan is not None and plan.key != live_key(model, optimizer):
            plan = None  # the live tensors changed: plan the copies again
        placement = None
        if plan is None:
            # where the copies go, before anything is checked or copied; none: not kept
            placement = self._place(step, model, optimizer)
            if placement is None:
                return False
        groups = plan.finite if plan is not None else finite_groups(model, optimizer)
        if not all_finite(groups):
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
        if placement is not None:
            plan = self._plan = Plan.build(model, optimizer, groups, host=placement.where == "host")
            if plan.without_optimizer and not self._said_without:
                self._said_without = True
                _log.warning(
                    "snapshot_without_optimizer_state",
                    step=step,
                    error=plan.without_optimizer,
                    effect="a restore brings back the weights and buffers, not the optimizer's "
                    "state (it cannot be taken on one rank without a collective)",
                )
        else:
            assert plan is not None
            plan.refresh(optimizer)
        self._model = plan.model
        self._optimizer = plan.optimizer
        self._params = plan.params
        self._shapes = plan.shapes
        self._step = step
        self._good_since = 0
        self.captures += 1
        return True

    def _place(
        self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None
    ) -> Placement | None:
        """Choose where a new plan's copies go (said when it changes); ``None`` when nowhere:
        then a snapshot held of ours (a copy of a structure that is gone) is dropped, its
        memory with it; said once, and tried again after *every* good steps (memory may be
        freed by then)."""
        by_device, stuck = sizes(copied_tensors(model, optimizer))
        before = self.placement
        placement = self.placement = choose(self.location, by_device, stuck=stuck)
        if placement.where != "none":
            if before is None or before.where != placement.where:
                _log.info(
                    "snapshot_placed",
                    step=step,
                    where=placement.where,
                    bytes=placement.nbytes,
                    reason=placement.reason,
                )
            return placement
        self._good_since = 0
        if self._plan is not None:  # a snapshot of ours, of the structure before: drop it
            self._plan = None
            self._model = self._optimizer = self._params = self._shapes = None
            self._step = None
        if before is not None and before.where == "none":
            return None  # said when it began
        _log.warning(
            "snapshot_not_kept",
            step=step,
            bytes=placement.nbytes,
            reason=placement.reason,
            effect="no restore is possible: non-finite parameters stop the run; pass "
            "StateSnapshots(location='device') to keep it beside the model, or save "
            "checkpoints and load one with StateSnapshots(checkpoint=...)",
        )
        return None

    def restore(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> int | None:
        """Load the held state into *model* and *optimizer*; returns its step.

        The learning rates the optimizer has now are kept, with the scheduler keys
        ``initial_lr``/``max_lr``/``min_lr`` (a restore undoes the weights and the optimizer's
        moments, not the LR decisions taken since). The optimizer keeps the param groups it has
        now: each parameter gets back the state it had at the capture (found by identity), a
        parameter added since (``add_param_group``) starts with no state, as it did when added.

        All or nothing. Everything it would load is checked first against the model and the
        optimizer as they are now: the model's entries (names, shapes, and the kind of dtype:
        floating, complex, integer or bool), the optimizer's param groups (their sizes, when
        the held state has no parameter identities: a checkpoint) and the shape of each
        parameter's state. When the structure changed since the capture (a layer added or
        replaced, a parameter reshaped, a buffer added or removed) nothing is written and the
        error names every change. A precision or device change (``model.to(...)``) is not one:
        the values are loaded cast, as ``load_state_dict`` casts them. A load that fails
        part-way all the same (a load hook that raises) is undone from a copy of the model
        taken here, and the optimizer gets its own state and groups back. After a failed
        restore the next good step takes a new snapshot.

        Raises:
            NoGoodStateError: if no good state was captured or loaded, if the one held does not
                fit the model and optimizer, or if its load failed (that error as the cause);
                the model and optimizer are as they were. An error that is not an
                ``Exception`` (``KeyboardInterrupt``) is undone too, and raised as it is.
            RuntimeError: if a load failed and there was no memory for the copy that would
                have undone it (logged as ``restore_without_undo`` before loading).
        """
        if self._model is None:
            placement = self.placement
            if placement is not None and placement.where == "none":
                msg = (
                    "no good state to restore: the snapshot was not kept, it would not fit in "
                    f"memory ({placement.reason}), and no checkpoint was given"
                )
            else:
                msg = (
                    "no good state to restore: none was captured yet (StateSnapshots captures "
                    "on the first good safe point) and no checkpoint was given"
                )
            raise NoGoodStateError(msg)
        if self._plan is not None:
            self._plan.settle()  # the copies to the host have landed before they are read
        held = "the state held " + (
            f"from step {self._step}" if self._step is not None else "(a checkpoint with no step)"
        )
        layout: Layout | None = None
        if optimizer is not None and self._optimizer is not None:
            layout = self._remapped(optimizer, self._optimizer)
        plan = self._plan  # None: the state held is a loaded checkpoint's (or none)
        # frozen parameters a snapshot leaves out (a checkpoint saved from one, too)
        live = model.state_dict(keep_vars=True)
        skipped = frozenset(k for k, v in live.items() if frozen(v) and k not in self._model)
        changes = model_changes(self._model, model, skipped)
        if optimizer is not None and layout is not None:
            changes += self._optimizer_changes(model, optimizer, layout, changes)
        if changes:
            self._failed()
            shown = "; ".join(changes[:SHOWN]) + (" ..." if len(changes) > SHOWN else "")
            _log.warning("restore_refused", step=self._step, changes=shown)
            msg = (
                f"{held} does not fit the model and optimizer as they are now, nothing was "
                f"restored (both are as they were): {shown}. Their structure changed since the "
                "snapshot; the next good step takes a new one"
            )
            raise NoGoodStateError(msg)
        bad = [k for k in skipped if non_finite(live[k])]  # a restore cannot mend them
        if bad:
            self._failed()
            msg = (
                f"frozen parameters are non-finite ({key_list(bad)}): the snapshot holds the "
                "trainable ones only (training does not change the frozen), nothing was restored"
            )
            raise NoGoodStateError(msg)
        undo = Undo.take(model, optimizer, host=plan is not None and plan.host, skip=skipped)
        keys = ("lr", *GROUP_LR_KEYS)
        current = plan is not None and plan.key == live_key(model, optimizer)
        try:
            held_model = plan.model_to_load() if plan is not None else self._model
            # copies into the live tensors, hooks run; the frozen parameters are not in it
            model.load_state_dict(held_model, strict=not skipped)
            if plan is not None:
                plan.load_loose_back()  # the optimizer's parameters outside the model
            if optimizer is not None and layout is not None:
                if current and plan is not None and in_place_ok(optimizer):
                    plan.load_optimizer_back(optimizer, keys)  # nothing allocated
                else:
                    lrs = [{k: g[k] for k in keys if k in g} for g in optimizer.param_groups]
                    optimizer.load_state_dict(copy.deepcopy(layout.state_dict))
                    for group, kept in zip(optimizer.param_groups, lrs, strict=True):
                        group.update(kept)
        except BaseException as exc:
            self._failed()
            error = f"{type(exc).__name__}: {exc}"
            undone = undo.put_back(model, optimizer)
            if not isinstance(exc, Exception):
                raise  # an interrupt stays one (undone, when there was memory for the copy)
            if not undone:
                _log.error("restore_failed", step=self._step, error=error, undone=False)
                msg = (
                    f"restoring {held} failed part-way ({error}) and could not be undone (no "
                    "memory for the copy): the model may be partly restored"
                )
                raise RuntimeError(msg) from exc
            _log.warning("restore_failed", step=self._step, error=error, undone=True)
            msg = (
                f"restoring {held} failed part-way ({error}); the model and optimizer were put "
                "back as they were, nothing was restored"
            )
            raise NoGoodStateError(msg) from exc
        self.restores += 1
        # Refresh at the next good step: the restored state is good, and the next snapshot
        # must not be `every` steps away (a second fault would go back further still).
        self._good_since = self.every
        _log.info("state_restored", step=self._step)
        return self._step

    def _failed(self) -> None:
        """Count a failed restore; the held state does not fit: take a new one at the next
        good step rather than *every* good steps from the last capture."""
        self.failed_restores += 1
        self._good_since = self.every

    def _remapped(self, optimizer: torch.optim.Optimizer, held: dict[str, Any]) -> Layout:
        """The held optimizer state dict laid out on *optimizer*'s param groups as they are now.

        With the same group sizes as at the capture it is loaded by position, as torch loads a
        state dict. Otherwise (``add_param_group`` since) each parameter's state is found by
        identity; groups that hold the same parameters as at the capture keep their captured
        settings, a group added since keeps its live ones. A loaded checkpoint has no
        parameter identities: its indices are the optimizer's order, loaded as they are.
        """
        params = self._params
        if params is None:
            return Layout(held)
        live_groups = optimizer.param_groups
        if [len(g["params"]) for g in held["param_groups"]] == [
            len(g["params"]) for g in live_groups
        ]:
            return Layout(held)  # the same layout: by position, as torch loads a state dict
        index = {id(p): i for i, p in enumerate(params)}
        by_members = {tuple(id(params[i]) for i in g["params"]): g for g in held["param_groups"]}
        held_state = held["state"]
        state: dict[int, Any] = {}
        origins: dict[int, int] = {}
        groups: list[dict[str, Any]] = []
        n = 0
        for live in live_groups:
            members = tuple(id(p) for p in live["params"])
            captured = by_members.get(members)
            groups.append(
                group_settings(
                    captured if captured is not None else live, list(range(n, n + len(members)))
                )
            )
            for j, pid in enumerate(members):
                old = index.get(pid)
                if old is not None and old in held_state:
                    state[n + j] = held_state[old]
                    origins[n + j] = old
            n += len(members)
        _log.info("optimizer_groups_changed_since_snapshot", step=self._step, groups=len(groups))
        return Layout({"state": state, "param_groups": groups}, origins)

    def _optimizer_changes(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        layout: Layout,
        model_changes: list[str],
    ) -> list[str]:
        """What keeps *layout* from loading into *optimizer* as it is now, in words.

        The param groups must have the sizes the optimizer's have (torch loads by position);
        each state tensor that was shaped like its parameter at the capture must still be (a
        reshaped parameter: its old moments would fail the next ``optimizer.step()``, or
        broadcast). A checkpoint does not say which tensors were: there, the per-parameter
        state names of torch's own optimizers are checked (``exp_avg``, ``momentum_buffer``,
        ...). A parameter of the model whose entry is already in *model_changes* is not said
        twice.
        """
        held_groups = layout.state_dict["param_groups"]
        live_groups = optimizer.param_groups
        held_sizes = [len(g["params"]) for g in held_groups]
        live_sizes = [len(g["params"]) for g in live_groups]
        if held_sizes != live_sizes:
            return [f"optimizer param groups: sizes {live_sizes} now, {held_sizes} at the snapshot"]
        live = [p for g in live_groups for p in g["params"]]
        by_index = dict(zip((i for g in held_groups for i in g["params"]), live, strict=True))
        position = {id(p): i for i, p in enumerate(live)}
        names = {id(p): name for name, p in model.named_parameters()}
        said = " ".join(model_changes)
        shapes = self._shapes
        out: list[str] = []
        for index, entries in layout.state_dict["state"].items():
            param = by_index.get(index)
            if param is None or not isinstance(entries, Mapping):
                continue  # not a parameter's state: torch keeps it as it is
            origin = layout.origins.get(index, index) if layout.origins is not None else index
            captured = shapes[origin] if shapes is not None and 0 <= origin < len(shapes) else None
            name = names.get(id(param))
            if name is not None and repr(name) in said:
                continue
            who = repr(name) if name is not None else f"{position[id(param)]} (not in the model)"
            for key, value in entries.items():
                if not isinstance(value, torch.Tensor):
                    continue
                shaped = value.shape == captured if captured is not None else key in PER_PARAMETER
                if shaped and value.shape != param.shape:
                    out.append(
                        f"optimizer state {key!r} of parameter {who}: shape "
                        f"{tuple(value.shape)} at the snapshot, parameter shape "
                        f"{tuple(param.shape)} now"
                    )
        return out

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the held state to *path* (loadable with ``weights_only=True``).

        Raises:
            NoGoodStateError: if no state is held.
        """
        if self._model is None:
            msg = "no state to save: capture() first"
            raise NoGoodStateError(msg)
        if self._plan is not None:
            self._plan.settle()
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
        self._shapes = None
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
    odd = [
        k
        for k, v in model.items()
        if not isinstance(v, torch.Tensor) and not k.endswith(_EXTRA_STATE_KEY_SUFFIX)
    ]
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
        k
        for k, v in model.items()
        if isinstance(v, torch.Tensor)
        and (v.is_floating_point() or v.is_complex())
        and v.isnan().any()
    ]
    if optimizer is not None:
        state = optimizer.get("state")
        if isinstance(state, Mapping):
            for index, entries in state.items():
                if isinstance(entries, Mapping):
                    bad += [
                        f"optimizer state {index}.{name}"
                        for name, v in entries.items()
                        if isinstance(v, torch.Tensor) and non_finite(v)
                    ]
    if bad:
        msg = (
            f"checkpoint {where!r} is not a good state: non-finite values in "
            f"{', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}"
        )
        raise ValueError(msg)
