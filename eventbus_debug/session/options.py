"""The session's knobs, validated once: :class:`SessionOptions`.

:class:`~eventbus_debug.Session` and :class:`~eventbus_debug.SyncSession` take the same
keywords (:class:`SessionKnobs`) and build one :class:`SessionOptions` from them; each value is
checked here, when the session is created, never while it runs.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Final, Protocol, TextIO, TypedDict, runtime_checkable

import torch

from .._bus._adapter import SinkAdapter, default_name
from .._validate import brief, fraction, log_dir as check_log_dir, positive_seconds
from ..exceptions import ArgumentTypeError, SubscriptionError
from ..extras.validation import InputSpec, OutputChecker
from ..probes import Cadence, DebugLevel, LeakDetector, Thresholds
from ..probes.levels import level_of
from ..recovery import RecoveryEngine, RecoveryPolicy, StateSnapshots
from ..recovery.agreement import Agreement
from ..recovery.lr import lr_schedulers
from ..recovery.strategies import recovery_policy
from ..typing import BatchSink, Handler, Sink
from .modes import DebugMode, DebugPlan, plan_for

__all__ = (
    "DEFAULT_LOG_DIR",
    "DEFAULT_SYSTEM_INTERVAL",
    "ConsoleOption",
    "SessionKnobs",
    "SessionOptions",
    "SinkOption",
    "level_of",
)

DEFAULT_LOG_DIR: Final = "debug_logs"
DEFAULT_SYSTEM_INTERVAL: Final = 10.0

SinkOption = Sink[Any] | BatchSink[Any]
"""A subscriber object the session subscribes to its bus (``report=``, ``alerts=``...)."""
ConsoleOption = bool | TextIO | Sink[Any] | BatchSink[Any]
"""``console=``: on/off, a text stream for the built-in console view, or your own sink."""
ModeOption = DebugMode | str | Iterable[DebugMode | str]


@runtime_checkable
class _Writable(Protocol):
    def write(self, text: str, /) -> int: ...


class SessionKnobs(TypedDict, total=False):
    """The keywords :class:`~eventbus_debug.Session` and :class:`~eventbus_debug.SyncSession`
    accept besides the model and optimizer: the fields of :class:`SessionOptions`."""

    log_dir: str | os.PathLike[str] | None
    level: DebugLevel | str | None
    mode: ModeOption | None
    name: str
    console: ConsoleOption
    report: bool | SinkOption
    alerts: bool | SinkOption
    recovery: bool | RecoveryEngine
    sinks: Sequence[SinkOption | Handler[Any]]
    thresholds: Thresholds | None
    cadence: Cadence | None
    skip_non_finite: bool
    input_spec: InputSpec | None
    output_checker: OutputChecker | None
    system_interval: float | None
    leak_detector: LeakDetector | bool | None
    policy: RecoveryPolicy | str
    scheduler: Any
    scaler: torch.amp.GradScaler | None
    distributed: bool | Agreement | None
    overhead_budget: float | None
    device_skip: bool
    close_timeout: float | None
    snapshots: StateSnapshots | None


def _check_type(name: str, value: object, types: tuple[type, ...], expected: str) -> None:
    if not isinstance(value, types):
        msg = f"{name} must be {expected}, got {value!r}"
        raise TypeError(msg)


def _sinks(value: object) -> tuple[Any, ...]:
    """``sinks=`` as a tuple, each checked as ``subscribe`` will check it.

    Raises:
        TypeError: if *value* is not a sequence, or an item is not a sink (the message names
            ``sinks[i]``; a :class:`~eventbus_debug.exceptions.SubscriptionError`).
    """
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        msg = (
            "sinks must be a sequence of sinks (async functions or objects with async "
            f"handle/handle_batch), got {value!r}"
        )
        raise TypeError(msg)
    items = tuple(value)
    for i, sink in enumerate(items):
        _check_sink(f"sinks[{i}]", sink)
    return items


def _check_sink(knob: str, sink: object) -> None:
    """Refuse *sink* now, naming *knob*, if the bus would refuse to subscribe it later."""
    try:
        SinkAdapter(sink, default_name(sink))
    except SubscriptionError as exc:
        raise SubscriptionError(f"{knob}: {exc}") from None


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionOptions:
    """Everything a session is configured with, besides its model and optimizer.

    Build it with the keywords of :class:`~eventbus_debug.Session` (they are its fields), or
    pass one as ``Session(model, optimizer, options=...)``. Every value is checked here.

    Attributes:
        log_dir: where the JSON-lines log and the report go; ``None``: no log, no report.
        level: the step probe's :class:`DebugLevel` (default BASIC); or give *mode*.
        mode: one or several :class:`DebugMode`; implies the level.
        name: the session's name (the ``source`` of its events).
        console: ``True`` for a console view on stderr, a text stream for it, your own sink,
            or ``False`` (default) for none.
        report: ``True`` (default) for a report writer in *log_dir*, a sink of yours, or
            ``False``.
        alerts: ``True`` (default) for an alert sink with the default threshold rules logging
            through stdlib ``logging`` (no handler when a console view shows the incidents
            already), a sink of yours, or ``False``.
        recovery: ``True`` (default) for a :class:`~eventbus_debug.RecoveryEngine` with the
            default strategies (applied at the safe point when an optimizer is given), an
            engine already subscribed to the session's bus, or ``False``.
        sinks: more sinks to subscribe (objects or async functions), each checked here as
            ``subscribe`` will check it (a :class:`~eventbus_debug.exceptions.SubscriptionError`
            naming ``sinks[i]``).
        thresholds: the step probe's thresholds.
        cadence: the step probe's cadence.
        skip_non_finite: without recovery, advise skipping the optimizer step when the step
            was not finite (with recovery, its strategies decide).
        input_spec: validate every batch of ``training_step`` against it (REPORT policy).
        output_checker: check the model's outputs in ``training_step``.
        system_interval: seconds between readings of the system sampler the session runs
            (``None``: no sampler).
        leak_detector: a :class:`~eventbus_debug.probes.LeakDetector` run at every safe point,
            ``True`` for a default one, ``False`` for none; ``None`` (default): one when the
            mode asks for memory tracking (MEMORY_PROFILING, FULL).
        policy: what recovery may do on its own: ``"observe"``, ``"safe"`` (default) or
            ``"aggressive"`` (see :class:`~eventbus_debug.RecoveryPolicy`).
        scheduler: the LR scheduler (or a sequence of them) stepping the optimizer, so that
            recovery's LR changes survive schedulers that recompute the rate.
        scaler: the AMP ``torch.amp.GradScaler``; its overflow steps are reported as
            ``StepSkipped``, never as incidents.
        distributed: agree on every recovery decision across the ranks of a process group.
            ``None`` (default): when a group of more than one rank is initialized; ``False``:
            never; ``True``: always; or an ``Agreement`` to use.
        overhead_budget: the share of the step time the session may cost (e.g. ``0.02``):
            the session measures its own cost per step and lowers the cadence of the costly
            checks (never the non-finite check) to stay within it. ``None`` (default): off.
        device_skip: skip a non-finite step with no host synchronization: the step probe's
            device vector becomes a ``found_inf`` flag handed to the fused optimizer (as a
            ``GradScaler`` does), which skips the update on the device; the probe runs deferred
            and the step's incidents are read one step later (``verdict.should_step`` stays
            True on a non-finite step, and ``verdict.probe`` is an earlier step's). Needs an
            optimizer built with ``fused=True``; not with ``scaler=``,
            ``skip_non_finite=False``, a distributed agreement or anomaly localization. See
            :class:`~eventbus_debug.recovery.device_skip.DeviceSkip`.
        close_timeout: seconds the session's exit grants its sinks to take what is queued
            for them and close. Given to the bus the session builds
            (``EventBus(close_timeout=...)``): a sink still busy then (a hanging webhook) is
            abandoned, and its undelivered events are counted in the bus's statistics and
            reported by ``EventsUndelivered`` / ``SinkUnresponsive`` incidents in the log.
            With ``Session(bus=...)``, the bound on draining the session's own subscriptions
            before it removes them. ``None`` (default): the bus's default (30 s), or 10 s with
            ``bus=``.
        snapshots: how recovery keeps the last good state (a
            :class:`~eventbus_debug.recovery.StateSnapshots` of this session's own: how often,
            where, a checkpoint to start from). ``None`` (default): ``StateSnapshots()``, every
            50 good steps, beside the model while small, else in host memory, else none (see
            its *location*). Needs recovery and an optimizer.
        plan: the instruments *level* / *mode* turn on (derived).
        schedulers: *scheduler* as a tuple (derived).
        recovery_policy: *policy* as a :class:`~eventbus_debug.RecoveryPolicy` (derived).

    Raises:
        TypeError: if a value is of the wrong type (the message names the knob).
        ValueError: if both *level* and *mode* are given, a level/mode/policy name is unknown,
            or a number is out of range.
    """

    log_dir: str | os.PathLike[str] | None = DEFAULT_LOG_DIR
    level: DebugLevel | str | None = None
    mode: ModeOption | None = None
    name: str = "training"
    console: ConsoleOption = False
    report: bool | SinkOption = True
    alerts: bool | SinkOption = True
    recovery: bool | RecoveryEngine = True
    sinks: Sequence[SinkOption | Handler[Any]] = ()
    thresholds: Thresholds | None = None
    cadence: Cadence | None = None
    skip_non_finite: bool = True
    input_spec: InputSpec | None = None
    output_checker: OutputChecker | None = None
    system_interval: float | None = DEFAULT_SYSTEM_INTERVAL
    leak_detector: LeakDetector | bool | None = None
    policy: RecoveryPolicy | str = RecoveryPolicy.SAFE
    scheduler: Any = None
    scaler: torch.amp.GradScaler | None = None
    distributed: bool | Agreement | None = None
    overhead_budget: float | None = None
    device_skip: bool = False
    close_timeout: float | None = None
    snapshots: StateSnapshots | None = None
    plan: DebugPlan = field(init=False)
    schedulers: tuple[Any, ...] = field(init=False)
    recovery_policy: RecoveryPolicy = field(init=False)

    def __post_init__(self) -> None:
        if self.mode is not None and self.level is not None:
            msg = "pass either level= or mode=, not both (a mode implies its level)"
            raise ValueError(msg)
        plan = (
            plan_for(self.mode)
            if self.mode is not None
            else DebugPlan(level=level_of(DebugLevel.BASIC if self.level is None else self.level))
        )
        object.__setattr__(self, "plan", plan)
        object.__setattr__(self, "schedulers", lr_schedulers(self.scheduler))
        object.__setattr__(self, "recovery_policy", recovery_policy(self.policy))
        object.__setattr__(self, "sinks", _sinks(self.sinks))
        check_log_dir(self.log_dir)
        _check_type("name", self.name, (str,), "a str")
        for knob in ("report", "alerts"):
            value = getattr(self, knob)
            if not isinstance(value, bool | Sink | BatchSink):
                msg = f"{knob} must be True, False or a sink, got {value!r}"
                raise TypeError(msg)
            if not isinstance(value, bool):
                _check_sink(knob, value)
        if not isinstance(self.console, bool | Sink | BatchSink | _Writable):
            msg = f"console must be a bool, a text stream or a sink, got {self.console!r}"
            raise TypeError(msg)
        if isinstance(self.console, Sink | BatchSink):
            _check_sink("console", self.console)
        if not isinstance(self.recovery, bool | RecoveryEngine):
            msg = f"recovery must be True, False or a RecoveryEngine, got {self.recovery!r}"
            raise TypeError(msg)
        _check_type("skip_non_finite", self.skip_non_finite, (bool,), "a bool")
        self._check_parts()
        if self.system_interval is not None:
            try:
                interval = positive_seconds("system_interval", self.system_interval)
            except ValueError as exc:  # an ArgumentTypeError keeps its type
                msg = (
                    "system_interval must be a positive, finite number of seconds or None, "
                    f"got {brief(self.system_interval)}"
                )
                raise type(exc)(msg) from None
            object.__setattr__(self, "system_interval", interval)
        if self.close_timeout is not None:
            if not isinstance(self.close_timeout, int | float) or isinstance(
                self.close_timeout, bool
            ):
                msg = (
                    "close_timeout must be a number of seconds or None, "
                    f"got {brief(self.close_timeout)}"
                )
                raise ArgumentTypeError(msg)
            object.__setattr__(
                self, "close_timeout", positive_seconds("close_timeout", self.close_timeout)
            )
        if self.overhead_budget is not None:
            fraction("overhead_budget", self.overhead_budget, inclusive=False)
        if self.snapshots is not None and self.recovery is False:
            msg = (
                "snapshots= needs recovery (it keeps the state a restore loads): not recovery=False"
            )
            raise ValueError(msg)
        _check_type("device_skip", self.device_skip, (bool,), "a bool")
        if self.device_skip:
            self._check_device_skip()

    def _check_device_skip(self) -> None:
        clash = (
            (
                "scaler=",
                self.scaler is not None,
                "the GradScaler owns optimizer.found_inf and "
                "already skips non-finite steps on the device for fused optimizers",
            ),
            (
                "skip_non_finite=False",
                not self.skip_non_finite,
                "device_skip always skips non-finite steps",
            ),
            (
                f"distributed={self.distributed!r}",
                self.distributed not in (None, False),
                "each rank would skip on its own flag",
            ),
            (
                "mode ANOMALY_DETECTION or FULL",
                self.plan.anomaly_localization,
                "its replay needs the step's own verdict at once, not one step later",
            ),
        )
        for what, bad, why in clash:
            if bad:
                msg = f"device_skip=True cannot be combined with {what}: {why}"
                raise ValueError(msg)

    def _check_parts(self) -> None:
        for knob, value, types, expected in (
            ("thresholds", self.thresholds, (Thresholds,), "a Thresholds"),
            ("cadence", self.cadence, (Cadence,), "a Cadence"),
            ("input_spec", self.input_spec, (InputSpec,), "an InputSpec"),
            ("output_checker", self.output_checker, (OutputChecker,), "an OutputChecker"),
            ("scaler", self.scaler, (torch.amp.GradScaler,), "a torch.amp.GradScaler"),
            ("snapshots", self.snapshots, (StateSnapshots,), "a StateSnapshots"),
        ):
            if value is not None:
                _check_type(knob, value, types, f"{expected} or None")
        if self.leak_detector is not None and not isinstance(
            self.leak_detector, LeakDetector | bool
        ):
            msg = (
                f"leak_detector must be a LeakDetector, a bool or None, got {self.leak_detector!r}"
            )
            raise TypeError(msg)
        if self.distributed is not None and not isinstance(self.distributed, bool | Agreement):
            msg = f"distributed must be None, a bool or an Agreement, got {self.distributed!r}"
            raise TypeError(msg)

    @classmethod
    def knobs(cls) -> frozenset[str]:
        """The names of the keywords (the fields given at construction)."""
        return frozenset(f.name for f in fields(cls) if f.init)

    @property
    def log_path(self) -> Path | None:
        """*log_dir* as a :class:`~pathlib.Path` (``None``: no log)."""
        return Path(self.log_dir) if self.log_dir is not None else None

    @property
    def wants_leak_detector(self) -> bool:
        """Whether a default leak detector is to be built (``True``, or ``None`` + the mode)."""
        return self.leak_detector is True or (
            self.leak_detector is None and self.plan.memory_tracking
        )
