"""The async session: ``async with Session(model, optimizer) as session``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from types import TracebackType
from typing import Any, Final

import anyio
import anyio.lowlevel
import torch
from torch import nn
from typing_extensions import Self, Unpack

from .._bus import EventBus
from ..diagnostics import get_logger
from ..events import Anomaly, EventsUndelivered, TensorRole
from ..exceptions import BusClosedError
from ..probes import AnomalyArming, StepProfiler
from ..step_context import bind_step_source
from ._base import TELEMETRY_LATENCY, SessionBase, options_from
from ._wiring import build_sinks, build_system, check_engine_bus
from .options import SessionKnobs, SessionOptions
from .verdict import TrainingStepResult, Verdict

__all__ = ("Session",)

_log = get_logger(__name__)

TRACE_DIR: Final = "traces"
EXIT_TIMEOUT: Final = 10.0
"""Seconds for each cleanup step on exit (the bus's own close is bounded by itself)."""
CLOSE_GRACE: Final = 1.0
"""The least time each subscription of the session's is given to drain, and its sink to
close, when the session leaves a bus it does not own (as a bus gives its own at close)."""


class Session(SessionBase[EventBus]):
    """An async debugging session for one model (and optimizer): ``async with Session(...)``.

    A few lines give a training loop the step probe, the rotating JSON-lines log, the report,
    the alerts, a console view, the system sampler and the recovery engine; every part can be
    replaced (pass an instance) or removed (pass ``False``)::

        async with Session(model, optimizer, log_dir="debug_logs") as session:
            for step, (x, y) in enumerate(loader):
                loss = loss_fn(model(x), y)
                loss.backward()
                verdict = await session.check_step(step, loss=loss)
                if verdict.should_step:
                    optimizer.step()
                optimizer.zero_grad()
                await session.step_completed(step, loss=verdict.loss)

    On entry it starts (or joins) a bus, subscribes the default sinks and builds the probes;
    on exit it publishes :class:`~eventbus_debug.events.SessionEnded`, closes the probes and,
    when it owns the bus, drains and closes it (so the log and the report account for every
    event). For plain ``for`` loops use :class:`~eventbus_debug.SyncSession` (same keywords,
    same method names, blocking).

    Args:
        model: the module to debug.
        optimizer: its optimizer (used for the learning rate, the checked training step and
            recovery actions).
        options: a :class:`SessionOptions` (or give its fields as keywords, not both).
        bus: an already running :class:`~eventbus_debug.EventBus` to use (the session then
            neither starts nor closes it).
        **knobs: the fields of :class:`SessionOptions` (``log_dir=``, ``level=``, ``mode=``,
            ``report=``, ``alerts=``, ``recovery=``, ``sinks=``...). With the PROFILING or FULL
            mode a :class:`~eventbus_debug.probes.StepProfiler` captures a window of steps at
            the start and after each incident, traces in ``log_dir/traces``.

    Raises:
        TypeError: if *model* is not a module, *optimizer* not an optimizer, *bus* not an
            EventBus, or a knob of the wrong type.
        ValueError: if both *level* and *mode* are given, or a level/mode name is unknown.
    """

    _ENTER = "async with Session(...)"

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        options: SessionOptions | None = None,
        bus: EventBus | None = None,
        **knobs: Unpack[SessionKnobs],
    ) -> None:
        super().__init__(model, optimizer, options_from(options, knobs, caller="Session"))
        if bus is not None and not isinstance(bus, EventBus):
            msg = f"bus must be an EventBus or None, got {bus!r}; for plain loops use SyncSession"
            raise TypeError(msg)
        check_engine_bus(self.options, bus)
        self._given_bus = bus
        self._stack: contextlib.AsyncExitStack | None = None
        self._anomaly: AnomalyArming | None = None

    async def __aenter__(self) -> Self:
        self._claim()
        stack = contextlib.AsyncExitStack()
        try:
            await self._start(stack)
        except BaseException as error:
            try:
                with anyio.CancelScope(shield=True):
                    await self._release(drain=False)
                await stack.aclose()
            finally:
                self._end_agreement(error)
                self._bus = None
                self._entered = False
            raise
        self._stack = stack
        self._live = True
        _log.info("session_started", session=self.name, level=self.plan.level.value)
        return self

    async def _start(self, stack: contextlib.AsyncExitStack) -> None:
        options = self.options
        bus = self._given_bus
        if bus is not None and not bus.running:
            msg = (
                f"bus must be a running EventBus (entered with `async with`), got {bus!r}; "
                "or leave bus= out for a bus of the session's own"
            )
            raise BusClosedError(msg)
        if bus is None:
            bus = await stack.enter_async_context(
                EventBus(telemetry_latency=TELEMETRY_LATENCY, close_timeout=self._close_timeout)
            )
        self._bus = bus
        self._join(bus)
        sinks = build_sinks(options, bus, continued=self._choose_run_id())
        if sinks.continue_report is not None:  # reads the log: a worker thread, not the loop
            await anyio.to_thread.run_sync(sinks.continue_report)
        self._subscriptions.extend(self._subscribe(bus, sinks))
        if sinks.flusher is not None:
            tg = await stack.enter_async_context(anyio.create_task_group())
            await tg.start(sinks.flusher.run_flusher)
            stack.callback(tg.cancel_scope.cancel)
        probe = self._wire(bus)
        stack.callback(probe.close)
        self.system = build_system(options, bus, lambda: self.step)
        if self.system is not None:
            # Off the training path: its own task, psutil in a worker thread.
            tg = await stack.enter_async_context(anyio.create_task_group())
            stack.callback(tg.cancel_scope.cancel)
            tg.start_soon(self.system.run)
        if self.plan.profiling:
            traces = self.log_dir / TRACE_DIR if self.log_dir is not None else None
            self.profiler = await stack.enter_async_context(
                StepProfiler(bus, traces, source=f"{self.name}.profiler")
            )
            self._subscriptions.append(
                bus.subscribe(self.profiler.handle, Anomaly, name=f"{self.name}.profiler")
            )
            self.profiler.arm(trigger="session_start")
        stack.callback(bind_step_source(lambda: self.step))
        self._anomaly = self._arm(bus)
        if self._anomaly is not None:
            stack.callback(self._anomaly.close)
        self._boundary_on(bus, probe, anomaly=self._anomaly, publish=bus.publish)
        bus.publish_nowait(self._started_event())

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        stack, self._stack = self._stack, None
        if stack is None:
            return
        self._live = False
        cancelled = isinstance(exc, anyio.get_cancelled_exc_class())
        # Shielded: a session cancelled from outside (move_on_after around it, a cancelled
        # task) still flushes its probes and publishes SessionEnded, in bounded time; closing
        # the stack then drains the log (the bus's close shields itself), and the
        # cancellation goes on propagating once this returns.
        try:
            with anyio.CancelScope(shield=True), anyio.move_on_after(EXIT_TIMEOUT) as scope:
                try:
                    if self.probe is not None:
                        await self.probe.flush()
                except Exception as error:
                    _log.warning("session_exit_flush_failed", session=self.name, error=repr(error))
            if scope.cancelled_caught:
                _log.warning("session_exit_flush_timed_out", session=self.name, s=EXIT_TIMEOUT)
            if self.profiler is not None and not cancelled:
                # Not shielded: it exits scopes of its own, entered outside this one (the stack
                # exits it again, cancelled or not).
                await self.profiler.__aexit__(None, None, None)  # writes a capture under way
            if self.system is not None:
                self.system.stop()  # SessionEnded stays the session's last event
            self.bus.publish_nowait(self._ended_event(exc, cancelled=cancelled))
        finally:
            try:
                with anyio.CancelScope(shield=True):
                    await self._release(drain=True)
                await stack.aclose()
            finally:
                self._end_agreement(exc)
                self._bus = None
                self._entered = False
            _log.info("session_ended", session=self.name, steps=self.steps_completed)

    async def _release(self, *, drain: bool) -> None:
        """On a bus the session does not own, take back everything it subscribed.

        Newest first, as a bus closes its sinks: each subscription is given what is queued
        for it (*drain*), removed, and its sink closed, so that the sinks removed after it (the
        log) still record what closing it published (the alert summaries), and an
        ``EventsUndelivered`` about a sink that did not finish in time. Bounded as a bus's
        close: ``close_timeout`` (else ``EXIT_TIMEOUT``) for them all, at least
        ``CLOSE_GRACE`` each. On its own bus the session only forgets them: the bus's close
        does all that.
        """
        subscriptions, self._subscriptions = self._subscriptions, []
        bus = self._given_bus
        if bus is None:
            return
        timeout = self.options.close_timeout or EXIT_TIMEOUT
        deadline = anyio.current_time() + timeout
        for sub in reversed(subscriptions):
            timed_out = False
            if drain and bus.running and not sub.disabled:
                with anyio.move_on_after(
                    max(deadline - anyio.current_time(), CLOSE_GRACE)
                ) as scope:
                    await bus.drain(sub)
                timed_out = scope.cancelled_caught
            sub.cancel()
            if timed_out:
                # told on the bus, where the subscriptions still to be removed (the log) see it
                lost = sub.statistics().discarded
                _log.warning(
                    "session_exit_drain_timed_out",
                    session=self.name,
                    sink=sub.name,
                    discarded=lost,
                    timeout_s=timeout,
                )
                if bus.running:
                    bus.publish_nowait(
                        EventsUndelivered(
                            source=self.name, sink=sub.name, undelivered=lost, timeout_s=timeout
                        )
                    )
            await sub.close_sink(max(deadline - anyio.current_time(), CLOSE_GRACE))

    # -- the per-step API -------------------------------------------------------------------------

    async def check_step(
        self,
        step: int,
        *,
        loss: torch.Tensor | float | None = None,
        samples: int | None = None,
    ) -> Verdict:
        """The safe point: run the probes due at *step*, then say whether to step.

        Call it after ``loss.backward()`` and before ``optimizer.step()``.

        Args:
            step: the training step.
            loss: the step's loss (a one-element tensor or a number; ``None``: not checked).
            samples: how many samples the step's gradients average, when the loop knows
                (``len(batch)``; the integrations pass it). A step of at most half the run's
                usual count (an epoch's last batch under ``drop_last=False``) is judged that
                many times more leniently for loss spikes and gradient explosions, and the
                detectors learn nothing from it: one hard sample is the whole batch.

        Raises:
            RuntimeError: if the session is not running.
            TrainingStopped: if recovery decided to stop.
            TypeError: if *samples* is not an int (and as :meth:`StepProbe.check_step
                <eventbus_debug.StepProbe.check_step>` for *step* and *loss*).
        """
        return await self._running().check(step, loss, samples)

    async def step_completed(
        self,
        step: int,
        *,
        loss: float | torch.Tensor | None = None,
        learning_rate: float | None = None,
        samples: int | None = None,
    ) -> None:
        """Record that *step* finished (a :class:`~eventbus_debug.events.StepCompleted`) and
        yield to the event loop once.

        Raises:
            RuntimeError: if the session is not running.
        """
        await self._running().completed(
            step, loss=loss, learning_rate=learning_rate, samples=samples
        )

    async def training_step(
        self,
        inputs: Any,
        targets: Any,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        *,
        step: int | None = None,
        samples: int | None = None,
    ) -> TrainingStepResult:
        """One fully checked training step.

        Validates the inputs (when an ``input_spec`` was given), runs forward and backward,
        checks the outputs (when an ``output_checker`` was given), awaits the safe point,
        steps the optimizer unless the verdict says not to, and records the step. *step*
        defaults to the one after the last; *samples* to the leading dimension of the first
        tensor in *inputs* (see :meth:`check_step`).

        Raises:
            RuntimeError: if the session has no optimizer or is not running.
        """
        return await self._running().training_step(
            inputs, targets, loss_fn, step=step, samples=samples
        )

    async def check_tensor(
        self, tensor: object, name: str, *, role: TensorRole = TensorRole.ACTIVATION
    ) -> bool:
        """Check *tensor* for NaN/Inf; publish a NonFiniteDetected naming the bad parts if so.

        Takes what a training loop produces: a tensor of any dtype or layout (checked in its
        own precision), a number, a numpy array, or a tuple, list or dict of them (see
        :func:`~eventbus_debug.probes.non_finite_counts`); one host transfer per device.

        Returns:
            True when every value is finite.

        Raises:
            TypeError: if *tensor* (or a leaf inside it) is of another type.
            ValueError: if a tensor is a meta tensor (it holds no values).
        """
        finite = self._check_tensor(tensor, name, role)
        await anyio.lowlevel.checkpoint()
        return finite
