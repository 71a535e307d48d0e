"""Sessions sharing one bus (``bus=``): each session's own recovery engine acts on its own
session's incidents, not on another session's (a GAN's generator and discriminator, two
models trained side by side).

A session's events carry sources under its name (``"<name>.step_probe"``, ``"<name>.amp"``);
an incident belongs to the running session on the same bus whose name is the longest such
prefix of its source. Incidents of no session (a user's own checks, a retried call's error)
stay everyone's, as on a bus with one session.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

from .._bus import SyncEventBus
from ..events import Anomaly
from ..exceptions import SubscriptionError

__all__ = ("host", "join", "leave")

_lock = threading.Lock()
_names: weakref.WeakKeyDictionary[object, list[str]] = weakref.WeakKeyDictionary()
"""The names of the sessions running on each bus (each name once: :func:`join` refuses a
second session of a name on a bus)."""


def host(bus: object) -> object:
    """The event loop's bus behind *bus*: a ``SyncEventBus`` and the ``EventBus`` it runs are
    one bus."""
    return bus.bus if isinstance(bus, SyncEventBus) else bus


def join(bus: object, name: str) -> Callable[[Anomaly], bool]:
    """Count session *name* as running on *bus*; returns the test of an incident that belongs
    to another session running on it (the one :meth:`RecoveryEngine.ignore` takes).

    Raises:
        SubscriptionError: if a session of that name runs on *bus* already (both would take
            each other's incidents for their own: each engine would skip, restore or retune its
            model for the other model's faults).
    """
    key = host(bus)
    with _lock:
        names = _names.setdefault(key, [])
        if name in names:
            msg = (
                f"a session named {name!r} is already running on this bus; give each session "
                f"sharing a bus its own name (Session(..., bus=bus, name='generator'))"
            )
            raise SubscriptionError(msg)
        names.append(name)

    def elsewhere(incident: Anomaly) -> bool:
        source = incident.source
        with _lock:
            names = list(_names.get(key, ()))
        owners = [n for n in names if source == n or source.startswith(n + ".")]
        return bool(owners) and max(owners, key=len) != name

    return elsewhere


def leave(bus: object, name: str) -> None:
    """Session *name* no longer runs on *bus* (idempotent per :func:`join`)."""
    key = host(bus)
    with _lock:
        names = _names.get(key)
        if names is not None and name in names:
            names.remove(name)
