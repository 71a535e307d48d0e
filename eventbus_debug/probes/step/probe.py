"""The step probe: loss, gradient, parameter and update checks after ``backward()``.

One call per step, ``verdict = await probe.check_step(step, loss=loss)``, runs the checks the
debug level makes due, with fused reductions on the device, and moves every number of the
step to the host in one transfer. Per-parameter names are resolved from that same vector, and
only when a check fired.

This module validates, schedules, offloads and reads (at once or deferred);
:mod:`._launch` does the device work, :mod:`._judge` the host judgement,
:mod:`.activations` the EXTREME forward hooks.
"""

from __future__ import annotations

import math
import numbers
import threading
from collections import deque
from collections.abc import Mapping
from typing import Any, Final

import anyio
import anyio.lowlevel
import numpy as np
import torch
from torch import nn

from eventbus_debug.diagnostics import get_logger

from ..._modules import float_parameters, named_root
from ..._saved import StateReader, check_format, portable
from ..._validate import (
    INT64_MAX,
    flags_and_source,
    int64_count,
    positive_int,
    publisher,
    sample_count,
)
from ...events import Event, LossSpiked
from ...typing import Publisher
from ..levels import Cadence, Checks, DebugLevel, Thresholds, checks_due, level_of
from ._arguments import loss_value, optimizer_lr, refuse_tensor
from ._judge import Judge, Judgement
from ._launch import Launcher, Pending
from .activations import ActivationHooks
from .verdict import StepVerdict

__all__ = (
    "OFFLOAD_NUMEL",
    "STATE_FORMAT",
    "STATE_VERSION",
    "StepProbe",
)

_log = get_logger(__name__)

OFFLOAD_NUMEL: Final = 1 << 24
"""Default gradient size (elements, CPU only) above which reductions run in a worker thread."""
MAX_IN_FLIGHT: Final = 4
"""Deferred mode: steps whose results may still be on their way before a read waits for one."""
STATE_FORMAT: Final = "eventbus_debug.StepProbe"
"""The ``"format"`` of :meth:`StepProbe.state_dict`."""
STATE_VERSION: Final = 1
"""The ``"version"`` of :meth:`StepProbe.state_dict` (a later one is refused)."""
_TENSOR: Final = torch.Tensor
_STRIDED: Final = torch.strided


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
        bus: where incidents and :class:`~eventbus_debug.events.StepChecked` telemetry go: any
            :class:`~eventbus_debug.typing.Publisher` (either bus); ``None``: nowhere, use the
            returned verdicts.
        level: which checks run: a :class:`DebugLevel` or its name (``"advanced"``, any case);
            change it between steps with :attr:`level`.
        cadence: how often each check runs.
        thresholds: when the checks fire.
        deferred: read each step's results at a later call instead of waiting for them. Each
            verdict is then at least one step late; on GPU the probe never waits for the
            device: a step whose copy is not done yet is read at a later call (up to
            :data:`MAX_IN_FLIGHT` steps in flight, then it waits for the oldest).
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
            ranks do not multiply false alarms by N. Whether the loss converged (which
            silences the vanishing checks) is judged on that mean loss too, so the ranks'
            detectors stay identical. The local loss is still checked for non-finite values
            at once.

    Raises:
        TypeError: if *model* is not an ``nn.Module``, *bus* is not a Publisher or ``None``, or
            *level*/*cadence*/*thresholds*/*scaler*/*optimizer*/*deferred*/*global_spikes*/
            *source* have the wrong type.
        ValueError: if the model has parameters on the meta device (they hold no values),
            *level* is not a level name, or *offload_numel* is not an int >= 1.
    """

    def __init__(
        self,
        model: nn.Module,
        bus: Publisher | None = None,
        *,
        level: DebugLevel | str = DebugLevel.BASIC,
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
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            msg = (
                "optimizer must be a torch.optim.Optimizer or None, got "
                f"{type(optimizer).__qualname__}"
            )
            raise TypeError(msg)
        flags_and_source(source, deferred=deferred, global_spikes=global_spikes)
        named_model = named_root(model)  # a compiled model's names are the model's
        meta = [n for n, p in named_model.named_parameters() if p.is_meta]
        if meta:
            msg = (
                f"the model has {len(meta)} parameter(s) on the meta device (e.g. {meta[0]!r}), "
                "which hold no values to check; materialize it first (model.to_empty(device=...) "
                "and initialize, or load a state dict with assign=True)"
            )
            raise ValueError(msg)
        self._bus = publisher("bus", bus)
        self._scaler = scaler
        self._said_late = False  # checked after scaler.step(): said once
        self._optimizer = optimizer
        self.cadence = cadence or Cadence()
        self.deferred = bool(deferred)
        self.offload_numel = positive_int("offload_numel", offload_numel)
        named = float_parameters(named_model)
        self._names: tuple[str, ...] = tuple(n for n, _ in named)
        self._params: tuple[nn.Parameter, ...] = tuple(p for _, p in named)
        self._numel = sum(p.numel() for p in self._params)
        # Floating buffers (BatchNorm running statistics) are checked with the parameters:
        # a NaN batch poisons them without touching a parameter.
        buffers = [(n, b) for n, b in named_model.named_buffers() if b.is_floating_point()]
        state = self._params + tuple(b for _, b in buffers)
        self._activations = ActivationHooks(named_model)
        self._launcher = Launcher(self._params, state, self._activations)
        self._judge = Judge(
            self._names,
            self._names + tuple(n for n, _ in buffers),
            thresholds or Thresholds(),
            scaler=scaler,
            source=source,
            global_spikes=bool(global_spikes),
        )
        self._in_flight: deque[Pending] = deque()
        self._lock = threading.Lock()
        self._level = DebugLevel.OFF
        self.level = level
        self._configured = True

    # -- configuration ------------------------------------------------------------------------

    @property
    def level(self) -> DebugLevel:
        """The debug level; assign a new one (a :class:`DebugLevel` or its name, any case)
        between steps (hooks are added or removed).

        Raises:
            ArgumentTypeError: (on assignment) if the value is neither a level nor a str.
            ValueError: (on assignment) if the value is not a level name.
        """
        return self._level

    @level.setter
    def level(self, value: DebugLevel | str) -> None:
        value = level_of(value)
        if value is self._level:
            return
        old, self._level = self._level, value
        if value is DebugLevel.EXTREME:
            self._activations.arm()
        else:
            self._activations.disarm()
        if not value.includes(DebugLevel.ADVANCED):
            self._launcher.forget_updates()
        if hasattr(self, "_configured"):
            _log.info("debug_level_changed", source=self.source, old=old.value, new=value.value)

    @property
    def thresholds(self) -> Thresholds:
        """The thresholds; assigning new ones restarts the detectors."""
        return self._judge.thresholds

    @thresholds.setter
    def thresholds(self, value: Thresholds) -> None:
        if not isinstance(value, Thresholds):
            msg = f"thresholds must be a Thresholds, got {value!r}"
            raise TypeError(msg)
        with self._lock:
            self._judge.thresholds = value

    @property
    def source(self) -> str:
        """The ``source`` stamped on events; assignable."""
        return self._judge.source

    @source.setter
    def source(self, value: str) -> None:
        self._judge.source = value

    @property
    def global_spikes(self) -> bool:
        """True when loss spikes are judged only in :meth:`observe_global_loss`."""
        return self._judge.global_spikes

    @property
    def activation_hooks_armed(self) -> bool:
        """True while the EXTREME forward hooks are registered on the model."""
        return self._activations.armed

    def rebaseline(self) -> None:
        """Restart the loss-spike and explosion baselines (call it after restoring a state).

        The restored model's loss is legitimately that of an older state: judged against the
        window of the steps just undone it would look like a new spike, and rollbacks would
        feed on themselves. Thread-safe; the session calls it after every restore.
        """
        with self._lock:
            self._judge.rebaseline()
            self._launcher.forget_updates()

    def discard_update(self) -> None:
        """Say that the step just checked will not change the weights (the loop skips it, or
        the AMP scaler does on an overflow): the weight-update ratios measured across it at
        the next check would read 0 for every parameter ("stalled"), so none are measured
        then. The session calls it on every step it does not step. Thread-safe."""
        with self._lock:
            self._launcher.forget_updates()

    def state_dict(self) -> dict[str, Any]:
        """What the detectors learned of the run, to save beside the model's checkpoint.

        A run resumed from a checkpoint with :meth:`load_state_dict` is judged as if it had
        never stopped: the loss-spike and explosion baselines, the run's range, the heavy
        tails and recurring levels, the convergence of the loss and each parameter's gradient
        history. A fresh probe knows none of it, and judges a converged, noisy run as new.

        Plain Python values (dicts, lists, numbers, bools, strings), so ``torch.save`` and
        ``torch.load(weights_only=True)``, ``json`` and ``pickle`` all carry it. In deferred
        mode the steps still in flight are read first (it waits for the device).
        """
        self.flush_sync()
        with self._lock:
            return {
                "format": STATE_FORMAT,
                "version": STATE_VERSION,
                "parameters": list(self._names),
                "judge": portable(self._judge.state()),
            }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a :meth:`state_dict`: the next check is judged as the run that saved
        it would have judged it. Parameters are matched by name (one the state does not name
        starts afresh); the level, cadence and thresholds stay this probe's own. A weight-update
        measurement in progress starts again.

        Raises:
            ValueError: if *state* is not a probe's state dict, is of a later version, or a
                field is missing or malformed (the message names it); the probe is then
                unchanged.
        """
        reader = _probe_state(state, "state")
        with self._lock:
            self._judge.load(reader.child("judge"))
            self._launcher.forget_updates()

    @staticmethod
    def check_state_dict(state: object, name: str = "state") -> None:
        """Check that *state* would load (:meth:`load_state_dict`'s checks, without a probe:
        a session checks a state given before it started).

        Raises:
            ValueError: as :meth:`load_state_dict`; the messages name fields from *name*.
        """
        reader = _probe_state(state, name)
        names = tuple(reader.names("parameters"))
        Judge(names, names, Thresholds(), scaler=None, source="", global_spikes=False).load(
            reader.child("judge")
        )

    @property
    def parameter_names(self) -> tuple[str, ...]:
        """The checked parameters' names (tied weights once, integer parameters left out)."""
        return self._names

    # -- the check ------------------------------------------------------------------------------

    async def check_step(
        self,
        step: int,
        *,
        loss: torch.Tensor | float | None = None,
        checkpoint: bool = True,
        samples: int | None = None,
    ) -> StepVerdict:
        """Run the checks due at *step*, publish the results, and return the verdict.

        Call it after ``loss.backward()`` and before ``optimizer.step()``. In deferred mode the
        verdict is an earlier call's, and this call's results are read by a later one (or by
        :meth:`flush`).

        Args:
            step: the training step (an ``int``).
            loss: the step's loss: a dense one-element real tensor, or a real number (an int,
                a float, a numpy real scalar such as ``numpy.float32``; not a bool);
                ``None``: not checked.
            checkpoint: yield to the event loop once (so sinks progress). A caller that yields
                once per step anyway (a session) passes False: the call then yields only when
                it offloads large CPU reductions to a worker thread (see *offload_numel*).
            samples: how many samples the step's gradients average (``None``: unknown). A
                step of at most half the run's usual count (an epoch's last batch, with
                ``drop_last=False``) has its loss and gradient norm judged that many times
                more leniently, and the detectors learn nothing from it: one hard sample is
                the whole batch.

        Raises:
            TypeError: if *step* is not an int, or *loss* is neither a tensor nor a real number,
                or is a complex, bool or sparse tensor, or *samples* is not an int.
            ValueError: if *step* or *samples* is negative, *loss* has more than one element,
                is a meta tensor, or a number too large for a float (``10**400``).
        """
        verdict = self.check_inline(step, loss, samples)
        if verdict is None:
            return await self._check_offloaded(step, loss, samples)
        if checkpoint:
            await anyio.lowlevel.checkpoint()
        return verdict

    async def _check_offloaded(
        self, step: int, loss: torch.Tensor | float | None, samples: int | None
    ) -> StepVerdict:
        """The step's check with its reductions in a worker thread (``offload_numel``).

        The worker thread reduces and judges; the events are published here, on the loop's
        thread (a bus is not published to from other threads but by publish_threadsafe: on
        trio a worker's publish raised, on asyncio it raced).
        """
        loss = self._validate(step, loss)  # validated by check_inline already: cheap, and rare
        checks = checks_due(self._level, self.cadence, step)
        events: list[Event] = []
        verdict = await anyio.to_thread.run_sync(self._check, step, loss, checks, events, samples)
        if self._bus is not None:
            self._bus.publish_many_nowait(events)
        return verdict

    def check_inline(
        self, step: int, loss: torch.Tensor | float | None = None, samples: int | None = None
    ) -> StepVerdict | None:
        """``check_step(step, loss=loss, checkpoint=False)`` without a coroutine, when it
        would not wait: the verdict; ``None`` when the step's reductions go to a worker thread
        (*offload_numel*), and the caller awaits :meth:`check_step` instead.

        The session's every-step path (an awaited call costs a few µs inside a training loop).

        Raises:
            TypeError: as :meth:`check_step`.
            ValueError: as :meth:`check_step`.
        """
        loss = self._validate(step, loss)
        if samples is not None:
            samples = sample_count(samples)
        checks = checks_due(self._level, self.cadence, step)
        if checks.any and self._offload(checks):
            return None
        return self._check(step, loss, checks, None, samples)

    def check_step_sync(
        self,
        step: int,
        *,
        loss: torch.Tensor | float | None = None,
        samples: int | None = None,
    ) -> StepVerdict:
        """:meth:`check_step` for synchronous loops (with a :class:`SyncEventBus`): no yield.

        It blocks the caller for the reductions (and, unless deferred, for the device).

        Raises:
            TypeError: as :meth:`check_step`.
            ValueError: as :meth:`check_step`.
        """
        loss = self._validate(step, loss)
        if samples is not None:
            samples = sample_count(samples)
        return self._check(step, loss, checks_due(self._level, self.cadence, step), None, samples)

    async def flush(self) -> StepVerdict | None:
        """In deferred mode, read and publish the steps still pending now (``None`` if none)."""
        verdict = self.flush_sync()
        await anyio.lowlevel.checkpoint()
        return verdict

    def flush_sync(self) -> StepVerdict | None:
        """:meth:`flush` without yielding (it waits for the device if results are in flight)."""
        with self._lock:
            verdict: StepVerdict | None = None
            while self._in_flight:
                verdict = self._read(self._in_flight.popleft(), deferred=True)
            return verdict

    def observe_global_loss(self, step: int, loss: float) -> LossSpiked | None:
        """Judge *step*'s loss averaged over the ranks for spikes (and whether the loss
        converged); publish and return a spike.

        A distributed session calls it after the ranks agreed (the mean rides in the agreement's
        one collective), with ``global_spikes=True``: every rank judges the same number, so the
        ranks' detectors stay identical (one rank's :meth:`state_dict` resumes them all) and
        decide together, one safe point later.
        """
        if not math.isfinite(loss):
            return None  # the local non-finite checks act on it, at once
        with self._lock:
            judge = self._judge
            widen = judge.widen_at(step)
            if widen == 1.0:
                judge.scale(loss)  # the convergence too: the same on every rank
            spike = judge.spike(step, loss, widen=widen)
        if spike is not None and self._bus is not None:
            self._bus.publish_nowait(spike)
        return spike

    def in_flight(self, step: int) -> tuple[torch.Tensor, bool] | None:
        """Deferred mode: *step*'s result vector while on its way to the host (still on the
        device), and whether it holds the gradient norms; ``None`` when no check ran then."""
        queue = self._in_flight
        if queue and queue[-1].layout.step == step:
            return queue[-1].vector, queue[-1].layout.checks.grads
        return None

    def close(self) -> None:
        """Remove the probe's hooks and forget pending results (idempotent)."""
        self._activations.disarm()
        self._in_flight.clear()
        self._launcher.release()

    # -- internals ------------------------------------------------------------------------------

    @staticmethod
    def _validate(step: object, loss: object) -> torch.Tensor | float | None:
        """*loss* as the probe takes it, after checking *step* and *loss* (``check_step``'s
        rules): a tensor, a float or None; another real number as a float."""
        if not isinstance(step, int) or isinstance(step, bool):
            msg = f"step must be an int, got {type(step).__qualname__} {step!r}"
            if isinstance(step, numbers.Integral) and not isinstance(step, bool | np.bool_):
                msg += " (a NumPy integer, from np.arange? pass int(step))"
            raise TypeError(msg)
        if not 0 <= step <= INT64_MAX:
            int64_count("step", step)  # raises
        if loss is None or loss.__class__ is float:
            return loss  # None or a float: nothing more to check
        if loss.__class__ is not _TENSOR and not isinstance(loss, torch.Tensor):
            return loss_value(loss)
        if loss.numel() != 1 or loss.layout is not _STRIDED:
            refuse_tensor(loss)
        if loss.is_meta:
            msg = "loss is a meta tensor (it has no values); pass the real loss"
            raise ValueError(msg)
        if loss.is_complex():
            msg = (
                f"loss must be real, got a {loss.dtype} tensor (backward needs a real scalar loss)"
            )
            raise TypeError(msg)
        if loss.dtype is torch.bool:
            msg = "loss must be a real number, got a torch.bool tensor (a bool is not a loss)"
            raise TypeError(msg)
        return loss

    def _offload(self, checks: Checks) -> bool:
        if not checks.grads or self._numel <= self.offload_numel:
            return False
        return self._params[0].device.type == "cpu"

    def _check(
        self,
        step: int,
        loss: torch.Tensor | float | None,
        checks: Checks,
        out: list[Event] | None = None,
        samples: int | None = None,
    ) -> StepVerdict:
        """Launch and read *step*'s *checks*; its events are published, or appended to *out*
        (a worker thread's call: the caller publishes them on the loop)."""
        launcher = self._launcher
        if not checks.any and not launcher.measuring_updates:
            return StepVerdict(step=step, checked=False)  # nothing to do: no lock needed
        with self._lock:
            vanishing = checks.vanishing and self._judge.l1_wanted
            if self._optimizer is not None:
                self._judge.lr = optimizer_lr(self._optimizer)
            # torch.no_grad() without its context-manager object (2 us -> 0.5 us per step)
            grad_mode = torch.is_grad_enabled()
            torch._C._set_grad_enabled(False)
            try:
                pending = launcher.launch(
                    step,
                    loss,
                    checks,
                    l1=vanishing,
                    inverse_scale=self._inverse_scale(step),
                    samples=samples,
                )
            finally:
                torch._C._set_grad_enabled(grad_mode)
            if not self.deferred:
                return self._read(pending, deferred=False, out=out)
            pending.grads = []  # deferred: never keep a step's gradients alive
            queue = self._in_flight
            queue.append(pending)
            verdict: StepVerdict | None = None
            # Read every step whose results arrived, oldest first; wait only when too many
            # are in flight. The verdict returned is the first that is not ok, else the newest.
            while len(queue) > 1 and (queue[0].ready() or len(queue) > MAX_IN_FLIGHT):
                read = self._read(queue.popleft(), deferred=True, out=out)
                if verdict is None or verdict.ok:
                    verdict = read
            return verdict or StepVerdict(step=step, checked=False, deferred=True)

    def _read(
        self, pending: Pending, *, deferred: bool, out: list[Event] | None = None
    ) -> StepVerdict:
        judged: Judgement = self._judge.judge(
            pending, pending.read(), deferred=deferred, recheck=self._recheck
        )
        if out is not None:
            out += judged.events
        elif self._bus is not None:
            self._bus.publish_many_nowait(judged.events)
        return judged.verdict

    def _recheck(self) -> tuple[list[float], tuple[int, ...]]:
        norms, slots = self._launcher.state_norms()
        values: list[float] = norms.tolist()
        return values, slots

    def _inverse_scale(self, step: int) -> torch.Tensor | None:
        """``1 / scale`` of the AMP scaler while *step*'s gradients are still scaled (on
        device)."""
        scaler = self._scaler
        if scaler is None or not scaler.is_enabled():
            return None
        scale = getattr(scaler, "_scale", None)
        if not isinstance(scale, torch.Tensor):
            return None  # scaler.scale() never ran: the gradients are not scaled
        states = getattr(scaler, "_per_optimizer_states", None)
        if self._optimizer is not None and isinstance(states, Mapping):
            stage = getattr(states.get(id(self._optimizer), {}).get("stage"), "name", "")
            if stage == "UNSCALED":
                return None  # scaler.unscale_(optimizer) ran (to clip): already unscaled
            if stage == "STEPPED":  # scaler.step() ran: unscaled, and stepped already
                if not self._said_late:
                    self._said_late = True
                    self._judge.say(
                        step,
                        "checked_after_scaler_step",
                        "check_step ran after scaler.step(optimizer): call it after backward "
                        "and before scaler.step(optimizer); a skip decided now comes after the "
                        "step was taken",
                    )
                return None
        # The scale is a float32 power of two (growth and backoff factors 2 and 0.5 by
        # default): its reciprocal is exact, and one kernel.
        return scale.reciprocal()


def _probe_state(state: object, name: str) -> StateReader:
    """*state* as a probe's saved state, its format and version checked."""
    reader = StateReader(state, name)
    check_format(reader, STATE_FORMAT, STATE_VERSION, "a StepProbe.state_dict()")
    reader.names("parameters")  # parameters are matched by name
    return reader
