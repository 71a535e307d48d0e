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
import math
import os
import threading
import time
import traceback
from collections import deque
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, ClassVar, Final, Protocol, TypeAlias, TypeVar

import anyio
import orjson

from eventbus_debug.diagnostics import get_logger
from eventbus_debug.events import (
    Event,
    GradientExploded,
    NonFiniteDetected,
    ResourceThresholdExceeded,
    Severity,
    SystemSampled,
    event_type,
)
from eventbus_debug.log.encoding import encode_event
from eventbus_debug.threads import run_in_daemon_thread

from ._terminal import resolve_stream, write_text
from .lines import describe, format_event, use_colors

__all__ = (
    "Alert",
    "AlertHandler",
    "AlertHandlerFailed",
    "AlertRule",
    "AlertSink",
    "AlertStatistics",
    "FileAlert",
    "LogAlert",
    "StderrAlert",
    "WebhookAlert",
    "alert_to_dict",
    "rules",
)

_log = get_logger(__name__)

DEFAULT_COOLDOWN: Final = 60.0
DEFAULT_TIMEOUT: Final = 5.0
DEFAULT_FLUSH_INTERVAL: Final = 1.0

Clock: TypeAlias = Callable[[], float]
AlertHandler: TypeAlias = Callable[["Alert"], "Awaitable[None] | None"]
"""A sync or async callable receiving an :class:`Alert`; its return value is ignored."""

H = TypeVar("H", bound=Callable[..., Any])


@event_type
class AlertHandlerFailed(Event):
    """An alert handler raised or exceeded the sink's timeout; the other handlers ran anyway.

    Attributes:
        handler: the handler's name.
        rule: the name of the rule that triggered it.
        error_type: the exception's class name (``"TimeoutError"`` when it timed out).
        message: the exception's message.
        timed_out: whether the handler was cancelled by the timeout.
        event_kind: the kind of the event being alerted on.
        event_seq: the sequence number of that event.
    """

    kind: ClassVar[str] = "sinks.alert_handler_failed"
    severity: Severity = Severity.ERROR
    handler: str
    rule: str
    error_type: str
    message: str
    timed_out: bool = False
    traceback: str = ""
    event_kind: str = ""
    event_seq: int = -1


def _default_key(event: Event) -> Hashable:
    return (event.kind, event.rank)


@dataclass(frozen=True, slots=True, kw_only=True)
class AlertRule:
    """Which events make an alert, and how often a handler may hear about them.

    Attributes:
        event_types: the event classes the rule matches (subclasses included).
        name: shown in alerts and failure reports; defaults to the class names joined by ``|``.
        min_severity: events below it never match.
        when: an optional predicate; the event matches only when it returns true.
        cooldown: seconds during which repeats of the same alert (same dedup ``key``) are
            counted instead of delivered; ``0`` delivers every occurrence.
        rate_limit: at most this many deliveries per ``rate_window`` seconds for the whole
            rule (``None``: no limit); the excess is counted into the next summary.
        rate_window: the rate limit's window in seconds.
        key: maps an event to its dedup key; by default ``(kind, rank)``.

    Raises:
        ValueError: if no event type is given, or a number is out of range (the message names
            the argument).
        TypeError: if an event type is not an :class:`~eventbus_debug.Event` subclass.
    """

    event_types: tuple[type[Event], ...]
    name: str = ""
    min_severity: Severity = Severity.DEBUG
    when: Callable[[Any], bool] | None = None
    cooldown: float = DEFAULT_COOLDOWN
    rate_limit: int | None = None
    rate_window: float = 60.0
    key: Callable[[Any], Hashable] = _default_key

    def __post_init__(self) -> None:
        types = self.event_types
        if isinstance(types, type):
            types = (types,)
            object.__setattr__(self, "event_types", types)
        if not types:
            msg = "event_types must name at least one Event subclass, got ()"
            raise ValueError(msg)
        for t in types:
            if not (isinstance(t, type) and issubclass(t, Event)):
                msg = f"event_types must hold Event subclasses, got {t!r}"
                raise TypeError(msg)
        if not isinstance(self.min_severity, Severity):
            msg = f"min_severity must be a Severity, got {self.min_severity!r}"
            raise TypeError(msg)
        if not (isinstance(self.cooldown, (int, float)) and self.cooldown >= 0):
            msg = f"cooldown must be a number of seconds >= 0, got {self.cooldown!r}"
            raise ValueError(msg)
        if self.rate_limit is not None and (
            isinstance(self.rate_limit, bool)
            or not isinstance(self.rate_limit, int)
            or self.rate_limit < 1
        ):
            msg = f"rate_limit must be None or an integer >= 1, got {self.rate_limit!r}"
            raise ValueError(msg)
        if not (isinstance(self.rate_window, (int, float)) and self.rate_window > 0):
            msg = f"rate_window must be a number of seconds > 0, got {self.rate_window!r}"
            raise ValueError(msg)
        if not self.name:
            object.__setattr__(self, "name", "|".join(t.__name__ for t in types))

    def matches(self, event: Event, /) -> bool:
        """Whether *event* passes the type, severity and predicate filters."""
        if not isinstance(event, self.event_types) or event.severity < self.min_severity:
            return False
        return self.when is None or bool(self.when(event))


@dataclass(frozen=True, slots=True, kw_only=True)
class Alert:
    """What a handler receives.

    Attributes:
        rule: the rule that matched.
        event: the latest event this alert stands for.
        suppressed: how many occurrences were held back (cooldown or rate limit) since the
            previous delivery for the same rule and key; they are included in ``count``.
        count: occurrences this delivery stands for (``1`` for a fresh alert).
        summary: True when this delivery reports held-back repeats after a cooldown.
        first_time_ns: wall time of the first occurrence this delivery stands for.
    """

    rule: AlertRule
    event: Event
    suppressed: int = 0
    count: int = 1
    summary: bool = False
    first_time_ns: int = 0

    @property
    def message(self) -> str:
        """A one-line, human-readable description: the event's kind, step, rank and description.

        The same words as the console and ``eventbus-debug tail`` (see :mod:`sinks.lines`),
        plus how many repeats the alert stands for.
        """
        ev = self.event
        where = "".join(
            (
                f" step {ev.step}" if ev.step is not None else "",
                f" rank {ev.rank}" if ev.rank else "",
            )
        )
        body = describe(ev)
        return f"{ev.kind}{where}" + (f": {body}" if body else "") + self.repeats

    @property
    def repeats(self) -> str:
        """``" (x5: 4 held back since the last alert)"`` for a summary, else ``""``."""
        if not self.suppressed:
            return ""
        return f" (x{self.count}: {self.suppressed} held back since the last alert)"


def alert_to_dict(alert: Alert, /) -> dict[str, Any]:
    """A JSON-ready mapping of *alert* (the event encoded as in the log, NaN kept as "NaN")."""
    return {
        "rule": alert.rule.name,
        "message": alert.message,
        "kind": alert.event.kind,
        "severity": alert.event.severity.value,
        "step": alert.event.step,
        "rank": alert.event.rank,
        "count": alert.count,
        "suppressed": alert.suppressed,
        "summary": alert.summary,
        "first_time_ns": alert.first_time_ns,
        "event": orjson.loads(encode_event(alert.event)),
    }


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
        ValueError: if *timeout* or *flush_interval* is not a positive number.
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
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            msg = f"timeout must be a positive number of seconds, got {timeout!r}"
            raise ValueError(msg)
        if flush_interval is not None and not (
            isinstance(flush_interval, (int, float)) and flush_interval > 0
        ):
            msg = f"flush_interval must be None or a positive number, got {flush_interval!r}"
            raise ValueError(msg)
        self._bus = bus
        self._timeout = float(timeout)
        self._clock = clock
        self._flush_interval = flush_interval
        self.name = name
        self._registrations: list[_Registration] = []
        self._matched = 0
        self._delivered = 0
        self._suppressed = 0
        self._failed = 0
        self._timed_out = 0
        self._closed = False

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
            ValueError, TypeError: as :class:`AlertRule` and :meth:`add_rule`.
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
            TypeError: if *rule* is not an :class:`AlertRule` or *handler* is not callable.
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
        """Deliver every pending summary, whatever its cooldown, so no count is lost. Idempotent."""
        if self._closed:
            return
        self._closed = True
        await self.flush(force=True)

    async def run_flusher(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        """Deliver due summaries every ``flush_interval`` seconds until cancelled or closed.

        Run it in your task group (``tg.start_soon(alerts.run_flusher)``) when events may stop
        arriving while a cooldown runs; otherwise summaries go out with the next event or at
        close.
        """
        interval = self._flush_interval or DEFAULT_FLUSH_INTERVAL
        task_status.started()
        while not self._closed:
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
                    await run_in_daemon_thread(reg.handler, alert, name="eventbus-alert-handler")
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


# -- built-in handlers ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LogAlert:
    """Log each alert through standard :mod:`logging` (sync: runs in a worker thread).

    The line goes to the stdlib logger *logger_name* (under ``eventbus_debug``): silent until
    the application configures logging, never on stdout. A session with a console view does
    not use it, so an incident is shown once.

    Args:
        logger_name: the logger name; names outside ``eventbus_debug`` are placed under it.
    """

    logger_name: str = "eventbus_debug.alerts"

    def __call__(self, alert: Alert, /) -> None:
        level = alert.event.severity
        logger = get_logger(self.logger_name)
        method = {
            Severity.DEBUG: logger.debug,
            Severity.INFO: logger.info,
            Severity.WARNING: logger.warning,
            Severity.ERROR: logger.error,
            Severity.CRITICAL: logger.critical,
        }[level]
        method(
            "alert",
            rule=alert.rule.name,
            kind=alert.event.kind,
            step=alert.event.step,
            rank=alert.event.rank,
            count=alert.count,
            suppressed=alert.suppressed,
            message=alert.message,
        )


class StderrAlert:
    """Write one line per alert to a stream (``sys.stderr`` at call time by default).

    The line is the console's line for the event (:func:`sinks.lines.format_event`) plus the
    repeats a summary stands for; it goes through an active tqdm or rich progress bar. Do not
    add it next to a console view that already shows incidents: each would print the incident.

    Args:
        stream: a text stream to write to instead of standard error.
        colors: ANSI colours; ``None`` uses them when the stream is a terminal.
    """

    def __init__(self, stream: IO[str] | None = None, *, colors: bool | None = None) -> None:
        self._stream = stream
        self._colors = colors
        self._lock = threading.Lock()

    def __call__(self, alert: Alert, /) -> None:
        stream = resolve_stream(self._stream)
        colors = use_colors(stream) if self._colors is None else self._colors
        line = format_event(alert.event, colors=colors) + alert.repeats + "\n"
        with self._lock:
            write_text(stream, line)


class FileAlert:
    """Append each alert as one JSON line (see :func:`alert_to_dict`) to *path*.

    The file is opened in append mode per alert, so external rotation is safe; lines are
    written whole under a lock.

    Args:
        path: the file to append to; its directory is created when missing.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()

    def __call__(self, alert: Alert, /) -> None:
        line = orjson.dumps(alert_to_dict(alert), option=orjson.OPT_APPEND_NEWLINE)
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "ab") as fh:
                fh.write(line)


class WebhookAlert:
    """POST each alert as JSON (see :func:`alert_to_dict`) to a URL, with a timeout.

    Needs the optional ``http`` extra (httpx): ``pip install 'eventbus-debug[http]'``. A
    non-2xx answer raises, so it is reported as an :class:`AlertHandlerFailed` incident.

    Args:
        url: the endpoint (Slack-compatible receivers, alertmanager bridges, your service).
        timeout: seconds for the whole request.
        headers: extra request headers (an ``Authorization`` token, for instance).

    Raises:
        ImportError: if httpx is not installed.
        ValueError: if *url* is not an http(s) URL or *timeout* is not positive.
    """

    def __init__(
        self, url: str, *, timeout: float = 5.0, headers: Mapping[str, str] | None = None
    ) -> None:
        try:
            import httpx
        except ImportError:
            msg = (
                "WebhookAlert needs httpx, the optional 'http' extra: "
                "pip install 'eventbus-debug[http]'"
            )
            raise ImportError(msg) from None
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            msg = f"url must be an http:// or https:// URL, got {url!r}"
            raise ValueError(msg)
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            msg = f"timeout must be a positive number of seconds, got {timeout!r}"
            raise ValueError(msg)
        self.url = url
        self.timeout = float(timeout)
        self.headers = dict(headers or {})
        self._httpx = httpx

    async def __call__(self, alert: Alert, /) -> None:
        body = orjson.dumps(alert_to_dict(alert))
        headers = {"content-type": "application/json", **self.headers}
        async with self._httpx.AsyncClient(timeout=self.timeout) as client:
            response = await client.post(self.url, content=body, headers=headers)
            response.raise_for_status()


# -- ready rules ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _SustainedAbove:
    """Predicate: a system metric above a threshold for *sustain* readings in a row (per rank),
    or a threshold incident for it (the sampler already requires sustained pressure)."""

    metric: str
    threshold: float
    sustain: int
    _runs: dict[int, int] = field(default_factory=dict, compare=False, repr=False)

    def __call__(self, event: Event) -> bool:
        if isinstance(event, ResourceThresholdExceeded):
            return event.metric == self.metric and event.value > self.threshold
        value = getattr(event, self.metric, None)
        if not isinstance(value, (int, float)) or math.isnan(value) or value <= self.threshold:
            self._runs.pop(event.rank, None)
            return False
        run = self._runs[event.rank] = self._runs.get(event.rank, 0) + 1
        return run >= self.sustain


@dataclass(frozen=True, slots=True)
class _ConstantKey:
    """Dedup key: one alert stream per rule and rank, whichever event class triggered it."""

    name: str

    def __call__(self, event: Event) -> Hashable:
        return (self.name, event.rank)


class _Rules:
    """Ready-made rules for the thresholds the seed documents use (``rules.memory_above()``...).

    The resource rules fire on sustained pressure only: *sustain* readings in a row above the
    threshold (``SystemSampled``), or the sampler's ``ResourceThresholdExceeded`` incident
    (which has its own sustain count). A single busy reading is not an alert.
    """

    def cpu_above(
        self, percent: float = 90.0, *, sustain: int = 3, cooldown: float = 300.0
    ) -> AlertRule:
        """CPU utilization above *percent* for *sustain* readings in a row.

        Not among :meth:`defaults`: a CPU kept busy by training is normal.
        """
        return self._metric("cpu_percent", percent, sustain, cooldown)

    def memory_above(
        self, percent: float = 90.0, *, sustain: int = 3, cooldown: float = 300.0
    ) -> AlertRule:
        """Host memory use above *percent* for *sustain* readings in a row."""
        return self._metric("memory_percent", percent, sustain, cooldown)

    def gpu_memory_above(
        self, percent: float = 90.0, *, sustain: int = 3, cooldown: float = 300.0
    ) -> AlertRule:
        """GPU memory use above *percent* for *sustain* readings (silent without a GPU)."""
        return self._metric("gpu_memory_percent", percent, sustain, cooldown)

    def gradient_explosion(self, *, cooldown: float = DEFAULT_COOLDOWN) -> AlertRule:
        """Every :class:`~eventbus_debug.GradientExploded` incident."""
        return AlertRule(
            event_types=(GradientExploded,), name="gradient_explosion", cooldown=cooldown
        )

    def non_finite(self, *, cooldown: float = DEFAULT_COOLDOWN) -> AlertRule:
        """Every :class:`~eventbus_debug.NonFiniteDetected` incident (NaN or Inf anywhere)."""
        return AlertRule(event_types=(NonFiniteDetected,), name="non_finite", cooldown=cooldown)

    def defaults(self) -> tuple[AlertRule, ...]:
        """Memory, GPU memory, gradient explosion and non-finite rules, default thresholds."""
        return (
            self.memory_above(),
            self.gpu_memory_above(),
            self.gradient_explosion(),
            self.non_finite(),
        )

    @staticmethod
    def _metric(metric: str, threshold: float, sustain: int, cooldown: float) -> AlertRule:
        if not (isinstance(threshold, (int, float)) and 0 < threshold <= 100):
            msg = f"percent must be in (0, 100], got {threshold!r}"
            raise ValueError(msg)
        if isinstance(sustain, bool) or not isinstance(sustain, int) or sustain < 1:
            msg = f"sustain must be an integer >= 1 (readings in a row), got {sustain!r}"
            raise ValueError(msg)
        name = f"{metric}>{threshold:g}"
        return AlertRule(
            event_types=(SystemSampled, ResourceThresholdExceeded),
            name=name,
            when=_SustainedAbove(metric, float(threshold), sustain),
            cooldown=cooldown,
            key=_ConstantKey(name),
        )


rules: Final = _Rules()
"""Ready rules: ``rules.cpu_above(90)``, ``rules.memory_above(90)``, ``rules.gpu_memory_above(90)``,
``rules.gradient_explosion()``, ``rules.non_finite()``, ``rules.defaults()``."""
