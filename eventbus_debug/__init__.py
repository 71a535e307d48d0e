"""eventbus-debug: debug PyTorch training without slowing it down.

Probes publish typed events onto an async :class:`EventBus`; independent sinks (a rotating
JSON-lines log, recovery, alerts, reports, your own) consume them without ever blocking the
training loop.

The names below are the front door; everything else is one dot away, in
:mod:`eventbus_debug.events`, :mod:`~eventbus_debug.probes`, :mod:`~eventbus_debug.recovery`,
:mod:`~eventbus_debug.session`, :mod:`~eventbus_debug.sinks`, :mod:`~eventbus_debug.log`,
:mod:`~eventbus_debug.testing`, :mod:`~eventbus_debug.extras` (opt-in features) and
:mod:`~eventbus_debug.compat` (the seed documents' names, never re-exported here). Names are
imported on first use (PEP 562), so ``import eventbus_debug`` and reading a log never import
torch; type checkers read the explicit imports below.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from ._bus import (
        BusStatistics as BusStatistics,
        EventBus as EventBus,
        Subscription as Subscription,
        SubscriptionStatistics as SubscriptionStatistics,
        SyncEventBus as SyncEventBus,
    )
    from .events import (
        Anomaly as Anomaly,
        Delivery as Delivery,
        Event as Event,
        Severity as Severity,
        current_rank as current_rank,
        event_type as event_type,
    )
    from .exceptions import (
        BusClosedError as BusClosedError,
        EventBusError as EventBusError,
        SubscriptionError as SubscriptionError,
        TrainingStopped as TrainingStopped,
    )
    from .log import (
        decode_event as decode_event,
        encode_event as encode_event,
        read_events as read_events,
    )
    from .probes import (
        Cadence as Cadence,
        DebugLevel as DebugLevel,
        StepProbe as StepProbe,
        StepVerdict as StepVerdict,
        Thresholds as Thresholds,
    )
    from .recovery import (
        CallState as CallState,
        RankAgreement as RankAgreement,
        RecoveryEngine as RecoveryEngine,
        RecoveryPolicy as RecoveryPolicy,
        Retrying as Retrying,
        SafePoint as SafePoint,
        retrying as retrying,
    )
    from .session import (
        DebugMode as DebugMode,
        Session as Session,
        SessionOptions as SessionOptions,
        SyncSession as SyncSession,
        Verdict as Verdict,
    )
    from .typing import (
        BatchSink as BatchSink,
        Handler as Handler,
        Publisher as Publisher,
        Sink as Sink,
    )

# name -> the module that defines it (a package front, so moves inside a package stay local)
_HOMES: dict[str, str] = {
    # the bus
    "EventBus": "._bus",
    "SyncEventBus": "._bus",
    "Subscription": "._bus",
    "BusStatistics": "._bus",
    "SubscriptionStatistics": "._bus",
    # events
    "Event": ".events",
    "Anomaly": ".events",
    "Severity": ".events",
    "Delivery": ".events",
    "event_type": ".events",
    "current_rank": ".events",
    # extension points
    "Sink": ".typing",
    "BatchSink": ".typing",
    "Handler": ".typing",
    "Publisher": ".typing",
    # the session
    "Session": ".session",
    "SyncSession": ".session",
    "SessionOptions": ".session",
    "Verdict": ".session",
    "DebugMode": ".session",
    "DebugLevel": ".probes",
    "Thresholds": ".probes",
    "Cadence": ".probes",
    # probes and recovery
    "StepProbe": ".probes",
    "StepVerdict": ".probes",
    "RecoveryEngine": ".recovery",
    "RankAgreement": ".recovery",
    "RecoveryPolicy": ".recovery",
    "SafePoint": ".recovery",
    "Retrying": ".recovery",
    "retrying": ".recovery",
    "CallState": ".recovery",
    # errors
    "EventBusError": ".exceptions",
    "BusClosedError": ".exceptions",
    "SubscriptionError": ".exceptions",
    "TrainingStopped": ".exceptions",
    # the log
    "read_events": ".log",
    "encode_event": ".log",
    "decode_event": ".log",
}

__all__ = ("__version__", *_HOMES)


if not TYPE_CHECKING:  # hidden from type checkers, which read the explicit imports above

    def __getattr__(name: str) -> Any:
        home = _HOMES.get(name)
        if home is None:
            msg = f"module {__name__!r} has no attribute {name!r}"
            raise AttributeError(msg)
        value = getattr(importlib.import_module(home, __name__), name)
        globals()[name] = value  # later lookups skip this function
        return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
