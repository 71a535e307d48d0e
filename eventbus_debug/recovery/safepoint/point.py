"""The safe point: where the training loop applies recovery decisions, deterministically."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, NoReturn, TypeAlias, final

import torch
from torch import nn
from torch.amp.grad_scaler import OptState

from eventbus_debug.diagnostics import get_logger

from ..._records import fast_init
from ..._saved import StateReader
from ..._tensors import non_finite
from ..._validate import positive_number
from ...events import RecoveryAction, RecoveryApplied, Severity, SnapshotPlaced, StepSkipped
from ...exceptions import TrainingStopped
from ..actions import Action, ClipGradients, DecidedAction, RestoreState, ScaleLR, SkipStep
from ..agreement import AgreedStep, Agreement
from ..agreement_blocking import BlockingAgreement
from ..engine import RecoveryEngine
from ..lr import lr_schedulers, scale_learning_rate
from ..memory import free_memory
from ._placement import Placement
from .snapshot import NoGoodStateError, StateSnapshots

__all__ = ("AgreeHook", "SafePoint", "StepDecision", "read_temporary")

_log = get_logger(__name__)

SOURCE: Final = "recovery.safe_point"

AgreeHook: TypeAlias = Callable[[Sequence[DecidedAction]], Sequence[DecidedAction]]
"""Turns this rank's pending decisions into the decisions every rank applies.

The identity by default. A distributed layer plugs in one small collective here: e.g. encode
the actions as a bit mask and the LR factor / clip norm as floats, ``all_reduce`` them (MAX for
the mask, MIN for the factors), and return the agreed decisions, so that no rank skips, restores
or stops alone.
"""


def _identity(decisions: Sequence[DecidedAction]) -> Sequence[DecidedAction]:
    return decisions


def _members(group: dict[str, Any]) -> tuple[int, ...]:
    """A param group's identity: its parameters' (a restore's new group dicts keep them)."""
    return tuple(id(p) for p in group["params"])


@dataclass(slots=True)
class _Temporary:
    """A temporary LR change in force.

    Attributes:
        left: healthy steps before it is undone.
        factor: the factor it multiplied the LR by.
        groups: the param groups it scaled (by :func:`_members`), the ones it undoes.
    """

    left: int
    factor: float
    groups: frozenset[tuple[int, ...]]


def read_temporary(state: StateReader) -> list[tuple[int, float, list[int]]]:
    """The ``(left, factor, group indices)`` of each temporary LR change in a saved
    :meth:`SafePoint.state`.

    Raises:
        ValueError: if a field is missing or malformed (the message names it).
    """
    changes: list[tuple[int, float, list[int]]] = []
    for item in state.children("temporary_lr_changes"):
        factor = item.checked("factor", positive_number)
        changes.append((item.count("left"), factor, item.counts("groups")))
    return changes


@fast_init
@dataclass(frozen=True, slots=True, kw_only=True)
class StepDecision:
    """What a safe point did, and whether the loop should call ``optimizer.step()``.

    Attributes:
        step: the step.
        should_step: call ``optimizer.step()`` when True; the gradients were zeroed otherwise.
        actions: the actions applied, in the order they were applied.
        details: what each action changed, in words.
        lr_factor: the factor the learning rates were multiplied by at this safe point.
        decided: the typed decisions this safe point applied (with their numbers), in the
            order they were decided; empty on a step with nothing to apply.
    """

    step: int
    should_step: bool
    actions: tuple[RecoveryAction, ...] = ()
    details: tuple[str, ...] = ()
    lr_factor: float = 1.0
    decided: tuple[Action, ...] = ()

    def __bool__(self) -> bool:
        return self.should_step


@final
class SafePoint:
    """Applies the engine's step-level decisions to a model and optimizer, at one known point.

    Call it after ``backward()`` and the probe's check, before ``optimizer.step()``::

        decision = await safe.before_optimizer_step(step)
        if decision.should_step:
            optimizer.step()
        optimizer.zero_grad()

    It waits until the engine handled every incident published so far (only the engine: a slow
    report writer does not delay training), takes the step's decisions from the engine once
    (:meth:`RecoveryEngine.take`, agreed across ranks with an *agreement*), passes them through
    the *agree* hook, then applies them in a fixed order: STOP (raises), RESTORE_STATE,
    SCALE_LR, FREE_MEMORY, CLIP_GRADIENTS, SKIP_STEP. A clean step (no incident at all, not
    even one answered with ``CONTINUE``) resets the strategies' consecutive counts and may
    refresh the snapshot of the last good state.

    Args:
        engine: the recovery engine.
        model: the model whose parameters and gradients are acted on.
        optimizer: its optimizer (learning rates, state).
        snapshots: where the last good state is kept; ``None`` keeps one every 50 good steps.
        agree: a hook turning the pending decisions into the applied ones (see
            :data:`AgreeHook`); called only when some decision is pending.
        agreement: the distributed :class:`~eventbus_debug.recovery.agreement.Agreement`,
            called at EVERY safe point (it is a collective): decisions and whether the step had
            an incident are agreed across ranks before anything is applied.
        schedulers: LR schedulers of *optimizer*. SCALE_LR also scales the base LRs they
            recompute from (``base_lrs``, ``initial_lr``, OneCycleLR's ``max_lr``/``min_lr``),
            so LambdaLR or OneCycleLR do not undo the decision at their next ``step()``.
        scaler: the loop's ``torch.amp.GradScaler``, for a loop that calls
            ``scaler.update()`` on every step (``if decision.should_step:
            scaler.step(optimizer)``, then ``scaler.update()``). On a step the safe point skips,
            ``scaler.step()`` does not run, so no inf check would be recorded and
            ``update()`` would raise ``AssertionError: No inf checks were recorded``; the safe
            point records it (``scaler.unscale_(optimizer)`` before zeroing the gradients,
            unless the loop unscaled already), and ``update()`` lowers the scale if they
            overflowed. Leave it out for a loop that calls ``update()`` only after
            ``scaler.step()``.

    Raises:
        TypeError: if *engine*, *model*, *optimizer*, *snapshots* or *scaler* has the wrong
            type, *agree* is not callable, or a scheduler has no ``step()``.
    """

    def __init__(
        self,
        engine: RecoveryEngine,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        snapshots: StateSnapshots | None = None,
        agree: AgreeHook | None = None,
        agreement: Agreement | None = None,
        schedulers: Sequence[Any] = (),
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        if not isinstance(engine, RecoveryEngine):
            msg = f"engine must be a RecoveryEngine, got {engine!r}"
            raise TypeError(msg)
        if not isinstance(model, nn.Module):
            msg = f"model must be a torch.nn.Module, got {type(model).__name__}"
            raise TypeError(msg)
        if not isinstance(optimizer, torch.optim.Optimizer):
            msg = f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            raise TypeError(msg)
        self.engine = engine
        self.model = model
        self.optimizer = optimizer
        self.schedulers: tuple[Any, ...] = lr_schedulers(tuple(schedulers))
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            msg = f"scaler must be a torch.amp.GradScaler or None, got {type(scaler).__name__}"
            raise TypeError(msg)
        self.scaler = scaler
        """The GradScaler whose inf check a skipped step records (see *scaler*)."""
        if snapshots is not None and not isinstance(snapshots, StateSnapshots):
            msg = f"snapshots must be a StateSnapshots or None, got {snapshots!r}"
            raise TypeError(msg)
        if agree is not None and not callable(agree):
            msg = f"agree must be a function decisions -> decisions, or None, got {agree!r}"
            raise TypeError(msg)
        self.snapshots = snapshots if snapshots is not None else StateSnapshots()
        self._agree = agree if agree is not None else _identity
        if agreement is not None and not isinstance(agreement, Agreement):
            msg = f"agreement must be an Agreement (with agree(step, decisions, noted)), got {agreement!r}"
            raise TypeError(msg)
        self.agreement = agreement
        if isinstance(agreement, BlockingAgreement):
            # a restore lands on every rank or on none: each says whether it holds a state
            agreement.holds_state = self._holds_state
        self.agreed: AgreedStep | None = None
        """What the ranks agreed at the last safe point (None without an agreement)."""
        self._skip_remaining = 0
        self._skip_reason = ""
        self._temporary: list[_Temporary] = []  # the temporary LR changes in force
        self._restore_listeners: list[Callable[[], None]] = []
        self._placement_seen: Placement | None = None  # the last placement said on the bus

    def _holds_state(self) -> bool:
        return self.snapshots.available

    def _say_placement(self, step: int) -> None:
        """Publish that no snapshot is kept (no room for one), and that one is again: what
        a reader of the log must know; where a kept one lives is logged only."""
        placement = self.snapshots.placement
        last, self._placement_seen = self._placement_seen, placement
        if placement is None:
            return
        unkept = placement.where == "none"
        if unkept == (last is not None and last.where == "none"):
            return
        self.engine.bus.publish_nowait(
            SnapshotPlaced(
                source=SOURCE,
                step=step,
                severity=Severity.WARNING if placement.where == "none" else Severity.INFO,
                where=placement.where,
                nbytes=placement.nbytes,
                reason=placement.reason,
            )
        )

    def add_restore_listener(self, listener: Callable[[], None]) -> None:
        """Call *listener* after every restore (the session restarts the probe's baselines).

        Raises:
            TypeError: if *listener* is not callable.
        """
        if not callable(listener):
            msg = f"listener must be callable, got {listener!r}"
            raise TypeError(msg)
        self._restore_listeners.append(listener)

    def state(self) -> dict[str, Any]:
        """The temporary LR changes in force (param groups by their index in the optimizer),
        to save in a checkpoint: the optimizer's state dict holds the changed LR, this says when
        to undo it (see :meth:`load`)."""
        index = {_members(g): i for i, g in enumerate(self.optimizer.param_groups)}
        return {
            "temporary_lr_changes": [
                {
                    "left": t.left,
                    "factor": t.factor,
                    "groups": sorted(index[m] for m in t.groups if m in index),
                }
                for t in self._temporary
            ]
        }

    def load(self, state: StateReader) -> None:
        """Continue from a :meth:`state`: the temporary LR changes it lists are undone after
        their remaining healthy steps, in the param groups at the same indices (the optimizer
        restored from the same checkpoint holds the changed LR).

        Raises:
            ValueError: if a field is missing or malformed (the message names it).
        """
        groups = self.optimizer.param_groups
        self._temporary = [
            _Temporary(left, factor, frozenset(_members(groups[i]) for i in idx if i < len(groups)))
            for left, factor, idx in read_temporary(state)
        ]

    @property
    def temporary_lr_changes(self) -> tuple[tuple[float, int], ...]:
        """The temporary LR changes in force: ``(factor, healthy steps before it is undone)``."""
        return tuple((t.factor, t.left) for t in self._temporary)

    async def before_optimizer_step(self, step: int, *, loss: float | None = None) -> StepDecision:
        """Wait for the engine, apply its pending decisions for *step*, say whether to step.

        Raises:
            TrainingStopped: if recovery decided to stop (strategies exhausted, or a restore
                was needed and no good state exists).
            TimeoutError: if the engine does not catch up within its ``drain_timeout``.
        """
        await self.engine.drain()
        return self._apply(step, loss)

    def before_optimizer_step_inline(
        self, step: int, *, loss: float | None = None
    ) -> StepDecision | None:
        """:meth:`before_optimizer_step` without a coroutine when the engine has nothing to
        catch up on (a healthy step): the decision; ``None`` when the engine has incidents to
        handle first, and the caller awaits :meth:`before_optimizer_step` instead.

        Raises:
            TrainingStopped: as :meth:`before_optimizer_step`.
        """
        engine = self.engine
        if engine._blocking is not None or not engine.caught_up():
            return None  # (an engine on a SyncEventBus: the awaited call says what to use)
        return self._apply(step, loss)

    def before_optimizer_step_sync(self, step: int, *, loss: float | None = None) -> StepDecision:
        """:meth:`before_optimizer_step` for a loop using a :class:`~eventbus_debug.SyncEventBus`.

        Raises:
            TrainingStopped: as :meth:`before_optimizer_step`.
            TimeoutError: as :meth:`before_optimizer_step`.
        """
        self.engine.drain_sync()
        return self._apply(step, loss)

    # -- applying ----------------------------------------------------------------------------

    def _apply(self, step: int, loss: float | None = None) -> StepDecision:
        pending = self.engine.take(step, loss=loss, agreement=self.agreement)
        if self.agreement is not None:
            self.agreed = pending.agreed
        decided = list(pending.actions)
        if self._agree is not _identity and self.agreement is None:
            decided = list(self._agree(decided))
        if not decided:
            if self._skip_remaining > 0:
                self._skip_remaining -= 1
                return self._skip(step, self._skip_reason, (), ())
            if not pending.clean:
                return StepDecision(step=step, should_step=True)
            self.snapshots.maybe_capture(step, self.model, self.optimizer)
            if self.snapshots.placement is not self._placement_seen:
                self._say_placement(step)
            if self._temporary:
                return self._tick_temporary(step)
            return StepDecision(step=step, should_step=True)
        actions: list[RecoveryAction] = []
        details: list[str] = []
        by_kind: dict[RecoveryAction, list[DecidedAction]] = {}
        for d in decided:
            by_kind.setdefault(d.kind, []).append(d)
        typed = tuple(d.action for d in decided)

        stops = by_kind.get(RecoveryAction.STOP)
        if stops:
            self._stop(step, stops[0].reason)

        skip = bool(by_kind.get(RecoveryAction.SKIP_STEP))
        reasons = [d.reason for d in decided]

        restores = by_kind.get(RecoveryAction.RESTORE_STATE, ())
        if restores:
            required = any(
                isinstance(d.action, RestoreState) and d.action.required for d in restores
            )
            try:
                restored = self.snapshots.restore(self.model, self.optimizer)
            except NoGoodStateError as exc:
                if required:
                    self._publish(step, RecoveryAction.RESTORE_STATE, str(exc), "failed")
                    self._stop(step, f"{restores[0].reason}; {exc}")
                # A precaution with nothing to restore: the step is skipped, nothing is lost.
                # A held state that does not fit the model any more (its structure changed:
                # the restore refused it and changed nothing) is the same case.
                if self.snapshots.available:
                    detail = f"nothing restored: {exc}"
                else:
                    detail = f"no good state held yet, nothing restored ({exc})"
                self._publish(step, RecoveryAction.RESTORE_STATE, detail, "skipped")
            else:
                age = f", {step - restored} steps old" if restored is not None else ""
                detail = f"restored the state of step {restored}{age}"
                self._publish(step, RecoveryAction.RESTORE_STATE, detail, "applied")
                actions.append(RecoveryAction.RESTORE_STATE)
                details.append(detail)
                for listener in self._restore_listeners:
                    listener()
            skip = True  # these gradients belong to the state just discarded

        lr_factor = 1.0
        for d in by_kind.get(RecoveryAction.SCALE_LR, ()):
            if not isinstance(d.action, ScaleLR):
                continue
            lr_factor *= d.action.factor
            if d.action.steps and d.action.factor != 1.0:
                members = frozenset(_members(g) for g in self.optimizer.param_groups)
                self._temporary.append(_Temporary(d.action.steps, d.action.factor, members))
        if lr_factor != 1.0:
            detail = scale_learning_rate(self.optimizer, lr_factor, self.schedulers)
            if self._temporary:
                detail += "; temporary: undone after healthy steps"
            self._publish(step, RecoveryAction.SCALE_LR, detail, "applied")
            actions.append(RecoveryAction.SCALE_LR)
            details.append(detail)

        if RecoveryAction.FREE_MEMORY in by_kind:
            detail = free_memory().describe()
            self._publish(step, RecoveryAction.FREE_MEMORY, detail, "applied")
            _log.info("memory_freed", step=step, detail=detail)
            actions.append(RecoveryAction.FREE_MEMORY)
            details.append(detail)

        clips = [d.action for d in decided if isinstance(d.action, ClipGradients)]
        if clips and not skip:
            max_norm = min(c.max_norm for c in clips)
            total = clips[-1].total_norm
            params = [p for p in self.model.parameters() if p.grad is not None]
            # The probe already reduced the gradients: reuse its total norm, no second pass.
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, torch.tensor(total))
            detail = f"gradients clipped from norm {total:.4g} to {max_norm:.4g}"
            self._publish(step, RecoveryAction.CLIP_GRADIENTS, detail, "applied")
            actions.append(RecoveryAction.CLIP_GRADIENTS)
            details.append(detail)

        skip_batches = max(
            (d.action.batches for d in decided if isinstance(d.action, SkipStep)), default=1
        )
        if skip:
            self._skip_remaining = max(self._skip_remaining, skip_batches - 1)
            self._skip_reason = f"skipping the batches after: {reasons[0]}"
            return self._skip(
                step, "; ".join(dict.fromkeys(reasons)), actions, details, lr_factor, typed
            )
        return StepDecision(
            step=step,
            should_step=True,
            actions=tuple(actions),
            details=tuple(details),
            lr_factor=lr_factor,
            decided=typed,
        )

    def _tick_temporary(self, step: int) -> StepDecision:
        """Count a healthy step against each temporary LR change; undo the ones that are due.

        A change is undone in the param groups it scaled: a group added since
        (``add_param_group``, unfreezing layers) was added at the LR meant for it, and keeps it.
        """
        due: list[_Temporary] = []
        keep: list[_Temporary] = []
        for entry in self._temporary:
            entry.left -= 1
            (due if entry.left <= 0 else keep).append(entry)
        self._temporary = keep
        if not due:
            return StepDecision(step=step, should_step=True)
        live = [_members(g) for g in self.optimizer.param_groups]
        undo_by_group = [1.0] * len(live)
        for entry in due:
            for i, members in enumerate(live):
                if members in entry.groups:
                    undo_by_group[i] /= entry.factor
        applied: list[str] = []
        for factor in dict.fromkeys(undo_by_group):
            if factor == 1.0:
                continue
            chosen = [i for i, f in enumerate(undo_by_group) if f == factor]
            everything = len(chosen) == len(live)
            applied.append(
                scale_learning_rate(
                    self.optimizer,
                    factor,
                    self.schedulers,
                    groups=None if everything else chosen,
                )
            )
        undo = math.prod(1.0 / e.factor for e in due)
        if not applied:
            return StepDecision(step=step, should_step=True)
        detail = f"temporary LR change undone after healthy steps: {'; '.join(applied)}"
        self._publish(step, RecoveryAction.SCALE_LR, detail, "restored")
        return StepDecision(
            step=step,
            should_step=True,
            actions=(RecoveryAction.SCALE_LR,),
            details=(detail,),
            lr_factor=undo,
        )

    def _skip(
        self,
        step: int,
        reason: str,
        actions: Sequence[RecoveryAction],
        details: Sequence[str],
        lr_factor: float = 1.0,
        decided: tuple[Action, ...] = (),
    ) -> StepDecision:
        if self.scaler is not None:
            _record_inf_check(self.scaler, self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        _clear_non_finite_grads(self.model, self.optimizer)
        detail = f"optimizer step {step} skipped, gradients zeroed"
        self._publish(step, RecoveryAction.SKIP_STEP, detail, "applied")
        self.engine.bus.publish_nowait(StepSkipped(source=SOURCE, step=step, reason=reason))
        return StepDecision(
            step=step,
            should_step=False,
            actions=(*actions, RecoveryAction.SKIP_STEP),
            details=(*details, detail),
            lr_factor=lr_factor,
            decided=decided,
        )

    def _stop(self, step: int, reason: str) -> NoReturn:
        self._publish(step, RecoveryAction.STOP, reason, "exhausted")
        _log.error("training_stopped", step=step, reason=reason)
        raise TrainingStopped(reason)

    def _publish(self, step: int, action: RecoveryAction, detail: str, outcome: str) -> None:
        self.engine.bus.publish_nowait(
            RecoveryApplied(source=SOURCE, step=step, action=action, detail=detail, outcome=outcome)
        )


def _clear_non_finite_grads(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Drop the non-finite gradients of the model's parameters the optimizer does not step.

    ``optimizer.zero_grad()`` clears its own; a parameter outside it (trained by another
    optimizer, or by none: a loop calling ``optimizer.zero_grad()`` never clears it) kept the
    skipped step's NaN, which every later step added to: each was then non-finite and skipped.
    Their finite gradients are theirs to keep (another optimizer's, accumulating)."""
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for p in model.parameters():
        grad = p.grad
        if grad is None or id(p) in stepped:
            continue
        if non_finite(grad):
            p.grad = None


def _record_inf_check(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
    """Give a skipped step the inf check ``scaler.step()`` would have recorded.

    ``scaler.unscale_(optimizer)`` checks the gradients before they are zeroed (a loop that
    already unscaled has its check). With no gradient at all (a batch skipped after a
    rollback) there is nothing to check: a "no overflow" is recorded, through the scaler's
    per-optimizer state, so that ``update()`` does not raise.
    """
    scale = getattr(scaler, "_scale", None)
    if not scaler.is_enabled() or not isinstance(scale, torch.Tensor):
        return  # disabled, or scale() never ran: update() has nothing to do / raises its own
    states = getattr(scaler, "_per_optimizer_states", None)
    if states is None:
        return
    state = states[id(optimizer)]
    if state.get("stage") is OptState.READY:
        scaler.unscale_(optimizer)
    found = state.get("found_inf_per_device")
    if isinstance(found, dict) and not found:
        device = scale.device
        found[device] = torch.zeros((), dtype=torch.float32, device=device)
