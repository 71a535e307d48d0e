"""The device side of a step check: every number of the step in one result vector, one transfer.

:class:`Launcher` runs the reductions a step's checks need (gradient 2-norms, the mean
``|grad|`` pass, parameter and buffer norms, the weight-update norms, the activation counts) as
fused calls, stacks their results with the loss into one vector and starts its copy to the
host. Nothing here synchronizes: :class:`Pending` is read later, on the host, by the judge.

At the every-step cadence without an AMP scaler, a CUDA step costs one ``_foreach_norm`` per
(device, dtype) group, one ``stack`` and one copy into a reused pinned buffer.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import torch
from torch import nn

from ... import _memory
from ..._tensors import copy_all
from ...diagnostics import get_logger
from .._reduce import NormPlan, assemble, sharded
from ..levels import Checks
from .activations import ActivationHooks, ActivationSlot

_log = get_logger(__name__)

__all__ = ("Launcher", "Layout", "Pending", "global_norms")

_MAX_PLANS: Final = 8
_PINNED_PER_SIZE: Final = 8
"""Pinned host buffers kept per vector size (deferred mode holds a few steps in flight)."""


_item = torch.Tensor.item
"""A one-element tensor's value (a float; an int for the activation counts)."""
_grad = operator.attrgetter("grad")
_requires_grad = operator.attrgetter("requires_grad")


class _GradPlan:
    """The reductions of one pattern of present gradients (and, fused, of the state too)."""

    __slots__ = ("_fused", "every", "ordered", "plan", "present", "sharded")

    def __init__(self, plan: NormPlan, present: tuple[int, ...], sharded: bool, n: int) -> None:
        self.plan = plan
        self.present = present  # parameter indices that have a gradient, ascending
        self.every = len(present) == n  # every parameter has one: the gradients list as it is
        self.ordered = tuple(present[j] for j in plan.order)  # parameter index per position
        self.sharded = sharded  # DTensor gradients: their norms need a collective
        self._fused: tuple[NormPlan, tuple[int, ...]] | bool | None = False

    def fused(
        self, grads: Sequence[torch.Tensor], state: Sequence[torch.Tensor]
    ) -> tuple[NormPlan, tuple[int, ...]] | None:
        """One plan over the gradients then the state, when it keeps the gradients first.

        Then one ``_foreach_norm`` serves both on a parameter-check step. Not for sharded or
        stacked tensors (their positions would interleave): ``None``, and two calls are made.
        """
        if self._fused is False:
            self._fused = None
            if not self.sharded and not any(map(sharded, state)):
                plan = NormPlan([*grads, *state])
                k = len(grads)
                order = plan.order
                if plan.flat and tuple(order[:k]) == self.plan.order:
                    self._fused = (plan, tuple(i - k for i in order[k:]))
        return self._fused  # type: ignore[return-value]


@dataclass(slots=True)
class Layout:
    """Where each result sits in a step's vector; host-side bookkeeping only."""

    step: int
    checks: Checks
    has_loss: bool
    host_loss: float | None  # a Python number: judged on the host, in float64
    grad_slots: tuple[int, ...]  # parameter index per gradient position
    grad_numels: tuple[int, ...]
    with_l1: bool
    param_slots: tuple[int, ...]  # slots >= number of parameters are buffers
    update_slots: tuple[int, ...]  # ‖Δw‖ per parameter since the snapshot step
    update_base: int  # the step whose parameter norms are the ‖w‖ of the update ratios
    activations: tuple[ActivationSlot, ...]
    samples: int | None = None  # the step's samples, when the caller said
    no_gradients: bool = False  # gradients were due and no trainable parameter had one


def global_norms(norms: torch.Tensor) -> torch.Tensor:
    """The global values of norms computed over sharded tensors (FSDP2 / DTensor gradients).

    A vector of per-shard reductions is a DTensor with a partial placement; ``full_tensor()``
    reduces it over the mesh (one collective for the whole vector), so the norms are the ones
    ``clip_grad_norm_`` computes, not a rank's shard. Plain tensors pass through.
    """
    full = getattr(norms, "full_tensor", None)
    if callable(full):
        reduced: torch.Tensor = full()
        return reduced
    return norms


class _PinnedPool:
    """Pinned host buffers and CUDA events, reused across steps (no allocation per step)."""

    __slots__ = ("_free",)

    def __init__(self) -> None:
        self._free: dict[tuple[int, torch.dtype], list[tuple[torch.Tensor, torch.cuda.Event]]] = {}

    def acquire(
        self, size: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.cuda.Event]:  # pragma: no cover - GPU
        free = self._free.get((size, dtype))
        if free:
            return free.pop()
        return (
            torch.empty(size, dtype=dtype, pin_memory=True),
            torch.cuda.Event(),  # type: ignore[no-untyped-call]
        )

    def release(
        self, buffer: torch.Tensor, event: torch.cuda.Event
    ) -> None:  # pragma: no cover - GPU
        free = self._free.setdefault((buffer.numel(), buffer.dtype), [])
        if len(free) < _PINNED_PER_SIZE:
            free.append((buffer, event))


class Pending:
    """One step's results on their way to the host.

    On CUDA the pieces are stacked into one vector, copied into a pinned buffer behind a
    recorded event: :meth:`ready` asks the event without waiting, :meth:`read` waits only if it
    is not done yet. On CPU nothing needs a transfer: the pieces are read one by one (0.2 us
    each; a stack costs more, 30 us with mixed dtypes), and the vector is stacked only if
    someone asks for it (:attr:`vector`).
    """

    __slots__ = (
        "_buffer",
        "_event",
        "_flat",
        "_pieces",
        "_pool",
        "_vector",
        "grads",
        "inverse_scale",
        "layout",
    )

    def __init__(
        self,
        layout: Layout,
        pieces: list[torch.Tensor],
        grads: list[torch.Tensor | None],
        pool: _PinnedPool,
        *,
        flat: bool = False,
    ) -> None:
        self.layout = layout
        self.grads = grads
        self._pool = pool
        self._pieces = pieces
        self._flat = flat
        self._event: torch.cuda.Event | None = None
        self._vector: torch.Tensor | None = None
        self.inverse_scale: torch.Tensor | None = None  # set by the launcher under AMP
        if pieces and pieces[0].is_cuda:  # pragma: no cover - GPU
            vector = self._vector = assemble(pieces, flat=flat)
            self._pieces = [vector]  # the pieces themselves are not kept alive
            self._buffer, self._event = pool.acquire(vector.numel(), vector.dtype)
            self._buffer.copy_(vector, non_blocking=True)
            self._event.record()

    @property
    def vector(self) -> torch.Tensor:
        """The step's numbers as one vector on the device (a device-side found-inf flag reads
        it); on CPU it is stacked on first access."""
        if self._vector is None:
            self._vector = assemble(self._pieces, flat=self._flat)
        return self._vector

    @property
    def device(self) -> torch.device:
        """The device the step's numbers were computed on."""
        return self._pieces[0].device if self._pieces else torch.device("cpu")

    def ready(self) -> bool:
        """True when :meth:`read` will not wait for the device."""
        return self._event is None or bool(self._event.query())  # type: ignore[no-untyped-call]

    def read(self) -> list[float]:
        """The step's numbers (waits for the copy only if it is not done yet)."""
        event = self._event
        if event is not None:  # pragma: no cover - GPU
            event.synchronize()  # a deferred read asks ready() first and never gets here early
            values: list[float] = self._buffer.tolist()
            self._pool.release(self._buffer, event)
            self._event = None
            return values
        pieces = self._pieces
        if not pieces:
            return []
        if self._vector is not None or not pieces[0].is_cpu:
            out: list[float] = self.vector.tolist()  # one transfer (MPS, XLA, ...)
            return out
        if self._flat:
            return list(map(_item, pieces))
        values = []
        for p in pieces:
            if p.dim():
                values += p.tolist()
            else:
                values.append(_item(p))
        return values

    def _gradients_at(self, positions: Sequence[int]) -> list[torch.Tensor] | None:
        """The values of the gradients at *positions* (a sparse one's stored values); ``None``
        in deferred mode, where that step's gradients are gone."""
        grads = self.grads
        if not grads:
            return None
        slots = self.layout.grad_slots
        out = []
        for j in positions:
            g = grads[slots[j]]
            assert g is not None
            out.append(g.coalesce().values() if g.is_sparse else g)
        return out

    def count_non_finite(self, positions: Sequence[int]) -> list[tuple[int | None, int | None]]:
        """NaN and Inf counts of the gradients at *positions* (second transfer, only on a fire)."""
        tensors = self._gradients_at(positions)
        if tensors is None:
            return [(None, None)] * len(positions)
        device = self.device
        pairs = [
            global_norms(torch.stack([t.isnan().sum(), t.isinf().sum()])).to(device)
            for t in tensors
        ]
        counts = torch.stack(pairs).tolist()
        return [(int(n), int(i)) for n, i in counts]

    def wide_norms(self, positions: Sequence[int]) -> list[float]:
        """The float64 2-norms of the (finite) gradients at *positions*, unscaled like the
        vector's; read only when their float32 norm overflowed (a third transfer, on a fire).

        ``inf`` where the gradients are gone (deferred mode).
        """
        tensors = self._gradients_at(positions)
        if tensors is None:
            return [math.inf] * len(positions)
        device = self.device
        norms = []
        for t in tensors:
            norm = global_norms(torch.linalg.vector_norm(t, dtype=torch.float64).reshape(1))
            if self.inverse_scale is not None:
                norm = norm * self.inverse_scale.to(device=norm.device, dtype=torch.float64)
            norms.append(norm.to(device))
        values: list[float] = torch.cat(norms).tolist()
        return values


class Launcher:
    """Plans and launches the device work of each step for one model's parameters and buffers.

    Args:
        params: the checked parameters (tied weights once).
        state: the parameters followed by the floating buffers (checked with the parameters).
        activations: the EXTREME hooks whose counts join the vector when due.
    """

    __slots__ = (
        "_activations",
        "_grad_plans",
        "_params",
        "_pool",
        "_snapshot",
        "_snapshot_step",
        "_state",
        "_state_plan",
        "_update_budget",
        "_update_flat",
        "_update_idx",
        "_update_next",
        "_update_plan",
        "_update_said",
        "_update_sizes",
        "_update_slots",
    )

    def __init__(
        self,
        params: tuple[nn.Parameter, ...],
        state: tuple[torch.Tensor, ...],
        activations: ActivationHooks,
    ) -> None:
        self._params = params
        self._state = state
        self._activations = activations
        self._grad_plans: dict[tuple[object, ...], _GradPlan] = {}
        self._state_plan: NormPlan | None = None
        self._snapshot: list[torch.Tensor] | None = None
        self._snapshot_step = -1
        self._update_idx: tuple[int, ...] = ()
        self._update_plan: NormPlan | None = None
        self._update_slots: tuple[int, ...] = ()  # parameter index per update-norm position
        self._update_flat = False  # the update norms are 0-d pieces (no stacked or sharded group)
        self._update_budget: int | None = -1  # bytes the weights' copy may take (-1: not read)
        self._update_next = 0  # where the next window of a rotating measurement starts
        self._update_said = False  # the rotation was logged
        self._update_sizes: tuple[tuple[int, ...], list[int]] | None = None
        self._pool = _PinnedPool()

    @property
    def measuring_updates(self) -> bool:
        """True while a snapshot waits for the next step to measure the weight updates."""
        return self._snapshot_step >= 0

    def forget_updates(self) -> None:
        """Drop the pending update measurement (after a restore or a level change)."""
        self._snapshot_step = -1

    def release(self) -> None:
        """Free the snapshot buffer and the pinned buffers."""
        self._snapshot = None
        self._snapshot_step = -1
        self._pool = _PinnedPool()

    def _within_budget(self, idx: tuple[int, ...]) -> tuple[int, ...]:
        """The parameters of *idx* whose weights are copied for this update measurement.

        All of them, unless the copy would take more than ``_memory.DEVICE_SHARE`` of the
        accelerator's memory (a model that fills its GPU must not run out of it for a
        debugging copy): then a window of them that fits, the next window at the next
        measurement, so that every parameter's update is measured in turn. A parameter too
        large for the budget on its own is not measured.
        """
        budget = self._update_budget
        if budget == -1:
            budget = self._update_budget = _memory.device_budget(self._params[idx[0]].device)
        if budget is None:
            return idx
        known = self._update_sizes
        if known is None or known[0] != idx:  # sized once per set of trainable parameters
            known = self._update_sizes = (idx, [_memory.nbytes(self._params[i]) for i in idx])
        sizes = known[1]
        if sum(sizes) <= budget:
            return idx
        if not self._update_said:
            self._update_said = True
            _log.info(
                "update_ratios_rotating",
                bytes=sum(sizes),
                budget=budget,
                reason="a copy of every trainable weight would take more than "
                f"{_memory.DEVICE_SHARE:.0%} of the device's memory: the weight updates are "
                "measured on a rotating window of parameters",
            )
        n = len(idx)
        first = self._update_next % n
        window: list[int] = []
        used = 0
        self._update_next = first  # all that fit, from *first* on: the same window again
        for k in range(n):
            j = (first + k) % n
            if sizes[j] > budget:
                continue  # too large on its own: never measured
            if used + sizes[j] > budget:
                self._update_next = j  # the next window starts where this one stopped
                break
            window.append(idx[j])
            used += sizes[j]
        return tuple(sorted(window))

    def _grad_plan(self, grads: list[torch.Tensor | None]) -> _GradPlan | None:
        key = tuple([None if g is None else g.layout for g in grads])
        cached = self._grad_plans.get(key)
        if cached is None:
            present = tuple(i for i, g in enumerate(grads) if g is not None)
            if not present:
                return None
            tensors = [g for g in grads if g is not None]
            cached = _GradPlan(NormPlan(tensors), present, any(map(sharded, tensors)), len(grads))
            if len(self._grad_plans) > _MAX_PLANS:
                self._grad_plans.clear()  # patterns rarely change; keep the cache bounded
            self._grad_plans[key] = cached
        return cached

    def state_norms(self) -> tuple[torch.Tensor, tuple[int, ...]]:
        """2-norms of every parameter and floating buffer (fused, as a vector), with their slots."""
        if self._state_plan is None:
            self._state_plan = NormPlan(self._state)
        plan = self._state_plan
        return global_norms(assemble(plan.reduce(self._state))), plan.order

    def launch(
        self,
        step: int,
        loss: torch.Tensor | float | None,
        checks: Checks,
        *,
        l1: bool,
        inverse_scale: torch.Tensor | None,
        samples: int | None = None,
    ) -> Pending:
        """Start the device work of *step*'s *checks*; *l1*: run the mean ``|grad|`` pass;
        *samples*: the step's samples, for the judge (``None``: unknown)."""
        pieces: list[torch.Tensor] = []
        grads: list[torch.Tensor | None] = []
        grad_slots: tuple[int, ...] = ()
        grad_numels: tuple[int, ...] = ()
        param_slots: tuple[int, ...] = ()
        home: torch.device | None = None
        with_l1 = False
        no_gradients = False
        # The update ratios divide by the parameter norms of the snapshot step: measure them then.
        with_state = (checks.params or checks.updates) and bool(self._state)
        host_loss: float | None = None
        lt: torch.Tensor | None = None
        all_scalars = True  # no 1-d piece so far (a stacked group, a scaled or global vector)
        if checks.loss and loss is not None:
            if isinstance(loss, torch.Tensor):
                # Checked in its own precision (a finite float64 loss of 1e39 is finite); the
                # vector takes the widest dtype of its pieces. detach (0.5 us) keeps no graph
                # alive while a deferred step waits; reshape (2 us) only when not 0-d already.
                lt = loss.detach() if loss.dim() == 0 else loss.detach().reshape(())
                pieces.append(lt)
            else:
                host_loss = float(loss)
        if checks.grads:
            grads = list(map(_grad, self._params))
            if not all(map(_requires_grad, self._params)):
                # A frozen parameter's .grad is stale (zeros after zero_grad(set_to_none=False)):
                # not this step's gradient, so not judged (never "dead", never in the norm).
                grads = [
                    g if p.requires_grad else None for p, g in zip(self._params, grads, strict=True)
                ]
            planned = self._grad_plan(grads)
            if planned is None:
                # due, and no trainable parameter has one: a check before loss.backward()
                no_gradients = any(map(_requires_grad, self._params))
            if planned is not None:
                plan = planned.plan
                grad_slots = planned.ordered
                grad_numels = plan.numels
                home = plan.home
                present: list[torch.Tensor]
                if planned.every:  # every parameter has a gradient (the usual case)
                    present = grads  # type: ignore[assignment]  # no None in it
                else:  # the gradients at planned.present, in order
                    present = [g for g in grads if g is not None]
                all_scalars = plan.flat and not planned.sharded
                fused = planned.fused(present, self._state) if with_state else None
                state_norms: list[torch.Tensor] = []
                if fused is not None:
                    both, param_slots = fused
                    norms = both.reduce([*present, *self._state])
                    k = len(present)
                    pieces += self._scaled(norms[:k], False, inverse_scale)
                    state_norms = norms[k:]
                    with_state = False
                else:
                    norms = plan.reduce(present)
                    pieces += self._scaled(norms, planned.sharded, inverse_scale)
                if l1:
                    norms = plan.reduce(present, ord=1.0)
                    pieces += self._scaled(norms, planned.sharded, inverse_scale)
                    with_l1 = True
                pieces += state_norms  # the vector's order: loss, l2, l1, state, updates, acts
        if with_state:
            norms_vector, param_slots = self.state_norms()
            home = home or norms_vector.device
            pieces.append(norms_vector)
        update_slots, update_base, updates_flat = self._updates(step, checks, pieces)
        activations: tuple[ActivationSlot, ...] = ()
        if checks.activations:
            activations, counts = self._activations.take()
            if home is not None and counts and counts[0].device != home:
                counts = [c.to(home, non_blocking=True) for c in counts]
            pieces += counts  # 0-d each: the vector stays flat
        if lt is not None and home is not None and lt.device != home:
            pieces[0] = lt.to(home, non_blocking=True)
        layout = Layout(
            step=step,
            checks=checks,
            has_loss=lt is not None,
            host_loss=host_loss,
            grad_slots=grad_slots,
            grad_numels=grad_numels,
            with_l1=with_l1,
            param_slots=param_slots,
            update_slots=update_slots,
            update_base=update_base,
            activations=activations,
            samples=samples,
            no_gradients=no_gradients,
        )
        flat = all_scalars and not with_state and updates_flat
        pending = Pending(layout, pieces, grads, self._pool, flat=flat)
        if inverse_scale is not None and grad_slots:
            pending.inverse_scale = inverse_scale
        return pending

    @staticmethod
    def _scaled(
        norms: list[torch.Tensor], shards: bool, inverse_scale: torch.Tensor | None
    ) -> list[torch.Tensor]:
        """*norms* unscaled (one fused multiply) and, for DTensor shards, as one global vector."""
        if shards:  # reduce over the mesh first: DTensors do not mix with plain tensors
            vector = global_norms(assemble(norms))
            if inverse_scale is not None:
                vector = vector * inverse_scale.to(device=vector.device, dtype=vector.dtype)
            return [vector]
        if inverse_scale is not None:
            norms = list(torch._foreach_mul(norms, inverse_scale.to(norms[0].device)))
        return norms

    def _updates(
        self, step: int, checks: Checks, pieces: list[torch.Tensor]
    ) -> tuple[tuple[int, ...], int, bool]:
        """‖Δw‖ since the snapshot step into *pieces*; a new snapshot when updates are due.

        Returns the update slots, the snapshot step, and whether every piece added is 0-d.
        """
        update_slots: tuple[int, ...] = ()
        flat = True
        base = self._snapshot_step
        snapshot = self._snapshot
        plan = self._update_plan
        if base >= 0 and snapshot is not None and plan is not None:
            current: list[torch.Tensor] = [self._params[i] for i in self._update_idx]
            torch._foreach_sub_(snapshot, current)  # in place: the buffer is rewritten below
            flat = self._update_flat
            if flat:
                pieces += plan.reduce(snapshot)  # 0-d pieces: the vector stays flat
            else:
                pieces.append(global_norms(assemble(plan.reduce(snapshot))))
            update_slots = self._update_slots
        self._snapshot_step = -1
        if checks.updates and self._params:
            # Only parameters that train now: frozen and gradient-less ones never "stall".
            idx = tuple(
                i for i, p in enumerate(self._params) if p.requires_grad and p.grad is not None
            )
            if idx:
                idx = self._within_budget(idx)
            if idx:
                now: list[torch.Tensor] = [self._params[i] for i in idx]
                if snapshot is None or idx != self._update_idx:
                    snapshot = [t.detach().clone() for t in now]
                    self._update_plan = NormPlan(snapshot)
                    self._update_flat = self._update_plan.flat and not any(map(sharded, snapshot))
                    self._update_slots = tuple(idx[j] for j in self._update_plan.order)
                else:
                    copy_all(snapshot, now)  # the persistent buffer: no allocation
                self._snapshot, self._update_idx, self._snapshot_step = snapshot, idx, step
        return update_slots, base, flat
