"""First-NaN localization: name the module (or parameter gradient) where a NaN/Inf was made.

Hooks are installed only while armed (a replayed step, a ``with`` block, the next steps after
an incident) and removed after, so a disarmed locator costs nothing. While armed, every module
call gets on-device flags for its inputs and its output (and, for the backward pass, the
gradients at its outputs and inputs, and every parameter gradient); the flags are moved to the
host once, after the replay.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import anyio.lowlevel
import torch
from torch import nn

from eventbus_debug.diagnostics import get_logger

from .._modules import named_root
from .._validate import publisher
from ..events import AnomalyLocalized, TensorRole
from ..typing import Publisher
from .finite import stored_values

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


def _flags(tensors: list[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
    """``[any NaN, any NaN or Inf]`` over *tensors*, as a uint8 pair on their device."""
    parts: list[torch.Tensor] = []
    for t in tensors:
        try:
            v = stored_values(t)
        except (TypeError, ValueError):
            continue
        if v.numel() == 0:
            continue
        parts.append(torch.stack([torch.isnan(v).any(), (~torch.isfinite(v)).any()]))
    if not parts:
        return torch.zeros(2, dtype=torch.uint8, device=device)
    home = parts[0].device
    return torch.stack([p.to(home) for p in parts]).any(dim=0).to(torch.uint8)


class _Kind(Enum):
    FORWARD = "forward"  # a module call: its input and output flags
    OUT_GRAD = "out_grad"  # the gradient arriving at a module call's output
    IN_GRAD = "in_grad"  # the gradient a module call's backward made for its input
    PARAM_GRAD = "param_grad"  # the gradient of a parameter


@dataclass(slots=True)
class _Record:
    kind: _Kind
    module: str
    call: int  # the forward call this record belongs to (-1: a parameter gradient)
    flags: torch.Tensor  # FORWARD: [in NaN, in non-finite, out NaN, out non-finite]; else 2
    shapes: tuple[tuple[int, ...], ...]
    inputs: list[torch.Tensor] = field(default_factory=list)
    parameter: str = ""


@dataclass(slots=True)
class _Read:
    """A record with its flags on the host."""

    record: _Record
    flags: list[int]

    @property
    def out_nan(self) -> bool:
        return bool(self.flags[-2])

    @property
    def out_bad(self) -> bool:
        return bool(self.flags[-1])


def _made_here(flags: list[int]) -> bool:
    """A call made the NaN/Inf of its output: no NaN came in for a NaN out; nothing for an Inf.

    An input holding ``-inf`` (an additive attention mask) does not excuse a NaN output: the
    module turned it into NaN (a softmax over a fully masked row).
    """
    in_nan, in_bad, out_nan, out_bad = flags
    if not out_bad:
        return False
    return not in_nan if out_nan else not in_bad


class FirstNonFiniteLocator:
    """Finds where a NaN or Inf was made: the module (or parameter gradient) of its origin.

    In the forward pass that is the first module, in completion order, whose inputs were
    finite and whose output is not: a NaN made inside a parent's own code (a softmax over a
    fully masked row in ``Attention.forward``, before its output projection) names the parent,
    not the projection that only passed the NaN on. In the backward pass it is the first module
    that received finite gradients and produced a non-finite one, or the parameter whose
    gradient alone is non-finite. Forward findings win: a NaN made in the forward pass poisons
    every gradient after it.

    Example::

        locator = FirstNonFiniteLocator(model, bus)
        if not verdict.finite:  # the step probe saw a NaN: replay the step with hooks armed
            found = await locator.localize(lambda: loss_fn(model(x), y).backward())

    Args:
        model: the module to watch; it is never mutated (hooks are removed after each use).
        bus: where :class:`AnomalyLocalized` goes (``None``: only returned).
        backward: also watch gradients (tensor hooks on module inputs, outputs and
            parameters).
        source: the ``source`` stamped on events.

    Raises:
        TypeError: if *model* is not an ``nn.Module`` or *bus* not a bus.
    """

    def __init__(
        self,
        model: nn.Module,
        bus: Publisher | None = None,
        *,
        backward: bool = True,
        source: str = "localizer",
    ) -> None:
        if not isinstance(model, nn.Module):
            msg = f"model must be a torch.nn.Module, got {type(model).__qualname__}"
            raise TypeError(msg)
        self._model = model
        self._bus = publisher("bus", bus)
        self.backward = backward
        self.source = source
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._records: list[_Record] = []
        self._open: dict[int, list[tuple[int, torch.Tensor, list[torch.Tensor]]]] = {}
        self._calls = 0

    @property
    def model(self) -> nn.Module:
        """The watched module."""
        return self._model

    @property
    def is_armed(self) -> bool:
        """True while hooks are installed."""
        return bool(self._handles)

    @property
    def has_records(self) -> bool:
        """True when the hooks recorded something since the last :meth:`result`."""
        return bool(self._records)

    def arm(self) -> None:
        """Install the hooks on every module (idempotent). Prefer :meth:`armed` or :meth:`localize`."""
        if self._handles:
            return
        self._records.clear()
        self._open.clear()
        root = named_root(self._model)
        modules = list(root.named_modules())
        if root is not self._model:
            # torch.compile's wrapper: a compiled forward runs the hooks of this module only
            # (hooks added after compiling are not traced), an eager replay those of the model
            modules.insert(0, ("", self._model))
        for name, module in modules:
            self._handles.append(
                module.register_forward_pre_hook(self._pre_hook(), with_kwargs=True)
            )
            self._handles.append(
                module.register_forward_hook(self._forward_hook(name), with_kwargs=True)
            )
        if self.backward:
            for name, p in root.named_parameters():
                if p.requires_grad:
                    owner = name.rpartition(".")[0]
                    self._handles.append(p.register_hook(self._param_hook(owner, name, p)))  # type: ignore[no-untyped-call]

    def disarm(self) -> None:
        """Remove every hook (idempotent); what was recorded stays for :meth:`result`."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._open.clear()

    @contextlib.contextmanager
    def armed(self) -> Iterator[None]:
        """Arm the hooks for the duration of the block; read the result with :meth:`result`."""
        self.arm()
        try:
            yield
        finally:
            self.disarm()

    def result(self, *, step: int | None = None) -> AnomalyLocalized | None:
        """Where the first NaN/Inf seen while armed was made (``None``: everything finite).

        One transfer moves every flag to the host; the records are cleared.
        """
        records, self._records = self._records, []
        if not records:
            return None
        home = records[0].flags.device
        flat = torch.cat([r.flags.reshape(-1).to(home) for r in records]).tolist()
        reads: list[_Read] = []
        at = 0
        for r in records:
            n = r.flags.numel()
            reads.append(_Read(r, flat[at : at + n]))
            at += n
        forward = [x for x in reads if x.record.kind is _Kind.FORWARD]
        found = _forward_origin(forward)
        if found is None:
            found = _backward_origin([x for x in reads if x.record.kind is not _Kind.FORWARD])
        if found is None:
            return None
        read, role = found
        record = read.record
        lo, hi = _finite_range(record.inputs)
        return AnomalyLocalized(
            step=step,
            source=self.source,
            module=record.module,
            phase="forward" if record.kind is _Kind.FORWARD else "backward",
            role=role,
            shapes=record.shapes,
            input_min=lo,
            input_max=hi,
            parameter=record.parameter,
        )

    async def localize(
        self, replay: Callable[[], object], *, step: int | None = None
    ) -> AnomalyLocalized | None:
        """Run *replay* (a forward, or forward and backward) with hooks armed; publish the finding.

        Errors raised by *replay* propagate after the hooks are removed.

        Returns:
            the published :class:`AnomalyLocalized`, or ``None`` when everything stayed finite.
        """
        found = self.localize_sync(replay, step=step)
        await anyio.lowlevel.checkpoint()
        return found

    def localize_sync(
        self, replay: Callable[[], object], *, step: int | None = None
    ) -> AnomalyLocalized | None:
        """:meth:`localize` for synchronous code (a :class:`~eventbus_debug.SyncSession`)."""
        self._records.clear()
        with self.armed():
            replay()
        found = self.result(step=step)
        if found is not None:
            self.publish(found)
        return found

    def publish(self, found: AnomalyLocalized) -> None:
        """Publish *found* on the locator's bus and log it."""
        if self._bus is not None:
            self._bus.publish_nowait(found)
        _log.info(
            "anomaly_localized",
            module=found.module,
            phase=found.phase,
            parameter=found.parameter,
            step=found.step,
        )

    # -- hooks --------------------------------------------------------------------------------

    def _pre_hook(
        self,
    ) -> Callable[[nn.Module, tuple[object, ...], dict[str, object] | None], None]:
        def hook(
            module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object] | None = None
        ) -> None:
            # Disarmed while the module's hooks were being called (by a hook before this one):
            # torch then calls this hook without kwargs; it must do nothing.
            if not self._handles:
                return
            try:
                inputs = _float_tensors(args) + _float_tensors(kwargs or {})
                with torch.no_grad():
                    flags = _flags(inputs)
                self._calls += 1
                self._open.setdefault(id(module), []).append((self._calls, flags, inputs))
            except Exception:  # a probe never raises into the user's forward
                _log.warning("localizer_hook_failed", exc_info=True)

        return hook

    def _forward_hook(
        self, name: str
    ) -> Callable[[nn.Module, tuple[object, ...], dict[str, object], object], None]:
        records = self._records

        def hook(
            module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object], output: object
        ) -> None:
            if not self._handles:
                return
            try:
                stack = self._open.get(id(module))
                if stack:
                    call, in_flags, inputs = stack.pop()
                else:  # armed while this call was running: judge its inputs as they are now
                    inputs = _float_tensors(args) + _float_tensors(kwargs)
                    self._calls += 1
                    call, in_flags = self._calls, _flags(inputs)
                outs = _float_tensors(output)
                if not outs:
                    return
                with torch.no_grad():
                    out_flags = _flags(outs)
                    flags = torch.cat([in_flags.to(out_flags.device), out_flags])
                shapes = tuple(tuple(o.shape) for o in outs if not o.is_nested)
                records.append(
                    _Record(_Kind.FORWARD, name, call, flags, shapes, [i.detach() for i in inputs])
                )
                if self.backward and torch.is_grad_enabled():
                    for o in outs:
                        if o.requires_grad:
                            o.register_hook(self._grad_hook(_Kind.OUT_GRAD, name, call, o))  # type: ignore[no-untyped-call]
                    for t in inputs:
                        if t.requires_grad:
                            t.register_hook(self._grad_hook(_Kind.IN_GRAD, name, call, t))  # type: ignore[no-untyped-call]
            except Exception:  # a probe never raises into the user's forward
                _log.warning("localizer_hook_failed", module=name, exc_info=True)

        return hook

    def _grad_hook(
        self, kind: _Kind, name: str, call: int, tensor: torch.Tensor
    ) -> Callable[[torch.Tensor], None]:
        records = self._records
        shape = tuple(tensor.shape)

        def hook(grad: torch.Tensor) -> None:
            with torch.no_grad():
                flags = _flags([grad], grad.device)
            records.append(_Record(kind, name, call, flags, (shape,)))

        return hook

    def _param_hook(
        self, owner: str, name: str, param: torch.Tensor
    ) -> Callable[[torch.Tensor], None]:
        records = self._records
        shape = tuple(param.shape)

        def hook(grad: torch.Tensor) -> None:
            with torch.no_grad():
                flags = _flags([grad], grad.device)
            records.append(_Record(_Kind.PARAM_GRAD, owner, -1, flags, (shape,), parameter=name))

        return hook


def _forward_origin(reads: list[_Read]) -> tuple[_Read, TensorRole] | None:
    """The first call (in completion order) that made a NaN/Inf; else where bad inputs came in."""
    for r in reads:
        if _made_here(r.flags):
            return r, TensorRole.OUTPUT
    came_in = [r for r in reads if r.flags[1]]  # non-finite inputs, made by no module
    if came_in:
        return min(came_in, key=lambda r: r.record.call), TensorRole.INPUT
    return None


def _backward_origin(reads: list[_Read]) -> tuple[_Read, TensorRole] | None:
    """The first gradient made non-finite by a call whose incoming gradients were finite."""
    bad_out_calls = {r.record.call for r in reads if r.record.kind is _Kind.OUT_GRAD and r.flags[1]}
    bad_out_modules = {
        r.record.module for r in reads if r.record.kind is _Kind.OUT_GRAD and r.flags[1]
    }
    first_bad: _Read | None = None
    for r in reads:
        if not r.flags[1]:
            continue
        first_bad = first_bad or r
        kind = r.record.kind
        if kind is _Kind.IN_GRAD and r.record.call not in bad_out_calls:
            return r, TensorRole.GRADIENT
        if kind is _Kind.PARAM_GRAD and r.record.module not in bad_out_modules:
            return r, TensorRole.GRADIENT
        if kind is _Kind.OUT_GRAD and r.record.module == "":
            return r, TensorRole.GRADIENT  # the loss, outside the model, made it
    return (first_bad, TensorRole.GRADIENT) if first_bad is not None else None


def _finite_range(inputs: list[torch.Tensor]) -> tuple[float | None, float | None]:
    values = []
    for t in inputs:
        try:
            v = stored_values(t)
        except (TypeError, ValueError):
            continue
        if v.is_complex():
            v = v.abs()
        v = v[torch.isfinite(v)]
        if v.numel():
            values.append(v.to(torch.float64))
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
        inputs_finite: False when its (positional) inputs held NaN or Inf.
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
    inputs_finite: bool = True


@dataclass(frozen=True, slots=True, kw_only=True)
class ForwardReport:
    """What :func:`debug_forward_pass` saw, layer by layer, in completion order.

    Attributes:
        layers: every module's record, in completion order.
        duration_s: host time of the whole forward pass.
        first_non_finite: the module where a NaN/Inf was made: the first (in completion order)
            whose inputs were finite and whose output is not — a parent whose own code made it
            is named, not the child that passed it on; ``None`` when everything was finite.
    """

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
    r"""Run ``model(inputs)`` once and report per-layer shapes, statistics and timing.

    Every statistic stays on the device until the end; one transfer moves them all. A
    ``torch.compile``\ d model runs eager here (the model it wraps), so that every layer's hooks
    run and the layers are named as in the model.

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
    in_flags: dict[int, torch.Tensor] = {}
    rows: list[tuple[str, str, tuple[tuple[int, ...], ...], torch.Tensor, float]] = []

    def pre(name: str) -> Callable[[nn.Module, object], None]:
        def hook(module: nn.Module, args: object) -> None:
            with torch.no_grad():
                in_flags[id(module)] = _flags(_float_tensors(args))
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
                flags = in_flags.pop(id(module), torch.zeros(2, dtype=torch.uint8))
                row = torch.cat(
                    [
                        stats,
                        torch.stack([torch.as_tensor(nan), torch.as_tensor(inf)]).to(stats),
                        flags.to(stats),
                    ]
                )
            rows.append(
                (name, type(module).__name__, tuple(tuple(x.shape) for x in outs), row, elapsed)
            )

        return hook

    model = named_root(model)  # a compiled model runs eager here: every layer's hooks fire
    modules = list(model.named_modules()) if layer_hooks else [("", model)]
    handles = []
    for name, module in modules:
        handles.append(module.register_forward_pre_hook(pre(name)))
        handles.append(module.register_forward_hook(post(name)))
    args = inputs if isinstance(inputs, tuple | list) else (inputs,)
    start = time.perf_counter()
    try:
        with torch.compiler.set_stance("force_eager"):  # a model compiled in place too
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
            inputs_finite=not v[7],
        )
        for (name, type_name, shapes, _, elapsed), v in zip(rows, values, strict=True)
    )
    made = [
        r
        for r, v in zip(layers, values, strict=True)
        if _made_here([int(v[6]), int(v[7]), int(v[4] > 0), int(v[4] + v[5] > 0)])
    ]
    bad = [r for r in layers if r.nan_count or r.inf_count]
    first = made[0] if made else bad[0] if bad else None
    return output, ForwardReport(
        layers=layers,
        duration_s=duration,
        first_non_finite=first.module if first is not None else None,
    )


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
    named = [(n, p.grad) for n, p in named_root(model).named_parameters() if p.grad is not None]
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
