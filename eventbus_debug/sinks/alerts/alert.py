"""An alert and the rule that makes it: :class:`AlertRule`, :class:`Alert`, and the
:class:`AlertHandlerFailed` incident a failing handler becomes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from typing import Any, Final, TypeAlias

import orjson

from eventbus_debug.events import (
    Event,
    Severity,
)
from eventbus_debug.log.encoding import encode_event

from .._checks import count, seconds
from .._events import AlertHandlerFailed as AlertHandlerFailed
from ..lines import describe

__all__ = (
    "DEFAULT_COOLDOWN",
    "Alert",
    "AlertHandler",
    "AlertHandlerFailed",
    "AlertRule",
    "alert_to_dict",
)

DEFAULT_COOLDOWN: Final = 60.0


AlertHandler: TypeAlias = Callable[["Alert"], "Awaitable[None] | None"]
"""A sync or async callable receiving an :class:`Alert`; its return value is ignored."""


def _default_key(event: Event) -> Hashable:
    return (event.kind, event.rank)


def _check_rule_callables(*, when: object, key: object) -> None:
    """A rule's predicate and dedup key must be callables: else every event would fail."""
    if when is not None and not callable(when):
        msg = f"when must be None or a callable taking an event, got {type(when).__qualname__} {when!r}"
        raise TypeError(msg)
    if not callable(key):
        msg = f"key must be a callable mapping an event to a hashable, got {type(key).__qualname__} {key!r}"
        raise TypeError(msg)


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
        ArgumentTypeError: if *cooldown*, *rate_limit* or *rate_window* is not a number (an int
            for *rate_limit*; a ``TypeError``, and the ``ValueError`` earlier releases raised).
        TypeError: if an event type is not an :class:`~eventbus_debug.Event` subclass, or
            ``when`` (when given) or ``key`` is not callable (else every event would fail).
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
        _check_rule_callables(when=self.when, key=self.key)
        cooldown = seconds(
            "cooldown",
            self.cooldown,
            rule="a number of seconds >= 0 (math.inf: once per key)",
            zero=True,
            infinite=True,
        )
        object.__setattr__(self, "cooldown", cooldown)
        if self.rate_limit is not None:
            count("rate_limit", self.rate_limit, rule="None or an integer >= 1")
        window = seconds("rate_window", self.rate_window, rule="a finite number of seconds > 0")
        object.__setattr__(self, "rate_window", window)
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
