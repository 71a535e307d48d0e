"""Cancellation, as the bus needs it around code it does not control (the sinks).

Two problems, one module. A sink may *raise* the event loop's cancellation exception without
its task being cancelled (it awaited a future that something else cancelled): that is the
sink's failure, not a request to stop delivering. And a sink may *ignore* a cancellation (it
shields itself, swallows the exception, or waits on a thread that cannot be interrupted): then
whoever waits for it must be able to stop waiting. On asyncio the bus therefore runs a sink's
code in tasks of their own that it never has to join (see :func:`run_abandonable`), and cancels them once, not at every await of theirs (a sink that
swallows one cancellation is left to finish in the background instead of being cancelled
again at each await, which would spin the event loop).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Coroutine
from typing import Any, Final, TypeVar

import anyio

from ..diagnostics import get_logger
from ..threads import running_loop

__all__ = (
    "FOREIGN_CANCELLATION_DETECTED",
    "abandon",
    "foreign_cancellation",
    "retrieved",
    "run_abandonable",
)

T = TypeVar("T")

_log = get_logger(__name__)

FOREIGN_CANCELLATION_DETECTED: Final = sys.version_info >= (3, 11)
"""Whether a cancellation exception raised by a sink can be told from a cancellation of its
task (``asyncio.Task.cancelling``, Python 3.11+). On 3.10 every one is taken as a real
cancellation of the task."""

_LEFT_BEHIND: set[asyncio.Task[Any]] = set()
"""Abandoned tasks, kept alive until they end (the event loop holds its tasks weakly)."""


def foreign_cancellation() -> bool:
    """Whether the cancellation exception being handled was raised by code the task ran (it
    awaited something another task cancelled) rather than delivered to the task.

    True only on asyncio with Python 3.11+ when nothing requested the current task's
    cancellation (``cancelling() == 0``; a cancel scope, anyio's included, cancels its tasks
    through ``Task.cancel``). Elsewhere False: on trio a ``Cancelled`` cannot be raised by user
    code, and on 3.10 the two cannot be told apart, so the exception is taken as a real
    cancellation (never swallowed).
    """
    if not FOREIGN_CANCELLATION_DETECTED or running_loop() is None:
        return False
    task = asyncio.current_task()
    return task is not None and task.cancelling() == 0


def abandon(task: asyncio.Task[Any]) -> None:
    """Cancel *task* once and stop caring: it is kept alive until it ends, and what it ends
    with (a late exception included) is only logged at debug level."""
    task.cancel()
    if task.done():
        _forget(task)
    else:
        _LEFT_BEHIND.add(task)
        task.add_done_callback(_forget)


def retrieved(task: asyncio.Task[Any]) -> None:
    """A done callback: mark *task*'s outcome as seen. A sink's ``KeyboardInterrupt`` or
    ``SystemExit`` leaves the event loop by itself; asyncio would also log the task's
    "exception was never retrieved" at exit."""
    if not task.cancelled():
        task.exception()


def _forget(task: asyncio.Task[Any]) -> None:
    _LEFT_BEHIND.discard(task)
    if not task.cancelled() and task.exception() is not None:
        _log.debug("abandoned_task_failed", task=task.get_name(), error=repr(task.exception()))


async def run_abandonable(fn: Callable[[], Coroutine[Any, Any, T]], name: str) -> T:
    """``await fn()``; if the caller is cancelled meanwhile, it stops waiting at once.

    On asyncio ``fn()`` runs in a task of its own: a cancelled caller cancels that task once
    and abandons it (:func:`abandon`), so a coroutine that shields itself or swallows the
    cancellation cannot hold the caller. On another backend it is awaited inline.

    Raises:
        whatever ``fn()`` raises; the cancellation exception when ``fn()`` ended cancelled
        although the caller was not (it raised the cancellation exception itself).
    """
    loop = running_loop()
    if loop is None:
        return await fn()
    task = loop.create_task(fn(), name=name)
    ended = anyio.Event()
    task.add_done_callback(lambda _: ended.set())
    try:
        await ended.wait()
    except BaseException:  # the caller is cancelled (or interrupted): stop waiting
        abandon(task)
        raise
    return task.result()
