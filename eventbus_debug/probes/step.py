"""The step probe: loss, gradient, parameter and update checks after ``backward()``.

One call per step, ``verdict = await probe.check_step(step, loss=loss)``, runs the checks the
debug level makes due, with fused reductions on the device, and moves every number of the
step to the host in one transfer. Per-parameter names are resolved from that same vector, and
only when a check fired.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

import anyio
import anyio.lowlevel
import torch
from torch import nn

from eventbus_debug._logging import get_logger

from .._bus import EventBus
from .._sync import SyncEventBus
from ..events import Event
from ._publish import publisher_for
from ._reduce import NormPlan
from .events import (
    DebugLevel,
    GradientExploded,
    GradientVanished,
    LossSpiked,
    NonFiniteDetected,
    StepChecked,
    TensorRole,
)
from .levels import Cadence, Checks, Thresholds, checks_due

__all__ = ("StepProbe", "StepVerdict")

_ForwardHook = Callable[[nn.Module, object, object], None]

_log = get_logger(__name__)

_F32: Final = torch.float32
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
    """

    step: int
    checked: bool = True
    finite: bool = True
    loss: float | None = None
    grad_norm: float | None = None
    param_norm: float | None = None
    fired: tuple[str, ...] = ()
    deferred: bool = False

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
    grad_slots: tuple[int, ...]  # parameter index per gradient position
    grad_numels: tuple[int, ...]
    with_l1: bool
    param_slots: tuple[int, ...]
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

    Raises:
        TypeError: if *model* is not an ``nn.Module``, *bus* is not a bus or ``None``, or
            *level*/*cadence*/*thresholds* have the wrong type.
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
        self._model = model
        self._publish = publisher_for(bus)
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
        self._grad_plans: dict[tuple[object, ...], _GradPlan] = {}
        self._param_plan: NormPlan | None = None
        self._snapshot: list[torch.Tensor] | None = None
        self._pending: _Pending | None = None
        self._lock = threading.Lock()
        # judge state
        self._checked_grads = 0
        self._warmup_max = 0.0
        self._losses: deque[float] = deque(maxlen=self.thresholds.spike_window)
        self._streak = 0
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

        ``‖g‖₁ >= ‖g‖₂``, so ``mean|g| >= ‖g‖₂ / n``: when that bound clears the vanishing
        threshold for the whole model (and every parameter, when checked per layer), no
        gradient can have vanished and the sum of absolute values (about twice the cost of
        the 2-norm) is skipped. Non-finite norms are decided by the norms alone. When the
        vanishing check is not *due* this step, the pass runs only for an all-zero gradient.
        """
        th = self.thresholds.vanishing
        values: list[float] = l2.tolist()
        if not all(map(math.isfinite, values)):
            return False
        if not due:
            # Between vanishing checks (Cadence.vanishing_every), only an exactly-zero
            # gradient (a dead layer, visible in its 2-norm) triggers the pass.
            return any(n and v == 0.0 for v, n in zip(values, numels, strict=True))
        total_numel = sum(numels)
        if total_numel and math.fsum(values) / total_numel < th:
            return True
        if self.thresholds.vanishing_per_layer:
            return any(n and v / n < th for v, n in zip(values, numels, strict=True))
        return False

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
                if on_cpu and self._l1_needed(l2, grad_numels, due=checks.vanishing):
                    _, l1 = plan.reduce(present, l1=True, l2=False)  # type: ignore[arg-type]
                parts.append(l2)
                if l1 is not None:
                    parts.append(l1)
                    with_l1 = True
        param_slots: tuple[int, ...] = ()
        if checks.params and self._params:
            if self._param_plan is None:
                self._param_plan = NormPlan(self._params)
            plan = self._param_plan
            l2, _ = plan.reduce(self._params, l1=False)
            home = home or plan.home
            parts.append(l2)
            param_slots = plan.order
        update_slots: tuple[int, ...] = ()
        if self._snapshot is not None:
            # ‖Δw‖ and ‖w‖ between the step that took the snapshot and this one.
            diffs = torch._foreach_sub(list(self._params), self._snapshot)
            d2 = torch.stack(torch._foreach_norm(diffs, 2, dtype=_F32))
            w2 = torch.stack(torch._foreach_norm(self._snapshot, 2, dtype=_F32))
            home = home or d2.device
            parts += [d2.to(home), w2.to(home)]
            update_slots = tuple(range(len(self._params)))
            self._snapshot = None
        if checks.updates and self._params:
            self._snapshot = list(torch._foreach_mul(list(self._params), 1.0))
        activations: tuple[tuple[str, str], ...] = ()
        if checks.activations and self._act_values:
            activations = tuple(self._act_values)
            stats = torch.stack([v.to(_F32) for v in self._act_values.values()])
            home = home or stats.device
            parts.append(stats.to(home))
        has_loss = checks.loss and loss is not None
        if has_loss:
            if isinstance(loss, torch.Tensor):
                lt = loss.detach().reshape(1)
                if lt.is_complex():
                    lt = lt.abs()
                home = home or lt.device
                parts.insert(0, lt.to(device=home, dtype=_F32))
            else:
                parts.insert(0, torch.tensor([float(loss)], dtype=_F32, device=home))  # type: ignore[arg-type]
        home = home or torch.device("cpu")
        moved = [p if p.device == home else p.to(home, non_blocking=True) for p in parts]
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
        finite = True
        loss_value: float | None = None
        if lay.has_loss:
            loss_value = values[0]
            pos = 1
            if math.isfinite(loss_value):
                spike = self._loss_spike(loss_value, step)
                if spike is not None:
                    incidents.append(spike)
            else:
                finite = False
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
        layer_norms: dict[str, float] = {}
        k = len(lay.grad_slots)
        if k:
            l2 = values[pos : pos + k]
            pos += k
            l1 = values[pos : pos + k] if lay.with_l1 else []
            pos += k if lay.with_l1 else 0
            grad_norm, grad_finite, found = self._judge_grads(pending, l2, l1, step)
            finite = finite and grad_finite
            incidents += found
            if lay.checks.layers:
                layer_norms = {self._names[s]: v for s, v in zip(lay.grad_slots, l2, strict=True)}
        param_norm: float | None = None
        m = len(lay.param_slots)
        if m:
            p2 = values[pos : pos + m]
            pos += m
            param_norm = math.sqrt(math.fsum(v * v for v in p2))
            if not math.isfinite(param_norm):
                bad = [s for s, v in zip(lay.param_slots, p2, strict=True) if not math.isfinite(v)]
                if bad:
                    finite = False
                    incidents.append(self._non_finite(TensorRole.PARAMETER, bad, None, step))
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
        )

    def _judge_grads(
        self, pending: _Pending, l2: Sequence[float], l1: Sequence[float], step: int
    ) -> tuple[float, bool, list[Event]]:
        lay = pending.layout
        th = self.thresholds
        incidents: list[Event] = []
        total = math.sqrt(math.fsum(v * v for v in l2))
        finite = True
        if not math.isfinite(total):
            bad = [j for j, v in enumerate(l2) if not math.isfinite(v)]
            counts = self._count_non_finite(pending, bad)
            really_bad = [j for j, (n, i) in zip(bad, counts, strict=True) if n or i or n is None]
            if really_bad:
                finite = False
                known = [c for c in counts if c[0] is not None]
                nan = sum(c[0] or 0 for c in known) if known else None
                inf = sum(c[1] or 0 for c in known) if known else None
                slots = [lay.grad_slots[j] for j in really_bad]
                incidents.append(self._non_finite(TensorRole.GRADIENT, slots, (nan, inf), step))
                return total, finite, incidents
            # the values are finite but the fp32 sum of squares overflowed: an explosion
        threshold = self._explosion_threshold(total)
        if threshold is not None and total > threshold:
            top = sorted(
                zip((self._names[s] for s in lay.grad_slots), l2, strict=True),
                key=lambda kv: -kv[1] if not math.isnan(kv[1]) else 0.0,
            )[: th.top_k]
            incidents.append(
                GradientExploded(
                    step=step,
                    source=self.source,
                    total_norm=total,
                    threshold=threshold,
                    top=tuple(top),
                )
            )
        if not l1 and l2 and all(v == 0.0 for v in l2):
            # No mean-|grad| pass this step (see Cadence.vanishing_every), but all-zero
            # gradients show in the 2-norms: report them at every gradient check.
            incidents.append(
                GradientVanished(
                    step=step,
                    source=self.source,
                    mean_abs=0.0,
                    threshold=th.vanishing,
                    layers=tuple(self._names[s] for s in lay.grad_slots),
                    all_zero=True,
                )
            )
        if l1:
            numel = sum(lay.grad_numels)
            total_l1 = math.fsum(l1)
            mean_abs = total_l1 / numel if numel else 0.0
            layers: tuple[str, ...] = ()
            if th.vanishing_per_layer or mean_abs < th.vanishing:
                layers = tuple(
                    self._names[s]
                    for s, a, n in zip(lay.grad_slots, l1, lay.grad_numels, strict=True)
                    if n and a / n < th.vanishing
                )
            if mean_abs < th.vanishing or layers:
                incidents.append(
                    GradientVanished(
                        step=step,
                        source=self.source,
                        mean_abs=mean_abs,
                        threshold=th.vanishing,
                        layers=layers,
                        all_zero=total_l1 == 0.0,
                    )
                )
        return total, finite, incidents

    def _explosion_threshold(self, total: float) -> float | None:
        th = self.thresholds
        self._checked_grads += 1
        adaptive: float | None = None
        if self._checked_grads <= th.explosion_warmup:
            if math.isfinite(total):
                self._warmup_max = max(self._warmup_max, total)
        elif self._warmup_max > 0:
            adaptive = th.explosion_factor * self._warmup_max
        candidates = [t for t in (th.explosion, adaptive) if t is not None]
        return min(candidates) if candidates else None

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
            pairs.append(torch.stack([t.isnan().sum(), t.isinf().sum()]).to(home))
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
            names=tuple(self._names[s] for s in slots),
            nan_count=nan,
            inf_count=inf,
        )

    def _loss_spike(self, loss: float, step: int) -> LossSpiked | None:
        th = self.thresholds
        window = self._losses
        if len(window) < th.spike_window:
            window.append(loss)
            return None
        mean = math.fsum(window) / len(window)
        ratio = loss / mean if mean else math.inf
        high = loss >= th.spike_ratio * mean if mean > 0 else False
        self._streak = self._streak + 1 if high else 0
        rule: str | None = None
        if self._streak > th.spike_patience:
            rule = "sustained"
            self._streak = 0
            window.clear()  # the loss moved: re-baseline on what follows
        elif abs(loss - mean) >= th.spike_deviation * abs(mean):
            rule = "deviation"
        if not high and rule is None:
            window.append(loss)  # spikes stay out of the baseline
        if rule is None:
            return None
        return LossSpiked(
            step=step, source=self.source, loss=loss, running_mean=mean, ratio=ratio, rule=rule
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
