"""Optimization modes: mixed precision, compilation, checkpointing, accumulation.

Two kinds of optimization exist, and they live in two places:

- *model transforms* (:attr:`OptimizationMode.COMPILE`,
  :attr:`OptimizationMode.GRADIENT_CHECKPOINTING`) change the module: :func:`optimize_model`;
- *step transforms* (:attr:`OptimizationMode.AMP`, :attr:`OptimizationMode.GRADIENT_ACCUMULATION`)
  change how one training step runs: :class:`OptimizedStep`, whose phases
  (:meth:`~OptimizedStep.forward_backward`, :meth:`~OptimizedStep.unscale`,
  :meth:`~OptimizedStep.optimizer_step`) leave a safe point between backward and the optimizer
  step where probes see the true (unscaled) gradients and recovery can skip the step.

Probes keep working under every mode: they read ``parameter.grad`` and the loss, which every
mode still produces. Under :attr:`~OptimizationMode.COMPILE` forward hooks on submodules (used
to localize the first non-finite activation) only see what the compiled graph exposes: hooks
registered before compilation are traced into the graph, hooks added later cause a recompile.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from enum import Enum
from typing import Any, Final, cast

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .._validate import positive_int
from ..diagnostics import get_logger

__all__ = (
    "OptimizationMode",
    "OptimizedStep",
    "StepOutcome",
    "default_amp_dtype",
    "disable_gradient_checkpointing",
    "enable_gradient_checkpointing",
    "is_gradient_checkpointing",
    "optimize_model",
)

_log = get_logger(__name__)

DEFAULT_ACCUMULATION_STEPS: Final = 4


class OptimizationMode(Enum):
    """How training is sped up or made to fit in memory.

    Attributes:
        NONE: plain float32 training.
        AMP: automatic mixed precision: ``torch.autocast`` (bfloat16 on CPU, float16 on CUDA)
            plus a ``GradScaler`` when float16 is used.
        COMPILE: ``torch.compile`` (on CPU it needs a C compiler).
        GRADIENT_CHECKPOINTING: recompute activations in backward instead of storing them.
        GRADIENT_ACCUMULATION: step the optimizer every N micro-batches.
        FULL: every mode above at once.
    """

    NONE = "none"
    AMP = "amp"
    COMPILE = "compile"
    GRADIENT_CHECKPOINTING = "gradient_checkpointing"
    GRADIENT_ACCUMULATION = "gradient_accumulation"
    FULL = "full"

    def expand(self) -> frozenset[OptimizationMode]:
        """The concrete modes this one stands for (``FULL`` is all of them)."""
        if self is OptimizationMode.FULL:
            return frozenset(m for m in OptimizationMode if m not in _NOT_CONCRETE)
        if self is OptimizationMode.NONE:
            return frozenset()
        return frozenset({self})


_NOT_CONCRETE: Final = (OptimizationMode.NONE, OptimizationMode.FULL)


def _mode_of(value: object) -> OptimizationMode:
    """*value*, if it is an :class:`OptimizationMode`.

    Raises:
        TypeError: if it is not (a mode's name included: the message names the member).
    """
    if isinstance(value, OptimizationMode):
        return value
    valid = [x.name for x in OptimizationMode]
    hint = ""
    if isinstance(value, str):
        member = value.strip().upper()
        if member in valid:
            hint = f" (use OptimizationMode.{member})"
    msg = f"mode must be an OptimizationMode, got {value!r}{hint}; valid: {valid}"
    raise TypeError(msg)


def _expand(modes: OptimizationMode | Iterable[OptimizationMode]) -> frozenset[OptimizationMode]:
    """The concrete modes *modes* stand for: one mode, or an iterable of modes.

    Raises:
        TypeError: if *modes* is not a mode or an iterable of modes (a str is one value, never
            its characters).
    """
    if isinstance(modes, OptimizationMode | str) or not isinstance(modes, Iterable):
        items: tuple[object, ...] = (modes,)  # refused below when not a mode, named whole
    else:
        items = tuple(modes)
    out: set[OptimizationMode] = set()
    for m in items:
        out |= _mode_of(m).expand()
    return frozenset(out)


# -- gradient checkpointing -------------------------------------------------------------------


class _CheckpointedForward:
    """An instance-level ``forward`` that runs the class's forward under activation checkpointing."""

    __slots__ = ("module",)

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fn = functools.partial(type(self.module).forward, self.module)
        if self.module.training and torch.is_grad_enabled():
            return checkpoint(fn, *args, use_reentrant=False, **kwargs)
        return fn(*args, **kwargs)


def _native(model: nn.Module, current: str, deprecated: str) -> Any:
    """The model's own switch: *current* (Hugging Face >= 5 deprecates *deprecated*), else
    *deprecated*, else None."""
    for name in (current, deprecated):
        fn = getattr(model, name, None)
        if callable(fn):
            return fn
    return None


def _checkpoint_targets(model: nn.Module) -> list[nn.Module]:
    children = list(model.children())
    return children or [model]


def enable_gradient_checkpointing(
    model: nn.Module, *, modules: Iterable[nn.Module] | None = None
) -> int:
    """Recompute the activations of *model*'s blocks in backward instead of keeping them.

    Models that have their own switch (Hugging Face's ``gradient_checkpointing_enable()``) use
    it. Otherwise each of *modules* (default: the direct children of *model*, or *model* itself
    when it has none) runs under :func:`torch.utils.checkpoint.checkpoint` while training with
    gradients enabled; in eval or under ``no_grad`` it runs as before. Idempotent.

    Returns:
        How many modules are checkpointed now (0 when the model's own switch was used).
    """
    native = _native(model, "activation_checkpointing_enable", "gradient_checkpointing_enable")
    if modules is None and callable(native):
        native()
        _log.info("gradient_checkpointing_enabled", model=type(model).__name__, native=True)
        return 0
    count = 0
    for m in modules if modules is not None else _checkpoint_targets(model):
        if not isinstance(m.__dict__.get("forward"), _CheckpointedForward):
            m.forward = _CheckpointedForward(m)
        count += 1
    _log.info("gradient_checkpointing_enabled", model=type(model).__name__, modules=count)
    return count


def disable_gradient_checkpointing(model: nn.Module) -> int:
    """Undo :func:`enable_gradient_checkpointing` on *model* and all its submodules.

    Returns:
        How many modules were restored.
    """
    native = _native(model, "activation_checkpointing_disable", "gradient_checkpointing_disable")
    if callable(native):
        native()
    count = 0
    for m in model.modules():
        if isinstance(m.__dict__.get("forward"), _CheckpointedForward):
            del m.forward
            count += 1
    if count:
        _log.info("gradient_checkpointing_disabled", model=type(model).__name__, modules=count)
    return count


def is_gradient_checkpointing(model: nn.Module) -> bool:
    """True when any submodule of *model* runs under checkpointing (ours or the model's own)."""
    name = (
        "is_activation_checkpointing"
        if hasattr(type(model), "is_activation_checkpointing")
        else "is_gradient_checkpointing"
    )
    if getattr(model, name, False) is True:
        return True
    return any(isinstance(m.__dict__.get("forward"), _CheckpointedForward) for m in model.modules())


# -- model transforms -------------------------------------------------------------------------


def optimize_model(
    model: nn.Module,
    mode: OptimizationMode | Iterable[OptimizationMode],
    *,
    compile_options: dict[str, Any] | None = None,
) -> nn.Module:
    """Apply the model-level part of *mode* to *model* and return the module to train.

    ``GRADIENT_CHECKPOINTING`` changes *model* in place; ``COMPILE`` returns a compiled wrapper
    that shares *model*'s parameters (so optimizers and probes built on *model* keep working).
    ``AMP`` and ``GRADIENT_ACCUMULATION`` change the step, not the model: use
    :class:`OptimizedStep` with the same modes.

    Args:
        model: the module to optimize.
        mode: one mode or several.
        compile_options: keyword arguments for :func:`torch.compile` (``mode``, ``dynamic``...).

    Raises:
        TypeError: if *mode* holds something that is not an :class:`OptimizationMode` (a
            mode's name included: the message names the member to use).
    """
    modes = _expand(mode)
    out = model
    if OptimizationMode.GRADIENT_CHECKPOINTING in modes:
        enable_gradient_checkpointing(model)
    if OptimizationMode.COMPILE in modes:
        out = cast(nn.Module, torch.compile(model, **(compile_options or {})))
        _log.info("model_compiled", model=type(model).__name__)
    return out


def default_amp_dtype(device_type: str) -> torch.dtype:
    """The autocast dtype for *device_type*: bfloat16 on CPU, float16 elsewhere."""
    return torch.bfloat16 if device_type == "cpu" else torch.float16


# -- step transforms --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class StepOutcome:
    """What one call of :meth:`OptimizedStep.run` did.

    Attributes:
        loss: the unscaled loss of this micro-batch (a detached tensor: reading it syncs).
        stepped: whether the optimizer stepped (False while accumulating, or when the scaler
            skipped a step with non-finite gradients).
        micro_step: the index of this micro-batch inside its accumulation window.
    """

    loss: torch.Tensor
    stepped: bool
    micro_step: int


class OptimizedStep:
    """One training step under AMP and/or gradient accumulation, with a safe point before the step.

    Use :meth:`run` for the whole step, or the phases to put checks at the safe point::

        step = OptimizedStep(model, optimizer, loss_fn, OptimizationMode.AMP)
        loss = step.forward_backward(inputs, targets)
        if step.should_step:
            step.unscale()               # gradients are true values from here on
            ...                          # await probes, apply recovery decisions
            step.optimizer_step()

    Args:
        model: the (possibly compiled) module.
        optimizer: its optimizer.
        loss_fn: ``loss_fn(outputs, targets) -> scalar tensor``.
        mode: the modes; the model-level ones are ignored here (see :func:`optimize_model`).
        accumulation_steps: micro-batches per optimizer step under ``GRADIENT_ACCUMULATION``.
        amp_dtype: autocast dtype (default: :func:`default_amp_dtype` of *device_type*).
        device_type: ``"cpu"`` or ``"cuda"`` (default: where the model's first parameter is).

    Raises:
        ValueError: if *accumulation_steps* < 1.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        mode: OptimizationMode | Iterable[OptimizationMode] = OptimizationMode.NONE,
        *,
        accumulation_steps: int = DEFAULT_ACCUMULATION_STEPS,
        amp_dtype: torch.dtype | None = None,
        device_type: str | None = None,
    ) -> None:
        accumulation_steps = positive_int("accumulation_steps", accumulation_steps)
        self.modes = _expand(mode)
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        if device_type is None:
            first = next(iter(model.parameters()), None)
            device_type = first.device.type if first is not None else "cpu"
        self.device_type = device_type
        self.amp = OptimizationMode.AMP in self.modes
        self.amp_dtype = amp_dtype or default_amp_dtype(device_type)
        self.accumulation_steps = (
            accumulation_steps if OptimizationMode.GRADIENT_ACCUMULATION in self.modes else 1
        )
        # A scaler only matters for float16: bfloat16 has float32's exponent range.
        self.scaler: torch.amp.GradScaler | None = (
            torch.amp.GradScaler(device_type)
            if self.amp and self.amp_dtype == torch.float16
            else None
        )
        self._micro = 0
        self._unscaled = False

    @property
    def micro_step(self) -> int:
        """How many micro-batches are accumulated in the current window."""
        return self._micro

    @property
    def should_step(self) -> bool:
        """True when the accumulation window is full: the optimizer should step now."""
        return self._micro >= self.accumulation_steps

    @property
    def loss_scale(self) -> float | None:
        """The GradScaler's current scale (None without a scaler)."""
        return float(self.scaler.get_scale()) if self.scaler is not None else None

    def autocast(self) -> AbstractContextManager[Any]:
        """The autocast context of this step (a no-op without AMP)."""
        if not self.amp:
            return nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.amp_dtype)

    def forward_backward(self, inputs: Any, targets: Any) -> torch.Tensor:
        """Forward under autocast, backward of the (scaled, accumulation-divided) loss.

        Returns:
            The unscaled loss of this micro-batch, detached.
        """
        if self._micro == 0:
            self.optimizer.zero_grad(set_to_none=True)
        with self.autocast():
            outputs = self.model(inputs)
            loss = self.loss_fn(outputs, targets)
        scaled = loss.float() / self.accumulation_steps
        if self.scaler is not None:
            scaled = self.scaler.scale(scaled)
        torch.autograd.backward(scaled)
        self._micro += 1
        return loss.detach().float()

    def unscale(self) -> None:
        """Divide the gradients by the loss scale, once per optimizer step (no-op without one)."""
        if self.scaler is not None and not self._unscaled:
            self.scaler.unscale_(self.optimizer)
        self._unscaled = True

    def optimizer_step(self) -> bool:
        """Step the optimizer (through the scaler when there is one) and open a new window.

        Returns:
            False when the scaler skipped the step because gradients were not finite.
        """
        stepped = True
        if self.scaler is not None:
            self.unscale()
            before = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            stepped = self.scaler.get_scale() >= before
        else:
            self.optimizer.step()
        self.reset()
        return stepped

    def skip_step(self) -> None:
        """Drop the accumulated gradients without stepping (a recovery decision)."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.scaler is not None and self._unscaled:
            # unscale_ recorded per-optimizer state; update() clears it and backs the scale off.
            self.scaler.update(self.scaler.get_scale() * self.scaler.get_backoff_factor())
        self.reset()

    def reset(self) -> None:
        """Open a new accumulation window."""
        self._micro = 0
        self._unscaled = False

    def run(self, inputs: Any, targets: Any) -> StepOutcome:
        """One micro-batch: forward, backward and, when the window is full, the optimizer step."""
        loss = self.forward_backward(inputs, targets)
        micro = self._micro - 1
        stepped = False
        if self.should_step:
            stepped = self.optimizer_step()
        return StepOutcome(loss=loss, stepped=stepped, micro_step=micro)
