"""The library's own diagnostics: standard :mod:`logging` under the ``eventbus_debug`` logger.

Every module gets its logger from :func:`get_logger`: a structlog bound logger (keyword fields,
as the code base writes them) wrapped around the stdlib logger of the same name, so the
application decides everything with the ordinary machinery::

    logging.basicConfig(level=logging.INFO)                 # show them
    logging.getLogger("eventbus_debug").setLevel("WARNING")  # only warnings and errors

The rules (DESIGN.md, decision 9):

- nothing is configured globally: no ``structlog.configure()``, no handler besides the
  :class:`logging.NullHandler` on the package logger (the stdlib convention for libraries), so
  the library is silent until the application configures logging, and never writes to stdout;
- a disabled level costs one ``isEnabledFor`` call, before any field is rendered;
- a log line can never raise into training: rendering errors are swallowed here, and the
  handlers' own I/O errors (a closed pipe, a full disk) go to :meth:`logging.Handler.handleError`
  as with any stdlib logging call.

A record's message is ``"event key=value ..."``; the fields also travel unrendered on the
record as ``record.eventbus_debug`` (a dict), for structured handlers.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, MutableMapping
from typing import Any, Final

import structlog

__all__ = ("LOGGER_NAME", "get_logger")

LOGGER_NAME: Final = "eventbus_debug"
"""The root of the library's logger hierarchy."""

_MAX_VALUE: Final = 200

logging.getLogger(LOGGER_NAME).addHandler(logging.NullHandler())

_LEVELS: Final[Mapping[str, int]] = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "warn": logging.WARNING,
    "error": logging.ERROR,
    "exception": logging.ERROR,
    "critical": logging.CRITICAL,
    "fatal": logging.CRITICAL,
}


def _text(value: Any) -> str:
    """A readable form of one field value: short floats, enum values, no reprs of tuples."""
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    if isinstance(value, str):
        text = value
    elif isinstance(value, (tuple, list, set, frozenset)):
        text = ",".join(_text(v) for v in value)
    elif hasattr(value, "value") and hasattr(type(value), "__members__"):  # an enum member
        text = str(value.value)
    else:
        try:
            text = str(value)
        except Exception:  # that value alone is left out of the line, never the line
            text = f"<unprintable {type(value).__name__}>"
    text = text.replace("\n", " | ")
    if len(text) > _MAX_VALUE:
        text = text[: _MAX_VALUE - 1] + "…"
    if not text or any(c.isspace() for c in text):
        text = '"' + text.replace('"', '\\"') + '"'
    return text


def _to_stdlib(
    _logger: Any, _method: str, event_dict: MutableMapping[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The last processor: the positional and keyword arguments of the stdlib logging call."""
    event = event_dict.pop("event", "")
    exc_info = event_dict.pop("exc_info", None)
    fields = " ".join(f"{k}={_text(v)}" for k, v in event_dict.items())
    message = f"{event} {fields}" if fields else str(event)
    kwargs: dict[str, Any] = {"extra": {LOGGER_NAME: dict(event_dict)}}
    if exc_info:
        kwargs["exc_info"] = exc_info
    return (message,), kwargs


_PROCESSORS: Final = (structlog.stdlib.PositionalArgumentsFormatter(), _to_stdlib)


class _SafeBoundLogger(structlog.stdlib.BoundLogger):
    """A stdlib bound logger that checks the level first and never raises from a log call."""

    def _proxy_to_logger(
        self, method_name: str, event: str | None = None, *event_args: Any, **event_kw: Any
    ) -> Any:
        try:
            level = _LEVELS.get(method_name, logging.INFO)
            logger: logging.Logger = self._logger
            if not logger.isEnabledFor(level):
                return None
            if method_name == "exception":
                event_kw.setdefault("exc_info", True)
            if event_args:
                event_kw["positional_args"] = event_args
            args, kwargs = self._process_event(method_name, event, event_kw)
            # 1: this frame, 2: BoundLogger.info & co., 3: the library code that logged.
            logger.log(level, *args, stacklevel=3, **kwargs)
        except Exception:  # a diagnostic must never break training
            return None
        return None


def get_logger(name: str = LOGGER_NAME) -> structlog.stdlib.BoundLogger:
    """The library logger for module *name* (pass ``__name__``), silent until logging is configured.

    Names outside the ``eventbus_debug`` hierarchy are placed under it (``sinks.console`` logs
    as ``eventbus_debug.sinks.console``), so one ``logging.getLogger("eventbus_debug")`` governs
    every line the library writes.

    Raises:
        TypeError: if *name* is not a non-empty string.
    """
    if not isinstance(name, str) or not name:
        msg = f"logger name must be a non-empty string, got {name!r}"
        raise TypeError(msg)
    if name != LOGGER_NAME and not name.startswith(LOGGER_NAME + "."):
        name = f"{LOGGER_NAME}.{name}"
    # Built directly (not through structlog.get_logger / wrap_logger's lazy proxy), so no
    # application structlog.configure() can change where the library's lines go.
    return _SafeBoundLogger(logging.getLogger(name), _PROCESSORS, {})
