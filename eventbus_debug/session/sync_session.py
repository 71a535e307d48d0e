"""The blocking session for plain ``for`` loops: ``with SyncSession(model, optimizer) as s``."""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent.futures import Future
from types import TracebackType
from typing import Any, Final

import torch
from torch import nn
from typing_extensions import Self, Unpack

from .._bus import SyncEventBus
from ..diagnostics import get_logger
from ..events import TensorRole
from ..probes import AnomalyArming
from ..step_context import bind_step_source
from ._base import TELEMETRY_LATENCY, SessionBase, options_from
from ._wiring import Sinks, build_sinks, build_system, check_engine_bus
from .options import SessionKnobs, SessionOptions
from .verdict import TrainingStepResult, Verdict

__all__ = ("SyncSession",)

_log = get_logger(__name__)

_BUS_MESSAGE: Final = (
    "bus= is an option of the async Session only (it joins a running EventBus); a SyncSession "
    "runs its own SyncEventBus on a background thread. Leave bus= out: give your sinks with "
    "sinks=[...], or subscribe them to session.bus inside `with SyncSession(...) as session:`; "
    "to share one running EventBus, use `async with Session(model, optimizer, bus=bus)`"
)
"""Why ``SyncSession(..., bus=...)`` is refused, and what a sync loop does instead."""


class SyncSession(SessionBase[SyncEventBus]):
    """:class:`~eventbus_debug.Session` for plain ``for`` loops: ``with SyncSession(...) as s``.

    The bus runs on a background thread (:class:`~eventbus_debug.SyncEventBus`); probes run on
    the training thread and hand their events over once per step. The methods are the
    :class:`~eventbus_debug.Session`'s, blocking instead of awaited.

    Example::

        with SyncSession(model, optimizer, log_dir="debug_logs") as session:
            for step, (x, y) in enumerate(loader):
                result = session.training_step(x, y, loss_fn, step=step)

    Args:
        model: the module to debug.
        optimizer: its optimizer.
        options: a :class:`SessionOptions` (or give its fields as keywords, not both).
        **knobs: the fields of :class:`SessionOptions`, as for
            :class:`~eventbus_debug.Session` (the profiling mode needs the async Session).

    Raises:
        TypeError: as :class:`~eventbus_debug.Session`; also for ``bus=``, an option of the
            async :class:`~eventbus_debug.Session` only (use ``sinks=`` or :attr:`bus`).
        ValueError: as :class:`~eventbus_debug.Session`.
    """

    _ENTER = "with SyncSession(...)"

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        options: SessionOptions | None = None,
        **knobs: Unpack[SessionKnobs],
    ) -> None:
        if "bus" in knobs:
            raise TypeError(_BUS_MESSAGE)
        super().__init__(model, optimizer, options_from(options, knobs, caller="SyncSession"))
        check_engine_bus(self.options, None)
        self._system_task: Future[None] | None = None
        self._flusher_task: Future[None] | None = None
        self._anomaly: AnomalyArming | None = None  # DebugMode.ANOMALY_DETECTION's localization
        self._unbind_step: Callable[[], None] | None = None

    def _close_extras(self) -> None:
        """Judge and remove the localization hooks; unbind the session's step."""
        anomaly, self._anomaly = self._anomaly, None
        if anomaly is not None:
            anomaly.close()
        unbind, self._unbind_step = self._unbind_step, None
        if unbind is not None:
            unbind()

    def __enter__(self) -> Self:
        self._claim()
        try:
            bus = SyncEventBus(
                telemetry_latency=TELEMETRY_LATENCY, close_timeout=self._close_timeout
            )
            bus.__enter__()
        except BaseException:
            self._entered = False
            raise
        try:
            self._bus = bus
            self._start(bus)
        except BaseException as error:
            try:
                self._end_agreement(error)
                self._stop_tasks(bus)
                self._close_extras()
                bus.close()
            finally:
                self._bus = None
                self._subscriptions = []
                self._entered = False
            raise
        self._live = True
        _log.info("session_started", session=self.name, level=self.plan.level.value)
        return self

    def _start(self, bus: SyncEventBus) -> None:
        options = self.options
        self._join(bus)
        # Sinks are built on the bus's thread: some create anyio primitives.
        continued = self._choose_run_id()
        sinks: Sinks = bus.portal.call(
            functools.partial(build_sinks, options, bus.bus, continued=continued)
        )
        if sinks.continue_report is not None:  # reads the log: here, not on the bus's thread
            sinks.continue_report()
        self._subscriptions.extend(self._subscribe(bus, sinks))
        if sinks.flusher is not None:
            # cancelled at exit: its sleep would hold the portal's close up to a second
            self._flusher_task = bus.portal.start_task_soon(sinks.flusher.run_flusher)
        probe = self._wire(bus)
        self.system = build_system(options, bus.bus, lambda: self.step)
        if self.system is not None:
            self._system_task = bus.portal.start_task_soon(self.system.run)
        if self.plan.profiling:
            _log.warning(
                "profiling_needs_async_session",
                session=self.name,
                detail="SyncSession has no event loop to write traces from; use Session",
            )
        self._unbind_step = bind_step_source(lambda: self.step)
        self._anomaly = self._arm(bus)
        self._boundary_on(bus, probe, anomaly=self._anomaly, flush=bus.flush)
        bus.publish(self._started_event())

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        bus, self._bus = self._bus, None
        if bus is None:
            return
        self._live = False
        try:
            self._stop_tasks(bus)  # SessionEnded stays the session's last event
            if self.probe is not None:
                self.probe.flush_sync()
                self.probe.close()
            self._close_extras()
            bus.publish(self._ended_event(exc))
        finally:
            try:
                self._end_agreement(exc)
                self._stop_tasks(bus)
                self._subscriptions = []
                bus.close()  # closing the alert sink delivers its pending summaries
            finally:
                self._entered = False
            _log.info("session_ended", session=self.name, steps=self.steps_completed)

    def _stop_tasks(self, bus: SyncEventBus) -> None:
        """Cancel the tasks the session runs on the bus's loop: the system sampler, the alert
        flusher (idempotent; never waits for the loop)."""
        task, self._system_task = self._system_task, None
        if task is not None:
            if self.system is not None:
                self.system.stop()
            bus.cancel_soon(task)
        flusher, self._flusher_task = self._flusher_task, None
        if flusher is not None:
            bus.cancel_soon(flusher)

    # -- the per-step API -------------------------------------------------------------------------

    def check_step(
        self,
        step: int,
        *,
        loss: torch.Tensor | float | None = None,
        samples: int | None = None,
    ) -> Verdict:
        """The safe point of a synchronous loop; see :meth:`Session.check_step`.

        Blocks while recovery catches up with this step's incidents. *samples*: how many
        samples the step's gradients average (see :meth:`Session.check_step`).

        Raises:
            RuntimeError: if the session is not running, or another thread is inside its
                ``training_step``, ``check_step`` or ``step_completed`` (one loop per session).
            TrainingStopped: if recovery decided to stop.
        """
        return self._running().check_sync(step, loss, samples)

    def step_completed(
        self,
        step: int,
        *,
        loss: float | torch.Tensor | None = None,
        learning_rate: float | None = None,
        samples: int | None = None,
    ) -> None:
        """Record that *step* finished, and hand this step's events to the bus's thread.

        Raises:
            RuntimeError: if the session is not running, or another thread is inside its
                ``training_step``, ``check_step`` or ``step_completed`` (one loop per session).
        """
        self._running().completed_sync(
            step, loss=loss, learning_rate=learning_rate, samples=samples
        )

    def check_tensor(
        self, tensor: object, name: str, *, role: TensorRole = TensorRole.ACTIVATION
    ) -> bool:
        """Check *tensor* for NaN/Inf; see :meth:`Session.check_tensor`.

        Returns:
            True when every value is finite.
        """
        return self._check_tensor(tensor, name, role)

    def training_step(
        self,
        inputs: Any,
        targets: Any,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        *,
        step: int | None = None,
        samples: int | None = None,
    ) -> TrainingStepResult:
        """One fully checked step; see :meth:`Session.training_step`.

        Raises:
            RuntimeError: if the session has no optimizer or is not running, or another thread
                is inside its ``training_step``, ``check_step`` or ``step_completed`` (calls
                from several threads one after another are fine; overlapping ones are not).
        """
        return self._running().training_step_sync(
            inputs, targets, loss_fn, step=step, samples=samples
        )
