"""Every error eventbus_debug raises derives from :class:`EventBusError`."""

from __future__ import annotations

__all__ = (
    "ArgumentTypeError",
    "BusClosedError",
    "EventBusError",
    "EventDecodeError",
    "LogReadError",
    "SubscriptionError",
    "TrainingStopped",
    "UnknownEventKindError",
)


class EventBusError(Exception):
    """Base class for every error raised by eventbus_debug."""


class ArgumentTypeError(EventBusError, TypeError, ValueError):
    """Raised when an argument is not of the type it must be (a string where a number goes).

    A :class:`TypeError`, as Python's own wrong-type errors are. It is also a
    :class:`ValueError` because earlier releases raised ``ValueError`` for these (the number
    checks refused a string like a negative number): code written to catch ``ValueError``
    around a constructor still catches it.
    """


class BusClosedError(EventBusError, RuntimeError):
    """Raised by the publish operations after the bus has been closed (or before it started)."""


class SubscriptionError(EventBusError, TypeError):
    """Raised by ``subscribe`` when the sink, the event types or the options are not usable."""


class EventDecodeError(EventBusError, ValueError):
    """Raised when a log line cannot be decoded into a typed event (unknown kind, bad fields)."""


class UnknownEventKindError(EventDecodeError):
    """Raised when a log line's ``kind`` names no registered event type.

    Your own ``@event_type`` classes are registered when the module that defines them is
    imported: import it before reading the log (the command line: ``--import MODULE``).
    """


class LogReadError(EventBusError, OSError):
    """Raised by :func:`~eventbus_debug.read_events` when a path holds no readable log."""


class TrainingStopped(EventBusError):
    """Raised at a safe point when recovery decided that training must stop.

    The debugger never ends training from inside a sink; the training loop receives this at the
    next step boundary it awaits, with the decision's reason as the message.
    """
