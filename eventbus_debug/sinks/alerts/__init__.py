"""Alerts: rules that pick events, handlers that tell someone, cooldowns that keep it sane.

- :mod:`.alert`: :class:`AlertRule`, :class:`Alert`, :class:`AlertHandlerFailed`;
- :mod:`.sink`: :class:`AlertSink` (cooldown, dedup, rate limit, bounded handlers);
- :mod:`.handlers`: :class:`LogAlert`, :class:`StderrAlert`, :class:`FileAlert`,
  :class:`WebhookAlert`;
- :mod:`.rules`: the ready rules (``rules.non_finite()``, ``rules.memory_above(90)``...).
"""

from __future__ import annotations

from .alert import (
    Alert as Alert,
    AlertHandler as AlertHandler,
    AlertHandlerFailed as AlertHandlerFailed,
    AlertRule as AlertRule,
    alert_to_dict as alert_to_dict,
)
from .handlers import (
    FileAlert as FileAlert,
    LogAlert as LogAlert,
    StderrAlert as StderrAlert,
    WebhookAlert as WebhookAlert,
)
from .rules import rules as rules
from .sink import AlertSink as AlertSink, AlertStatistics as AlertStatistics

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
