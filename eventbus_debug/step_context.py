"""The ambient training step: what events published outside the step probe are stamped with.

A session binds its step (``lambda: session.step``) for the code that runs inside it, so a
retried call (:func:`~eventbus_debug.recovery.retrying`) or a skipped sample
(:func:`~eventbus_debug.recovery.skip_corrupt_samples`) publishes its events with the step the
session is at, without being handed the session. The binding is a :mod:`contextvars` variable:
tasks started inside the session, and the thread that entered a
:class:`~eventbus_debug.SyncSession`, see it; other threads and processes do not.

Loops without a session bind their own counter::

    with step_source(lambda: step):
        for step, batch in enumerate(loader):
            ...
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

__all__ = ("StepSource", "bind_step_source", "current_step", "step_source")

StepSource = Callable[[], "int | None"]
"""Returns the current training step (``None`` before the first one)."""

_SOURCE: contextvars.ContextVar[StepSource | None] = contextvars.ContextVar(
    "eventbus_debug_step_source", default=None
)


def current_step(source: StepSource | None = None) -> int | None:
    """The step from *source* when given, else from the bound source, else ``None``.

    A source that raises or returns something else than an int (or ``None``) gives ``None``:
    stamping an event must never fail the code that publishes it.
    """
    fn = source if source is not None else _SOURCE.get()
    if fn is None:
        return None
    try:
        value = fn()
    except Exception:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value


def _check(source: object) -> StepSource:
    if not callable(source):
        msg = f"a step source must be a callable returning the current step, got {source!r}"
        raise TypeError(msg)
    return source


def bind_step_source(source: StepSource) -> Callable[[], None]:
    """Bind *source* in the current context; returns the function that unbinds it.

    For objects with separate enter and exit methods (a session); prefer :func:`step_source`.

    Raises:
        TypeError: if *source* is not callable.
    """
    token = _SOURCE.set(_check(source))
    previous = token.old_value

    def unbind() -> None:
        try:
            _SOURCE.reset(token)
        except ValueError:  # exited from another context than it was entered in
            _SOURCE.set(None if previous is contextvars.Token.MISSING else previous)

    return unbind


@contextlib.contextmanager
def step_source(source: StepSource) -> Iterator[None]:
    """Bind *source* as the current step for the block.

    Raises:
        TypeError: if *source* is not callable.
    """
    unbind = bind_step_source(source)
    try:
        yield
    finally:
        unbind()
