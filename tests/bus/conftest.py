"""Fixtures of the bus tests."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

RELEASE_S = 30.0
"""When the watchdog releases the hung sinks (far beyond any bound the bus may take). Each
test releases them itself once the bus is closed: the event loop's own shutdown (the end of
``anyio.run``) waits for the tasks still running, the abandoned ones included."""


@pytest.fixture(name="release")
def _release() -> Iterator[threading.Event]:
    """Set by a watchdog after RELEASE_S, and at the end of the test: a hung sink waits on it,
    so a bus that waited for the sink fails its bound instead of hanging the suite."""
    released = threading.Event()
    watchdog = threading.Timer(RELEASE_S, released.set)
    watchdog.daemon = True
    watchdog.start()
    yield released
    released.set()
    watchdog.cancel()
