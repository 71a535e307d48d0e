"""eventbus-debug: debug PyTorch training without slowing it down.

Probes publish typed events onto an async :class:`EventBus`; independent sinks (a rotating
JSON-lines log, recovery, alerts, reports, your own) consume them without ever blocking the
training loop.
"""

from __future__ import annotations

from ._bus import BusStatistics, EventBus, Subscription, SubscriptionStatistics
from ._sync import SyncEventBus
from .encoding import decode_event, encode_event
from .events import (
    Anomaly,
    Delivery,
    Event,
    EventsDropped,
    EventsUndelivered,
    SessionEnded,
    SessionStarted,
    Severity,
    SinkDisabled,
    SinkFailed,
    StepCompleted,
    current_rank,
    event_type,
    event_types,
    refresh_rank,
)
from .exceptions import (
    BusClosedError,
    EventBusError,
    EventDecodeError,
    LogReadError,
    SubscriptionError,
    TrainingStopped,
)
from .logfile import LOG_SUFFIX, log_file_name, log_files, read_events
from .typing import BatchSink, Handler, Sink

# Feature packages re-export their public names here; each owns its own __all__, so adding a
# feature never means editing this file.
from . import probes as probes, recovery as recovery, session as _session_mod
from .probes import *  # noqa: F403
from .recovery import *  # noqa: F403
from .session import *  # noqa: F403

__version__ = "0.1.0"

_CORE = (
    "LOG_SUFFIX",
    "Anomaly",
    "BatchSink",
    "BusClosedError",
    "BusStatistics",
    "Delivery",
    "Event",
    "EventBus",
    "EventBusError",
    "EventDecodeError",
    "EventsDropped",
    "EventsUndelivered",
    "Handler",
    "LogReadError",
    "SessionEnded",
    "SessionStarted",
    "Severity",
    "Sink",
    "SinkDisabled",
    "SinkFailed",
    "StepCompleted",
    "Subscription",
    "SubscriptionError",
    "SubscriptionStatistics",
    "SyncEventBus",
    "TrainingStopped",
    "current_rank",
    "decode_event",
    "encode_event",
    "event_type",
    "event_types",
    "log_file_name",
    "log_files",
    "read_events",
    "refresh_rank",
)

__all__ = (*_CORE, *probes.__all__, *recovery.__all__, *_session_mod.__all__)  # noqa: PLE0604
