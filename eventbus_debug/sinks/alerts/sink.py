"""Alerts: rules that pick events, handlers that tell someone, cooldowns that keep it sane.

An :class:`AlertSink` holds (rule, handler) registrations. For every event it receives, each
matching rule decides whether its handler hears about it now or later:

- **cooldown / dedup**: the first occurrence of an alert (same rule, same dedup key) is
  delivered at once; repeats within ``cooldown`` seconds are counted, not delivered; once the
  cooldown is over the handler receives one *summary* :class:`Alert` whose ``suppressed`` says
  how many repeats it stands for. 1,000 identical alerts in a minute reach the handler twice:
  the first one, then one summary with ``suppressed=999``.
- **rate limit**: at most ``rate_limit`` deliveries per ``rate_window`` seconds per rule;
  alerts over the limit are counted into the next summary as well.

Handlers are sync or async callables taking an :class:`Alert`. The handlers an event triggers
run concurrently, each bounded by the sink's ``timeout``; sync handlers run in a worker thread.
A handler that raises or times out becomes an :class:`AlertHandlerFailed` incident on the bus
and never affects the other handlers, the sink or the bus.

Example::

    async with EventBus() as bus:
        alerts = AlertSink(bus)

        @alerts.on(GradientExploded, cooldown=60.0)
        async def page(alert: Alert) -> None:
            ...

        alerts.add_rule(rules.non_finite(), StderrAlert())
        bus.subscribe(alerts)
"""

from __future__ import annotations

import inspect
import time
import traceback
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol, TypeAlias, TypeVar

import anyio

from eventbus_debug.diagnostics import get_logger
from eventbus_debug.events import (
    Event,
    Severity,
)
from eventbus_debug.threads import run_in_daemon_thread

from .._checks import seconds
from .alert import (
    DEFAULT_COOLDOWN,
    Alert,
    AlertHandler,
    AlertHandlerFailed,
    AlertRule,
    _default_key,
)

__all__ = ("AlertSink", "AlertStatistics")

_log = get_logger(__name__)


DEFAULT_TIMEOUT: Final = 5.0
DEFAULT_FLUSH_INTERVAL: Final = 1.0


Clock: TypeAlias = Callable[[], float]


H = TypeVar("H", bound=Callable[..., Any])


@dataclass(frozen=True, slots=True)
class AlertStatistics:
    """Counters of an :class:`AlertSink`.

    Attributes:
        matched: rule matches (one event matching two rules counts twice).
        delivered: handler calls made (fresh alerts and summaries).
        suppressed: matches held back by a cooldown or a rate limit.
        failed: handler calls that raised.
        timed_out: handler calls cancelled by the timeout.
        pending: held-back matches not yet reported in a summary.
    """

    matched: int
    delivered: int
    suppressed: int
    failed: int
    timed_out: int
    pending: int


class _Publisher(Protocol):
    def publish_nowait(self, event: Event, /) -> None: ...


@dataclass(slots=True)
class _KeyState:
    last_delivery: float
    pending: int = 0
    pending_event: Event | None = None
    pending_first_ns: int = 0


@dataclass(slots=True, eq=False)
class _Registration:
    rule: AlertRule
    handler: AlertHandler
    name: str
    is_async: bool
    states: dict[Hashable, _KeyState] = field(default_factory=dict)
    recent: deque[float] = field(default_factory=deque)


class AlertSink:
    """A sink that turns matching events into calls of your alert handlers.

    Subscribe it to a bus (``bus.subscribe(alerts)``; give event types to pre-filter). Register
    handlers with the :meth:`on` decorator or :meth:`add_rule`. Failures of handlers are
    published on *bus* as :class:`AlertHandlerFailed`; the sink never delivers those to its own
    rules, so a broken handler cannot feed on itself.

    Args:
        bus: where handler failures are published (anything with ``publish_nowait``).
        timeout: seconds each handler call may take before it is cancelled (sync handlers are
            abandoned in their worker thread).
        clock: a monotonic clock in seconds; inject a fake one in tests.
        flush_interval: how often, in real seconds, :meth:`run_flusher` looks for summaries
            whose cooldown ended while no new event arrived (``None``: the default, 1 s).
        name: the ``source`` of the incidents this sink publishes.

    Raises:
        TypeError: if *bus* has no callable ``publish_nowait`` (a failing handler would then
            go unreported), *clock* is not callable or *name* is not a string.
        ArgumentTypeError: if *timeout* or *flush_interval* is not a number (a ``TypeError``,
            and the ``ValueError`` earlier releases raised).
        ValueError: if *timeout* or *flush_interval* is not a finite number > 0.
    """

    def __init__(
        self,
        bus: _Publisher,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        clock: Clock = time.monotonic,
        flush_interval: float | None = DEFAULT_FLUSH_INTERVAL,
        name: str = "alerts",
    ) -> None:
        if not callable(getattr(bus, "publish_nowait", None)):
            msg = (
                "bus must be an EventBus or another object with a publish_nowait(event) method "
                f"(where handler failures are published), got {type(bus).__qualname__} {bus!r}"
            )
            raise TypeError(msg)
        if not callable(clock):
            msg = f"clock must be a callable returning seconds, got {type(clock).__qualname__}"
            raise TypeError(msg)
        if not isinstance(name, str):
            msg = f"name must be a str, got {type(name).__qualname__}"
            raise TypeError(msg)
        self._timeout = seconds("timeout", timeout, rule="a finite number of seconds > 0")
        if flush_interval is not None:
            flush_interval = seconds(
                "flush_interval", flush_interval, rule="None or a finite number of seconds > 0"
            )
        self._bus = bus
        self._clock = clock
        self._flush_interval = flush_interval
        self.name = name
        self._registrations: list[_Registration] = []
        self._matched = 0
        self._delivered = 0
        self._suppressed = 0
        self._failed = 0
        self._timed_out = 0
        self._closes = 0  # how many times the sink was closed (ends run_flusher)

    # -- registration --------------------------------------------------------------------------

    def on(
        self,
        *event_types: type[Event],
        min_severity: Severity = Severity.DEBUG,
        when: Callable[[Any], bool] | None = None,
        cooldown: float = DEFAULT_COOLDOWN,
        rate_limit: int | None = None,
        rate_window: float = 60.0,
        key: Callable[[Any], Hashable] = _default_key,
        name: str = "",
    ) -> Callable[[H], H]:
        """Decorator: call the decorated handler for events matching a new :class:`AlertRule`.

        The arguments are those of :class:`AlertRule`; the handler is returned unchanged.

        Raises:
            ValueError, TypeError: as :class:`AlertRule` and :meth:`add_rule` (a *when* or
                *key* that is not callable is a ``TypeError`` here, not a failure on every
                event).
        """
        rule = AlertRule(
            event_types=event_types,
            name=name,
            min_severity=min_severity,
            when=when,
            cooldown=cooldown,
            rate_limit=rate_limit,
            rate_window=rate_window,
            key=key,
        )

        def register(handler: H) -> H:
            self.add_rule(rule, handler)
            return handler

        return register

    def add_rule(self, rule: AlertRule, handler: AlertHandler, /) -> None:
        """Call *handler* (sync or async) with an :class:`Alert` for events matching *rule*.

        The same rule may be registered with several handlers; each keeps its own cooldown.

        Raises:
            TypeError: if *rule* is not an :class:`AlertRule`, its ``when`` (when given) or
                ``key`` is not callable, or *handler* is not callable.
        """
        if not isinstance(rule, AlertRule):
            msg = f"rule must be an AlertRule, got {rule!r}"
            raise TypeError(msg)
        if not callable(handler):
            msg = f"handler must be a callable taking an Alert, got {handler!r}"
            raise TypeError(msg)
        self._registrations.append(
            _Registration(
                rule=rule,
                handler=handler,
                name=_handler_name(handler),
                is_async=_is_async_callable(handler),
            )
        )

    @property
    def rules(self) -> tuple[tuple[AlertRule, AlertHandler], ...]:
        """The registered (rule, handler) pairs, in registration order."""
        return tuple((r.rule, r.handler) for r in self._registrations)

    def statistics(self) -> AlertStatistics:
        """A snapshot of the sink's counters."""
        pending = sum(s.pending for r in self._registrations for s in r.states.values())
        return AlertStatistics(
            matched=self._matched,
            delivered=self._delivered,
            suppressed=self._suppressed,
            failed=self._failed,
            timed_out=self._timed_out,
            pending=pending,
        )

    # -- the sink protocol ---------------------------------------------------------------------

    async def handle(self, event: Event, /) -> None:
        """Match *event* against every rule and run the handlers due, concurrently."""
        if isinstance(event, AlertHandlerFailed) and event.source == self.name:
            return
        now = self._clock()
        due: list[tuple[_Registration, Alert]] = []
        for reg in self._registrations:
            try:
                if not reg.rule.matches(event):
                    continue
                key = reg.rule.key(event)
            except Exception as exc:
                self._report_failure(reg, event, exc, timed_out=False, phase="rule")
                continue
            self._matched += 1
            alert = self._decide(reg, key, event, now)
            if alert is not None:
                due.append((reg, alert))
        due.extend(self._due_summaries(now))
        if due:
            await self._deliver(due)

    async def flush(self, *, force: bool = False) -> int:
        """Deliver the summaries whose cooldown is over (all of them with *force*).

        Returns:
            The number of summaries delivered.
        """
        due = self._due_summaries(self._clock(), force=force)
        if due:
            await self._deliver(due)
        return len(due)

    async def aclose(self) -> None:
        """Deliver every pending summary, whatever its cooldown, so no count is lost.

        Idempotent (a second close has nothing left to deliver); a sink subscribed again after
        a close delivers what was held back since at its next close.
        """
        self._closes += 1
        await self.flush(force=True)

    async def run_flusher(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        """Deliver due summaries every ``flush_interval`` seconds until cancelled or closed.

        Run it in your task group (``tg.start_soon(alerts.run_flusher)``) when events may stop
        arriving while a cooldown runs; otherwise summaries go out with the next event or at
        close.
        """
        interval = self._flush_interval or DEFAULT_FLUSH_INTERVAL
        closes = self._closes  # runs until the next close, also on a sink closed before
        task_status.started()
        while self._closes == closes:
            await anyio.sleep(interval)
            await self.flush()

    # -- internals -----------------------------------------------------------------------------

    def _decide(self, reg: _Registration, key: Hashable, event: Event, now: float) -> Alert | None:
        rule = reg.rule
        state = reg.states.get(key)
        if state is not None and now - state.last_delivery < rule.cooldown:
            self._hold(state, event)
            return None
        if not self._rate_ok(reg, now):
            if state is None:
                # Never delivered: start the cooldown window now, so the summary follows.
                state = _KeyState(last_delivery=now)
                reg.states[key] = state
            self._hold(state, event)
            return None
        if state is None:
            state = _KeyState(last_delivery=now)
            reg.states[key] = state
        suppressed = state.pending
        first_ns = state.pending_first_ns if suppressed else event.time_ns
        state.last_delivery = now
        state.pending = 0
        state.pending_event = None
        reg.recent.append(now)
        return Alert(
            rule=rule,
            event=event,
            suppressed=suppressed,
            count=suppressed + 1,
            summary=suppressed > 0,
            first_time_ns=first_ns,
        )

    def _hold(self, state: _KeyState, event: Event) -> None:
        if state.pending == 0:
            state.pending_first_ns = event.time_ns
        state.pending += 1
        state.pending_event = event
        self._suppressed += 1

    def _rate_ok(self, reg: _Registration, now: float) -> bool:
        limit = reg.rule.rate_limit
        if limit is None:
            return True
        recent = reg.recent
        while recent and now - recent[0] >= reg.rule.rate_window:
            recent.popleft()
        return len(recent) < limit

    def _due_summaries(
        self, now: float, *, force: bool = False
    ) -> list[tuple[_Registration, Alert]]:
        due: list[tuple[_Registration, Alert]] = []
        for reg in self._registrations:
            for state in reg.states.values():
                if state.pending == 0 or state.pending_event is None:
                    continue
                if not force:
                    if now - state.last_delivery < reg.rule.cooldown:
                        continue
                    if not self._rate_ok(reg, now):
                        continue
                due.append(
                    (
                        reg,
                        Alert(
                            rule=reg.rule,
                            event=state.pending_event,
                            suppressed=state.pending,
                            count=state.pending,
                            summary=True,
                            first_time_ns=state.pending_first_ns,
                        ),
                    )
                )
                state.last_delivery = now
                state.pending = 0
                state.pending_event = None
                reg.recent.append(now)
        return due

    async def _deliver(self, due: Sequence[tuple[_Registration, Alert]]) -> None:
        if len(due) == 1:
            await self._call(*due[0])
            return
        async with anyio.create_task_group() as tg:
            for reg, alert in due:
                tg.start_soon(self._call, reg, alert)

    async def _call(self, reg: _Registration, alert: Alert) -> None:
        self._delivered += 1
        try:
            with anyio.fail_after(self._timeout):
                if reg.is_async:
                    result = reg.handler(alert)
                    if inspect.isawaitable(result):
                        await result
                else:
                    # A daemon thread: a handler that never returns never keeps the process alive.
                    result = await run_in_daemon_thread(
                        reg.handler, alert, name="eventbus-alert-handler"
                    )
                    if inspect.isawaitable(result):
                        # A plain callable that returns a coroutine (``lambda a: pager.send(a)``,
                        # as AlertHandler allows): run it here, within the same timeout, so the
                        # alert is delivered (or its failure reported) instead of dropped.
                        await result
        except TimeoutError as exc:
            self._timed_out += 1
            self._report_failure(reg, alert.event, exc, timed_out=True, phase="handler")
        except Exception as exc:
            self._failed += 1
            self._report_failure(reg, alert.event, exc, timed_out=False, phase="handler")

    def _report_failure(
        self, reg: _Registration, event: Event, exc: BaseException, *, timed_out: bool, phase: str
    ) -> None:
        message = (
            f"handler {reg.name} took longer than {self._timeout:g} s and was cancelled"
            if timed_out
            else f"{phase} raised: {exc}"
        )
        _log.warning(
            "alert_handler_failed",
            sink=self.name,
            handler=reg.name,
            rule=reg.rule.name,
            error=f"{type(exc).__name__}: {exc}",
            timed_out=timed_out,
        )
        failure = AlertHandlerFailed(
            step=event.step,
            source=self.name,
            handler=reg.name,
            rule=reg.rule.name,
            error_type=type(exc).__name__,
            message=message,
            timed_out=timed_out,
            traceback="" if timed_out else "".join(traceback.format_exception(exc)),
            event_kind=event.kind,
            event_seq=event.seq,
        )
        try:
            self._bus.publish_nowait(failure)
        except Exception as publish_exc:  # the bus is closing: the log line above stays
            _log.warning(
                "alert_failure_unpublished",
                sink=self.name,
                error=f"{publish_exc}",
                handler=reg.name,
            )


def _is_async_callable(fn: object) -> bool:
    if inspect.iscoroutinefunction(fn):
        return True
    call = getattr(fn, "__call__", None)  # noqa: B004
    return call is not None and inspect.iscoroutinefunction(call)


def _handler_name(handler: object) -> str:
    name = getattr(handler, "__qualname__", None) or getattr(handler, "__name__", None)
    if isinstance(name, str):
        return name
    return type(handler).__name__
