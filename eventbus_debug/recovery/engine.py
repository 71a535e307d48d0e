"""The recovery engine: a bus subscriber that turns incidents into typed, bounded decisions.

It never touches the model. Step-level decisions wait for the training loop's safe point,
which takes them once per step (:meth:`RecoveryEngine.take`); call-level decisions are picked
up by the retried call that published the error (:mod:`eventbus_debug.recovery.calls`). Every
decision is published as a :class:`RecoveryDecided` event, so the log shows what was decided
and why. Which strategies run, on what, within which bounds: :mod:`.registry`.
"""

from __future__ import annotations

import threading
import traceback
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, final

from eventbus_debug.diagnostics import get_logger

from .._bus import EventBus, Subscription, SyncEventBus
from .._validate import positive_seconds
from ..events import (
    Anomaly,
    ErrorCategory,
    ErrorRaised,
    Event,
    NonFiniteDetected,
    RecoveryAction,
    RecoveryDecided,
    Severity,
)
from ..events.recovery import CallSettings
from ..typing import Publisher
from .actions import STEP_ACTIONS, DecidedAction, Decision, Stop
from .classify import ErrorClassifier, exception_names
from .registry import Registration, StrategySpec, Trigger, default_strategies, normalize
from .strategies import RecoveryPolicy, Strategy, StrategyFunction, recovery_policy

if TYPE_CHECKING:
    from .agreement import AgreedStep, Agreement

__all__ = ("Pending", "RecoveryEngine", "RecoveryStatistics")

_log = get_logger(__name__)

ENGINE_SOURCE: Final = "recovery"
DEFAULT_DRAIN_TIMEOUT: Final = 60.0


@dataclass(frozen=True, slots=True)
class Pending:
    """What a safe point takes from the engine at one step (:meth:`RecoveryEngine.take`).

    Attributes:
        actions: the step-level decisions to apply (agreed across ranks with an agreement).
        clean: True when no strategy answered an incident for this step (on any rank): the
            step counts as good (snapshots, temporary LR changes).
        agreed: what the ranks agreed, with an agreement; ``None`` without one.
    """

    actions: tuple[DecidedAction, ...] = ()
    clean: bool = True
    agreed: AgreedStep | None = None


_CLEAN: Final = Pending()


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
        bus: the bus to subscribe to and publish on: an :class:`EventBus` or a
            :class:`SyncEventBus` (both satisfy :class:`~eventbus_debug.typing.Publisher`).
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
        bus: Publisher,
        *,
        strategies: Iterable[StrategySpec] | None = None,
        policy: RecoveryPolicy | str = RecoveryPolicy.SAFE,
        classifier: ErrorClassifier | None = None,
        name: str = "recovery",
        drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
    ) -> None:
        self._host, self._blocking = _attach(bus)
        timeout = positive_seconds("drain_timeout", drain_timeout)
        self.policy = recovery_policy(policy)
        specs = default_strategies(self.policy) if strategies is None else list(strategies)
        self._registrations: list[Registration] = []
        for spec in specs:
            if not isinstance(spec, StrategySpec):
                msg = f"strategies must hold StrategySpec objects, got {spec!r}"
                raise TypeError(msg)
            self._registrations.append(Registration(spec, len(self._registrations)))
        self.classifier = classifier if classifier is not None else ErrorClassifier()
        self.drain_timeout = timeout
        self._bus = bus
        self._lock = threading.Lock()
        self._pending: list[DecidedAction] = []
        self._noted = 0
        self._counting = False  # some strategy has a consecutive count > 0
        self._calls: dict[str, list[DecidedAction]] = {}
        self._stop_reason: str | None = None
        self._stop_steps: deque[int | None] = deque(maxlen=8)  # steps a STOP was decided at
        self._incidents = 0
        self._unmatched = 0
        self._exhausted = 0
        self._strategy_failures = 0
        self._decisions: dict[RecoveryAction, int] = {}
        self._errors: dict[ErrorCategory, int] = {}
        owner = self._blocking if self._blocking is not None else self._host
        self.subscription: Subscription = owner.subscribe(
            self, Anomaly, name=name, capacity=1 << 16
        )
        self.ignore: Callable[[Anomaly], bool] | None = None
        """Incidents this returns True for are left alone (not counted, no decision): a
        session's own engine leaves another session's incidents on a shared bus to that
        session's engine. ``None``: every incident on the bus is handled."""
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
        reg = Registration(spec, len(self._registrations))
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
    def bus(self) -> Publisher:
        """The bus the engine is subscribed to: where the training side publishes."""
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
        ignore = self.ignore
        if ignore is not None and ignore(event):
            return
        for decided in self.decide(event):
            self._host.publish_nowait(
                RecoveryDecided(
                    source=ENGINE_SOURCE,
                    step=decided.step,
                    severity=Severity.CRITICAL
                    if decided.kind is RecoveryAction.STOP
                    else Severity.WARNING,
                    action=decided.kind,
                    reason=decided.reason,
                    strategy=decided.strategy,
                    trigger_kind=decided.trigger_kind,
                    trigger_seq=decided.trigger_seq,
                    decided=decided.action,
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
                decisions = normalize(reg.decide(incident, reg.history(step)), reg.name)
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
        retry_id = incident.retry_id if isinstance(incident, ErrorRaised) else ""
        if not decisions:
            if not retry_id and self._stopping(incident.step):
                return ()  # this step is already stopping: one STOP is enough
            strategy = "exhausted"
            decisions = (
                Decision(
                    action=Stop(),
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
        with self._lock:
            for d in out:
                self._decisions[d.kind] = self._decisions.get(d.kind, 0) + 1
                if d.kind is RecoveryAction.STOP:
                    if self._stop_reason is None:
                        self._stop_reason = d.reason
                        self._exhausted += strategy == "exhausted"
                    if not retry_id:
                        self._stop_steps.append(d.step)
                    _log.error("recovery_stop_decided", reason=d.reason)
            if retry_id:
                self._calls[retry_id] = list(out)
            else:
                self._pending.extend(
                    d for d in out if d.kind in STEP_ACTIONS or d.kind is RecoveryAction.STOP
                )
        return out

    def _stopping(self, step: int | None) -> bool:
        """Whether a STOP is already decided for *step*'s incidents, or waits to be applied.

        One STOP per step is enough (the loss and the gradients of one bad batch both run out
        of strategies). A retried call's STOP is its own: the call raises it, and a loop that
        catches it (a data source given up on) goes on; later exhausted incidents, of steps or
        of calls, must still stop.
        """
        with self._lock:
            if step is not None and step in self._stop_steps:
                return True
            return any(d.kind is RecoveryAction.STOP for d in self._pending)

    def _report_strategy_failure(self, name: str, incident: Anomaly, exc: Exception) -> None:
        with self._lock:
            self._strategy_failures += 1
        _log.warning(
            "recovery_strategy_failed", strategy=name, error=f"{type(exc).__name__}: {exc}"
        )
        self._host.publish_nowait(
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

    def take(
        self, step: int, *, loss: float | None = None, agreement: Agreement | None = None
    ) -> Pending:
        """Remove and return what a safe point applies at *step*: the one call per step.

        Without an *agreement* a step is clean when no strategy answered an incident since
        the last call, even with ``CONTINUE`` (a dead layer reported on every step is a run of
        consecutive incidents, not a good step); errors of retried calls belong to the call,
        not to the step. With an *agreement* (a collective: call it on every rank at every
        step) the decisions and the cleanliness are the group's, and *loss* is averaged. A
        clean step restarts every strategy's consecutive count.

        Raises:
            TrainingStopped: if the ranks cannot agree (see the agreement).
        """
        if agreement is None and not self._pending and not self._noted:
            # The healthy-step fast path: no lock, no allocation.
            if self._counting:
                self._mark_good()
            return _CLEAN
        actions, noted = self._take_pending()
        if agreement is None:
            return Pending(actions=actions, clean=not noted)
        agreed = agreement.agree(step, actions, bool(noted), loss=loss)
        if not agreed.noted and self._counting:
            self._mark_good()
        return Pending(actions=agreed.decisions, clean=not agreed.noted, agreed=agreed)

    def take_for_agreement(self) -> tuple[tuple[DecidedAction, ...], int]:
        """Remove the pending step decisions and the incident count, for an early agreement.

        An overlapped agreement sends them during ``backward()`` (before the safe point) and
        returns them, agreed, from :meth:`take`'s call; nothing else changes.
        """
        return self._take_pending()

    def _take_pending(self) -> tuple[tuple[DecidedAction, ...], int]:
        """Remove and return the pending step decisions and the count of incidents noted."""
        with self._lock:
            actions = tuple(self._pending)
            self._pending.clear()
            noted, self._noted = self._noted, 0
        return actions, noted

    def answers(self, incident: Anomaly) -> bool:
        """Whether some registered strategy is asked about incidents like *incident*."""
        with self._lock:
            return any(reg.matches(incident) for reg in self._registrations)

    def _mark_good(self) -> None:
        """A step passed with no incident: every strategy's consecutive count restarts."""
        with self._lock:
            for reg in self._registrations:
                reg.consecutive = 0
            self._counting = False

    def take_call_decisions(self, retry_id: str) -> tuple[DecidedAction, ...]:
        """Remove and return the decisions taken for the error a retried call published."""
        with self._lock:
            return tuple(self._calls.pop(retry_id, ()))

    def error_event(
        self,
        exc: BaseException,
        *,
        attempt: int = 1,
        context: Mapping[str, str] | None = None,
        settings: CallSettings | None = None,
        retry_id: str = "",
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
            settings=settings,
            retry_id=retry_id,
        )

    # -- waiting for the engine --------------------------------------------------------------

    async def drain(self) -> None:
        """Wait until the engine handled every incident published so far (not other sinks).

        Raises:
            TypeError: if the engine is on a :class:`SyncEventBus` (use :meth:`drain_sync`).
            TimeoutError: after *drain_timeout* seconds.
        """
        if self._blocking is not None:
            msg = "drain() needs an EventBus; this engine uses a SyncEventBus: call drain_sync()"
            raise TypeError(msg)
        if self.caught_up():
            # Nothing for the engine in flight: return without touching the event loop (the hot
            # path of a healthy step, a few hundred ns; telemetry still waiting for dispatch is
            # not the engine's concern, and the session's step_completed is the step's yield).
            return
        await self._host.drain(self.subscription, timeout=self.drain_timeout)

    def drain_sync(self) -> None:
        """:meth:`drain` for an engine on a :class:`SyncEventBus` (blocks the training thread).

        Bounded also when a sink holds the bus's thread (a blocking call in an async handler,
        which keeps the bus's own timeout from firing): the training thread stops waiting after
        *drain_timeout* plus ``THREAD_GRACE`` (1 s); see :meth:`SyncEventBus.drain`.

        Raises:
            TypeError: if the engine is on an async :class:`EventBus` (await :meth:`drain`).
            TimeoutError: after *drain_timeout* seconds; its message names the sink the
                engine waited for, or what holds the bus's thread.
        """
        if self._blocking is None:
            msg = "drain_sync() needs a SyncEventBus; this engine uses an EventBus: await drain()"
            raise TypeError(msg)
        self._blocking.drain(self.subscription, timeout=self.drain_timeout)

    @property
    def blocking(self) -> bool:
        """True when the engine is on a :class:`SyncEventBus`: wait with the ``_sync`` calls."""
        return self._blocking is not None

    def caught_up(self) -> bool:
        """True when no incident waits for the engine, queued or undispatched (no await).

        The healthy step's check: the subscription's O(1) pending count first, then the bus's
        undispatched incidents (no statistics snapshot built per step; issue #13, item 6).
        """
        return self.subscription.pending == 0 and not self._host.has_undispatched(Anomaly)

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


def _attach(bus: object) -> tuple[EventBus, SyncEventBus | None]:
    """The event loop's bus the engine runs on, and the blocking front when there is one."""
    if isinstance(bus, SyncEventBus):
        return bus.bus, bus
    if isinstance(bus, EventBus):
        return bus, None
    msg = (
        f"bus must be an EventBus or a SyncEventBus (a Publisher the engine can subscribe "
        f"to), got {bus!r}"
    )
    raise TypeError(msg)


def _describe(incident: Anomaly) -> str:
    if isinstance(incident, ErrorRaised):
        return f"{incident.error_type}: {incident.message[:200]}"
    if isinstance(incident, NonFiniteDetected):
        return f"non-finite {incident.role.value}"
    return incident.kind
