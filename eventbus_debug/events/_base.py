"""Typed events: the only thing that travels on the bus.

Every event is an immutable, slotted dataclass with a common header (sequence number, wall time,
step, rank, source, severity) and named fields. Events carry host-side numbers and strings only,
never live tensors, so publishing one never synchronizes a device and never keeps memory alive.

Each concrete event class declares a stable ``kind`` (the name written in the log) and whether it
is an *incident* (rare, must always arrive) or *telemetry* (frequent, may be shed under sustained
overload). Declare your own with :func:`event_type`::

    from typing import ClassVar
    from eventbus_debug import Delivery, Event, Severity, event_type

    @event_type
    class BatchSkipped(Event):
        kind: ClassVar[str] = "my_project.batch_skipped"
        delivery: ClassVar[Delivery] = Delivery.INCIDENT
        severity: Severity = Severity.WARNING
        batch_index: int
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar, Final, TypeVar

from .._records import FieldCheck, fast_init
from ._checks import FieldRule, check_fields, field_error, field_rules

if sys.version_info >= (3, 11):
    from typing import dataclass_transform
else:  # pragma: no cover - Python 3.10
    from typing_extensions import dataclass_transform

__all__ = (
    "Anomaly",
    "Delivery",
    "Event",
    "Severity",
    "current_rank",
    "event_type",
    "event_types",
    "refresh_rank",
)

E = TypeVar("E", bound="Event")


@functools.total_ordering
class Severity(Enum):
    """How much an event matters; ordered, so ``severity >= Severity.WARNING`` works."""

    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"
    CRITICAL = "critical"

    @property
    def level(self) -> int:
        """The numeric level, as in :mod:`logging` (DEBUG=10 … CRITICAL=50)."""
        return _SEVERITY_LEVELS[self]

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, Severity):
            return NotImplemented
        return _SEVERITY_LEVELS[self] < _SEVERITY_LEVELS[other]


_SEVERITY_LEVELS: Final[Mapping[Severity, int]] = {
    Severity.DEBUG: 10,
    Severity.INFO: 20,
    Severity.WARNING: 30,
    Severity.ERROR: 40,
    Severity.CRITICAL: 50,
}


class Delivery(Enum):
    """The delivery guarantee of an event class.

    Attributes:
        INCIDENT: always queued, even to a full subscriber; never shed.
        TELEMETRY: may be shed, oldest first, when a subscriber falls behind; every shed event is
            counted and reported by an :class:`EventsDropped` incident.
    """

    INCIDENT = "incident"
    TELEMETRY = "telemetry"


# -- rank -------------------------------------------------------------------------------------

_rank: int = 0


def refresh_rank() -> int:
    """Re-read this process's rank and return it.

    The rank comes from ``torch.distributed`` when a process group is initialized, else from the
    ``RANK`` environment variable, else 0. Buses call this when they start; call it yourself if
    you initialize the process group after a bus started.
    """
    global _rank
    rank: int | None = None
    # No process group can exist before torch is imported: reading a log never imports torch.
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        rank = int(dist.get_rank())
    if rank is None:
        raw = os.environ.get("RANK", "0")
        try:
            rank = int(raw)
        except ValueError:
            rank = 0
    _rank = rank
    return rank


def current_rank() -> int:
    """The rank stamped on new events (cached; see :func:`refresh_rank`)."""
    return _rank


refresh_rank()


# -- the base and the registry ----------------------------------------------------------------

_REGISTRY: dict[str, type[Event]] = {}


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """Base class of every message on the bus.

    Header fields, common to every event:

    Attributes:
        seq: sequence number, unique per bus, assigned when the bus dispatches the event
            (``-1`` until then).
        time_ns: wall-clock time of creation, ``time.time_ns()``.
        step: the training step the event is about, if any.
        rank: the distributed rank of the process that created it.
        source: what produced it (a probe, a sink, the bus, a user's code).
        severity: how much it matters (each class picks a sensible default).
    """

    kind: ClassVar[str] = "event"
    delivery: ClassVar[Delivery] = Delivery.INCIDENT
    # Whether the constructor checks each field against its declared type (a TypeError naming
    # the field). Off only for the records the library builds on every training step from
    # values it checked already; the log writer checks every event anyway (see _checks).
    _check_fields: ClassVar[bool] = True

    seq: int = -1
    time_ns: int = field(default_factory=time.time_ns)
    step: int | None = None
    rank: int = field(default_factory=current_rank)
    source: str = ""
    severity: Severity = Severity.INFO

    @property
    def is_incident(self) -> bool:
        """True when this event must always arrive (see :class:`Delivery`)."""
        return type(self).delivery is Delivery.INCIDENT


@dataclass_transform(frozen_default=True, kw_only_default=True, field_specifiers=(field,))
def event_type(cls: type[E]) -> type[E]:
    """Class decorator that makes *cls* a frozen, slotted, keyword-only event and registers it.

    The class must subclass :class:`Event` and declare its own ``kind``: a stable, unique name
    used in logs (prefix your project's kinds, e.g. ``"myproj.batch_skipped"``). Registration
    lets :func:`~eventbus_debug.decode_event` turn a log line back into the same class.

    Raises:
        TypeError: if *cls* is not an :class:`Event` subclass, or declares no ``kind`` of its own.
        ValueError: if another class already registered the same ``kind``.
    """
    if not (isinstance(cls, type) and issubclass(cls, Event)):
        msg = f"@event_type needs a subclass of Event, got {cls!r}"
        raise TypeError(msg)
    kind = cls.__dict__.get("kind")
    if not isinstance(kind, str) or not kind:
        msg = (
            f'{cls.__qualname__} must declare its own `kind: ClassVar[str] = "..."`, '
            "a stable name written in logs"
        )
        raise TypeError(msg)
    existing = _REGISTRY.get(kind)
    if existing is not None and existing.__qualname__ != cls.__qualname__:
        msg = (
            f"event kind {kind!r} is already used by {existing.__module__}.{existing.__qualname__}"
        )
        raise ValueError(msg)
    new_cls = dataclass(frozen=True, slots=True, kw_only=True)(cls)
    rules: Mapping[str, FieldRule] | None = {}
    if new_cls._check_fields:
        try:
            rules = field_rules(new_cls)
        except NameError:  # a forward reference not defined yet: check every field, later
            rules = None
    checks = {name: _field_check(new_cls, name, rule) for name, rule in (rules or {}).items()}
    plain_init = new_cls.__init__
    # the rank is read from this module's cached global, live (see refresh_rank)
    fast_init(new_cls, live={current_rank: "_rank"}, namespace=globals(), checks=checks)
    if new_cls._check_fields and (rules is None or new_cls.__init__ is plain_init):
        _check_after_init(new_cls)  # fast_init could not generate the checks: the general way
    _REGISTRY[kind] = new_cls
    return new_cls


def _field_check(cls: type, name: str, rule: FieldRule) -> FieldCheck:
    check = rule.check

    def reject(value: Any) -> None:
        problem = check(value)
        if problem is not None:
            raise field_error(cls, name, f"must be {rule.what}, {problem}")

    return FieldCheck(rule.guard, rule.names, reject)


def _check_after_init(cls: type) -> None:
    """Wrap *cls*'s ``__init__`` to check every field once it ran."""
    init: Callable[..., None] = cls.__dict__["__init__"]  # the dataclass's, or fast_init's

    @functools.wraps(init)
    def __init__(self: Event, /, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        check_fields(self)

    cls.__init__ = __init__  # type: ignore[misc]


@dataclass(frozen=True, slots=True, kw_only=True)
class Anomaly(Event):
    """Base class of every incident that reports something wrong with training itself.

    Probes publish subclasses of it (non-finite values, explosion, loss spikes, leaks, ...);
    the recovery engine and the alert sink subscribe to ``Anomaly`` to see them all. It is
    abstract: it has no ``kind`` of its own and is never published directly.
    """

    severity: Severity = Severity.WARNING


def has_incident(events: Iterable[Event]) -> bool:
    """Whether any of *events* is an incident (its class's ``delivery`` is ``INCIDENT``)."""
    incident = Delivery.INCIDENT
    for event in events:  # a loop, not any(genexpr): a batch is often one or two events
        if type(event).delivery is incident:
            return True
    return False


def event_types() -> Mapping[str, type[Event]]:
    """Every registered event class, keyed by its ``kind`` (a read-only snapshot)."""
    return dict(_REGISTRY)
