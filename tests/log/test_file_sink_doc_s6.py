"""RotatingFileSink's docstring states its wake_interval default as it is (0.2 s)."""

from __future__ import annotations

import inspect

from eventbus_debug.sinks import RotatingFileSink
from eventbus_debug.sinks.rotating_file import DEFAULT_WAKE_INTERVAL


def test_wake_interval_default_is_documented_as_it_is() -> None:
    """The signature's default, the constant and the docstring agree: 0.2 s, not 0."""
    default = inspect.signature(RotatingFileSink).parameters["wake_interval"].default
    assert default == DEFAULT_WAKE_INTERVAL == 0.2
    doc = RotatingFileSink.__doc__ or ""
    entry = doc[doc.index("wake_interval:") : doc.index("high_water:")]
    assert "(default ``0.2``)" in entry
    assert "``0`` (default)" not in entry
