"""The recovery engine: a bus subscriber that turns incidents into typed, bounded decisions.

It never touches the model. Step-level decisions wait for the training loop's safe point
(:class:`~eventbus_debug.recovery.SafePoint`); call-level decisions are picked up by the retried
call that published the error (:mod:`eventbus_debug.recovery.retry`). Every decision is published
as a :class:`RecoveryDecided` event, so the log shows what was decided and why.
"""

from __future__ import annotations

import re
import threading
import traceback
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, TypeAlias, final

import anyio.lowlevel

from eventbus_debug.diagnostics import get_logger

from .._bus import EventBus, Subscription, SyncEventBus
from ..events import (
    Anomaly,
    ErrorCategory,
    ErrorRaised,
    Event,
    GradientExploded,
    GradientVanished,
    LossSpiked,
    MemoryLeakSuspected,
    NonFiniteDetected,
    RecoveryAction,
    RecoveryDecided,
    Severity,
    TensorRole,
    event_types,
)
from .classify import ErrorClassifier, exception_names
from .strategies import (
    STEP_ACTIONS,
    ClipOnExplosion,
    DataLoaderFallback,
    Decision,
    FreeMemoryOnLeak,
    ModelLoadingFallback,
    RecoveryPolicy,
    ReportNonFinite,
    ReportVanishing,
    RestoreLastGood,
    RollbackOnLossSpike,
    ShrinkBatchOnOOM,
    SkipNonFinite,
    Strategy,
    StrategyFunction,
    StrategyHistory,
    recovery_policy,
)

__all__ = (
    "DecidedAction",
    "RecoveryEngine",
    "RecoveryStatistics",
    "StrategySpec",
    "Trigger",
    "default_strategies",
)

_log = get_logger(__name__)

ENGINE_SOURCE: Final = "recovery"
RETRY_ID_KEY: Final = "retry_id"
DEFAULT_DRAIN_TIMEOUT: Final = 60.0

Trigger: TypeAlias = "type[Anomaly] | type[BaseException] | ErrorCategory | str | re.Pattern[str]"
"""What a strategy is registered on: an incident class, an exception class (matched against
:attr:`ErrorRaised.exception_types`), an :class:`ErrorCategory`, or a message pattern (a string
is a case-insensitive substring, a compiled pattern is searched)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StrategySpec:
    """A strategy with its triggers and bounds, as given to :class:`RecoveryEngine`.

    Attributes:
        strategy: an object with ``decide(incident, history)`` or a function of the same shape.
        on: what it answers for (see :data:`Trigger`); one trigger or a tuple of them.
        name: the name in decisions and logs (defaults to the strategy's class or function).
        max_attempts: the most decisions it may take over the run; ``None``: no limit.
        max_consecutive: the most decisions in a row with no good step in between.
    """

    strategy: Strategy | StrategyFunction
    on: Trigger | tuple[Trigger, ...]
    name: str = ""
    max_attempts: int | None = None
    max_consecutive: int | None = None


def _call_strategies() -> list[StrategySpec]:
    """Failed calls routed through :func:`~eventbus_debug.recovery.retrying`: the call retries."""
    return [
        StrategySpec(
            strategy=ShrinkBatchOnOOM(), on=ErrorCategory.MEMORY, name="shrink_batch_on_oom"
        ),
        StrategySpec(
            strategy=DataLoaderFallback(), on=ErrorCategory.DATA, name="data_loading_fallback"
        ),
        StrategySpec(
            strategy=ModelLoadingFallback(), on=ErrorCategory.MODEL, name="model_loading_fallback"
        ),
    ]


def default_strategies(policy: RecoveryPolicy | str = RecoveryPolicy.SAFE) -> list[StrategySpec]:
    """The built-in strategies of *policy*, in the order they are tried (a new list each call).

    * ``observe``: none; every incident is published and nothing is done about it.
    * ``safe`` (default): skip non-finite steps (a precautionary restore at the third in a
      row, no LR change, never a stop for bad batches); restore non-finite parameters and
      buffers (stop only when that cannot bring the model back: no good state, or three
      restores in a row that did not hold); clip only a norm 100x beyond the largest the
      run has seen (other explosions are reported); roll back with a temporary LR halving
      only on a sustained loss spike, at most 3 times per run; report vanishing gradients;
      free memory on a suspected leak; shrink the batch / fall back for failed calls.
    * ``aggressive``: skip, then restore with a temporary LR halving, then stop; clip every
      explosion, halving the LR (temporarily) every third in a row; roll back on any loss spike.

    Raises:
        ValueError: if *policy* is not a policy name.
    """
    policy = recovery_policy(policy)
    if policy is RecoveryPolicy.OBSERVE:
        return []
    if policy is RecoveryPolicy.SAFE:
        return [
            StrategySpec(
                strategy=SkipNonFinite(max_consecutive=None, restore_after=3),
                on=NonFiniteDetected,
                name="skip_non_finite",
            ),
            StrategySpec(
                strategy=RestoreLastGood(
                    roles=(TensorRole.PARAMETER, TensorRole.BUFFER), lr_factor=1.0
                ),
                on=NonFiniteDetected,
                name="restore_non_finite_state",
                max_consecutive=3,
            ),
            StrategySpec(
                strategy=ReportNonFinite(), on=NonFiniteDetected, name="report_non_finite"
            ),
            StrategySpec(
                strategy=ClipOnExplosion(min_ratio=100.0, lower_lr_after=None),
                on=GradientExploded,
                name="clip_gradients",
            ),
            StrategySpec(
                strategy=RollbackOnLossSpike(rules=("sustained",), max_rollbacks=3),
                on=LossSpiked,
                name="rollback_on_loss_spike",
            ),
            StrategySpec(strategy=ReportVanishing(), on=GradientVanished, name="report_vanishing"),
            StrategySpec(
                strategy=FreeMemoryOnLeak(), on=MemoryLeakSuspected, name="free_memory_on_leak"
            ),
            *_call_strategies(),
        ]
    return [
        StrategySpec(strategy=SkipNonFinite(), on=NonFiniteDetected, name="skip_non_finite"),
        StrategySpec(
            strategy=RestoreLastGood(
                roles=(TensorRole.PARAMETER, TensorRole.BUFFER), lr_factor=1.0
            ),
            on=NonFiniteDetected,
            name="restore_non_finite_state",
            max_consecutive=2,
        ),
        StrategySpec(
            strategy=RestoreLastGood(roles=(TensorRole.LOSS, TensorRole.GRADIENT)),
            on=NonFiniteDetected,
            name="restore_and_lower_lr",
            max_consecutive=2,
        ),
        StrategySpec(strategy=ReportNonFinite(), on=NonFiniteDetected, name="report_non_finite"),
        StrategySpec(
            strategy=ClipOnExplosion(),
            on=GradientExploded,
            name="clip_gradients",
            max_consecutive=50,
        ),
        StrategySpec(
            strategy=RollbackOnLossSpike(),
            on=LossSpiked,
            name="rollback_on_loss_spike",
            max_consecutive=3,
        ),
        StrategySpec(strategy=ReportVanishing(), on=GradientVanished, name="report_vanishing"),
        StrategySpec(
            strategy=FreeMemoryOnLeak(), on=MemoryLeakSuspected, name="free_memory_on_leak"
        ),
        *_call_strategies(),
    ]


@dataclass(frozen=True, slots=True, kw_only=True)
class DecidedAction:
    """A decision together with what triggered it (what the appliers consume).

    Attributes:
        decision: the decision.
        strategy: the name of the strategy that took it (``"exhausted"`` for a STOP).
        trigger_kind: the ``kind`` of the triggering incident.
        trigger_seq: its ``seq`` on the bus.
        step: its step.
    """

    decision: Decision
    strategy: str
    trigger_kind: str
    trigger_seq: int
    step: int | None

    @property
    def action(self) -> RecoveryAction:
        """The decided action."""
        return self.decision.action


@dataclass(frozen=True, slots=True, kw_only=True)
class RecoveryStatistics:
    """A snapshot of what the engine saw and decided.

    Attributes:
        incidents: incidents handled.
        unmatched: incidents no strategy was registered for.
        decisions: decisions taken, by action.
        errors: :class:`ErrorRaised` incidents, by category.
        strategy_failures: strategies that raised.
        exhausted: incidents for which every matching strategy declined (→ STOP).
        stop_reason: why training must stop, once decided.
    """

    incidents: int
    unmatched: int
    decisions: Mapping[RecoveryAction, int]
    errors: Mapping[ErrorCategory, int]
    strategy_failures: int
    exhausted: int
    stop_reason: str | None


class _Registration:
    __slots__ = (
        "actions",
        "attempts",
        "categories",
        "consecutive",
        "decide",
        "event_types",
        "exception_names",
        "last_step",
        "max_attempts",
        "max_consecutive",
        "name",
        "patterns",
        "previous",
    )

    def __init__(self, spec: StrategySpec, index: int) -> None:
        strategy = spec.strategy
        decide = getattr(strategy, "decide", None)
        if decide is None:
            if not callable(strategy):
                msg = (
                    f"strategy must have a decide(incident, history) method or be a function "
                    f"of that shape, got {strategy!r}"
                )
                raise TypeError(msg)
            decide = strategy
        self.decide: Callable[[Anomaly, StrategyHistory], object] = decide
        self.name = spec.name or getattr(strategy, "__name__", "") or type(strategy).__name__
        if not isinstance(self.name, str) or not self.name:
            self.name = f"strategy_{index}"
        for arg, value in (
            ("max_attempts", spec.max_attempts),
            ("max_consecutive", spec.max_consecutive),
        ):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                msg = f"{arg} must be a positive integer or None, got {value!r} (strategy {self.name!r})"
                raise ValueError(msg)
        self.max_attempts = spec.max_attempts
        self.max_consecutive = spec.max_consecutive
        self.event_types: list[type[Anomaly]] = []
        self.exception_names: list[str] = []
        self.categories: list[ErrorCategory] = []
        self.patterns: list[re.Pattern[str]] = []
        triggers = spec.on if isinstance(spec.on, tuple) else (spec.on,)
        if not triggers:
            msg = f"on must name at least one trigger, got () (strategy {self.name!r})"
            raise ValueError(msg)
        for trigger in triggers:
            self._add_trigger(trigger)
        self.attempts = 0
        self.consecutive = 0
        self.last_step: int | None = None
        self.actions: dict[RecoveryAction, int] = {}
        self.previous = StrategyHistory()

    def _add_trigger(self, trigger: object) -> None:
        if isinstance(trigger, ErrorCategory):
            self.categories.append(trigger)
        elif isinstance(trigger, re.Pattern):
            self.patterns.append(trigger)
        elif isinstance(trigger, str):
            if not trigger:
                msg = f"on: a message pattern must not be empty (strategy {self.name!r})"
                raise ValueError(msg)
            self.patterns.append(re.compile(re.escape(trigger), re.IGNORECASE))
        elif isinstance(trigger, type) and issubclass(trigger, Anomaly):
            known = event_types().values()
            if trigger is not Anomaly and not any(issubclass(t, trigger) for t in known):
                msg = f"on: {trigger.__qualname__} is not a registered event type (strategy {self.name!r})"
                raise ValueError(msg)
            self.event_types.append(trigger)
        elif isinstance(trigger, type) and issubclass(trigger, BaseException):
            self.exception_names.append(exception_names(trigger)[0])
        elif isinstance(trigger, type) and issubclass(trigger, Event):
            msg = (
                f"on: {trigger.__qualname__} is not an incident (Anomaly subclass); the engine "
                f"only receives anomalies and errors (strategy {self.name!r})"
            )
            raise ValueError(msg)
        else:
            msg = (
                f"on: unknown trigger {trigger!r} for strategy {self.name!r}; use an Anomaly "
                "subclass, an exception class, an ErrorCategory or a message pattern (str)"
            )
            raise TypeError(msg)

    def matches(self, incident: Anomaly) -> bool:
        if any(isinstance(incident, t) for t in self.event_types):
            return True
        if not isinstance(incident, ErrorRaised):
            return False
        if incident.category in self.categories:
            return True
        if self.exception_names and any(
            n in incident.exception_types for n in self.exception_names
        ):
            return True
        return any(p.search(incident.message) for p in self.patterns)

    def exhausted(self) -> bool:
        if self.max_attempts is not None and self.attempts >= self.max_attempts:
            return True
        return self.max_consecutive is not None and self.consecutive >= self.max_consecutive

    def history(self, step: int | None = None) -> StrategyHistory:
        if step is not None and step == self.last_step and self.attempts:
            return self.previous  # a second incident of a step it already answered
        return StrategyHistory(
            attempts=self.attempts, consecutive=self.consecutive, actions=dict(self.actions)
        )

    def answered(self, step: int | None) -> bool:
        return step is not None and self.attempts > 0 and self.last_step == step

    def record(self, step: int | None, decisions: Sequence[Decision]) -> None:
        self.previous = self.history()
        self.attempts += 1
        self.consecutive += 1
        self.last_step = step
        for d in decisions:
            self.actions[d.action] = self.actions.get(d.action, 0) + 1


def _normalize(result: object, name: str) -> tuple[Decision, ...]:
    if result is None:
        return ()
    if isinstance(result, Decision):
        return (result,)
    if isinstance(result, (list, tuple)) and all(isinstance(d, Decision) for d in result):
        return tuple(result)
    msg = f"strategy {name!r} returned {result!r}; return a Decision, a sequence of them, or None"
    raise TypeError(msg)


@final
class RecoveryEngine:
    """Subscribes to every :class:`~eventbus_debug.Anomaly` and decides what to do about it.

    Strategies are tried in order; the first that answers wins. A strategy that raises is
    reported (an :class:`ErrorRaised` with ``source="recovery"``) and the next one is tried.
    When strategies matched an incident but all declined (their bounds are reached), the
    decision is STOP, raised as :class:`~eventbus_debug.TrainingStopped` at the next safe point.
    Incidents that no strategy is registered for are counted and otherwise left alone.

    Example::

        async with EventBus() as bus:
            engine = RecoveryEngine(bus)
            engine.register(my_fn, on="CUDA out of memory")
            safe = SafePoint(engine, model, optimizer)

    Args:
        bus: the bus to subscribe to (an :class:`EventBus` or a :class:`SyncEventBus`).
        strategies: the strategies, in order; ``None`` uses :func:`default_strategies` of
            *policy*.
        policy: the :class:`RecoveryPolicy` (or its name) whose default strategies are used
            when *strategies* is ``None``: ``"observe"``, ``"safe"`` (default), ``"aggressive"``.
        classifier: derives the category of errors reported through the engine.
        name: the subscription's name.
        drain_timeout: seconds a safe point or a retried call waits for the engine.

    Raises:
        TypeError: if *bus* is not a bus, or a strategy or trigger is not usable.
        ValueError: if a bound or a trigger is invalid (the message names it).
    """

    def __init__(
        self,
        bus: EventBus | SyncEventBus,
        *,
        strategies: Iterable[StrategySpec] | None = None,
        policy: RecoveryPolicy | str = RecoveryPolicy.SAFE,
        classifier: ErrorClassifier | None = None,
        name: str = "recovery",
        drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
    ) -> None:
        if not isinstance(bus, (EventBus, SyncEventBus)):
            msg = f"bus must be an EventBus or a SyncEventBus, got {bus!r}"
            raise TypeError(msg)
        if (
            isinstance(drain_timeout, bool)
            or not isinstance(drain_timeout, (int, float))
            or drain_timeout <= 0
        ):
            msg = f"drain_timeout must be a positive number of seconds, got {drain_timeout!r}"
            raise ValueError(msg)
        self.policy = recovery_policy(policy)
        specs = default_strategies(self.policy) if strategies is None else list(strategies)
        self._registrations: list[_Registration] = []
        for spec in specs:
            if not isinstance(spec, StrategySpec):
                msg = f"strategies must hold StrategySpec objects, got {spec!r}"
                raise TypeError(msg)
            self._registrations.append(_Registration(spec, len(self._registrations)))
        self.classifier = classifier if classifier is not None else ErrorClassifier()
        self.drain_timeout = float(drain_timeout)
        self._bus = bus
        self._lock = threading.Lock()
        self._pending: list[DecidedAction] = []
        self._noted = 0
        self._counting = False  # some strategy has a consecutive count > 0
        self._calls: dict[str, list[DecidedAction]] = {}
        self._stop_reason: str | None = None
        self._incidents = 0
        self._unmatched = 0
        self._exhausted = 0
        self._strategy_failures = 0
        self._decisions: dict[RecoveryAction, int] = {}
        self._errors: dict[ErrorCategory, int] = {}
        self.subscription: Subscription = bus.subscribe(self, Anomaly, name=name, capacity=1 << 16)
        self.agreement: object | None = None
        """The session's cross-rank agreement (a ``RankAgreement``), used by retried calls so
        every rank re-runs a failed call together; ``None`` outside a process group."""
        self.name = name

    # -- configuration ---------------------------------------------------------------------

    def register(
        self,
        strategy: Strategy | StrategyFunction,
        *,
        on: Trigger | tuple[Trigger, ...],
        name: str = "",
        max_attempts: int | None = None,
        max_consecutive: int | None = None,
        first: bool = True,
    ) -> None:
        """Add a strategy; by default it is tried before every other one.

        This is the seeds' ``register_recovery_strategy("CUDA out of memory", fn)``::

            engine.register(fn, on="CUDA out of memory")      # message pattern
            engine.register(fn, on=torch.OutOfMemoryError)     # exception type
            engine.register(fn, on=LossSpiked)                 # incident type

        Raises:
            TypeError: if *strategy* has no ``decide`` and is not callable, or a trigger in
                *on* is not a type, category or pattern.
            ValueError: if *on* is empty or names a non-incident event, or a bound is < 1.
        """
        spec = StrategySpec(
            strategy=strategy,
            on=on,
            name=name,
            max_attempts=max_attempts,
            max_consecutive=max_consecutive,
        )
        reg = _Registration(spec, len(self._registrations))
        with self._lock:
            if first:
                self._registrations.insert(0, reg)
            else:
                self._registrations.append(reg)
        _log.info("recovery_strategy_registered", strategy=reg.name, first=first)

    @property
    def strategy_names(self) -> tuple[str, ...]:
        """The registered strategies' names, in the order they are tried."""
        return tuple(r.name for r in self._registrations)

    @property
    def bus(self) -> EventBus | SyncEventBus:
        """The bus the engine is subscribed to."""
        return self._bus

    @property
    def stop_reason(self) -> str | None:
        """Why training must stop, once a STOP was decided; else ``None``."""
        return self._stop_reason

    # -- the subscriber ----------------------------------------------------------------------

    async def handle(self, event: Event, /) -> None:
        """Decide about one incident (called by the bus)."""
        if not isinstance(event, Anomaly) or event.source == ENGINE_SOURCE:
            return
        for decided in self.decide(event):
            self._loop_bus.publish_nowait(
                RecoveryDecided(
                    source=ENGINE_SOURCE,
                    step=decided.step,
                    severity=Severity.CRITICAL
                    if decided.action is RecoveryAction.STOP
                    else Severity.WARNING,
                    action=decided.action,
                    reason=decided.decision.reason,
                    strategy=decided.strategy,
                    trigger_kind=decided.trigger_kind,
                    trigger_seq=decided.trigger_seq,
                    parameters=dict(decided.decision.parameters),
                )
            )

    def decide(self, incident: Anomaly) -> tuple[DecidedAction, ...]:
        """Run the strategies on *incident*, record and queue the result, and return it.

        The bus calls this through :meth:`handle`; call it directly only to test strategies.
        """
        with self._lock:
            self._incidents += 1
            if isinstance(incident, ErrorRaised):
                self._errors[incident.category] = self._errors.get(incident.category, 0) + 1
            regs = list(self._registrations)
        matched = False
        strategy = ""
        decisions: tuple[Decision, ...] = ()
        # One answer per strategy and step covers the several incidents of one bad step; a
        # retried call's errors are not step incidents: each attempt needs its own answer.
        step = None if isinstance(incident, ErrorRaised) else incident.step
        for reg in regs:
            if not reg.matches(incident):
                continue
            matched = True
            answered = reg.answered(step)
            if reg.exhausted() and not answered:
                continue
            try:
                decisions = _normalize(reg.decide(incident, reg.history(step)), reg.name)
            except Exception as exc:
                self._report_strategy_failure(reg.name, incident, exc)
                continue
            if decisions and answered:
                # This strategy already answered another incident of this step (the loss and
                # then the gradients of one bad batch): one answer per step covers both.
                return ()
            if decisions:
                reg.record(step, decisions)
                self._counting = True
                strategy = reg.name
                break
        if not matched:
            with self._lock:
                self._unmatched += 1
            return ()
        if not isinstance(incident, ErrorRaised):
            with self._lock:
                self._noted += 1
        if not decisions:
            if self._stop_reason is not None:
                return ()  # already stopping: one STOP is enough
            strategy = "exhausted"
            decisions = (
                Decision(
                    action=RecoveryAction.STOP,
                    reason=f"every recovery strategy for {incident.kind} is exhausted "
                    f"({_describe(incident)})",
                ),
            )
        out = tuple(
            DecidedAction(
                decision=d,
                strategy=strategy,
                trigger_kind=incident.kind,
                trigger_seq=incident.seq,
                step=incident.step,
            )
            for d in decisions
        )
        retry_id = incident.context.get(RETRY_ID_KEY) if isinstance(incident, ErrorRaised) else None
        with self._lock:
            for d in out:
                self._decisions[d.action] = self._decisions.get(d.action, 0) + 1
                if d.action is RecoveryAction.STOP and self._stop_reason is None:
                    self._stop_reason = d.decision.reason
                    self._exhausted += strategy == "exhausted"
                    _log.error("recovery_stop_decided", reason=d.decision.reason)
            if retry_id is not None:
                self._calls[retry_id] = list(out)
            else:
                self._pending.extend(
                    d for d in out if d.action in STEP_ACTIONS or d.action is RecoveryAction.STOP
                )
        return out

    def _report_strategy_failure(self, name: str, incident: Anomaly, exc: Exception) -> None:
        with self._lock:
            self._strategy_failures += 1
        _log.warning(
            "recovery_strategy_failed", strategy=name, error=f"{type(exc).__name__}: {exc}"
        )
        self._loop_bus.publish_nowait(
            ErrorRaised(
                source=ENGINE_SOURCE,
                step=incident.step,
                error_type=exception_names(type(exc))[0],
                message=f"recovery strategy {name!r} raised on {incident.kind}: {exc}",
                traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
                category=ErrorCategory.CONFIGURATION,
                context={"strategy": name, "trigger_kind": incident.kind},
                exception_types=exception_names(type(exc)),
            )
        )

    # -- what the appliers use ---------------------------------------------------------------

    def take_pending(self) -> tuple[DecidedAction, ...]:
        """Remove and return the step-level decisions not applied yet (for safe points)."""
        if not self._pending:  # the healthy-step fast path: no lock
            return ()
        with self._lock:
            out = tuple(self._pending)
            self._pending.clear()
        return out

    def take_call_decisions(self, retry_id: str) -> tuple[DecidedAction, ...]:
        """Remove and return the decisions taken for the error a retried call published."""
        with self._lock:
            return tuple(self._calls.pop(retry_id, ()))

    def take_noted(self) -> int:
        """Return and reset the number of step incidents a strategy answered since the last call.

        A safe point calls it with :meth:`take_pending`: a step is *good* (consecutive counts
        restart) only when no strategy answered an incident for it, even with ``CONTINUE``
        (a dead layer reported on every step is a run of consecutive incidents, not a good step).
        Errors of retried calls are not counted: they belong to the call, not to the step.
        """
        if not self._noted:
            return 0
        with self._lock:
            noted, self._noted = self._noted, 0
        return noted

    def mark_good(self) -> None:
        """A step passed with no incident: every strategy's consecutive count restarts."""
        if not self._counting:
            return
        with self._lock:
            for reg in self._registrations:
                reg.consecutive = 0
            self._counting = False

    def error_event(
        self,
        exc: BaseException,
        *,
        attempt: int = 1,
        context: Mapping[str, str] | None = None,
        step: int | None = None,
        source: str = "",
    ) -> ErrorRaised:
        """Build the :class:`ErrorRaised` incident for *exc* (classified by :attr:`classifier`)."""
        ctx = dict(context or {})
        cls = self.classifier.classify(exc, ctx)
        names = exception_names(type(exc))
        return ErrorRaised(
            source=source,
            step=step,
            severity=cls.severity,
            error_type=names[0],
            message=str(exc),
            traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
            category=cls.category,
            attempt=attempt,
            context=ctx,
            exception_types=names,
        )

    async def report_error(
        self,
        exc: BaseException,
        *,
        context: Mapping[str, str] | None = None,
        attempt: int = 1,
        step: int | None = None,
    ) -> tuple[DecidedAction, ...]:
        """Publish *exc* as an :class:`ErrorRaised`, wait for the engine, return its decisions.

        The async counterpart of the seeds' ``ErrorHandler.handle_error(error, context)``;
        the caller applies the decisions (or use :func:`~eventbus_debug.recovery.retrying`).

        Raises:
            TypeError: if the engine is attached to a :class:`SyncEventBus` (use
                :meth:`report_error_sync`).
            TimeoutError: if the engine does not answer within *drain_timeout*.
        """
        bus = self._bus
        if not isinstance(bus, EventBus):
            msg = "report_error() needs an EventBus; this engine uses a SyncEventBus: call report_error_sync()"
            raise TypeError(msg)
        retry_id, event = self._tagged_error_event(exc, context, attempt, step)
        bus.publish_nowait(event)
        await bus.drain(self.subscription, timeout=self.drain_timeout)
        return self.take_call_decisions(retry_id)

    def report_error_sync(
        self,
        exc: BaseException,
        *,
        context: Mapping[str, str] | None = None,
        attempt: int = 1,
        step: int | None = None,
    ) -> tuple[DecidedAction, ...]:
        """:meth:`report_error` for a :class:`SyncEventBus` (blocks until the engine answered).

        Raises:
            TypeError: if the engine is attached to an async :class:`EventBus`.
            TimeoutError: if the engine does not answer within *drain_timeout*.
        """
        bus = self._bus
        if not isinstance(bus, SyncEventBus):
            msg = "report_error_sync() needs a SyncEventBus; this engine uses an EventBus: await report_error()"
            raise TypeError(msg)
        retry_id, event = self._tagged_error_event(exc, context, attempt, step)
        bus.publish(event)
        bus.drain(self.subscription, timeout=self.drain_timeout)
        return self.take_call_decisions(retry_id)

    def _tagged_error_event(
        self,
        exc: BaseException,
        context: Mapping[str, str] | None,
        attempt: int,
        step: int | None,
    ) -> tuple[str, ErrorRaised]:
        """An :class:`ErrorRaised` for *exc* tagged with a fresh retry id (for its decisions)."""
        retry_id = uuid.uuid4().hex
        event = self.error_event(
            exc, attempt=attempt, context={**(context or {}), RETRY_ID_KEY: retry_id}, step=step
        )
        return retry_id, event

    def publish(self, event: Event) -> None:
        """Publish from the training side (the right call for either kind of bus)."""
        bus = self._bus
        if isinstance(bus, SyncEventBus):
            bus.publish(event)
        else:
            bus.publish_nowait(event)

    async def drain(self) -> None:
        """Wait until the engine handled every incident published so far (not other sinks).

        Raises:
            TimeoutError: after *drain_timeout* seconds.
        """
        bus = self._bus
        if isinstance(bus, SyncEventBus):
            msg = "drain() needs an EventBus; this engine uses a SyncEventBus: call drain_sync()"
            raise TypeError(msg)
        if self._caught_up(bus):
            # Nothing for the engine in flight: skip the dispatcher round trip (the hot path of
            # a healthy step; telemetry still waiting for dispatch is not the engine's concern).
            await anyio.lowlevel.checkpoint_if_cancelled()
            return
        await bus.drain(self.subscription, timeout=self.drain_timeout)

    def _caught_up(self, bus: EventBus) -> bool:
        """True when no incident waits for the engine, undispatched or queued."""
        if bus.has_undispatched(Anomaly):
            return False
        return self.subscription.statistics().queued == 0

    def drain_sync(self) -> None:
        """:meth:`drain` for a :class:`SyncEventBus` (blocks the training thread).

        Raises:
            TimeoutError: after *drain_timeout* seconds.
        """
        bus = self._bus
        if not isinstance(bus, SyncEventBus):
            msg = "drain_sync() needs a SyncEventBus; this engine uses an EventBus: await drain()"
            raise TypeError(msg)
        bus.drain(self.subscription, timeout=self.drain_timeout)

    @property
    def is_sync(self) -> bool:
        """True when the engine is attached to a :class:`SyncEventBus`."""
        return isinstance(self._bus, SyncEventBus)

    @property
    def _loop_bus(self) -> EventBus:
        bus = self._bus
        return bus.bus if isinstance(bus, SyncEventBus) else bus

    def statistics(self) -> RecoveryStatistics:
        """A snapshot of the engine's counters."""
        with self._lock:
            return RecoveryStatistics(
                incidents=self._incidents,
                unmatched=self._unmatched,
                decisions=dict(self._decisions),
                errors=dict(self._errors),
                strategy_failures=self._strategy_failures,
                exhausted=self._exhausted,
                stop_reason=self._stop_reason,
            )


def _describe(incident: Anomaly) -> str:
    if isinstance(incident, ErrorRaised):
        return f"{incident.error_type}: {incident.message[:200]}"
    if isinstance(incident, NonFiniteDetected):
        return f"non-finite {incident.role.value}"
    return incident.kind
