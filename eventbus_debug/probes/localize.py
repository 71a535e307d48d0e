"""First-NaN localization: name the module (or parameter gradient) where a NaN/Inf was made.

Hooks are installed only while armed (a replayed step, a ``with`` block, the next steps after
an incident) and removed after, so a disarmed locator costs nothing. While armed, every module
call gets on-device flags for its inputs and its output (and, for the backward pass, the
gradients at its outputs and inputs, and every parameter gradient); the flags are moved to the
host once, after the replay.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import Enum

import anyio.lowlevel
import torch
from torch import nn

from eventbus_debug.diagnostics import get_logger

from .._modules import named_root
from .._validate import publisher
from ..events import AnomalyLocalized, TensorRole
from ..typing import Publisher
from ._flags import float_tensors, made_here, nonfinite_flags
from .finite import stored_values

__all__ = ("FirstNonFiniteLocator",)

_log = get_logger(__name__)


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
                inputs = float_tensors(args) + float_tensors(kwargs or {})
                with torch.no_grad():
                    flags = nonfinite_flags(inputs)
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
                    inputs = float_tensors(args) + float_tensors(kwargs)
                    self._calls += 1
                    call, in_flags = self._calls, nonfinite_flags(inputs)
                outs = float_tensors(output)
                if not outs:
                    return
                with torch.no_grad():
                    out_flags = nonfinite_flags(outs)
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
                flags = nonfinite_flags([grad], grad.device)
            records.append(_Record(kind, name, call, flags, (shape,)))

        return hook

    def _param_hook(
        self, owner: str, name: str, param: torch.Tensor
    ) -> Callable[[torch.Tensor], None]:
        records = self._records
        shape = tuple(param.shape)

        def hook(grad: torch.Tensor) -> None:
            with torch.no_grad():
                flags = nonfinite_flags([grad], grad.device)
            records.append(_Record(_Kind.PARAM_GRAD, owner, -1, flags, (shape,), parameter=name))

        return hook


def _forward_origin(reads: list[_Read]) -> tuple[_Read, TensorRole] | None:
    """The first call (in completion order) that made a NaN/Inf; else where bad inputs came in."""
    for r in reads:
        if made_here(r.flags):
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
