"""The bus: subscriptions with bounded queues, the dispatcher, and the blocking twin.

:class:`EventBus` is the async bus; :class:`SyncEventBus` runs one on a background thread for
plain ``for`` loops. Both satisfy :class:`~eventbus_debug.typing.Publisher`.
"""

from __future__ import annotations

from .bus import (
    BusStatistics as BusStatistics,
    EventBus as EventBus,
    Subscription as Subscription,
    SubscriptionStatistics as SubscriptionStatistics,
)
from .sync import SyncEventBus as SyncEventBus

__all__ = ("BusStatistics", "EventBus", "Subscription", "SubscriptionStatistics", "SyncEventBus")
