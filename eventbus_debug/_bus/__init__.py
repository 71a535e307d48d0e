"""The bus: subscriptions with bounded queues, the dispatcher, and the blocking twin.

:class:`EventBus` is the async bus; :class:`SyncEventBus` runs one on a background thread for
plain ``for`` loops. Both satisfy :class:`~eventbus_debug.typing.Publisher`.

Modules: ``bus`` (the dispatcher, publishing, drain and close), ``subscription`` (one sink's
queue, pump and failures), ``statistics`` (the snapshots), ``_adapter`` (a sink's methods,
resolved once), ``_cancel`` (a sink's own cancellation told from its task's; sink code the bus
can stop waiting for), ``_waiters`` (one-shot wake-ups) and ``sync`` (the only sync bridge).
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
