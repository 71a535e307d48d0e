"""What :class:`Session` and :class:`SyncSession` share: options, parts, level, lifecycle events."""

from __future__ import annotations

import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from difflib import get_close_matches
from typing import Any, ClassVar, Final, Generic

import torch
from torch import nn

from .._bus import Subscription
from .._bus.bus import DEFAULT_CLOSE_TIMEOUT
from .._modules import named_root
from .._saved import StateReader
from ..diagnostics import get_logger
from ..events import (
    Anomaly,
    Event,
    NonFiniteDetected,
    SessionEnded,
    SessionStarted,
    TensorRole,
    given_run_id,
    new_run_id,
)
from ..exceptions import TrainingStopped
from ..extras.debug_context import DebugContext, debug_context
from ..extras.validation import InputValidator, OutputChecker
from ..probes import (
    AnomalyArming,
    DebugLevel,
    LeakDetector,
    StepProbe,
    StepProfiler,
    SystemSampler,
)
from ..probes.finite import non_finite_counts
from ..recovery import RecoveryEngine, SafePoint, ScalerMonitor
from ..recovery.agreement import (
    AGREE_TIMEOUT,
    Agreement,
    RankAgreement,
    agreement_for,
    distributed_active,
)
from ..typing import Publisher
from . import _sharing as sharing
from ._state import SavedState, read_state, session_state
from ._wiring import (
    AlertsSink,
    BusT,
    ReportSink,
    Sinks,
    arm_localization,
    build_device_skip,
    build_leak_detector,
    build_probe,
    build_recovery,
    build_validator,
)
from .boundary import StepBoundary
from .modes import DebugPlan
from .options import SessionKnobs, SessionOptions, level_of

_log = get_logger(__name__)

TELEMETRY_LATENCY: Final = 0.1
"""A session's own bus fans telemetry out in batches at most this old (incidents at once):
one dispatch and one turn of each sink per batch instead of per step
(``EventBus(telemetry_latency=...)``)."""

__all__ = ("SessionBase", "options_from")


def options_from(
    options: SessionOptions | None, knobs: SessionKnobs, *, caller: str
) -> SessionOptions:
    """*options*, or the :class:`SessionOptions` built from *knobs* (not both).

    Args:
        options: the options given, or None.
        knobs: the other keywords given to the session.
        caller: the class the user called (``"Session"``), named by the errors.

    Raises:
        TypeError: if a keyword is not an option (the message names it and *caller*), if
            *options* is not a SessionOptions, or is given with keywords.
    """
    unknown = sorted(set(knobs) - SessionOptions.knobs())
    if unknown:
        raise TypeError(_unknown_keyword_message(caller, unknown))
    if options is None:
        return SessionOptions(**knobs)
    if not isinstance(options, SessionOptions):
        msg = f"options must be a SessionOptions or None, got {options!r}"
        raise TypeError(msg)
    if knobs:
        msg = f"pass either options= or keywords ({', '.join(sorted(knobs))}), not both"
        raise TypeError(msg)
    return options


def _unknown_keyword_message(caller: str, unknown: list[str]) -> str:
    """``Session() got an unexpected keyword argument 'x' (did you mean 'y'?); ...``."""
    plural = "s" if len(unknown) > 1 else ""
    names = ", ".join(repr(name) for name in unknown)
    known = SessionOptions.knobs()
    close = get_close_matches(unknown[0], known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return (
        f"{caller}() got unexpected keyword argument{plural} {names}{hint}; its options are "
        f"the fields of SessionOptions: {', '.join(sorted(known))}"
    )


class SessionBase(Generic[BusT]):
    """The parts and bookkeeping of a session; the subclasses add the bus and the entries."""

    _ENTER: ClassVar[str] = "with a session"

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, options: SessionOptions
    ) -> None:
        if not isinstance(model, nn.Module):
            msg = f"model must be a torch.nn.Module, got {type(model).__qualname__}"
            raise TypeError(msg)
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            msg = f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__qualname__}"
            raise TypeError(msg)
        self.model = model
        self.optimizer = optimizer
        self.options = options
        """The session's :class:`SessionOptions`."""
        self.name = options.name
        self.plan: DebugPlan = options.plan
        self.policy = options.recovery_policy
        """The :class:`~eventbus_debug.RecoveryPolicy` of the default engine."""
        self.schedulers = options.schedulers
        """The LR schedulers recovery keeps in step with its LR decisions."""
        self.scaler = options.scaler
        """The AMP ``GradScaler``: its overflow steps are StepSkipped events, not incidents."""
        self.log_dir = options.log_path
        self.skip_non_finite = options.skip_non_finite
        self._validator = build_validator(options)
        self._output_checker = options.output_checker
        self.leak_detector: LeakDetector | None = build_leak_detector(options)
        """The memory leak detector, run at every safe point (None when off)."""
        self.device_skip = build_device_skip(options, optimizer)
        """The found-inf flag handed to the fused optimizer (None unless ``device_skip=True``)."""
        self.agreement: Agreement | None = None
        """How this rank agrees with the others (None outside a process group)."""
        self._joined: object | None = None  # the bus the session counts as running on
        self._elsewhere: Callable[[Anomaly], bool] = _nobody_else
        """Whether an incident belongs to another session on the bus (set by :meth:`_join`)."""
        self.amp: ScalerMonitor | None = None
        self.system: SystemSampler | None = None
        """The system sampler, once the session started (None when off); see its ``summary()``."""
        self.profiler: StepProfiler | None = None
        """The step profiler (PROFILING / FULL modes, async :class:`Session` only)."""
        self.report: ReportSink | None = None
        """The report sink (a :class:`~eventbus_debug.sinks.ReportWriter` unless you gave
        yours), once the session started (None when removed)."""
        self.alerts: AlertsSink | None = None
        """The alert sink (an :class:`~eventbus_debug.sinks.AlertSink` unless you gave yours),
        once the session started (None when removed)."""
        self.probe: StepProbe | None = None
        self.recovery: RecoveryEngine | None = None
        """The recovery engine, once the session started (None when removed)."""
        self.safe_point: SafePoint | None = None
        """Where recovery decisions are applied (None without recovery or optimizer)."""
        self._bus: BusT | None = None
        self._subscriptions: list[Subscription] = []
        self._boundary: StepBoundary | None = None
        """The step boundary, once started (kept after the end: :attr:`step` reads it)."""
        self._live = False
        self._entered = False
        """Between the start of an entry and the end of its exit (a second entry is refused)."""
        self._claim_lock = threading.Lock()  # two threads entering at once: one is refused
        self._started = 0.0
        self._saved: SavedState | None = None
        """A state loaded before the start, applied when the probe and boundary are built."""
        self.run_id: str | None = None
        """The run's id in the log (:attr:`SessionStarted.run_id
        <eventbus_debug.events.SessionStarted.run_id>`), once the session started; a session
        resumed with :meth:`load_state_dict` continues the saved run's (unless
        ``$EVENTBUS_DEBUG_RUN_ID`` names one)."""

    def _claim(self) -> None:
        """Mark the session entered.

        Raises:
            RuntimeError: if it is entered already (nothing is changed then).
        """
        with self._claim_lock:
            if self._entered:
                msg = (
                    f"session {self.name!r} is already running; leave it before entering it "
                    "again (or create another session)"
                )
                raise RuntimeError(msg)
            self._entered = True

    @property
    def _close_timeout(self) -> float:
        """The ``close_timeout`` of the bus the session builds (the bus's default unless set)."""
        timeout = self.options.close_timeout
        return DEFAULT_CLOSE_TIMEOUT if timeout is None else timeout

    # -- parts ------------------------------------------------------------------------------------

    def _join(self, bus: BusT) -> None:
        """Count the session as running on *bus* (first thing at entry, before anything is
        subscribed: a second session of this name on the bus is refused with nothing to undo).

        Raises:
            SubscriptionError: if a session of this name runs on *bus* already.
        """
        self._elsewhere = sharing.join(bus, self.name)
        self._joined = bus

    def _subscribe(self, bus: BusT, sinks: Sinks) -> list[Subscription]:
        """Subscribe *sinks* to *bus* under the session's name; keep the report and alerts."""
        self.report = sinks.report
        self.alerts = sinks.alerts
        return [bus.subscribe(sink, name=f"{self.name}.{name}") for sink, name in sinks.subscribers]

    def _end_agreement(self, exc: BaseException | None = None) -> None:
        """At the session's end (or a failed entry): no collective, idempotent.

        The session no longer counts as running on its bus (see :mod:`._sharing`).

        The agreement the session built is closed (its hook removed, its gloo group retired, see
        :meth:`RankAgreement.close`); one given as ``distributed=`` is only detached, so it can
        serve the next session. When the session ends with an error of this rank's own (*exc*;
        not the agreed ``TrainingStopped``), the group it built is destroyed at once
        (:meth:`RankAgreement.abort`): the other ranks, waiting in their next agreement, stop
        now instead of after the agreement timeout.
        """
        joined, self._joined = self._joined, None
        if joined is not None:
            sharing.leave(joined, self.name)
        agreement = self.agreement
        if not isinstance(agreement, RankAgreement):
            return
        if isinstance(self.options.distributed, Agreement):
            agreement.detach()
        elif exc is not None and not isinstance(exc, TrainingStopped):
            agreement.abort()
        else:
            agreement.close()

    def _wire(self, bus: BusT) -> StepProbe:
        """The training side's parts on *bus*: agreement, probe, leak detector, recovery."""
        options = self.options
        self.agreement = agreement_for(options.distributed, AGREE_TIMEOUT)
        probe = self.probe = build_probe(
            options,
            self.model,
            self.optimizer,
            bus,
            agreement=self.agreement,
            level=self.plan.level,
        )
        if self.leak_detector is not None:
            self.leak_detector.bind(bus)
        recovery = build_recovery(
            options,
            self.model,
            self.optimizer,
            bus,
            agreement=self.agreement,
            on_restore=probe.rebaseline,
            device_skip=self.device_skip,
            probe=probe,
        )
        self.recovery = recovery.engine
        elsewhere = self._elsewhere
        if options.recovery is True and recovery.engine is not None:
            # the session's own engine: removed with the session's other subscriptions, and
            # deaf to the incidents of another session sharing the bus
            self._subscriptions.append(recovery.engine.subscription)
            recovery.engine.ignore = elsewhere
        self.safe_point = recovery.safe_point
        self.amp = recovery.amp
        if self._saved is not None:  # checked when it was given
            self._load_parts(self._saved)
        elif self.optimizer is not None and self.optimizer.state:
            _log.warning(
                "resumed_without_detector_state",
                session=self.name,
                detail="the optimizer has already stepped (a run resumed from a checkpoint, or "
                "a new session each epoch?) and no session state was loaded: the detectors "
                "learn the run anew and may report its ordinary batches in the first steps",
                hint="save session.state_dict() in the checkpoint (or take it from the last "
                "session) and call session.load_state_dict(state) before the session starts "
                "(README: 'Resuming a run from a checkpoint'); the Lightning, Hugging Face and "
                "Ignite integrations do it with their own checkpoints",
            )
        return probe

    def _arm(self, bus: BusT) -> AnomalyArming | None:
        """DebugMode.ANOMALY_DETECTION's localization hooks on *bus* (None when off)."""
        armed = arm_localization(self.options, self.model, bus, lambda: self.step)
        if armed is None:
            return None
        anomaly, subscription = armed
        self._subscriptions.append(subscription)
        return anomaly

    def _boundary_on(
        self,
        publisher: Publisher,
        probe: StepProbe,
        *,
        anomaly: AnomalyArming | None,
        publish: Callable[[Event], Awaitable[None]] | None = None,
        flush: Callable[[], None] | None = None,
    ) -> StepBoundary:
        """The session's step boundary over its parts, publishing on *publisher*."""
        self._boundary = StepBoundary(
            model=self.model,
            optimizer=self.optimizer,
            name=self.name,
            publisher=publisher,
            probe=probe,
            safe_point=self.safe_point,
            amp=self.amp,
            leak_detector=self.leak_detector,
            profiler=self.profiler,
            anomaly=anomaly,
            validator=self.validator,
            output_checker=self.output_checker,
            skip_non_finite=self.skip_non_finite,
            overhead_budget=self.options.overhead_budget,
            device_skip=self.device_skip,
            publish=publish,
            flush=flush,
        )
        if self.options.distributed is None and self.agreement is None:
            self._boundary.lone = _refuse_a_later_group
        saved, self._saved = self._saved, None
        if saved is not None:
            if saved.step is not None:
                self._boundary.step = saved.step
            _log.info("session_state_loaded", session=self.name, step=saved.step)
        return self._boundary

    @property
    def bus(self) -> BusT:
        """The session's bus (an ``EventBus``, or a ``SyncEventBus`` for a SyncSession).

        Raises:
            RuntimeError: before the session started.
        """
        if self._bus is None:
            msg = f"session {self.name!r} is not running; use `{self._ENTER}`"
            raise RuntimeError(msg)
        return self._bus

    def _running(self) -> StepBoundary:
        boundary = self._boundary
        if boundary is None or not self._live:
            msg = f"session {self.name!r} is not running; use `{self._ENTER}`"
            raise RuntimeError(msg)
        return boundary

    @property
    def validator(self) -> InputValidator | None:
        """What checks ``training_step``'s inputs (assign one, e.g. with the SKIP policy)."""
        return self._validator

    @validator.setter
    def validator(self, value: InputValidator | None) -> None:
        if value is not None and not isinstance(value, InputValidator):
            msg = f"validator must be an InputValidator or None, got {value!r}"
            raise TypeError(msg)
        self._validator = value
        if self._boundary is not None:
            self._boundary.validator = value

    @property
    def output_checker(self) -> OutputChecker | None:
        """What checks ``training_step``'s outputs (None when off)."""
        return self._output_checker

    # -- step bookkeeping -------------------------------------------------------------------------

    @property
    def step(self) -> int | None:
        """The step being checked or last completed (None before the first)."""
        return self._boundary.step if self._boundary is not None else None

    @step.setter
    def step(self, value: int | None) -> None:
        """Set the step events are stamped with (a loop that numbers steps itself).

        Raises:
            RuntimeError: if the session is not running.
        """
        self._running().step = value

    def next_step(self, step: int | None = None) -> int:
        """*step*, or the one after the step last checked or completed (0 at first): the step
        a call that names none is about.

        Raises:
            RuntimeError: if the session is not running.
        """
        return self._running().next_step(step)

    @property
    def steps_completed(self) -> int:
        """How many steps were recorded complete."""
        return self._boundary.steps_completed if self._boundary is not None else 0

    @property
    def overhead(self) -> float | None:
        """The session's own time per step over the rest of the step's time, so far (``0.02``:
        the session made the steps 2 % longer); None before two steps finished."""
        return self._boundary.meter.overhead if self._boundary is not None else None

    # -- level ------------------------------------------------------------------------------------

    @property
    def level(self) -> DebugLevel:
        """The step probe's debug level; assign to change it from the next step on."""
        return self.probe.level if self.probe is not None else self.plan.level

    @level.setter
    def level(self, value: DebugLevel | str) -> None:
        lvl = level_of(value)
        self.plan = replace(self.plan, level=lvl)
        if self.probe is not None:
            self.probe.level = lvl

    def rebaseline(self) -> None:
        """Say the data changed on purpose (a new task or dataset for fine-tuning, the next
        stage of a curriculum): the loss-spike and gradient-explosion baselines restart from
        the next check, as after a restore.

        A loss or gradient norm that jumps because the data changed looks, to the detectors,
        exactly like one that jumps because something broke; only you know which it is. The
        non-finite checks, recovery and everything else go on as before; the jump at the
        change is judged against the new data's own first steps.

        Raises:
            RuntimeError: if the session is not running.
        """
        self._running()
        assert self.probe is not None  # a running session has its probe
        self.probe.rebaseline()
        _log.info("detectors_rebaselined", session=self.name, step=self.step)

    # -- resuming ---------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What the session learned of the run, to save in a checkpoint beside the model's,
        the optimizer's and the scheduler's state dicts.

        A run resumed from that checkpoint with :meth:`load_state_dict` is judged as if it
        had never stopped. The state holds the detectors' baselines and memories (the
        loss-spike and explosion windows, the run's range, its heavy tails and recurring
        levels, whether the loss converged, each parameter's gradient history), recovery's
        temporary LR changes in force (undone on the step the uninterrupted run would undo
        them), the step reached and the run's id (the resumed session continues that run in
        the log and the report). Without it, a resumed session knows nothing of the run, and a
        converged, noisy run looks new to it: incidents it would not have reported.

        Plain Python values: ``torch.save`` / ``torch.load(weights_only=True)``, ``json`` and
        ``pickle`` all carry it (a few kilobytes; it grows with the parameter count by one
        float per parameter tensor). What recovery tried so far (its consecutive counts and
        budgets), its last good snapshot and a weight-update measurement in progress are not
        in it: they start anew, as after a restore. Before the start it is the state given to
        :meth:`load_state_dict`, if any.
        """
        probe = self.probe
        if probe is None:
            saved = self._saved
            if saved is None:
                return session_state(None, None)
            return session_state(saved.step, saved.probe, saved.recovery, saved.run_id)
        safe_point = self.safe_point
        return session_state(
            self.step,
            probe.state_dict(),
            safe_point.state() if safe_point is not None else None,
            self.run_id,
        )

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a :meth:`state_dict` (call it before the session starts, or between
        steps): the next check is judged as the run that saved it would have judged it.

        Parameters are matched by name (one the state does not name starts afresh); the
        level, cadence and thresholds stay this session's own. In a distributed run, load
        the same state (rank 0's) on every rank.

        Raises:
            ValueError: if *state* is not a session's state dict, is of a later version, or a
                field is missing or malformed (the message names it); nothing changes then.
            RuntimeError: if the session has ended.
        """
        saved = read_state(state)
        if self._boundary is not None and not self._live:
            msg = f"session {self.name!r} has ended; load the state into the next session"
            raise RuntimeError(msg)
        if self.probe is None or self._boundary is None:
            self._saved = saved  # applied at the start
            return
        self._load_parts(saved)
        if saved.step is not None:
            self._boundary.step = saved.step
        _log.info("session_state_loaded", session=self.name, step=saved.step)

    def _load_parts(self, saved: SavedState) -> None:
        """*saved* (checked) into the probe and the safe point."""
        if saved.probe is not None and self.probe is not None:
            self.probe.load_state_dict(saved.probe)
        if saved.recovery is not None and self.safe_point is not None:
            self.safe_point.load(StateReader(saved.recovery, "state['recovery']"))

    def set_level(self, value: DebugLevel | str) -> None:
        """Set :attr:`level` (``"basic"``, ``"advanced"``... accepted); for the HTTP endpoint.

        Raises:
            ValueError: if *value* is not a level name (the valid ones are listed).
        """
        self.level = value

    # -- publishing -------------------------------------------------------------------------------

    def publish(self, event: Event, /) -> None:
        """Publish *event* on the session's bus without waiting.

        Raises:
            RuntimeError: if the session is not running.
        """
        self._running().publisher.publish_nowait(event)

    def _check_tensor(self, tensor: object, name: str, role: TensorRole) -> bool:
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
        return counts.finite

    def debug_context(self, name: str, *, detect_anomaly: bool = False) -> DebugContext:
        """:func:`~eventbus_debug.extras.debug_context` publishing on this session, stamped with
        its step."""
        return debug_context(
            name, publish=self.publish, step=lambda: self.step, detect_anomaly=detect_anomaly
        )

    # -- lifecycle events -------------------------------------------------------------------------

    def _started_event(self) -> SessionStarted:
        self._started = time.perf_counter()
        config = {
            "level": self.plan.level.value,
            "model": _model_name(self.model),
            "parameters": str(sum(p.numel() for p in self.model.parameters())),
            "anomaly_localization": str(self.plan.anomaly_localization).lower(),
            "memory_tracking": str(self.plan.memory_tracking).lower(),
            "profiling": str(self.plan.profiling).lower(),
        }
        if self.log_dir is not None:
            config["log_dir"] = str(self.log_dir)
        assert self.run_id is not None  # chosen at the start, before the sinks were built
        return SessionStarted(source=self.name, name=self.name, config=config, run_id=self.run_id)

    def _choose_run_id(self) -> str | None:
        """Set :attr:`run_id` at the start, before anything is published: the id the
        environment or the loaded state gives (returned: earlier parts of the run may be in the
        log, for the report to continue), else a fresh one (``None`` returned)."""
        given = given_run_id(self._saved.run_id if self._saved is not None else None)
        self.run_id = given if given is not None else new_run_id()
        return given

    def _ended_event(self, exc: BaseException | None, *, cancelled: bool = False) -> SessionEnded:
        detail = ""
        if cancelled:
            reason = "cancelled"
        elif exc is None:
            reason = "completed"
        elif isinstance(exc, TrainingStopped):
            reason = "stopped"
            detail = str(exc).strip()  # the decision's reason, or why the ranks could not agree
        else:
            reason = f"error: {type(exc).__name__}: {exc}"
        meter = self._boundary.meter if self._boundary is not None else None
        if self.device_skip is not None:
            self.device_skip.release()  # no flag outlives the session on the optimizer
        return SessionEnded(
            overhead=meter.overhead if meter is not None else None,
            overhead_budget=self.options.overhead_budget,
            step=self.step,
            source=self.name,
            name=self.name,
            reason=reason,
            detail=detail,
            steps=self.steps_completed,
            duration_s=time.perf_counter() - self._started,
        )


def _nobody_else(incident: Anomaly) -> bool:
    """No incident belongs to another session (before the session joined a bus)."""
    return False


def _model_name(model: nn.Module) -> str:
    """The model's class name (``Sequential (compiled)`` for a ``torch.compile`` wrapper)."""
    root = named_root(model)
    name = type(root).__name__
    return name if root is model else f"{name} (compiled)"


def _refuse_a_later_group() -> None:
    """At a check of a session entered alone with ``distributed=None`` (its first, then every
    ``LONE_EVERY``-th): refuse to go on once a process group of several ranks exists (it was
    initialized after the session's entry), instead of letting each rank decide alone,
    silently.

    Raises:
        RuntimeError: naming the order to follow, or ``distributed=False``.
    """
    if distributed_active():
        msg = (
            "this session was entered before torch.distributed.init_process_group(), so it "
            "does not agree its decisions with the other ranks (they could skip, restore or "
            "stop apart): enter the session after init_process_group(), or pass "
            "distributed=False to decide on each rank alone"
        )
        raise RuntimeError(msg)
