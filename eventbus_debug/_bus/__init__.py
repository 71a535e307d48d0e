"""The bus: subscriptions with bounded queues, the dispatcher, and the blocking twin.

:class:`EventBus` is the async bus; :class:`SyncEventBus` runs one on a background thread for
plain ``for`` loops. Both satisfy :class:`~eventbus_debug.typing.Publisher`.

Modules, bottom up: ``statistics`` (the snapshots), ``_adapter`` (a sink's methods, resolved
once), ``_cancel`` (a sink's own cancellation told from its task's; sink code the bus can stop
waiting for), ``_stalls`` (how long a sink holds the event loop), ``_waiters`` (one-shot
wake-ups); one subscription in layers: ``_queue`` (its bounded queue, shedding and flow
control), ``_pump`` (its task, failures and stalls), ``subscription`` (``Subscription``: its
public face and its leaving the bus); the bus in layers: ``_dispatch`` (routing and the
dispatcher), ``_publish`` (the ``publish*`` methods), ``_drain`` (``drain`` and the bounded
close), ``bus`` (``EventBus``: constructor, ``async with``, ``subscribe``); and ``sync`` (the
only sync bridge).
"""

from __future__ import annotations

from .bus import EventBus as EventBus
from .statistics import (
    BusStatistics as BusStatistics,
    SubscriptionStatistics as SubscriptionStatistics,
)
from .subscription import Subscription as Subscription
from .sync import SyncEventBus as SyncEventBus

__all__ = ("BusStatistics", "EventBus", "Subscription", "SubscriptionStatistics", "SyncEventBus")
