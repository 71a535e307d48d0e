"""The console's line for an event, and whether a stream gets colours.

The words are :mod:`eventbus_debug.events.describe`'s (one description per event, shared with
``eventbus-debug tail`` and the report); this module re-exports them under the names the sinks
have always used and adds :func:`use_colors`, the terminal question that only sinks ask.
"""

from __future__ import annotations

import os

from eventbus_debug.events.describe import (
    describe as describe,
    format_clock as format_clock,
    format_value as format_value,
    terminal_line as format_event,
)

__all__ = ("describe", "format_clock", "format_event", "format_value", "use_colors")


def use_colors(stream: object) -> bool:
    """Whether to colour lines for *stream*: a terminal, unless ``NO_COLOR`` is set."""
    if os.environ.get("NO_COLOR"):
        return False
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except (OSError, ValueError):  # a closed stream
        return False
