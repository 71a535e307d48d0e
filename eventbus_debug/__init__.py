"""eventbus-debug: debug PyTorch training without slowing it down.

Probes publish typed events onto an async :class:`EventBus`; independent sinks (a rotating
JSON-lines log, recovery, alerts, reports, your own) consume them without ever blocking the
training loop.
"""

from __future__ import annotations

# Feature packages re-export their public names here; each owns its own __all__, so adding a
# feature never means editing this file.
from . import probes as probes, recovery as recovery, session as _session_mod
from ._bus import (
    BusStatistics as BusStatistics,
    EventBus as EventBus,
    Subscription as Subscription,
    SubscriptionStatistics as SubscriptionStatistics,
)
from ._sync import (
    SyncEventBus as SyncEventBus,
)
from .encoding import (
    decode_event as decode_event,
    encode_event as encode_event,
    encode_events as encode_events,
)
from .events import (
    Anomaly as Anomaly,
    Delivery as Delivery,
    Event as Event,
    EventsDropped as EventsDropped,
    EventsUndelivered as EventsUndelivered,
    SessionEnded as SessionEnded,
    SessionStarted as SessionStarted,
    Severity as Severity,
    SinkDisabled as SinkDisabled,
    SinkFailed as SinkFailed,
    StepCompleted as StepCompleted,
    current_rank as current_rank,
    event_type as event_type,
    event_types as event_types,
    refresh_rank as refresh_rank,
)
from .exceptions import (
    BusClosedError as BusClosedError,
    EventBusError as EventBusError,
    EventDecodeError as EventDecodeError,
    LogReadError as LogReadError,
    SubscriptionError as SubscriptionError,
    TrainingStopped as TrainingStopped,
)
from .logfile import (
    LOG_SUFFIX as LOG_SUFFIX,
    log_file_name as log_file_name,
    log_files as log_files,
    read_events as read_events,
)
from .probes import *  # noqa: F403
from .recovery import *  # noqa: F403
from .session import *  # noqa: F403
from .step_context import (
    current_step as current_step,
    step_source as step_source,
)
from .typing import (
    BatchSink as BatchSink,
    Handler as Handler,
    Sink as Sink,
)

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
    "encode_events",
    "event_type",
    "event_types",
    "log_file_name",
    "log_files",
    "read_events",
    "refresh_rank",
    "current_step",
    "step_source",
)

__all__ = (*_CORE, *probes.__all__, *recovery.__all__, *_session_mod.__all__)
