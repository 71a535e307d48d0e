"""Build a session's parts from its :class:`SessionOptions`: sinks, probe, sampler, recovery.

The one core module that imports the built-in sinks (:mod:`eventbus_debug.sinks`): the
sessions get their parts from here, typed with the sinks' own classes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

import torch
from torch import nn

from .._bus import EventBus, Subscription, SyncEventBus
from .._bus._adapter import default_name
from ..extras.validation import InputValidator, ValidationPolicy
from ..probes import AnomalyArming, LeakDetector, StepProbe, SystemSampler
from ..probes.anomaly_arming import arm_on_incidents
from ..probes.levels import Cadence, DebugLevel, checks_due
from ..recovery import RecoveryEngine, SafePoint, ScalerMonitor
from ..recovery.agreement import Agreement, RankAgreement
from ..recovery.device_skip import DeviceSkip
from ..sinks import AlertSink, ConsoleSink, LogAlert, ReportWriter, RotatingFileSink, rules
from ..step_context import StepSource
from ..typing import BatchSink, Handler, Publisher, Sink
from ._sharing import host
from .options import SessionOptions, SinkOption

__all__ = (
    "AlertsSink",
    "BusT",
    "Recovery",
    "ReportSink",
    "Sinks",
    "Subscriber",
    "build_device_skip",
    "build_leak_detector",
    "build_probe",
    "build_recovery",
    "check_engine_bus",
    "build_sinks",
    "build_system",
    "build_validator",
    "arm_localization",
    "rank_zero",
)

BusT = TypeVar("BusT", EventBus, SyncEventBus)
"""The session's bus: an :class:`EventBus` (Session) or a :class:`SyncEventBus` (SyncSession)."""

Subscriber = SinkOption | Handler[Any]
ReportSink = ReportWriter | SinkOption
"""The session's report: the built-in writer or your own sink."""
AlertsSink = AlertSink | SinkOption
"""The session's alerts: the built-in alert sink or your own sink."""


@dataclass(slots=True, kw_only=True)
class Sinks:
    """The sinks a session subscribes, with the two it exposes by name.

    Attributes:
        subscribers: each sink with its short name (``"log"``, ``"report"``...; a sink of
            ``sinks=`` is named as a bus names it: its ``name``, else its function's or
            class's name, with ``-2``... past a name already taken).
        report: the report sink (None when removed).
        alerts: the alert sink (None when removed).
        flusher: the built-in alert sink whose ``run_flusher`` task the session runs.
        continue_report: see below (None unless the session continues a run).
    """

    subscribers: list[tuple[Subscriber, str]] = field(default_factory=list)
    report: ReportSink | None = None
    alerts: AlertsSink | None = None
    flusher: AlertSink | None = None
    continue_report: Callable[[], int] | None = None
    """Folds the continued run's earlier events from the log into the default report: run
    it before the sinks are subscribed (it reads the whole log: off the event loop)."""


_SESSION_NAMES: Final = frozenset(
    {"log", "report", "alerts", "console", "recovery", "profiler", "localizer"}
)
"""The short names of the subscriptions a session makes itself (``training.recovery``...):
a sink of ``sinks=`` with one of them gets ``-2``."""


def rank_zero() -> bool:
    """True outside a process group and on its rank 0."""
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def build_sinks(
    options: SessionOptions, publisher: Publisher, *, continued: str | None = None
) -> Sinks:
    """The log, report, alerts, console and extra sinks *options* ask for.

    *publisher* is where the alert sink publishes its alerts (the bus, on its own loop).
    *continued*: the run id the session continues (resumed from a checkpoint, or named by the
    environment); the default report is to fold that run's earlier events from the log first
    (:attr:`Sinks.continue_report`).
    """
    out = Sinks()
    log_dir = options.log_path
    if log_dir is not None:
        out.subscribers.append((RotatingFileSink(log_dir), "log"))
    # In a process group, rank 0 writes the live report; `eventbus-debug report LOGDIR`
    # merges every rank's log afterwards.
    if options.report is True and log_dir is not None and rank_zero():
        out.report = ReportWriter(log_dir, title=f"{options.name}: eventbus-debug report")
        if continued is not None:
            out.continue_report = functools.partial(out.report.continue_run, log_dir, continued)
    elif not isinstance(options.report, bool):
        out.report = options.report
    if out.report is not None:
        out.subscribers.append((out.report, "report"))
    console = options.console
    if options.alerts is True:
        alerts = AlertSink(publisher)
        # A console view already shows every incident: the default LogAlert would show it a
        # second time, so it is only added without one (your own rules still apply).
        if console is False:
            handler = LogAlert()
            for rule in rules.defaults():
                alerts.add_rule(rule, handler)
        out.alerts = out.flusher = alerts
    elif not isinstance(options.alerts, bool):
        out.alerts = options.alerts
        if isinstance(options.alerts, AlertSink):
            out.flusher = options.alerts
    if out.alerts is not None:
        out.subscribers.append((out.alerts, "alerts"))
    if console is True:
        # None: sys.stderr as it is when writing (a rich progress bar may redirect it).
        out.subscribers.append((ConsoleSink(stream=None), "console"))
    elif isinstance(console, Sink | BatchSink):
        out.subscribers.append((console, "console"))
    elif console is not False:
        out.subscribers.append((ConsoleSink(stream=console), "console"))
    taken = {name for _, name in out.subscribers} | _SESSION_NAMES
    for sink in options.sinks:
        # Named as a bus names it (its `name`, else its function's or class's name), then
        # `-2`, `-3`... past the names already taken; the session prefixes its own name.
        name = base = default_name(sink)
        n = 2
        while name in taken:
            name, n = f"{base}-{n}", n + 1
        taken.add(name)
        out.subscribers.append((sink, name))
    return out


def build_probe(
    options: SessionOptions,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    bus: BusT,
    *,
    agreement: Agreement | None,
    level: DebugLevel | None = None,
) -> StepProbe:
    """The step probe, publishing on *bus*, at *level* (the session's level now: set before
    the entry or during an earlier one), else the options' level."""
    return StepProbe(
        model,
        bus,
        level=options.plan.level if level is None else level,
        thresholds=options.thresholds,
        cadence=options.cadence,
        source=f"{options.name}.step_probe",
        scaler=options.scaler,
        optimizer=optimizer,
        deferred=options.device_skip,  # its flag skips on the device; the host reads later
        # With an agreement the loss spikes are judged on the ranks' mean loss, which rides in
        # the agreement's one collective (see StepBoundary).
        global_spikes=agreement is not None
        and options.recovery is not False
        and optimizer is not None,
    )


def build_system(options: SessionOptions, bus: EventBus, step: StepSource) -> SystemSampler | None:
    """The system sampler (run as a task on *bus*'s loop), or None when off."""
    if options.system_interval is None:
        return None
    return SystemSampler(
        bus, interval=options.system_interval, step=step, source=f"{options.name}.system"
    )


def build_device_skip(
    options: SessionOptions, optimizer: torch.optim.Optimizer | None
) -> DeviceSkip | None:
    """The found-inf flag handed to the fused optimizer (None unless ``device_skip=True``).

    Raises:
        TypeError: if *optimizer* is not an optimizer (None included).
        ValueError: if it is not a fused one (the message names it).
    """
    if not options.device_skip:
        return None
    return DeviceSkip(optimizer, source=f"{options.name}.device_skip")


def build_validator(options: SessionOptions) -> InputValidator | None:
    """The REPORT-policy validator of ``training_step``'s inputs (None without a spec)."""
    spec = options.input_spec
    return InputValidator(spec, policy=ValidationPolicy.REPORT) if spec is not None else None


def build_leak_detector(options: SessionOptions) -> LeakDetector | None:
    """The leak detector run at every safe point (None when off); bound when the bus runs."""
    if options.wants_leak_detector:
        return LeakDetector(source=f"{options.name}.memory")
    if isinstance(options.leak_detector, LeakDetector):
        return options.leak_detector
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class Recovery:
    """What recovery adds to a session (each None when it does not apply).

    Attributes:
        engine: the recovery engine (None when removed).
        safe_point: where its decisions are applied (None without engine or optimizer).
        amp: the GradScaler's watcher (None without a scaler).
    """

    engine: RecoveryEngine | None = None
    safe_point: SafePoint | None = None
    amp: ScalerMonitor | None = None


def build_recovery(
    options: SessionOptions,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    bus: BusT,
    *,
    agreement: Agreement | None,
    on_restore: Callable[[], None],
    device_skip: DeviceSkip | None = None,
    probe: StepProbe | None = None,
) -> Recovery:
    """The recovery engine on *bus*, its safe point and the AMP watcher.

    *on_restore* runs after every restore (the probe's rebaseline). With *device_skip* the
    safe point drops the decisions about a step the device already skipped. *probe* (the
    session's step probe) tells an overlapped agreement which steps check rank-local state.

    Raises:
        ValueError: if *device_skip* is given in a process group that agrees (the ranks would
            skip on their own flags), or a ``recovery=`` engine is on another bus.
    """
    if device_skip is not None:
        if agreement is not None:
            msg = (
                "device_skip=True cannot run in a process group that agrees: pass distributed=False"
            )
            raise ValueError(msg)
        device_skip.publisher = bus
    amp = None
    if options.scaler is not None:
        amp = ScalerMonitor(options.scaler, bus.publish_nowait, source=f"{options.name}.amp")
    engine: RecoveryEngine | None = None
    if options.recovery is True:
        engine = RecoveryEngine(
            bus, name=f"{options.name}.recovery", policy=options.recovery_policy
        )
    elif isinstance(options.recovery, RecoveryEngine):
        engine = options.recovery  # on the session's bus: checked when the session was made
    if engine is None:
        return Recovery(amp=amp)
    if isinstance(agreement, RankAgreement):
        engine.agreement = agreement  # retried calls agree across ranks
        if optimizer is not None:
            _overlap_agreement(options, model, engine, agreement, probe)
    if optimizer is None:
        return Recovery(engine=engine, amp=amp)
    safe_point = SafePoint(
        engine,
        model,
        optimizer,
        schedulers=options.schedulers,
        scaler=options.scaler,  # a skipped step records the scaler's inf check (update() works)
        snapshots=options.snapshots,
        agreement=agreement,
        agree=device_skip.agree if device_skip is not None else None,
    )
    # After a restore the loss and norms are the restored state's: judged against the undone
    # steps' baselines they would look like new faults.
    safe_point.add_restore_listener(on_restore)
    return Recovery(engine=engine, safe_point=safe_point, amp=amp)


def check_engine_bus(options: SessionOptions, bus: object | None) -> None:
    """Refuse a ``recovery=`` engine that is not subscribed to *bus*, the session's bus
    (``None``: a bus of the session's own, which no engine built before it can be on).

    Raises:
        ValueError: naming ``recovery``: the engine would never hear the session's incidents
            (a NaN step would be stepped).
    """
    engine = options.recovery
    if not isinstance(engine, RecoveryEngine):
        return
    if bus is not None and host(engine.bus) is host(bus):
        return
    where = "a bus the session builds itself" if bus is None else f"{bus!r}"
    msg = (
        f"recovery= must be a RecoveryEngine subscribed to the session's bus ({where}), got one "
        f"on {engine.bus!r}: it would never hear this session's incidents. Pass recovery=True "
        "for the session's own engine, or share your bus: "
        "Session(model, optimizer, bus=bus, recovery=RecoveryEngine(bus))"
    )
    raise ValueError(msg)


def _overlap_agreement(
    options: SessionOptions,
    model: nn.Module,
    engine: RecoveryEngine,
    agreement: RankAgreement,
    probe: StepProbe | None = None,
) -> None:
    """Hide the agreement behind DDP's backward where the checks allow it (else it blocks).

    Only with ``RankAgreement(overlap=True)``. Not with a GradScaler (its overflow steps must not
    be skipped by the session) nor with an overhead budget (it stretches each rank's cadence on
    its own clock, so the ranks would check different steps). Parameter and activation checks
    read rank-local state: those steps add a blocking round. The agreement keeps *model* either
    way (to check its join context).
    """
    if options.scaler is not None or options.overhead_budget is not None:
        agreement.attach(model, engine, overlap=False)
        return
    level, cadence = options.plan.level, options.cadence or Cadence()

    def blocking_at(step: int) -> bool:
        # the probe's level and cadence now: a level set at run time (``set_level``) moves
        # the parameter and activation checks, and with them the blocking rounds
        due = (
            checks_due(probe.level, probe.cadence, step)
            if probe is not None
            else checks_due(level, cadence, step)
        )
        return due.params or due.activations

    agreement.attach(model, engine, blocking_at=blocking_at)


def arm_localization(
    options: SessionOptions, model: nn.Module, bus: BusT, step: StepSource
) -> tuple[AnomalyArming, Subscription] | None:
    """DebugMode.ANOMALY_DETECTION's localization hooks, armed on *bus*'s incidents."""
    if not options.plan.anomaly_localization:
        return None
    return arm_on_incidents(model, bus, step=step, name=options.name)
