"""The sinks' own event kinds, in a module light enough to import whenever the sinks are.

Importing :mod:`eventbus_debug.sinks` registers them, so a log written with alerts on can be
read back by anything that imported the sinks (``eventbus-debug summary`` among them).
"""

from __future__ import annotations

from typing import ClassVar

from eventbus_debug.events import Event, Severity, event_type

__all__ = ("AlertHandlerFailed",)


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
