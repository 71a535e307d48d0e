"""The session: one object wiring the bus, probes, sinks, sampler and recovery together.

Seed 001's ``debug_training_session(model, ...)`` / ``create_pytorch_debugger(...)`` and seed
002's ``AsyncTrainingLogger``: a few lines give a training loop the step probe, the rotating
JSON-lines log, the report, the alerts, a console view, the system sampler and the recovery
engine; every part can be replaced (pass an instance) or removed (pass ``False``)::

    async with Session(model, optimizer, log_dir="debug_logs") as session:
        for step, (x, y) in enumerate(loader):
            loss = loss_fn(model(x), y)
            loss.backward()
            verdict = await session.check_step(step, loss=loss)
            if verdict.should_step:
                optimizer.step()
            optimizer.zero_grad()
            await session.step_completed(step, loss=verdict.loss)

For plain ``for`` loops use :class:`SyncSession` (same arguments, ``with`` instead of
``async with``, ``check_step_nowait``).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Final

import anyio
import anyio.lowlevel
import torch
from torch import nn
from typing_extensions import Self

from eventbus_debug.diagnostics import get_logger

from ._bus import EventBus, Subscription, SyncEventBus
from .events import (
    Anomaly,
    Event,
    NonFiniteDetected,
    SessionEnded,
    SessionStarted,
    StepCompleted,
    StepSkipped,
    TensorRole,
)
from .extras.debug_context import DebugContext, debug_context
from .extras.validation import (
    InputSpec,
    InputValidator,
    OutputChecker,
    ValidationPolicy,
    Violation,
)
from .modes import DebugMode, DebugPlan, plan_for
from .probes.anomaly_arming import AnomalyArming, RngState, arm_on_incidents
from .probes.finite import non_finite_counts
from .probes.levels import Cadence, DebugLevel, Thresholds
from .probes.memory import LeakDetector
from .probes.profiler import StepProfiler
from .probes.step import StepProbe, StepVerdict
from .probes.system import SystemSampler
from .recovery.agreement import AGREE_TIMEOUT, Agreement, RankAgreement, agreement_for
from .recovery.amp import ScalerMonitor
from .recovery.engine import RecoveryEngine
from .recovery.lr import lr_schedulers
from .recovery.safepoint import SafePoint, StepDecision
from .recovery.strategies import RecoveryPolicy, recovery_policy
from .step_context import bind_step_source

__all__ = (
    "Session",
    "SessionVerdict",
    "SyncSession",
    "TrainingStepResult",
    "create_pytorch_debugger",
    "debug_training_session",
    "debug_training_step",
)

_log = get_logger(__name__)

DEFAULT_LOG_DIR: Final = "debug_logs"
DEFAULT_SYSTEM_INTERVAL: Final = 10.0
TRACE_DIR: Final = "traces"


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionVerdict:
    """What the session concluded at a step's safe point (after backward, before the step).

    Attributes:
        step: the step.
        probe: the step probe's verdict (its numbers and the incidents it fired).
        should_step: False when the optimizer step must be skipped (non-finite values, or a
            recovery decision).
        actions: the recovery actions applied at this safe point, by name.
        decision: the recovery safe point's decision (None without recovery).
    """

    step: int
    probe: StepVerdict
    should_step: bool
    actions: tuple[str, ...] = ()
    decision: StepDecision | None = None

    @property
    def loss(self) -> float | None:
        """The checked loss (None when the loss was not checked this step)."""
        return self.probe.loss

    @property
    def grad_norm(self) -> float | None:
        """The total gradient norm (None when gradients were not checked this step)."""
        return self.probe.grad_norm

    @property
    def finite(self) -> bool:
        """False when the loss, a gradient or a parameter was NaN or infinite."""
        return self.probe.finite


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingStepResult:
    """What :func:`debug_training_step` / :meth:`Session.training_step` did.

    Attributes:
        step: the step.
        loss: the loss value (NaN when it was not finite).
        stepped: whether the optimizer stepped.
        verdict: the safe point's verdict.
        duration_s: the step's wall time.
    """

    step: int
    loss: float
    stepped: bool
    verdict: SessionVerdict
    duration_s: float


def _sink_module() -> Any:
    # sinks imports eventbus_debug: import it lazily, once eventbus_debug is fully initialized.
    from . import sinks

    return sinks


class _Core:
    """What the async and the sync session share: configuration, probe, step bookkeeping."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        log_dir: str | Path | None,
        level: DebugLevel | str | None,
        mode: DebugMode | str | Iterable[DebugMode | str] | None,
        name: str,
        console: bool | IO[str] | object,
        report: bool | object,
        alerts: bool | object,
        recovery: bool | RecoveryEngine,
        sinks: Sequence[object],
        thresholds: Thresholds | None,
        cadence: Cadence | None,
        skip_non_finite: bool,
        input_spec: InputSpec | None,
        output_checker: OutputChecker | None,
        system_interval: float | None = DEFAULT_SYSTEM_INTERVAL,
        leak_detector: LeakDetector | bool | None = None,
        policy: RecoveryPolicy | str = RecoveryPolicy.SAFE,
        scheduler: Any = None,
        scaler: torch.amp.GradScaler | None = None,
        distributed: bool | Agreement | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            msg = f"model must be a torch.nn.Module, got {type(model).__qualname__}"
            raise TypeError(msg)
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            msg = f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__qualname__}"
            raise TypeError(msg)
        if mode is not None and level is not None:
            msg = "pass either level= or mode=, not both (a mode implies its level)"
            raise ValueError(msg)
        self.plan: DebugPlan = (
            plan_for(mode)
            if mode is not None
            else DebugPlan(level=_level(level or DebugLevel.BASIC))
        )
        self.model = model
        self.optimizer = optimizer
        self.name = name
        self.policy = recovery_policy(policy)
        """The :class:`~eventbus_debug.recovery.RecoveryPolicy` of the default engine."""
        self.schedulers = lr_schedulers(scheduler)
        """The LR schedulers recovery keeps in step with its LR decisions."""
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            msg = f"scaler must be a torch.amp.GradScaler or None, got {type(scaler).__qualname__}"
            raise TypeError(msg)
        self.scaler = scaler
        """The AMP ``GradScaler``: its overflow steps are StepSkipped events, not incidents."""
        if distributed is not None and not isinstance(distributed, bool | Agreement):
            msg = f"distributed must be None, a bool or an Agreement, got {distributed!r}"
            raise TypeError(msg)
        self._distributed = distributed
        self.agreement: Agreement | None = None
        """How this rank agrees with the others (None outside a process group)."""
        self.amp: ScalerMonitor | None = None
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self._console = console
        self._report_opt = report
        self._alerts_opt = alerts
        self._recovery_opt = recovery
        self._extra_sinks = tuple(sinks)
        self._thresholds = thresholds
        self._cadence = cadence
        self.skip_non_finite = skip_non_finite
        self.validator = (
            InputValidator(input_spec, policy=ValidationPolicy.REPORT) if input_spec else None
        )
        self.output_checker = output_checker
        if system_interval is not None and not (
            isinstance(system_interval, int | float) and system_interval > 0
        ):
            msg = f"system_interval must be a positive number of seconds or None, got {system_interval!r}"
            raise ValueError(msg)
        self._system_interval = system_interval
        if leak_detector is True or (leak_detector is None and self.plan.memory_tracking):
            leak_detector = LeakDetector(source=f"{name}.memory")
        elif leak_detector is not None and not isinstance(leak_detector, LeakDetector | bool):
            msg = f"leak_detector must be a LeakDetector, a bool or None, got {leak_detector!r}"
            raise TypeError(msg)
        self.leak_detector: LeakDetector | None = (
            leak_detector if isinstance(leak_detector, LeakDetector) else None
        )
        """The memory leak detector, run at every safe point (None when off)."""
        self.system: SystemSampler | None = None
        """The system sampler, once the session started (None when off); see its ``summary()``."""
        self.profiler: StepProfiler | None = None
        """The step profiler (PROFILING / FULL modes, async :class:`Session` only)."""
        self.report: Any = None
        """The :class:`sinks.ReportWriter`, once the session started (None when removed)."""
        self.alerts: Any = None
        """The :class:`sinks.AlertSink`, once the session started (None when removed)."""
        self.probe: StepProbe | None = None
        self.recovery: RecoveryEngine | None = None
        """The recovery engine, once the session started (None when removed)."""
        self.safe_point: SafePoint | None = None
        """Where recovery decisions are applied (None without recovery or optimizer)."""
        self.step: int | None = None
        self.steps_completed = 0
        self._started = 0.0
        self._last_step_t: float | None = None
        self._subscriptions: list[Subscription] = []

    # -- the parts ------------------------------------------------------------------------------

    def _build_sinks(self, publisher: Any) -> list[tuple[object, str]]:
        s = _sink_module()
        out: list[tuple[object, str]] = []
        if self.log_dir is not None:
            out.append((s.RotatingFileSink(self.log_dir), "log"))
        # In a process group, rank 0 writes the live report; `eventbus-debug report LOGDIR`
        # merges every rank's log afterwards.
        if self._report_opt is True and self.log_dir is not None and _rank_zero():
            self.report = s.ReportWriter(self.log_dir, title=f"{self.name}: eventbus-debug report")
        elif self._report_opt not in (True, False, None):
            self.report = self._report_opt
        if self.report is not None:
            out.append((self.report, "report"))
        console = self._console
        if self._alerts_opt is True:
            self.alerts = s.AlertSink(publisher)
            # A console view already shows every incident: the default LogAlert would show it
            # a second time, so it is only added without one (your own rules still apply).
            if console in (False, None):
                handler = s.LogAlert()
                for rule in s.rules.defaults():
                    self.alerts.add_rule(rule, handler)
        elif self._alerts_opt not in (True, False, None):
            self.alerts = self._alerts_opt
        if self.alerts is not None:
            out.append((self.alerts, "alerts"))
        if console is True or hasattr(console, "write"):
            # None: sys.stderr as it is when writing (a rich progress bar may redirect it).
            stream = console if hasattr(console, "write") else None
            out.append((s.ConsoleSink(stream=stream), "console"))
        elif console not in (False, None):
            out.append((console, "console"))
        for i, sink in enumerate(self._extra_sinks):
            out.append((sink, getattr(sink, "name", None) or f"sink{i}"))
        return out

    def _make_probe(self, bus: EventBus | SyncEventBus) -> StepProbe:
        return StepProbe(
            self.model,
            bus,
            level=self.plan.level,
            thresholds=self._thresholds,
            cadence=self._cadence,
            source=f"{self.name}.step_probe",
            scaler=self.scaler,
            optimizer=self.optimizer,
            # With an agreement the loss spikes are judged on the ranks' mean loss, which
            # rides in the agreement's one collective (see _global_loss).
            global_spikes=self.agreement is not None
            and self._recovery_opt not in (False, None)
            and self.optimizer is not None,
        )

    def _make_system(self, bus: EventBus) -> SystemSampler | None:
        if self._system_interval is None:
            return None
        self.system = SystemSampler(
            bus,
            interval=self._system_interval,
            step=lambda: self.step,
            source=f"{self.name}.system",
        )
        return self.system

    def _global_loss(self, verdict: StepVerdict) -> None:
        """Judge the ranks' mean loss for spikes (distributed sessions, after agreeing)."""
        agreed = self.safe_point.agreed if self.safe_point is not None else None
        if agreed is not None and agreed.loss is not None and self.probe is not None:
            self.probe.observe_global_loss(verdict.step, agreed.loss)

    def _observe_memory(self, step: int) -> None:
        if self.leak_detector is not None:
            self.leak_detector.observe(step)

    def _make_recovery(self, bus: EventBus | SyncEventBus) -> None:
        opt = self._recovery_opt
        if self.scaler is not None:
            publish = bus.publish if isinstance(bus, SyncEventBus) else bus.publish_nowait
            self.amp = ScalerMonitor(self.scaler, publish, source=f"{self.name}.amp")
        if opt is True:
            self.recovery = RecoveryEngine(bus, name=f"{self.name}.recovery", policy=self.policy)
        elif isinstance(opt, RecoveryEngine):
            self.recovery = opt
        elif opt not in (False, None):
            msg = f"recovery must be True, False or a RecoveryEngine, got {opt!r}"
            raise TypeError(msg)
        if self.recovery is not None and isinstance(self.agreement, RankAgreement):
            self.recovery.agreement = self.agreement  # retried calls agree across ranks
        if self.recovery is not None and self.optimizer is not None:
            self.safe_point = SafePoint(
                self.recovery,
                self.model,
                self.optimizer,
                schedulers=self.schedulers,
                agreement=self.agreement,
            )
            if self.probe is not None:
                # After a restore the loss and norms are the restored state's: judged against
                # the undone steps' baselines they would look like new faults.
                self.safe_point.add_restore_listener(self.probe.rebaseline)

    # -- level ----------------------------------------------------------------------------------

    @property
    def level(self) -> DebugLevel:
        """The step probe's debug level; assign to change it from the next step on."""
        return self.probe.level if self.probe is not None else self.plan.level

    @level.setter
    def level(self, value: DebugLevel | str) -> None:
        lvl = _level(value)
        self.plan = DebugPlan(
            level=lvl,
            anomaly_localization=self.plan.anomaly_localization,
            profiling=self.plan.profiling,
            memory_tracking=self.plan.memory_tracking,
        )
        if self.probe is not None:
            self.probe.level = lvl

    def set_level(self, value: DebugLevel | str) -> None:
        """Set :attr:`level` (``"basic"``, ``"advanced"``... accepted); for the HTTP endpoint.

        Raises:
            ValueError: if *value* is not a level name (the valid ones are listed).
        """
        self.level = value

    # -- step bookkeeping -----------------------------------------------------------------------

    def _next_step(self, step: int | None) -> int:
        if step is not None:
            return step
        return 0 if self.step is None else self.step + 1

    def _verdict(
        self, step: int, verdict: StepVerdict, decision: StepDecision | None
    ) -> SessionVerdict:
        if decision is not None:
            return SessionVerdict(
                step=step,
                probe=verdict,
                should_step=decision.should_step,
                actions=tuple(a.value for a in decision.actions),
                decision=decision,
            )
        # An AMP overflow is the scaler's to skip: scaler.step() must still run.
        should = verdict.overflow or not (self.skip_non_finite and not verdict.finite)
        return SessionVerdict(
            step=step,
            probe=verdict,
            should_step=should,
            actions=() if should else ("skip_step",),
        )

    def _completed(
        self,
        step: int,
        loss: float | torch.Tensor | None,
        learning_rate: float | None,
        samples: int | None,
    ) -> StepCompleted:
        now = time.perf_counter()
        duration = now - self._last_step_t if self._last_step_t is not None else None
        self._last_step_t = now
        self.step = step
        self.steps_completed += 1
        if isinstance(loss, torch.Tensor):
            loss = float(loss.detach())
        if learning_rate is None and self.optimizer is not None:
            learning_rate = float(self.optimizer.param_groups[0]["lr"])
        return StepCompleted(
            step=step,
            source=self.name,
            loss=loss,
            learning_rate=learning_rate,
            samples_per_s=samples / duration if samples and duration else None,
            duration_s=duration,
        )

    def _started_event(self) -> SessionStarted:
        self._started = time.perf_counter()
        config = {
            "level": self.plan.level.value,
            "model": type(self.model).__name__,
            "parameters": str(sum(p.numel() for p in self.model.parameters())),
            "anomaly_localization": str(self.plan.anomaly_localization).lower(),
            "memory_tracking": str(self.plan.memory_tracking).lower(),
            "profiling": str(self.plan.profiling).lower(),
        }
        if self.log_dir is not None:
            config["log_dir"] = str(self.log_dir)
        return SessionStarted(source=self.name, name=self.name, config=config)

    def _ended_event(self, exc: BaseException | None) -> SessionEnded:
        from .exceptions import TrainingStopped

        if exc is None:
            reason = "completed"
        elif isinstance(exc, TrainingStopped):
            reason = "stopped"
        else:
            reason = f"error: {type(exc).__name__}: {exc}"
        return SessionEnded(
            step=self.step,
            source=self.name,
            name=self.name,
            reason=reason,
            steps=self.steps_completed,
            duration_s=time.perf_counter() - self._started,
        )


def _rank_zero() -> bool:
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _level(value: DebugLevel | str) -> DebugLevel:
    if isinstance(value, DebugLevel):
        return value
    try:
        return DebugLevel(str(value).lower())
    except ValueError:
        valid = ", ".join(v.value for v in DebugLevel)
        msg = f"level must be one of {valid}; got {value!r}"
        raise ValueError(msg) from None


class Session(_Core):
    """An async debugging session for one model (and optimizer): ``async with Session(...)``.

    On entry it starts (or joins) a bus, subscribes the default sinks and builds the probes;
    on exit it publishes :class:`~eventbus_debug.SessionEnded`, closes the probes and, when it
    owns the bus, drains and closes it (so the log and the report account for every event).

    Args:
        model: the module to debug.
        optimizer: its optimizer (used for the learning rate, the checked training step and
            recovery actions).
        log_dir: where the JSON-lines log and the report go; ``None``: no log, no report.
        level: the step probe's :class:`DebugLevel` (default BASIC); or give *mode*.
        mode: one or several :class:`DebugMode` (seed 003); implies the level.
        name: the session's name (the ``source`` of its events).
        console: ``True`` for a console view on stderr, a text stream, a sink object, or
            ``False`` (default) for none.
        report: ``True`` (default) for a :class:`sinks.ReportWriter` in *log_dir*, an instance,
            or ``False``.
        alerts: ``True`` (default) for a :class:`sinks.AlertSink` with the seeds' threshold
            rules logging through stdlib ``logging`` (no handler when a console view shows the
            incidents already), an instance, or ``False``.
        recovery: ``True`` (default) for a :class:`~eventbus_debug.recovery.engine.RecoveryEngine`
            with the default strategies (applied at :meth:`check_step` when an optimizer is
            given), an engine already subscribed to *bus*, or ``False``.
        sinks: more sinks to subscribe (objects or async functions).
        bus: an already running :class:`EventBus` to use (the session then neither starts
            nor closes it).
        thresholds: the step probe's thresholds.
        cadence: the step probe's cadence.
        skip_non_finite: without recovery, advise skipping the optimizer step when the step
            was not finite (with recovery, its strategies decide).
        input_spec: validate every batch of :meth:`training_step` against it (REPORT policy).
        output_checker: check the model's outputs in :meth:`training_step`.
        system_interval: seconds between readings of the :class:`~eventbus_debug.SystemSampler`
            the session runs as a task (``None``: no sampler); see :attr:`system`.
        leak_detector: a :class:`~eventbus_debug.LeakDetector` run at every safe point,
            ``True`` for a default one, ``False`` for none; ``None`` (default): one when the
            mode asks for memory tracking (MEMORY_PROFILING, FULL). With the PROFILING or FULL
            mode a :class:`~eventbus_debug.StepProfiler` captures a window of steps at the
            start and after each incident, traces in ``log_dir/traces``.
        policy: what recovery may do on its own (:class:`~eventbus_debug.recovery.RecoveryPolicy`):
            ``"observe"`` (never act; every detection still published), ``"safe"`` (default:
            skip non-finite steps, restore non-finite state, clip only extreme norms, roll back
            only on sustained spikes, every LR change temporary; never touches a healthy run)
            or ``"aggressive"``.
        scheduler: the LR scheduler (or a sequence of them) stepping *optimizer*, so that
            recovery's LR changes survive schedulers that recompute the rate (warm-up/decay,
            cosine, OneCycle) and temporary changes are undone on the schedule's values.
        distributed: agree on every recovery decision across the ranks of a torch.distributed
            process group (one small collective per step; see ``docs/distributed.md``).
            ``None`` (default): when a group of more than one rank is initialized; ``False``:
            never; ``True``: always; or an ``Agreement`` to use.
        scaler: the AMP ``torch.amp.GradScaler``. Its overflow steps (inf gradients while it
            probes its scale) are reported as ``StepSkipped`` with the scales, never as
            incidents or recovery actions; call ``scaler.step(optimizer)`` when
            ``verdict.should_step`` and ``scaler.update()`` before ``step_completed``.

    Raises:
        TypeError: if *model* is not a module or *optimizer* not an optimizer.
        ValueError: if both *level* and *mode* are given, or a level/mode name is unknown.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        log_dir: str | Path | None = DEFAULT_LOG_DIR,
        level: DebugLevel | str | None = None,
        mode: DebugMode | str | Iterable[DebugMode | str] | None = None,
        name: str = "training",
        console: bool | IO[str] | object = False,
        report: bool | object = True,
        alerts: bool | object = True,
        recovery: bool | RecoveryEngine = True,
        sinks: Sequence[object] = (),
        bus: EventBus | None = None,
        thresholds: Thresholds | None = None,
        cadence: Cadence | None = None,
        skip_non_finite: bool = True,
        input_spec: InputSpec | None = None,
        output_checker: OutputChecker | None = None,
        system_interval: float | None = DEFAULT_SYSTEM_INTERVAL,
        leak_detector: LeakDetector | bool | None = None,
        policy: RecoveryPolicy | str = RecoveryPolicy.SAFE,
        scheduler: Any = None,
        scaler: torch.amp.GradScaler | None = None,
        distributed: bool | Agreement | None = None,
    ) -> None:
        super().__init__(
            model,
            optimizer,
            log_dir=log_dir,
            level=level,
            mode=mode,
            name=name,
            console=console,
            report=report,
            alerts=alerts,
            recovery=recovery,
            sinks=sinks,
            thresholds=thresholds,
            cadence=cadence,
            skip_non_finite=skip_non_finite,
            input_spec=input_spec,
            output_checker=output_checker,
            system_interval=system_interval,
            leak_detector=leak_detector,
            policy=policy,
            scheduler=scheduler,
            scaler=scaler,
            distributed=distributed,
        )
        if bus is not None and not isinstance(bus, EventBus):
            msg = f"bus must be an EventBus or None, got {bus!r}; for plain loops use SyncSession"
            raise TypeError(msg)
        self._given_bus = bus
        self._bus: EventBus | None = None
        self._stack: contextlib.AsyncExitStack | None = None

    @property
    def bus(self) -> EventBus:
        """The session's bus.

        Raises:
            RuntimeError: before the session started.
        """
        if self._bus is None:
            msg = f"session {self.name!r} is not running; use `async with Session(...)`"
            raise RuntimeError(msg)
        return self._bus

    _anomaly: AnomalyArming | None = None  # DebugMode.ANOMALY_DETECTION's localization

    async def __aenter__(self) -> Self:
        stack = contextlib.AsyncExitStack()
        await stack.__aenter__()
        try:
            if self._given_bus is not None:
                bus = self._given_bus
            else:
                bus = await stack.enter_async_context(EventBus())
            self._bus = bus
            for sink, name in self._build_sinks(bus):
                self._subscriptions.append(bus.subscribe(sink, name=f"{self.name}.{name}"))
            if self.alerts is not None and hasattr(self.alerts, "run_flusher"):
                tg = await stack.enter_async_context(anyio.create_task_group())
                await tg.start(self.alerts.run_flusher)
                stack.callback(tg.cancel_scope.cancel)
            self.agreement = agreement_for(self._distributed, AGREE_TIMEOUT)
            self.probe = self._make_probe(bus)
            stack.callback(self.probe.close)
            if self.leak_detector is not None:
                self.leak_detector.bind(bus)
            system = self._make_system(bus)
            if system is not None:
                # Off the training path: its own task, psutil in a worker thread.
                tg = await stack.enter_async_context(anyio.create_task_group())
                stack.callback(tg.cancel_scope.cancel)
                tg.start_soon(system.run)
            if self.plan.profiling:
                traces = self.log_dir / TRACE_DIR if self.log_dir is not None else None
                self.profiler = await stack.enter_async_context(
                    StepProfiler(bus, traces, source=f"{self.name}.profiler")
                )
                self._subscriptions.append(
                    bus.subscribe(self.profiler.handle, Anomaly, name=f"{self.name}.profiler")
                )
                self.profiler.arm(trigger="session_start")
            self._make_recovery(bus)
            stack.callback(bind_step_source(lambda: self.step))
            if self.plan.anomaly_localization:
                self._anomaly, sub = arm_on_incidents(
                    self.model, bus, step=lambda: self.step, name=self.name
                )
                self._subscriptions.append(sub)
                stack.callback(self._anomaly.close)
            bus.publish_nowait(self._started_event())
        except BaseException:
            await stack.aclose()
            self._bus = None
            raise
        self._stack = stack
        _log.info("session_started", session=self.name, level=self.plan.level.value)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        stack, self._stack = self._stack, None
        if stack is None:
            return
        from dataclasses import replace

        exit_timeout = 10.0  # each cleanup step; the bus's own close is bounded by itself
        cancelled = isinstance(exc, anyio.get_cancelled_exc_class())
        # Shielded: a session cancelled from outside (move_on_after around it, a cancelled
        # task) still flushes its probes and publishes SessionEnded, in bounded time; closing
        # the stack then drains the log (the bus's close shields itself), and the
        # cancellation goes on propagating once this returns.
        try:
            with anyio.CancelScope(shield=True), anyio.move_on_after(exit_timeout) as scope:
                try:
                    if self.probe is not None:
                        await self.probe.flush()
                except Exception as error:
                    _log.warning("session_exit_flush_failed", session=self.name, error=repr(error))
            if scope.cancelled_caught:
                _log.warning("session_exit_flush_timed_out", session=self.name, s=exit_timeout)
            if self.profiler is not None and not cancelled:
                # Not shielded: it exits scopes of its own, entered outside this one (the stack
                # exits it again, cancelled or not).
                await self.profiler.__aexit__(None, None, None)  # writes a capture under way
            if self.system is not None:
                self.system.stop()  # SessionEnded stays the session's last event
            ended = self._ended_event(None if cancelled else exc)
            if cancelled:
                ended = replace(ended, reason="cancelled")
            self.bus.publish_nowait(ended)
            if self._given_bus is not None:
                with anyio.CancelScope(shield=True), anyio.move_on_after(exit_timeout):
                    await self.bus.drain(*self._subscriptions)
                for sub in self._subscriptions:
                    sub.cancel()
        finally:
            try:
                await stack.aclose()
            finally:
                self._bus = None
            _log.info("session_ended", session=self.name, steps=self.steps_completed)

    # -- publishing -----------------------------------------------------------------------------

    def publish(self, event: Event, /) -> None:
        """Publish *event* on the session's bus without blocking."""
        self.bus.publish_nowait(event)

    # -- the per-step API -----------------------------------------------------------------------

    async def check_step(
        self, step: int, *, loss: torch.Tensor | float | None = None
    ) -> SessionVerdict:
        """The safe point: run the probes due at *step*, then say whether to step.

        Call it after ``loss.backward()`` and before ``optimizer.step()``.

        Raises:
            RuntimeError: if the session is not running.
        """
        if self.probe is None:
            msg = f"session {self.name!r} is not running; use `async with Session(...)`"
            raise RuntimeError(msg)
        self.step = step
        verdict = await self.probe.check_step(step, loss=loss)
        if verdict.overflow and self.amp is not None:
            self.amp.overflowed(verdict.step)
        self._observe_memory(step)
        decision = (
            await self.safe_point.before_optimizer_step(step, loss=verdict.loss)
            if self.safe_point is not None
            else None
        )
        self._global_loss(verdict)
        return self._verdict(step, verdict, decision)

    async def step_completed(
        self,
        step: int,
        *,
        loss: float | torch.Tensor | None = None,
        learning_rate: float | None = None,
        samples: int | None = None,
    ) -> None:
        """Record that *step* finished (a :class:`~eventbus_debug.StepCompleted`) and yield."""
        if self.profiler is not None:
            self.profiler.step(step)
        if self.amp is not None:
            self.amp.completed(step)
        await self.bus.publish(self._completed(step, loss, learning_rate, samples))

    async def training_step(
        self,
        inputs: Any,
        targets: Any,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        *,
        step: int | None = None,
        samples: int | None = None,
    ) -> TrainingStepResult:
        """One fully checked training step (seed 001's ``debug_training_step``).

        Validates the inputs (when an ``input_spec`` was given), runs forward and backward,
        checks the outputs (when an ``output_checker`` was given), awaits the safe point,
        steps the optimizer unless the verdict says not to, and records the step.

        Raises:
            RuntimeError: if the session has no optimizer or is not running.
        """
        if self.optimizer is None:
            msg = "training_step needs an optimizer; pass one to Session(model, optimizer)"
            raise RuntimeError(msg)
        step = self._next_step(step)
        t0 = time.perf_counter()
        if self.validator is not None and isinstance(inputs, torch.Tensor):
            violations = self.validator.check(inputs, publish=self.publish, step=step)
            if violations and self.validator.policy.rejects:  # before the forward pass
                self.publish(_rejection(step, violations, source=self.name))
                await self.step_completed(step, loss=None)
                return _rejected_result(step, violations, t0)
        rng = RngState.capture(self.model) if self._anomaly is not None else None
        self.optimizer.zero_grad(set_to_none=True)
        outputs = self.model(inputs)
        if self.output_checker is not None:
            self.output_checker.check(outputs, publish=self.publish, step=step)
        loss = loss_fn(outputs, targets)
        torch.autograd.backward(loss)
        verdict = await self.check_step(step, loss=loss)
        if verdict.should_step:
            self.optimizer.step()
        else:
            self.optimizer.zero_grad(set_to_none=True)
        if self._anomaly is not None and not (verdict.finite or verdict.probe.overflow):
            # replay the failed step with the hooks armed (an AMP overflow is not a fault)
            await self._anomaly.replay(
                lambda: torch.autograd.backward(loss_fn(self.model(inputs), targets)),
                step=step,
                rng=rng,
            )
            self.optimizer.zero_grad(set_to_none=True)
        value = verdict.loss if verdict.loss is not None else float(loss.detach())
        await self.step_completed(step, loss=value, samples=samples or _batch_size(inputs))
        return TrainingStepResult(
            step=step,
            loss=value,
            stepped=verdict.should_step,
            verdict=verdict,
            duration_s=time.perf_counter() - t0,
        )

    # -- seed 002's async training logger ---------------------------------------------------------

    async def check_tensor_anomalies_async(
        self, tensor: object, name: str, *, role: TensorRole = TensorRole.ACTIVATION
    ) -> bool:
        """Check *tensor* for NaN/Inf; publish a NonFiniteDetected naming the bad parts if so.

        Takes what a training loop produces: a tensor of any dtype or layout (checked in its
        own precision), a number, a numpy array, or a tuple, list or dict of them (see
        :func:`~eventbus_debug.probes.finite.non_finite_counts`); one host transfer per device.

        Returns:
            True when every value is finite.

        Raises:
            TypeError: if *tensor* (or a leaf inside it) is of another type.
            ValueError: if a tensor is a meta tensor (it holds no values).
        """
        counts = non_finite_counts(tensor, name=name)
        if not counts.finite:
            self.publish(
                NonFiniteDetected(
                    step=self.step,
                    source=self.name,
                    role=role,
                    names=counts.non_finite,
                    nan_count=counts.nan_count,
                    inf_count=counts.inf_count,
                )
            )
        await anyio.lowlevel.checkpoint()
        return counts.finite

    async def check_gradient_anomalies_async(self, step: int | None = None) -> SessionVerdict:
        """Check the model's gradients now (the step probe at this step); see :meth:`check_step`."""
        return await self.check_step(self._next_step(step) if step is None else step)

    async def update_progress_async(
        self,
        *,
        step: int,
        loss: float | torch.Tensor | None = None,
        learning_rate: float | None = None,
        epoch: int | None = None,
    ) -> None:
        """Seed 002's progress update: a :class:`~eventbus_debug.StepCompleted` event.

        *epoch* is accepted for compatibility; steps are numbered globally.
        """
        del epoch
        await self.step_completed(step, loss=loss, learning_rate=learning_rate)

    # -- helpers bound to the session -----------------------------------------------------------

    def debug_context(self, name: str, *, detect_anomaly: bool = False) -> DebugContext:
        """:func:`~eventbus_debug.debug_context` publishing on this session, stamped with its step."""
        return debug_context(
            name, publish=self.publish, step=lambda: self.step, detect_anomaly=detect_anomaly
        )


class SyncSession(_Core):
    """:class:`Session` for plain ``for`` loops: ``with SyncSession(model, optimizer) as s:``.

    The bus runs on a background thread (:class:`~eventbus_debug.SyncEventBus`); probes run on
    the training thread and hand their events over once per step.

    Example::

        with SyncSession(model, optimizer, log_dir="debug_logs") as session:
            for step, (x, y) in enumerate(loader):
                result = session.training_step(x, y, loss_fn, step=step)

    Args:
        model, optimizer, log_dir, level, mode, name, console, report, alerts, recovery, sinks,
        thresholds, cadence, skip_non_finite, input_spec, output_checker, system_interval,
        leak_detector: as :class:`Session` (the profiling mode needs the async Session).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        log_dir: str | Path | None = DEFAULT_LOG_DIR,
        level: DebugLevel | str | None = None,
        mode: DebugMode | str | Iterable[DebugMode | str] | None = None,
        name: str = "training",
        console: bool | IO[str] | object = False,
        report: bool | object = True,
        alerts: bool | object = True,
        recovery: bool | RecoveryEngine = True,
        sinks: Sequence[object] = (),
        thresholds: Thresholds | None = None,
        cadence: Cadence | None = None,
        skip_non_finite: bool = True,
        input_spec: InputSpec | None = None,
        output_checker: OutputChecker | None = None,
        system_interval: float | None = DEFAULT_SYSTEM_INTERVAL,
        leak_detector: LeakDetector | bool | None = None,
        policy: RecoveryPolicy | str = RecoveryPolicy.SAFE,
        scheduler: Any = None,
        scaler: torch.amp.GradScaler | None = None,
        distributed: bool | Agreement | None = None,
    ) -> None:
        super().__init__(
            model,
            optimizer,
            log_dir=log_dir,
            level=level,
            mode=mode,
            name=name,
            console=console,
            report=report,
            alerts=alerts,
            recovery=recovery,
            sinks=sinks,
            thresholds=thresholds,
            cadence=cadence,
            skip_non_finite=skip_non_finite,
            input_spec=input_spec,
            output_checker=output_checker,
            system_interval=system_interval,
            leak_detector=leak_detector,
            policy=policy,
            scheduler=scheduler,
            scaler=scaler,
            distributed=distributed,
        )
        self._bus: SyncEventBus | None = None
        self._system_task: Future[None] | None = None

    @property
    def bus(self) -> SyncEventBus:
        """The session's :class:`~eventbus_debug.SyncEventBus`.

        Raises:
            RuntimeError: before the session started.
        """
        if self._bus is None:
            msg = f"session {self.name!r} is not running; use `with SyncSession(...)`"
            raise RuntimeError(msg)
        return self._bus

    _anomaly: AnomalyArming | None = None  # DebugMode.ANOMALY_DETECTION's localization
    _unbind_step: Callable[[], None] | None = None

    def _close_extras(self) -> None:
        """Judge and remove the localization hooks; unbind the session's step."""
        anomaly, self._anomaly = self._anomaly, None
        if anomaly is not None:
            anomaly.close()
        unbind, self._unbind_step = self._unbind_step, None
        if unbind is not None:
            unbind()

    def __enter__(self) -> Self:
        bus = SyncEventBus()
        bus.__enter__()
        try:
            self._bus = bus
            # Sinks are built on the bus's thread: some create anyio primitives.
            sinks = bus.portal.call(self._build_sinks, bus.bus)
            for sink, name in sinks:
                self._subscriptions.append(bus.subscribe(sink, name=f"{self.name}.{name}"))
            if self.alerts is not None and hasattr(self.alerts, "run_flusher"):
                bus.portal.start_task_soon(self.alerts.run_flusher)
            self.agreement = agreement_for(self._distributed, AGREE_TIMEOUT)
            self.probe = self._make_probe(bus)
            if self.leak_detector is not None:
                self.leak_detector.bind(bus)
            system = self._make_system(bus.bus)
            if system is not None:
                self._system_task = bus.portal.start_task_soon(system.run)
            if self.plan.profiling:
                _log.warning(
                    "profiling_needs_async_session",
                    session=self.name,
                    detail="SyncSession has no event loop to write traces from; use Session",
                )
            self._make_recovery(bus)
            self._unbind_step = bind_step_source(lambda: self.step)
            if self.plan.anomaly_localization:
                self._anomaly, sub = arm_on_incidents(
                    self.model, bus, step=lambda: self.step, name=self.name
                )
                self._subscriptions.append(sub)
            bus.publish(self._started_event())
        except BaseException:
            self._close_extras()
            bus.close()
            self._bus = None
            raise
        _log.info("session_started", session=self.name, level=self.plan.level.value)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        bus, self._bus = self._bus, None
        if bus is None:
            return
        try:
            task, self._system_task = self._system_task, None
            if task is not None and self.system is not None:
                self.system.stop()
                task.cancel()
            if self.probe is not None:
                self.probe.flush_nowait()
                self.probe.close()
            self._close_extras()
            bus.publish(self._ended_event(exc))
        finally:
            bus.close()
            _log.info("session_ended", session=self.name, steps=self.steps_completed)

    def publish(self, event: Event, /) -> None:
        """Publish *event* (buffered on this thread; incidents hand over at once)."""
        self.bus.publish(event)

    def check_step_nowait(
        self, step: int, *, loss: torch.Tensor | float | None = None
    ) -> SessionVerdict:
        """The safe point of a synchronous loop; see :meth:`Session.check_step`.

        Raises:
            RuntimeError: if the session is not running.
        """
        if self.probe is None:
            msg = f"session {self.name!r} is not running; use `with SyncSession(...)`"
            raise RuntimeError(msg)
        self.step = step
        verdict = self.probe.check_step_nowait(step, loss=loss)
        if verdict.overflow and self.amp is not None:
            self.amp.overflowed(verdict.step)
        self._observe_memory(step)
        decision = (
            self.safe_point.before_optimizer_step_sync(step, loss=verdict.loss)
            if self.safe_point is not None
            else None
        )
        self._global_loss(verdict)
        return self._verdict(step, verdict, decision)

    def step_completed(
        self,
        step: int,
        *,
        loss: float | torch.Tensor | None = None,
        learning_rate: float | None = None,
        samples: int | None = None,
    ) -> None:
        """Record that *step* finished, and hand this step's events to the bus's thread."""
        bus = self.bus
        if self.amp is not None:
            self.amp.completed(step)
        bus.publish(self._completed(step, loss, learning_rate, samples))
        bus.flush()

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
            RuntimeError: if the session has no optimizer or is not running.
        """
        if self.optimizer is None:
            msg = "training_step needs an optimizer; pass one to SyncSession(model, optimizer)"
            raise RuntimeError(msg)
        step = self._next_step(step)
        t0 = time.perf_counter()
        if self.validator is not None and isinstance(inputs, torch.Tensor):
            violations = self.validator.check(inputs, publish=self.publish, step=step)
            if violations and self.validator.policy.rejects:  # before the forward pass
                self.publish(_rejection(step, violations, source=self.name))
                self.step_completed(step, loss=None)
                return _rejected_result(step, violations, t0)
        rng = RngState.capture(self.model) if self._anomaly is not None else None
        self.optimizer.zero_grad(set_to_none=True)
        outputs = self.model(inputs)
        if self.output_checker is not None:
            self.output_checker.check(outputs, publish=self.publish, step=step)
        loss = loss_fn(outputs, targets)
        torch.autograd.backward(loss)
        verdict = self.check_step_nowait(step, loss=loss)
        if verdict.should_step:
            self.optimizer.step()
        else:
            self.optimizer.zero_grad(set_to_none=True)
        if self._anomaly is not None and not (verdict.finite or verdict.probe.overflow):
            # replay the failed step with the hooks armed (an AMP overflow is not a fault)
            self._anomaly.replay_sync(
                lambda: torch.autograd.backward(loss_fn(self.model(inputs), targets)),
                step=step,
                rng=rng,
            )
            self.optimizer.zero_grad(set_to_none=True)
        value = verdict.loss if verdict.loss is not None else float(loss.detach())
        self.step_completed(step, loss=value, samples=samples or _batch_size(inputs))
        return TrainingStepResult(
            step=step,
            loss=value,
            stepped=verdict.should_step,
            verdict=verdict,
            duration_s=time.perf_counter() - t0,
        )

    def debug_context(self, name: str, *, detect_anomaly: bool = False) -> DebugContext:
        """:func:`~eventbus_debug.debug_context` publishing on this session."""
        return debug_context(
            name, publish=self.publish, step=lambda: self.step, detect_anomaly=detect_anomaly
        )


def _batch_size(inputs: Any) -> int | None:
    if isinstance(inputs, torch.Tensor) and inputs.dim() > 0:
        return int(inputs.shape[0])
    return None


def _rejection(step: int, violations: Sequence[Violation], *, source: str) -> StepSkipped:
    """The event of a batch rejected by input validation: the step was not run at all."""
    rules = ", ".join(sorted({v.rule for v in violations}))
    return StepSkipped(
        step=step,
        source=source,
        reason=f"input validation rejected the batch before the forward pass ({rules})",
    )


def _rejected_result(
    step: int, violations: Sequence[Violation], started: float
) -> TrainingStepResult:
    """What ``training_step`` returns for a rejected batch: nothing ran, nothing stepped."""
    finite = not any(v.rule == "non_finite" for v in violations)
    probe = StepVerdict(step=step, checked=False, finite=finite, fired=("input_validation_failed",))
    verdict = SessionVerdict(step=step, probe=probe, should_step=False, actions=("reject_batch",))
    return TrainingStepResult(
        step=step,
        loss=math.nan,
        stepped=False,
        verdict=verdict,
        duration_s=time.perf_counter() - started,
    )


# -- the seeds' entry points --------------------------------------------------------------------


def create_pytorch_debugger(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    enable_anomaly_detection: bool = True,
    enable_profiling: bool = False,
    enable_memory_tracking: bool = False,
    enable_gradient_checking: bool = True,
    log_dir: str | Path | None = DEFAULT_LOG_DIR,
    **options: Any,
) -> Session:
    """Seed 001's factory: a :class:`Session` (not yet started) with the seed's switches.

    The ``enable_*`` switches become :class:`DebugMode` values; everything else is passed to
    :class:`Session`. Start it with ``async with``.
    """
    modes: list[DebugMode] = []
    if enable_anomaly_detection:
        modes.append(DebugMode.ANOMALY_DETECTION)
    if enable_profiling:
        modes.append(DebugMode.PROFILING)
    if enable_memory_tracking:
        modes.append(DebugMode.MEMORY_PROFILING)
    if enable_gradient_checking:
        modes.append(DebugMode.GRADIENT_CHECKING)
    return Session(
        model,
        optimizer,
        mode=modes or DebugMode.NONE,
        log_dir=log_dir,
        **options,
    )


def debug_training_session(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None, **options: Any
) -> Session:
    """Seed 001's ``debug_training_session``: ``async with debug_training_session(model) as s``.

    Takes the arguments of :func:`create_pytorch_debugger`.
    """
    return create_pytorch_debugger(model, optimizer, **options)


async def debug_training_step(
    model: nn.Module,
    inputs: Any,
    targets: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    *,
    session: Session | None = None,
    step: int | None = None,
) -> TrainingStepResult:
    """Seed 001's ``debug_training_step``: one fully checked step.

    With *session*, the step runs in it (its probes, sinks and recovery). Without, a
    short-lived session with no log is used: the verdict says what the checks found.
    """
    if session is not None:
        if session.model is not model or session.optimizer is not optimizer:
            msg = "session was built for another model/optimizer; pass the session's own"
            raise ValueError(msg)
        return await session.training_step(inputs, targets, loss_fn, step=step)
    async with Session(model, optimizer, log_dir=None, alerts=False, report=False) as s:
        return await s.training_step(inputs, targets, loss_fn, step=step)
