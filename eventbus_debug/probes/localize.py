"""First-NaN localization: name the first module whose output (or gradient) is non-finite.

Hooks are installed only while armed (a replayed step, a ``with`` block) and removed after, so
a disarmed locator costs nothing. While armed, every module output gets one on-device flag
(and, for the backward pass, every module input and output gradient); the flags are moved to
the host once, after the replay.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import anyio.lowlevel
import torch
from torch import nn

from eventbus_debug._logging import get_logger

from .._bus import EventBus
from .._sync import SyncEventBus
from ._publish import publisher_for
from .events import AnomalyLocalized, TensorRole

__all__ = (
    "BackwardReport",
    "FirstNonFiniteLocator",
    "ForwardReport",
    "LayerRecord",
    "debug_backward_pass",
    "debug_forward_pass",
)

_log = get_logger(__name__)


def _tensors(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, tuple | list):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _float_tensors(value: object) -> list[torch.Tensor]:
    return [
        t for t in _tensors(value) if (t.is_floating_point() or t.is_complex()) and not t.is_meta
    ]


@dataclass(slots=True)
class _Record:
    module: str
    phase: str
    role: TensorRole
    flag: torch.Tensor
    shapes: tuple[tuple[int, ...], ...]
    inputs: list[torch.Tensor] = field(default_factory=list)


class FirstNonFiniteLocator:
    """Finds the first module of *model* whose output, or gradient, is NaN or infinite.

    Example::

        locator = FirstNonFiniteLocator(model, bus)
        if not verdict.finite:  # the step probe saw a NaN: replay the step with hooks armed
            found = await locator.localize(lambda: loss_fn(model(x), y).backward())

    Args:
        model: the module to watch; it is never mutated (hooks are removed after each use).
        bus: where :class:`AnomalyLocalized` goes (``None``: only returned).
        backward: also watch gradients (tensor hooks on module inputs and outputs).
        source: the ``source`` stamped on events.

    Raises:
        TypeError: if *model* is not an ``nn.Module`` or *bus* not a bus.
    """

    def __init__(
        self,
        model: nn.Module,
        bus: EventBus | SyncEventBus | None = None,
        *,
        backward: bool = True,
        source: str = "localizer",
    ) -> None:
        if not isinstance(model, nn.Module):
            msg = f"model must be a torch.nn.Module, got {type(model).__qualname__}"
            raise TypeError(msg)
        self._model = model
        self._publish = publisher_for(bus)
        self.backward = backward
        self.source = source
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._records: list[_Record] = []

    @property
    def is_armed(self) -> bool:
        """True while hooks are installed."""
        return bool(self._handles)

    def arm(self) -> None:
        """Install the hooks on every module (idempotent). Prefer :meth:`armed` or :meth:`localize`."""
        if self._handles:
            return
        self._records.clear()
        for name, module in self._model.named_modules():
            self._handles.append(module.register_forward_hook(self._forward_hook(name)))

    def disarm(self) -> None:
        """Remove every hook (idempotent)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    @contextlib.contextmanager
    def armed(self) -> Iterator[None]:
        """Arm the hooks for the duration of the block; read the result with :meth:`result`."""
        self.arm()
        try:
            yield
        finally:
            self.disarm()

    def result(self, *, step: int | None = None) -> AnomalyLocalized | None:
        """The first non-finite forward output (else backward gradient) seen while armed.

        One transfer moves every flag to the host. Forward findings win over backward ones:
        a NaN produced in the forward pass also poisons every gradient after it.
        """
        records, self._records = self._records, []
        if not records:
            return None
        flags = torch.stack([r.flag.to("cpu") for r in records]).tolist()
        bad = [r for r, f in zip(records, flags, strict=True) if f]
        if not bad:
            return None
        first = next((r for r in bad if r.phase == "forward"), bad[0])
        lo, hi = _finite_range(first.inputs)
        return AnomalyLocalized(
            step=step,
            source=self.source,
            module=first.module,
            phase=first.phase,
            role=first.role,
            shapes=first.shapes,
            input_min=lo,
            input_max=hi,
        )

    async def localize(
        self, replay: Callable[[], object], *, step: int | None = None
    ) -> AnomalyLocalized | None:
        """Run *replay* (a forward, or forward and backward) with hooks armed; publish the finding.

        Errors raised by *replay* propagate after the hooks are removed.

        Returns:
            the published :class:`AnomalyLocalized`, or ``None`` when everything stayed finite.
        """
        with self.armed():
            replay()
        found = self.result(step=step)
        if found is not None:
            self._publish(found)
            _log.info("anomaly_localized", module=found.module, phase=found.phase, step=step)
        await anyio.lowlevel.checkpoint()
        return found

    # -- hooks --------------------------------------------------------------------------------

    def _forward_hook(self, name: str) -> Callable[[nn.Module, object, object], None]:
        records = self._records

        def hook(module: nn.Module, args: object, output: object) -> None:
            try:
                outs = _float_tensors(output)
                if not outs:
                    return
                inputs = _float_tensors(args)
                with torch.no_grad():
                    flag = torch.stack([(~torch.isfinite(o)).any() for o in outs]).any()
                shapes = tuple(tuple(o.shape) for o in outs)
                records.append(
                    _Record(
                        name,
                        "forward",
                        TensorRole.OUTPUT,
                        flag,
                        shapes,
                        [i.detach() for i in inputs],
                    )
                )
                if self.backward and torch.is_grad_enabled():
                    # The gradient into a module's input is what that module's backward made;
                    # inner modules register first, so the innermost culprit is seen first.
                    watched = [t for t in inputs if t.requires_grad]
                    if not name:  # the model's output: a gradient already bad came from outside
                        watched += [o for o in outs if o.requires_grad]
                    for t in watched:
                        t.register_hook(self._grad_hook(name, t))  # type: ignore[no-untyped-call]
            except Exception:  # a probe never raises into the user's forward
                _log.warning("localizer_hook_failed", module=name, exc_info=True)

        return hook

    def _grad_hook(self, name: str, tensor: torch.Tensor) -> Callable[[torch.Tensor], None]:
        records = self._records
        shape = tuple(tensor.shape)

        def hook(grad: torch.Tensor) -> None:
            # The gradient *into* a module's input is produced by that module's backward.
            with torch.no_grad():
                flag = (~torch.isfinite(grad)).any()
            records.append(_Record(name, "backward", TensorRole.GRADIENT, flag, (shape,)))

        return hook


def _finite_range(inputs: list[torch.Tensor]) -> tuple[float | None, float | None]:
    values = [t[torch.isfinite(t)].float() for t in inputs if not t.is_complex() and t.numel()]
    values = [v for v in values if v.numel()]
    if not values:
        return None, None
    lo, hi = torch.stack([torch.stack([v.min(), v.max()]) for v in values]).T.tolist()
    return float(min(lo)), float(max(hi))


# -- debug passes (the seeds' vocabulary) ----------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerRecord:
    """One module's output in a debugged forward pass.

    Attributes:
        module: the qualified module name (``""`` for the root).
        type: the module's class name.
        shapes: the shapes of its floating-point outputs.
        mean, std, min, max: statistics over its (first) output's finite values.
        nan_count, inf_count: non-finite elements over all its outputs.
        duration_s: host time from the module's start to its end (on GPU: launch time only).
    """

    module: str
    type: str
    shapes: tuple[tuple[int, ...], ...]
    mean: float
    std: float
    min: float
    max: float
    nan_count: int
    inf_count: int
    duration_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class ForwardReport:
    """What :func:`debug_forward_pass` saw, layer by layer, in completion order."""

    layers: tuple[LayerRecord, ...]
    duration_s: float
    first_non_finite: str | None

    @property
    def finite(self) -> bool:
        """True when no layer produced NaN or Inf."""
        return self.first_non_finite is None


def debug_forward_pass(
    model: nn.Module, inputs: object, *, layer_hooks: bool = True
) -> tuple[Any, ForwardReport]:
    """Run ``model(inputs)`` once and report per-layer shapes, statistics and timing.

    Every statistic stays on the device until the end; one transfer moves them all.

    Args:
        model: the module to run.
        inputs: a tensor, or a tuple/list of positional arguments.
        layer_hooks: record every submodule (else only the whole model).

    Returns:
        the model's output and the :class:`ForwardReport`.

    Raises:
        TypeError: if *model* is not an ``nn.Module``.
    """
    if not isinstance(model, nn.Module):
        msg = f"model must be a torch.nn.Module, got {type(model).__qualname__}"
        raise TypeError(msg)
    starts: dict[int, float] = {}
    rows: list[tuple[str, str, tuple[tuple[int, ...], ...], torch.Tensor, float]] = []

    def pre(name: str) -> Callable[[nn.Module, object], None]:
        def hook(module: nn.Module, args: object) -> None:
            starts[id(module)] = time.perf_counter()

        return hook

    def post(name: str) -> Callable[[nn.Module, object, object], None]:
        def hook(module: nn.Module, args: object, output: object) -> None:
            outs = [o for o in _float_tensors(output) if not o.is_complex()]
            if not outs:
                return
            elapsed = time.perf_counter() - starts.pop(id(module), time.perf_counter())
            with torch.no_grad():
                o = outs[0].detach().float()
                fin = o[torch.isfinite(o)]
                nan = sum(x.isnan().sum() for x in outs)
                inf = sum(x.isinf().sum() for x in outs)
                if fin.numel():
                    std = fin.std() if fin.numel() > 1 else torch.zeros((), device=o.device)
                    stats = torch.stack([fin.mean(), std, fin.min(), fin.max()])
                else:
                    stats = torch.full((4,), float("nan"), device=o.device)
                row = torch.cat(
                    [stats, torch.stack([torch.as_tensor(nan), torch.as_tensor(inf)]).to(stats)]
                )
            rows.append(
                (name, type(module).__name__, tuple(tuple(x.shape) for x in outs), row, elapsed)
            )

        return hook

    modules = list(model.named_modules()) if layer_hooks else [("", model)]
    handles = []
    for name, module in modules:
        handles.append(module.register_forward_pre_hook(pre(name)))
        handles.append(module.register_forward_hook(post(name)))
    args = inputs if isinstance(inputs, tuple | list) else (inputs,)
    start = time.perf_counter()
    try:
        output = model(*args)
    finally:
        for h in handles:
            h.remove()
    duration = time.perf_counter() - start
    values = torch.stack([r[3].cpu() for r in rows]).tolist() if rows else []
    layers = tuple(
        LayerRecord(
            module=name,
            type=type_name,
            shapes=shapes,
            mean=v[0],
            std=v[1],
            min=v[2],
            max=v[3],
            nan_count=int(v[4]),
            inf_count=int(v[5]),
            duration_s=elapsed,
        )
        for (name, type_name, shapes, _, elapsed), v in zip(rows, values, strict=True)
    )
    first = next((r.module for r in layers if r.nan_count or r.inf_count), None)
    return output, ForwardReport(layers=layers, duration_s=duration, first_non_finite=first)


@dataclass(frozen=True, slots=True, kw_only=True)
class BackwardReport:
    """What :func:`debug_backward_pass` saw.

    Attributes:
        duration_s: host time of ``loss.backward()``.
        grad_norms: per-parameter gradient 2-norm (when a model was given).
        non_finite: the parameters whose gradient holds NaN or Inf.
        total_norm: the total gradient 2-norm.
    """

    duration_s: float
    grad_norms: dict[str, float]
    non_finite: tuple[str, ...]
    total_norm: float | None


def debug_backward_pass(
    loss: torch.Tensor, model: nn.Module | None = None, *, retain_graph: bool = False
) -> BackwardReport:
    """Run ``loss.backward()`` and report its duration and the resulting gradient norms.

    Raises:
        TypeError: if *loss* is not a tensor.
        ValueError: if *loss* has more than one element or does not require grad.
    """
    if not isinstance(loss, torch.Tensor):
        msg = f"loss must be a tensor, got {type(loss).__qualname__}"
        raise TypeError(msg)
    if loss.numel() != 1 or not loss.requires_grad:
        msg = f"loss must be a one-element tensor that requires grad, got shape {tuple(loss.shape)} requires_grad={loss.requires_grad}"
        raise ValueError(msg)
    start = time.perf_counter()
    loss.backward(retain_graph=retain_graph)  # type: ignore[no-untyped-call]
    duration = time.perf_counter() - start
    if model is None:
        return BackwardReport(duration_s=duration, grad_norms={}, non_finite=(), total_norm=None)
    named = [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None]
    if not named:
        return BackwardReport(duration_s=duration, grad_norms={}, non_finite=(), total_norm=0.0)
    grads = [g.coalesce().values() if g.is_sparse else g for _, g in named]
    norms = torch.stack(
        [n.cpu() for n in torch._foreach_norm(grads, 2, dtype=torch.float32)]
    ).tolist()
    by_name = {n: v for (n, _), v in zip(named, norms, strict=True)}
    total = sum(v * v for v in norms) ** 0.5
    bad = tuple(n for n, v in by_name.items() if v != v or v in (float("inf"), -float("inf")))
    return BackwardReport(duration_s=duration, grad_norms=by_name, non_finite=bad, total_norm=total)
