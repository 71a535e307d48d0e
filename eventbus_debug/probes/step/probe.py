"""The step probe: loss, gradient, parameter and update checks after ``backward()``.

One call per step, ``verdict = await probe.check_step(step, loss=loss)``, runs the checks the
debug level makes due, with fused reductions on the device, and moves every number of the
step to the host in one transfer. Per-parameter names are resolved from that same vector, and
only when a check fired.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

import anyio
import anyio.lowlevel
import torch
from torch import nn

from eventbus_debug.diagnostics import get_logger

from .._bus import EventBus, SyncEventBus
from ..events import (
    Event,
    GradientExploded,
    GradientVanished,
    LossSpiked,
    NonFiniteDetected,
    StepChecked,
    TensorRole,
)
from ._publish import publisher_for
from ._reduce import NormPlan
from .detectors import ExplosionDetector, LossSpikeDetector
from .levels import Cadence, Checks, DebugLevel, Thresholds, checks_due

__all__ = ("StepProbe", "StepVerdict")

_ForwardHook = Callable[[nn.Module, object, object], None]

_log = get_logger(__name__)

_F32: Final = torch.float32
_F64: Final = torch.float64
_CONVERGED: Final = 1e-6
"""A loss within this fraction of the largest loss the run had has converged: gradients near
zero are then the optimum, not a vanishing problem."""
_MAX_PLANS: Final = 8
OFFLOAD_NUMEL: Final = 1 << 24
"""Default gradient size (elements, CPU only) above which reductions run in a worker thread."""

_RELU_LIKE: Final[tuple[type[nn.Module], ...]] = (nn.ReLU, nn.ReLU6)
_SIGMOID_LIKE: Final[tuple[type[nn.Module], ...]] = (nn.Sigmoid, nn.Hardsigmoid)
_TANH_LIKE: Final[tuple[type[nn.Module], ...]] = (nn.Tanh, nn.Hardtanh, nn.Softsign)
_SATURATION: Final = 0.99
"""A tanh-like output with ``|y| >= 0.99`` (sigmoid-like: y <= 0.01 or y >= 0.99) is saturated."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StepVerdict:
    """What one step check found; what the training loop acts on.

    Attributes:
        step: the step the values belong to (in deferred mode, an earlier step than the call's).
        checked: False when no check ran (level OFF, nothing due, or the first deferred call).
        finite: False when the loss, a gradient or a parameter held NaN or Inf.
        loss: the loss value, when given and checked.
        grad_norm: the total gradient 2-norm (tied weights once), when gradients were checked.
        param_norm: the total parameter 2-norm, when parameters were checked.
        fired: the ``kind`` of every incident published for this step.
        deferred: True when the values were read one step late, without waiting.
        overflow: True when the gradients overflowed under an AMP ``GradScaler`` (its routine
            business: ``scaler.step`` skips the update and lowers the scale; not an incident).
    """

    step: int
    checked: bool = True
    finite: bool = True
    loss: float | None = None
    grad_norm: float | None = None
    param_norm: float | None = None
    fired: tuple[str, ...] = ()
    deferred: bool = False
    overflow: bool = False

    @property
    def ok(self) -> bool:
        """True when the values are finite and no incident fired."""
        return self.finite and not self.fired


@dataclass(frozen=True, slots=True)
class _GradPlan:
    plan: NormPlan
    present: tuple[int, ...]  # parameter indices that have a gradient, ascending
    ordered: tuple[int, ...]  # parameter index of each position of the result vectors


@dataclass(frozen=True, slots=True)
class _Layout:
    """Where each result sits in a step's vector; host-side bookkeeping only."""

    step: int
    checks: Checks
    has_loss: bool
    host_loss: float | None  # a Python number: judged on the host, in float64
    grad_slots: tuple[int, ...]  # parameter index per gradient position
    grad_numels: tuple[int, ...]
    with_l1: bool
    param_slots: tuple[int, ...]  # slots >= len(params) are buffers
    update_slots: tuple[int, ...]
    activations: tuple[tuple[str, str], ...]  # (module name, "dead" | "saturated")


class _Pending:
    """One step's results on their way to the host."""

    __slots__ = ("_buffer", "_event", "device", "grads", "layout")

    def __init__(
        self, layout: _Layout, vector: torch.Tensor, grads: list[torch.Tensor | None]
    ) -> None:
        self.layout = layout
        self.grads = grads
        self.device = vector.device
        self._event: torch.cuda.Event | None = None
        if vector.device.type == "cuda" and torch.cuda.is_available():  # pragma: no cover - GPU
            # Deferred mode: start the copy now, read it at the next step; no synchronization.
            self._buffer = torch.empty(vector.shape, dtype=vector.dtype, pin_memory=True)
            self._buffer.copy_(vector, non_blocking=True)
            self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._event.record()
        else:
            self._buffer = vector

    def read(self) -> list[float]:
        if self._event is not None:  # pragma: no cover - GPU
            self._event.synchronize()  # normally long done: it was recorded one step ago
        values: list[float] = self._buffer.tolist()
        return values


def _global(norms: torch.Tensor) -> torch.Tensor:
    """The global values of norms computed over sharded tensors (FSDP2 / DTensor gradients).

    A vector of per-shard reductions is a DTensor with a partial placement; ``full_tensor()``
    reduces it over the mesh (one collective for the whole vector), so the norms are the ones
    ``clip_grad_norm_`` computes, not a rank's shard. Plain tensors pass through.
    """
    full = getattr(norms, "full_tensor", None)
    return full() if callable(full) else norms  # type: ignore[no-any-return]


class StepProbe:
    """Checks loss, gradients, parameters and weight updates of *model* after ``backward()``.

    Example::

        probe = StepProbe(model, bus)
        for step, (x, y) in enumerate(loader):
            loss = loss_fn(model(x), y)
            loss.backward()
            verdict = await probe.check_step(step, loss=loss)
            if verdict.finite:
                optimizer.step()
            optimizer.zero_grad()

    Args:
        model: the module whose parameters are checked (parameters shared by several
            submodules, i.e. tied weights, are counted once). The probe never mutates it.
        bus: where incidents and :class:`StepChecked` telemetry go (``None``: nowhere; use the
            returned verdicts).
        level: which checks run (see :class:`DebugLevel`); change it between steps with
            :attr:`level`.
        cadence: how often each check runs.
        thresholds: when the checks fire.
        deferred: read each step's results at the next call instead of waiting for them. Each
            verdict is then one step late; on GPU this adds no synchronization to the step.
        offload_numel: on CPU, run the reductions in a worker thread when the gradients hold
            more elements than this (the event loop keeps serving sinks meanwhile).
        source: the ``source`` stamped on events.
        scaler: the AMP ``torch.amp.GradScaler`` the loop uses, if any. Gradient norms are
            then judged unscaled (divided by the scale on the device, no synchronization,
            unless ``scaler.unscale_(optimizer)`` already ran), and non-finite gradients with a
            finite loss are the scaler's overflow steps (``verdict.overflow``), not incidents.
        optimizer: the optimizer *scaler* steps (tells whether the gradients are unscaled).
        global_spikes: judge loss spikes only on the loss averaged over the ranks, handed to
            :meth:`observe_global_loss` (a distributed session does, after its agreement), so N
            ranks do not multiply false alarms by N. The local loss is still checked for
            non-finite values at once.

    Raises:
        TypeError: if *model* is not an ``nn.Module``, *bus* is not a bus or ``None``, or
            *level*/*cadence*/*thresholds*/*scaler* have the wrong type.
        ValueError: if the model has parameters on the meta device (they hold no values).
    """

    def __init__(
        self,
        model: nn.Module,
        bus: EventBus | SyncEventBus | None = None,
        *,
        level: DebugLevel = DebugLevel.BASIC,
        cadence: Cadence | None = None,
        thresholds: Thresholds | None = None,
        deferred: bool = False,
        offload_numel: int = OFFLOAD_NUMEL,
        source: str = "step_probe",
        scaler: torch.amp.GradScaler | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        global_spikes: bool = False,
    ) -> None:
        if not isinstance(model, nn.Module):
            msg = f"model must be a torch.nn.Module, got {type(model).__qualname__}"
            raise TypeError(msg)
        if cadence is not None and not isinstance(cadence, Cadence):
            msg = f"cadence must be a Cadence, got {cadence!r}"
            raise TypeError(msg)
        if thresholds is not None and not isinstance(thresholds, Thresholds):
            msg = f"thresholds must be a Thresholds, got {thresholds!r}"
            raise TypeError(msg)
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            msg = f"scaler must be a torch.amp.GradScaler or None, got {type(scaler).__qualname__}"
            raise TypeError(msg)
        meta = [n for n, p in model.named_parameters() if p.is_meta]
        if meta:
            msg = (
                f"the model has {len(meta)} parameter(s) on the meta device (e.g. {meta[0]!r}), "
                "which hold no values to check; materialize it first (model.to_empty(device=...) "
                "and initialize, or load a state dict with assign=True)"
            )
            raise ValueError(msg)
        self._model = model
        self._publish = publisher_for(bus)
        self._scaler = scaler
        self._optimizer = optimizer
        self._global_spikes = bool(global_spikes)
        self.cadence = cadence or Cadence()
        self.thresholds = thresholds or Thresholds()
        self.deferred = bool(deferred)
        self.offload_numel = int(offload_numel)
        self.source = source
        named = [
            (n, p)
            for n, p in model.named_parameters()  # remove_duplicate=True: tied weights once
            if p.is_floating_point() or p.is_complex()
        ]
        self._names: tuple[str, ...] = tuple(n for n, _ in named)
        self._params: tuple[nn.Parameter, ...] = tuple(p for _, p in named)
        # Floating buffers (BatchNorm running statistics) are checked with the parameters:
        # a NaN batch poisons them without touching a parameter.
        buffers = [(n, b) for n, b in model.named_buffers() if b.is_floating_point()]
        self._state_names: tuple[str, ...] = self._names + tuple(n for n, _ in buffers)
        self._state: tuple[torch.Tensor, ...] = self._params + tuple(b for _, b in buffers)
        self._grad_plans: dict[tuple[object, ...], _GradPlan] = {}
        self._param_plan: NormPlan | None = None
        self._snapshot: list[torch.Tensor] | None = None
        self._pending: _Pending | None = None
        self._lock = threading.Lock()
        # judge state
        self._spikes: LossSpikeDetector
        self._explosions: ExplosionDetector
        self._build_detectors()
        self._loss_scale = 0.0
        self._converged = False
        n = len(self._params)
        self._alive = [False] * n  # the parameter once had a gradient worth the name
        self._dead_streak = [0] * n
        self._dead_reported: set[int] = set()
        self._vanish_streak = 0
        self._vanish_reported = False
        self._zero_reported = False
        self._update_idx: tuple[int, ...] = ()
        # activation statistics (EXTREME)
        self._act_modules: tuple[tuple[str, nn.Module, str], ...] = tuple(
            (name, m, "dead" if isinstance(m, _RELU_LIKE) else "saturated")
            for name, m in model.named_modules()
            if isinstance(m, _RELU_LIKE + _SIGMOID_LIKE + _TANH_LIKE)
        )
        self._act_values: dict[tuple[str, str], torch.Tensor] = {}
        self._act_handles: list[torch.utils.hooks.RemovableHandle] = []
        self._level = DebugLevel.OFF
        self.level = level
        self._configured = True

    # -- configuration ------------------------------------------------------------------------

    @property
    def level(self) -> DebugLevel:
        """The debug level; assign a new one between steps (hooks are added or removed)."""
        return self._level

    @level.setter
    def level(self, value: DebugLevel) -> None:
        if not isinstance(value, DebugLevel):
            msg = f"level must be a DebugLevel, got {value!r}; e.g. DebugLevel.BASIC"
            raise TypeError(msg)
        if value is self._level:
            return
        old, self._level = self._level, value
        if value is DebugLevel.EXTREME:
            self._arm_activations()
        else:
            self._disarm_activations()
        if not value.includes(DebugLevel.ADVANCED):
            self._snapshot = None
        if hasattr(self, "_configured"):
            _log.info("debug_level_changed", source=self.source, old=old.value, new=value.value)

    @property
    def thresholds(self) -> Thresholds:
        """The thresholds; assigning new ones restarts the detectors."""
        return self._thresholds

    @thresholds.setter
    def thresholds(self, value: Thresholds) -> None:
        if not isinstance(value, Thresholds):
            msg = f"thresholds must be a Thresholds, got {value!r}"
            raise TypeError(msg)
        self._thresholds = value
        if hasattr(self, "_spikes"):
            self._build_detectors()

    def _build_detectors(self) -> None:
        th = self._thresholds
        self._spikes = LossSpikeDetector(
            window=th.spike_window,
            warmup=th.spike_warmup,
            rtol=th.spike_rtol,
            atol=th.spike_atol,
            mad_factor=th.spike_mad,
            scale_tol=th.spike_scale_tol,
            patience=th.spike_patience,
        )
        self._explosions = ExplosionDetector(
            window=th.explosion_window, factor=th.explosion_factor, cap=th.explosion
        )

    def rebaseline(self) -> None:
        """Restart the loss-spike and explosion baselines (call it after restoring a state).

        The restored model's loss is legitimately that of an older state: judged against the
        window of the steps just undone it would look like a new spike, and rollbacks would
        feed on themselves. Thread-safe; the session calls it after every restore.
        """
        with self._lock:
            self._spikes.reset()
            self._explosions.reset()
            self._snapshot = None

    @property
    def parameter_names(self) -> tuple[str, ...]:
        """The checked parameters' names (tied weights once, integer parameters left out)."""
        return self._names

    # -- the check ------------------------------------------------------------------------------

    async def check_step(
        self, step: int, *, loss: torch.Tensor | float | None = None
    ) -> StepVerdict:
        """Run the checks due at *step*, publish the results, and return the verdict.

        Call it after ``loss.backward()`` and before ``optimizer.step()``. It always yields to
        the event loop once (so sinks progress). In deferred mode the verdict is the previous
        call's, and this call's results are read by the next one (or by :meth:`flush`).

        Args:
            step: the training step (an ``int``).
            loss: the step's loss: a one-element tensor or a number (``None``: not checked).

        Raises:
            TypeError: if *step* is not an int, or *loss* neither a tensor nor a number.
            ValueError: if *step* is negative or *loss* has more than one element.
        """
        self._validate(step, loss)
        checks = checks_due(self._level, self.cadence, step)
        if checks.any and self._offload(checks):
            verdict = await anyio.to_thread.run_sync(self._check, step, loss, checks)
        else:
            verdict = self._check(step, loss, checks)
        await anyio.lowlevel.checkpoint()
        return verdict

    def check_step_nowait(
        self, step: int, *, loss: torch.Tensor | float | None = None
    ) -> StepVerdict:
        """:meth:`check_step` for synchronous loops (with a :class:`SyncEventBus`): no yield.

        Raises:
            TypeError: as :meth:`check_step`.
            ValueError: as :meth:`check_step`.
        """
        self._validate(step, loss)
        return self._check(step, loss, checks_due(self._level, self.cadence, step))

    async def flush(self) -> StepVerdict | None:
        """In deferred mode, read and publish the last pending step now (``None`` if none)."""
        verdict = self.flush_nowait()
        await anyio.lowlevel.checkpoint()
        return verdict

    def flush_nowait(self) -> StepVerdict | None:
        """:meth:`flush` without yielding."""
        with self._lock:
            pending, self._pending = self._pending, None
            if pending is None:
                return None
            return self._judge(pending, pending.read(), deferred=True)

    def close(self) -> None:
        """Remove the probe's hooks and forget pending results (idempotent)."""
        self._disarm_activations()
        self._pending = None
        self._snapshot = None

    # -- internals ------------------------------------------------------------------------------

    @staticmethod
    def _validate(step: object, loss: object) -> None:
        if not isinstance(step, int) or isinstance(step, bool):
            msg = f"step must be an int, got {type(step).__qualname__} {step!r}"
            raise TypeError(msg)
        if step < 0:
            msg = f"step must be >= 0, got {step}"
            raise ValueError(msg)
        if loss is None:
            return
        if isinstance(loss, torch.Tensor):
            if loss.numel() != 1:
                msg = (
                    f"loss must be a scalar tensor (one element), got shape {tuple(loss.shape)}; "
                    "reduce it first, e.g. loss.mean()"
                )
                raise ValueError(msg)
            if loss.is_meta:
                msg = "loss is a meta tensor (it has no values); pass the real loss"
                raise ValueError(msg)
            return
        if isinstance(loss, bool) or not isinstance(loss, int | float):
            msg = f"loss must be a one-element tensor or a number, got {type(loss).__qualname__}"
            raise TypeError(msg)

    def _offload(self, checks: Checks) -> bool:
        if not checks.grads or not self._params or self._params[0].device.type != "cpu":
            return False
        return sum(p.numel() for p in self._params) > self.offload_numel

    def _check(self, step: int, loss: torch.Tensor | float | None, checks: Checks) -> StepVerdict:
        with self._lock:
            if not checks.any and self._snapshot is None:
                return StepVerdict(step=step, checked=False)
            with torch.no_grad():
                pending = self._launch(step, loss, checks)
            if not self.deferred:
                return self._judge(pending, pending.read(), deferred=False)
            previous, self._pending = self._pending, pending
            pending.grads = []  # deferred: never keep last step's gradients alive
            if previous is None:
                return StepVerdict(step=step, checked=False, deferred=True)
            return self._judge(previous, previous.read(), deferred=True)

    def _grad_plan(self, grads: list[torch.Tensor | None]) -> _GradPlan | None:
        key = tuple(None if g is None else g.layout for g in grads)
        cached = self._grad_plans.get(key)
        if cached is None:
            present = tuple(i for i, g in enumerate(grads) if g is not None)
            if not present:
                return None
            plan = NormPlan([g for g in grads if g is not None])
            cached = _GradPlan(plan, present, tuple(present[j] for j in plan.order))
            if len(self._grad_plans) > _MAX_PLANS:
                self._grad_plans.clear()  # patterns rarely change; keep the cache bounded
            self._grad_plans[key] = cached
        return cached

    def _l1_needed(self, l2: torch.Tensor, numels: tuple[int, ...], *, due: bool) -> bool:
        """Whether mean ``|grad|`` must be computed, given the 2-norms (CPU only: reading is free).

        Only the model-wide vanishing check needs it (dead layers are judged from the 2-norms).
        ``‖g‖₁ >= ‖g‖₂``, so ``mean|g| >= Σ‖g‖₂ / n``: when that bound clears the threshold no
        gradient can have vanished and the pass (about twice the cost of the 2-norms) is
        skipped. Non-finite norms are decided by the norms alone.
        """
        if not due:
            return False
        values: list[float] = l2.tolist()
        if not all(map(math.isfinite, values)):
            return False
        total_numel = sum(numels)
        return bool(total_numel) and math.fsum(values) / total_numel < self.thresholds.vanishing

    def _state_norms(self) -> tuple[torch.Tensor, tuple[int, ...]]:
        """2-norms of every parameter and floating buffer (fused), with their slots."""
        if self._param_plan is None:
            self._param_plan = NormPlan(self._state)
        plan = self._param_plan
        l2, _ = plan.reduce(self._state, l1=False)
        return _global(l2), plan.order

    def _inverse_scale(self) -> torch.Tensor | None:
        """``1 / scale`` of the AMP scaler while the gradients are still scaled (on device)."""
        scaler = self._scaler
        if scaler is None or not scaler.is_enabled():
            return None
        scale = getattr(scaler, "_scale", None)
        if not isinstance(scale, torch.Tensor):
            return None  # scaler.scale() never ran: the gradients are not scaled
        states = getattr(scaler, "_per_optimizer_states", None)
        if self._optimizer is not None and isinstance(states, Mapping):
            stage = states.get(id(self._optimizer), {}).get("stage")
            if getattr(stage, "name", "") == "UNSCALED":
                return None
        return scale.double().reciprocal()

    def _launch(self, step: int, loss: torch.Tensor | float | None, checks: Checks) -> _Pending:
        parts: list[torch.Tensor] = []
        grads: list[torch.Tensor | None] = []
        grad_slots: tuple[int, ...] = ()
        grad_numels: tuple[int, ...] = ()
        home: torch.device | None = None
        with_l1 = False
        if checks.grads:
            grads = [p.grad for p in self._params]
            planned = self._grad_plan(grads)
            if planned is not None:
                plan = planned.plan
                grad_slots = planned.ordered
                grad_numels = plan.numels
                present = [grads[i] for i in planned.present]
                home = plan.home
                on_cpu = home.type == "cpu"
                l2, l1 = plan.reduce(present, l1=checks.vanishing and not on_cpu)  # type: ignore[arg-type]
                l2, l1 = _global(l2), (_global(l1) if l1 is not None else None)
                inverse = self._inverse_scale()
                if inverse is not None:
                    l2 = l2 * inverse.to(device=l2.device, dtype=l2.dtype)
                if on_cpu and self._l1_needed(l2, grad_numels, due=checks.vanishing):
                    _, l1 = plan.reduce(present, l1=True, l2=False)  # type: ignore[arg-type]
                    l1 = _global(l1) if l1 is not None else None
                if l1 is not None and inverse is not None:
                    l1 = l1 * inverse.to(device=l1.device, dtype=l1.dtype)
                parts.append(l2)
                if l1 is not None:
                    parts.append(l1)
                    with_l1 = True
        param_slots: tuple[int, ...] = ()
        if checks.params and self._state:
            l2, param_slots = self._state_norms()
            home = home or l2.device
            parts.append(l2)
        update_slots: tuple[int, ...] = ()
        if self._snapshot is not None:
            # ‖Δw‖ and ‖w‖ between the step that took the snapshot and this one.
            current: list[torch.Tensor] = [self._params[i] for i in self._update_idx]
            diffs = torch._foreach_sub(current, self._snapshot)
            d2 = _global(torch.stack(torch._foreach_norm(diffs, 2, dtype=_F32)))
            w2 = _global(torch.stack(torch._foreach_norm(self._snapshot, 2, dtype=_F32)))
            home = home or d2.device
            parts += [d2.to(home), w2.to(home)]
            update_slots = self._update_idx
            self._snapshot = None
        if checks.updates and self._params:
            # Only parameters that train now: frozen and gradient-less ones never "stall".
            self._update_idx = tuple(
                i for i, p in enumerate(self._params) if p.requires_grad and p.grad is not None
            )
            if self._update_idx:
                now: list[torch.Tensor] = [self._params[i] for i in self._update_idx]
                self._snapshot = list(torch._foreach_mul(now, 1.0))
        activations: tuple[tuple[str, str], ...] = ()
        if checks.activations and self._act_values:
            activations = tuple(self._act_values)
            stats = torch.stack([v.to(_F32) for v in self._act_values.values()])
            home = home or stats.device
            parts.append(stats.to(home))
        has_loss = checks.loss and loss is not None
        host_loss: float | None = None
        wide = False
        if has_loss:
            if isinstance(loss, torch.Tensor):
                lt = loss.detach().reshape(1)
                if lt.is_complex():
                    lt = lt.abs()
                # Checked in its own precision: a finite float64 loss of 1e39 is finite.
                wide = lt.dtype == _F64
                home = home or lt.device
                parts.insert(0, lt.to(device=home, dtype=_F64 if wide else _F32))
            else:
                host_loss = float(loss)  # type: ignore[arg-type]
                has_loss = False
        home = home or torch.device("cpu")
        moved = [p if p.device == home else p.to(home, non_blocking=True) for p in parts]
        if wide:
            moved = [p.to(_F64) for p in moved]
        if not moved:
            vector = torch.zeros(0, dtype=_F32)
        elif len(moved) == 1:
            vector = moved[0]
        else:
            vector = torch.cat(moved)
        layout = _Layout(
            step=step,
            checks=checks,
            has_loss=has_loss,
            host_loss=host_loss,
            grad_slots=grad_slots,
            grad_numels=grad_numels,
            with_l1=with_l1,
            param_slots=param_slots,
            update_slots=update_slots,
            activations=activations,
        )
        return _Pending(layout, vector, grads)

    # -- the host-side judgement ------------------------------------------------------------------

    def _judge(self, pending: _Pending, values: list[float], *, deferred: bool) -> StepVerdict:
        lay = pending.layout
        step = lay.step
        incidents: list[Event] = []
        pos = 0
        loss_value: float | None = lay.host_loss
        if lay.has_loss:
            loss_value = values[0]
            pos = 1
        loss_finite = loss_value is None or math.isfinite(loss_value)
        finite = loss_finite
        if loss_value is not None:
            if loss_finite:
                self._loss_scale = max(self._loss_scale, abs(loss_value))
                self._converged = abs(loss_value) <= _CONVERGED * self._loss_scale
            else:
                incidents.append(
                    NonFiniteDetected(
                        step=step,
                        source=self.source,
                        role=TensorRole.LOSS,
                        names=("loss",),
                        nan_count=int(math.isnan(loss_value)),
                        inf_count=int(math.isinf(loss_value)),
                    )
                )
        grad_norm: float | None = None
        grad_finite = True
        overflow = False
        layer_norms: dict[str, float] = {}
        k = len(lay.grad_slots)
        if k:
            l2 = values[pos : pos + k]
            pos += k
            l1 = values[pos : pos + k] if lay.with_l1 else []
            pos += k if lay.with_l1 else 0
            grad_norm, grad_finite, found = self._judge_grads(
                pending, l2, l1, step, loss_finite=loss_finite
            )
            overflow = not grad_finite and not found and loss_finite
            finite = finite and grad_finite
            incidents += found
            if lay.checks.layers:
                layer_norms = {self._names[s]: v for s, v in zip(lay.grad_slots, l2, strict=True)}
        if loss_value is not None and loss_finite and not overflow and not self._global_spikes:
            spike = self._spike(step, loss_value)
            if spike is not None:
                incidents.append(spike)
        param_norm: float | None = None
        m = len(lay.param_slots)
        n_params = len(self._params)
        if m:
            p2 = values[pos : pos + m]
            pos += m
            param_norm = math.sqrt(
                math.fsum(v * v for s, v in zip(lay.param_slots, p2, strict=True) if s < n_params)
            )
            bad = [s for s, v in zip(lay.param_slots, p2, strict=True) if not math.isfinite(v)]
        elif not finite and not overflow and self._state:
            # The loss or the gradients are not finite and the parameters were not due: look
            # at them now (one more transfer, only on a fire) so that a NaN parameter or
            # buffer is restored at this step, not up to param_every steps later.
            norms, slots = self._state_norms()
            bad = [s for s, v in zip(slots, norms.tolist(), strict=True) if not math.isfinite(v)]
        else:
            bad = []
        if bad:
            finite = False
            params = [s for s in bad if s < n_params]
            buffers = [s for s in bad if s >= n_params]
            if params:
                incidents.append(self._non_finite(TensorRole.PARAMETER, params, None, step))
            if buffers:
                incidents.append(self._non_finite(TensorRole.BUFFER, buffers, None, step))
        ratios: dict[str, float] = {}
        u = len(lay.update_slots)
        if u:
            d2, w2 = values[pos : pos + u], values[pos + u : pos + 2 * u]
            pos += 2 * u
            ratios = {
                self._names[s]: (d / w if w > 0 else (0.0 if d == 0 else math.inf))
                for s, d, w in zip(lay.update_slots, d2, w2, strict=True)
            }
            self._log_update_ratios(ratios, step)
        dead: dict[str, float] = {}
        saturated: dict[str, float] = {}
        for (name, what), v in zip(lay.activations, values[pos:], strict=False):
            (dead if what == "dead" else saturated)[name] = v
        fired = tuple(e.kind for e in incidents)
        for event in incidents:
            self._publish(event)
        self._publish(
            StepChecked(
                step=step,
                source=self.source,
                loss=loss_value,
                grad_norm=grad_norm,
                param_norm=param_norm,
                finite=finite,
                fired=fired,
                layer_grad_norms=layer_norms,
                update_ratios=ratios,
                dead_fractions=dead,
                saturated_fractions=saturated,
                deferred=deferred,
            )
        )
        return StepVerdict(
            step=step,
            finite=finite,
            loss=loss_value,
            grad_norm=grad_norm,
            param_norm=param_norm,
            fired=fired,
            deferred=deferred,
            overflow=overflow,
        )

    def _spike(self, step: int, loss: float) -> LossSpiked | None:
        verdict = self._spikes.observe(loss)
        if verdict is None:
            return None
        base = verdict.baseline
        return LossSpiked(
            step=step,
            source=self.source,
            loss=loss,
            running_mean=base,
            ratio=loss / base if base else math.inf,
            rule=verdict.rule.value,
            tolerance=verdict.tolerance,
            streak=verdict.streak,
        )

    def observe_global_loss(self, step: int, loss: float) -> LossSpiked | None:
        """Judge *step*'s loss averaged over the ranks for spikes; publish and return a spike.

        A distributed session calls it after the ranks agreed (the mean rides in the agreement's
        one collective), with ``global_spikes=True``: every rank judges the same number, so the
        ranks' detectors stay identical and decide together, one safe point later.
        """
        if not math.isfinite(loss):
            return None  # the local non-finite checks act on it, at once
        with self._lock:
            spike = self._spike(step, loss)
        if spike is not None:
            self._publish(spike)
        return spike

    def _judge_grads(
        self,
        pending: _Pending,
        l2: Sequence[float],
        l1: Sequence[float],
        step: int,
        *,
        loss_finite: bool,
    ) -> tuple[float, bool, list[Event]]:
        lay = pending.layout
        th = self.thresholds
        incidents: list[Event] = []
        total = math.sqrt(math.fsum(v * v for v in l2))
        if not math.isfinite(total):
            bad = [j for j, v in enumerate(l2) if not math.isfinite(v)]
            counts = self._count_non_finite(pending, bad)
            really_bad = [j for j, (n, i) in zip(bad, counts, strict=True) if n or i or n is None]
            if really_bad:
                if self._scaler is not None and self._scaler.is_enabled() and loss_finite:
                    # A GradScaler overflow: scaler.step() skips the update and halves the
                    # scale. Routine in fp16 training, not an incident (the session reports
                    # a StepSkipped with the scales once scaler.update() ran).
                    return total, False, []
                known = [c for c in counts if c[0] is not None]
                nan = sum(c[0] or 0 for c in known) if known else None
                inf = sum(c[1] or 0 for c in known) if known else None
                slots = [lay.grad_slots[j] for j in really_bad]
                incidents.append(self._non_finite(TensorRole.GRADIENT, slots, (nan, inf), step))
                return total, False, incidents
            # finite values whose fp32 sum of squares overflowed: judge the float64 norm
            total = math.sqrt(math.fsum(float(v) ** 2 for v in l2 if math.isfinite(v)))
            if not math.isfinite(total):
                total = math.inf
        exploded = self._explosions.observe(total) if math.isfinite(total) else None
        if exploded is not None or total == math.inf:
            top = sorted(
                zip((self._names[s] for s in lay.grad_slots), l2, strict=True),
                key=lambda kv: -kv[1] if not math.isnan(kv[1]) else 0.0,
            )[: th.top_k]
            incidents.append(
                GradientExploded(
                    step=step,
                    source=self.source,
                    total_norm=total,
                    threshold=exploded.threshold if exploded else math.inf,
                    top=tuple(top),
                    baseline=exploded.baseline if exploded else math.nan,
                    largest=exploded.largest if exploded else self._explosions.largest,
                    rule=exploded.rule if exploded else "cap",
                )
            )
        incidents += self._vanishing(lay, l2, l1, step)
        return total, True, incidents

    def _vanishing(
        self, lay: _Layout, l2: Sequence[float], l1: Sequence[float], step: int
    ) -> list[Event]:
        """Dead layers and vanishing gradients: persistent, relative, never on a converged run.

        A parameter is a dead layer when its gradient RMS falls below ``vanishing_relative``
        times the model's for ``vanishing_patience`` checks in a row, having once been above
        it: gradients that are zero by construction never were. Each is reported once, when it
        dies. The whole model vanished when its mean ``|grad|`` stays below ``vanishing`` (or
        every gradient is exactly zero) while the loss has not converged.
        """
        th = self.thresholds
        if self._converged:
            self._vanish_streak = 0
            self._dead_streak = [0] * len(self._dead_streak)
            return []
        out: list[Event] = []
        numels = lay.grad_numels
        total_numel = sum(numels)
        all_zero = bool(l2) and all(v == 0.0 for v in l2)
        dead: list[int] = []
        if th.vanishing_per_layer and total_numel and not all_zero:
            model_rms = math.sqrt(math.fsum(v * v for v in l2) / total_numel)
            floor = th.vanishing_relative * model_rms
            for slot, v, n in zip(lay.grad_slots, l2, numels, strict=True):
                if not n:
                    continue
                low = v / math.sqrt(n) < floor
                if not low:
                    self._alive[slot] = True
                    self._dead_streak[slot] = 0
                    self._dead_reported.discard(slot)
                elif self._alive[slot]:
                    self._dead_streak[slot] += 1
                    if (
                        self._dead_streak[slot] >= th.vanishing_patience
                        and slot not in self._dead_reported
                    ):
                        self._dead_reported.add(slot)
                        dead.append(slot)
        mean_abs = math.fsum(l1) / total_numel if l1 and total_numel else math.nan
        vanished = all_zero or (bool(l1) and mean_abs < th.vanishing)
        if l1 or all_zero:
            self._vanish_streak = self._vanish_streak + 1 if vanished else 0
            if not vanished:
                self._vanish_reported = False
        model_fired = (
            vanished
            and (all_zero or self._vanish_streak >= th.vanishing_patience)
            and not self._vanish_reported
        )
        if model_fired:
            self._vanish_reported = True
        if model_fired or dead:
            layers = tuple(self._names[s] for s in (lay.grad_slots if all_zero else dead))
            out.append(
                GradientVanished(
                    step=step,
                    source=self.source,
                    mean_abs=0.0 if all_zero else mean_abs,
                    threshold=th.vanishing if model_fired else th.vanishing_relative,
                    layers=layers,
                    all_zero=all_zero,
                )
            )
        return out

    def _count_non_finite(
        self, pending: _Pending, positions: list[int]
    ) -> list[tuple[int | None, int | None]]:
        """NaN and Inf counts of the offending gradients (second transfer, only on a fire)."""
        grads = pending.grads
        slots = pending.layout.grad_slots
        if not grads:  # deferred: the gradients of that step are gone
            return [(None, None)] * len(positions)
        pairs = []
        home = pending.device
        for j in positions:
            g = grads[slots[j]]
            assert g is not None
            t = g.coalesce().values() if g.is_sparse else g
            pairs.append(_global(torch.stack([t.isnan().sum(), t.isinf().sum()])).to(home))
        counts = torch.stack(pairs).tolist()
        return [(int(n), int(i)) for n, i in counts]

    def _non_finite(
        self,
        role: TensorRole,
        slots: Sequence[int],
        counts: tuple[int | None, int | None] | None,
        step: int,
    ) -> NonFiniteDetected:
        nan, inf = counts if counts is not None else (None, None)
        return NonFiniteDetected(
            step=step,
            source=self.source,
            role=role,
            names=tuple(self._state_names[s] for s in slots),
            nan_count=nan,
            inf_count=inf,
        )

    def _log_update_ratios(self, ratios: dict[str, float], step: int) -> None:
        th = self.thresholds
        low = [n for n, r in ratios.items() if r < th.update_ratio_low]
        high = [n for n, r in ratios.items() if r > th.update_ratio_high]
        if low or high:
            _log.warning(
                "weight_update_ratio_out_of_bounds",
                step=step,
                stalled=low[:10],
                too_large=high[:10],
            )

    # -- activation statistics (EXTREME) -----------------------------------------------------------

    def _arm_activations(self) -> None:
        if self._act_handles:
            return
        for name, module, what in self._act_modules:
            self._act_handles.append(
                module.register_forward_hook(self._act_hook(name, module, what))
            )

    def _disarm_activations(self) -> None:
        for handle in self._act_handles:
            handle.remove()
        self._act_handles.clear()
        self._act_values.clear()

    def _act_hook(self, name: str, module: nn.Module, what: str) -> _ForwardHook:
        values = self._act_values
        sigmoid = isinstance(module, _SIGMOID_LIKE)
        low = 1.0 - _SATURATION

        def hook(module: nn.Module, args: object, output: object) -> None:
            if not isinstance(output, torch.Tensor) or not output.numel():
                return
            try:
                with torch.no_grad():
                    out = output.detach()
                    if what == "dead":
                        hits = (out <= 0).sum(dtype=_F32)
                    elif sigmoid:
                        hits = ((out <= low) | (out >= _SATURATION)).sum(dtype=_F32)
                    else:
                        hits = (out.abs() >= _SATURATION).sum(dtype=_F32)
                    values[(name, what)] = hits / out.numel()
            except Exception:  # a probe never raises into the user's forward
                _log.warning("activation_hook_failed", module=name, exc_info=True)

        return hook
