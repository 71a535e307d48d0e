"""Skip a non-finite step on the device: a found-inf flag handed to a fused optimizer.

``torch.amp.GradScaler`` drives the fused optimizers without a host synchronization: an
optimizer whose ``_step_supports_amp_scaling`` is set (``Adam``, ``AdamW`` and ``SGD`` built
with ``fused=True``) reads ``optimizer.found_inf`` (a float32 0-d tensor) in ``step()``, and its
kernel leaves the parameters and the optimizer state untouched when the flag is not zero (Adam
also takes back the step count it added). :class:`DeviceSkip` hands such a flag over, computed
on the device from the step probe's result vector (the loss and the gradient norms), so a
non-finite step is skipped with no ``.item()`` at all: the host learns about it one step later,
when the probe's deferred read publishes the incident.

The contract, read in torch 2.13: ``GradScaler.step`` sets ``optimizer.grad_scale`` and
``optimizer.found_inf`` before ``optimizer.step()`` and deletes them after
(``torch/amp/grad_scaler.py``, ``step``); ``Adam.step`` and ``SGD.step`` pass
``getattr(self, "found_inf", None)`` to ``_fused_adam`` / ``_fused_sgd``, which move it to each
parameter's device and hand it to the kernel (``torch/optim/adam.py`` ``_fused_adam``,
``torch/optim/sgd.py`` ``_fused_sgd``). A ``GradScaler`` overwrites ``found_inf`` with its own
and deletes it after its step: with a scaler the scaler owns the flag (and already skips
non-finite steps on the device), so the session refuses the combination.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from typing import Any, Final, Protocol

import torch
from torch.utils.hooks import RemovableHandle

from eventbus_debug.diagnostics import get_logger

from ..events import RecoveryAction, StepSkipped
from ..typing import Publisher
from .actions import DecidedAction

__all__ = ("DeviceSkip", "Judged", "fused_optimizer")

_log = get_logger(__name__)

_ATTR: Final = "found_inf"
# Decisions about the gradients of a step already gone: applying them at a later step would
# act on that (healthy) step's gradients instead.
_STALE: Final = frozenset({RecoveryAction.SKIP_STEP, RecoveryAction.CLIP_GRADIENTS})
_AMP_DTYPES: Final = frozenset({torch.float32, torch.float16, torch.bfloat16})


class Judged(Protocol):
    """What :class:`DeviceSkip` reads of a step probe's verdict (a ``StepVerdict``)."""

    @property
    def step(self) -> int: ...
    @property
    def checked(self) -> bool: ...
    @property
    def loss(self) -> float | None: ...
    @property
    def grad_norm(self) -> float | None: ...


def fused_optimizer(optimizer: object) -> torch.optim.Optimizer:
    """*optimizer*, when its ``step()`` reads a device-side ``found_inf`` flag.

    Raises:
        TypeError: if *optimizer* is not a ``torch.optim.Optimizer``.
        ValueError: if it does not read the flag (not built with ``fused=True``, or a custom
            optimizer on the deprecated ``grad_scaler=`` keyword contract); the message names it.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        msg = (
            "device_skip needs a fused torch optimizer (e.g. torch.optim.AdamW(..., fused=True)), "
            f"got {type(optimizer).__qualname__}"
        )
        raise TypeError(msg)
    name = type(optimizer).__qualname__
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        msg = (
            f"device_skip needs an optimizer whose step() reads a device-side found_inf flag; "
            f"{name} does not (build Adam, AdamW or SGD with fused=True)"
        )
        raise ValueError(msg)
    if "grad_scaler" in inspect.signature(optimizer.step).parameters:
        msg = (
            f"{name}.step() takes the deprecated grad_scaler= keyword instead of reading "
            "optimizer.found_inf; device_skip cannot drive it"
        )
        raise ValueError(msg)
    return optimizer


class DeviceSkip:
    """Hands a device-side found-inf flag to a fused optimizer at each step.

    The session drives it: :meth:`launched` computes the step's flag from the probe's device
    vector (right after the probe launched it, before the safe point), :meth:`arm` sets
    ``optimizer.found_inf`` when the step is to be taken, and the flag is removed right after
    ``optimizer.step()`` (a step post-hook), at :meth:`disarm` (``step_completed``) and at
    :meth:`release` (the session's end), whichever comes first. An ``optimizer.step()`` called
    without an armed flag is an ordinary step.

    Torch's fused SGD with momentum creates its momentum buffers uninitialized
    (``torch.empty_like``) at its first step and fills them in the kernel; a first step skipped
    on the device would leave them so. Until those buffers exist, the flag is therefore read
    on the host (one synchronization, before the first real step only), and a non-finite step
    has its gradients set to ``None`` instead, which makes ``optimizer.step()`` a no-op.

    Args:
        optimizer: a fused optimizer (see :func:`fused_optimizer`).
        publisher: where the :class:`~eventbus_debug.events.StepSkipped` of each step skipped on
            the device goes, once the probe read it (``None``: nowhere).
        source: the ``source`` of those events.

    Raises:
        TypeError: as :func:`fused_optimizer`.
        ValueError: as :func:`fused_optimizer`.
    """

    __slots__ = (
        "_armed",
        "_flag",
        "_handle",
        "_host_first",
        "_one",
        "optimizer",
        "publisher",
        "source",
        "step",
    )

    def __init__(
        self,
        optimizer: object,
        *,
        publisher: Publisher | None = None,
        source: str = "device_skip",
    ) -> None:
        self.optimizer = opt = fused_optimizer(optimizer)
        self.publisher = publisher
        self.source = source
        self.step: int | None = None
        """The step whose flag was computed last (the safe point under way)."""
        self._flag: torch.Tensor | None = None
        self._one = torch.ones(())
        self._armed: torch.Tensor | None = None
        self._handle: RemovableHandle | None = None
        self._host_first = isinstance(opt, torch.optim.SGD) and any(
            g.get("momentum", 0) for g in opt.param_groups
        )

    # -- the step -----------------------------------------------------------------------------

    @property
    def flag(self) -> torch.Tensor | None:
        """The last step's flag (float32, 0-d, on the device; 1.0: skip), None before any."""
        return self._flag

    @property
    def armed(self) -> bool:
        """True while ``optimizer.found_inf`` holds this object's flag."""
        return self._armed is not None

    def launched(
        self,
        step: int,
        launch: tuple[torch.Tensor, bool] | None,
        loss: torch.Tensor | float | None,
        previous: Judged | None = None,
    ) -> torch.Tensor:
        """Compute *step*'s flag on the device; report the previous step skipped on the device.

        Args:
            step: the step under way.
            launch: the probe's device vector of *step* and whether it holds the gradient norms
                (``StepProbe.in_flight``); ``None`` when no check ran at *step*: the gradients
                are then checked here (their max-norms, one fused call).
            loss: the step's loss: a Python number is checked on the host (it is there).
            previous: the probe's verdict read at this call (an earlier step's): when its loss
                or gradient norm was not finite, that step's flag was set and the optimizer
                skipped it: a :class:`~eventbus_debug.events.StepSkipped` says so.
        """
        self.step = step
        if previous is not None:
            self._report(step, previous)
        vector, grads_covered = launch if launch is not None else (None, False)
        device = vector.device if vector is not None and vector.numel() else self._device()
        flag = self._flag
        if flag is None or flag.device != device:
            flag = self._flag = torch.zeros((), dtype=torch.float32, device=device)
            self._one = torch.ones((), dtype=torch.float32, device=device)
        if vector is None or not vector.numel() or vector.device != device:
            flag.zero_()
            grads_covered = False
        elif vector.dtype in _AMP_DTYPES:
            # GradScaler's own check: one kernel sets the flag when a value is not finite
            # (multiplying the vector by 1 in place, which changes no value).
            flag.zero_()
            torch._amp_foreach_non_finite_check_and_unscale_([vector], flag, self._one)
        else:
            torch.logical_not(torch.isfinite(vector).all(), out=flag)
        if not grads_covered:
            self._check_grads(flag)
        if loss is not None and not isinstance(loss, torch.Tensor) and not math.isfinite(loss):
            flag.fill_(1.0)
        return flag

    def arm(self) -> None:
        """Set ``optimizer.found_inf`` to the step's flag (before ``optimizer.step()``).

        Raises:
            RuntimeError: if no flag was computed, or ``optimizer.found_inf`` holds someone
                else's flag (a ``GradScaler`` step under way).
        """
        flag = self._flag
        if flag is None:
            msg = "DeviceSkip.arm() before launched(): no flag computed for this step"
            raise RuntimeError(msg)
        optimizer = self.optimizer
        current = optimizer.__dict__.get(_ATTR)
        if current is not None and current is not self._armed:
            msg = (
                f"{type(optimizer).__qualname__}.found_inf is already set by someone else (a "
                "GradScaler?); device_skip and a GradScaler cannot share an optimizer"
            )
            raise RuntimeError(msg)
        if self._host_first and not self._momentum_ready() and bool(flag):
            # Fused SGD's first step creates uninitialized momentum buffers even when skipped
            # on the device: skip it on the host (no gradients, so step() does nothing).
            optimizer.zero_grad(set_to_none=True)
            return
        if self._handle is None:
            self._handle = optimizer.register_step_post_hook(self._stepped)
        setattr(optimizer, _ATTR, flag)
        self._armed = flag

    def disarm(self) -> None:
        """Remove the flag from the optimizer (a no-op when it is not there)."""
        armed, self._armed = self._armed, None
        if armed is not None and self.optimizer.__dict__.get(_ATTR) is armed:
            delattr(self.optimizer, _ATTR)

    def release(self) -> None:
        """Remove the flag and the optimizer hook (the session ended; idempotent)."""
        self.disarm()
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.remove()

    def agree(self, decisions: Sequence[DecidedAction]) -> list[DecidedAction]:
        """The recovery decisions to apply at the safe point under way (a SafePoint hook).

        The probe reads each step one step late, so recovery's answer to a non-finite step
        arrives at the next safe point: skipping or clipping then would act on the next,
        healthy step's gradients. Those decisions about an earlier step are dropped (the
        device already skipped the bad step); the others (restore, LR, memory, stop) stay.
        """
        now = self.step
        if now is None:
            return list(decisions)
        keep = []
        for d in decisions:
            if d.kind in _STALE and d.step is not None and d.step < now:
                _log.debug("device_skip_stale_decision", step=d.step, now=now, action=d.kind.value)
                continue
            keep.append(d)
        return keep

    # -- internals ------------------------------------------------------------------------------

    def _stepped(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.disarm()

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _device(self) -> torch.device:
        params = self._params()
        for p in params:
            if p.grad is not None:
                return p.grad.device
        return params[0].device if params else torch.device("cpu")

    def _check_grads(self, flag: torch.Tensor) -> None:
        """OR into *flag* whether a gradient is not finite (max |g| is finite iff all are)."""
        grads = [p.grad for p in self._params() if p.grad is not None]
        if not grads:
            return
        norms = torch._foreach_norm(grads, math.inf)
        maxima = torch.stack([n.to(flag.device, torch.float32) for n in norms])
        torch.logical_or(flag, torch.logical_not(torch.isfinite(maxima).all()), out=flag)

    def _momentum_ready(self) -> bool:
        """True when every gradient of a momentum group has its momentum buffer."""
        state = self.optimizer.state
        for group in self.optimizer.param_groups:
            if not group.get("momentum", 0):
                continue
            for p in group["params"]:
                if p.grad is not None and state.get(p, {}).get("momentum_buffer") is None:
                    return False
        self._host_first = False  # the buffers exist from now on
        return True

    def _report(self, step: int, previous: Judged) -> None:
        if not previous.checked or previous.step >= step or self.publisher is None:
            return
        values = (previous.loss, previous.grad_norm)
        if all(v is None or math.isfinite(v) for v in values):
            return
        self.publisher.publish_nowait(
            StepSkipped(
                step=previous.step,
                source=self.source,
                reason=f"non-finite {_what(values)}: device_skip skipped the optimizer update",
            )
        )


def _what(values: tuple[float | None, float | None]) -> str:
    loss, grad = (v is not None and not math.isfinite(v) for v in values)
    return " and ".join(n for n, bad in (("loss", loss), ("gradients", grad)) if bad)
