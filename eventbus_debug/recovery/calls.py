"""Report a retried call's error to the engine and wait for the decisions taken about it.

The error is published as an :class:`~eventbus_debug.events.ErrorRaised` tagged with a fresh
``retry_id`` and the call's typed :class:`~eventbus_debug.events.CallSettings`; once the engine
handled it, the decisions filed under that id are the call's (never a safe point's).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping

from ..events import ErrorRaised
from ..events.recovery import CallSettings
from .actions import DecidedAction
from .engine import RecoveryEngine

__all__ = ("report_error", "report_error_sync")


def _tagged(
    engine: RecoveryEngine,
    exc: BaseException,
    settings: CallSettings | None,
    context: Mapping[str, str] | None,
    attempt: int,
    step: int | None,
) -> ErrorRaised:
    return engine.error_event(
        exc,
        attempt=attempt,
        context=context,
        settings=settings,
        retry_id=uuid.uuid4().hex,
        step=step,
    )


async def report_error(
    engine: RecoveryEngine,
    exc: BaseException,
    *,
    settings: CallSettings | None = None,
    context: Mapping[str, str] | None = None,
    attempt: int = 1,
    step: int | None = None,
) -> tuple[DecidedAction, ...]:
    """Publish *exc* as an :class:`ErrorRaised`, wait for *engine*, return its decisions.

    The async counterpart of the seeds' ``ErrorHandler.handle_error(error, context)``; the
    caller applies the decisions (or use :func:`~eventbus_debug.recovery.retrying`).

    Raises:
        TypeError: if the engine is on a :class:`~eventbus_debug.SyncEventBus` (use
            :func:`report_error_sync`).
        TimeoutError: if the engine does not answer within its ``drain_timeout``.
    """
    if engine.blocking:
        msg = "report_error() needs an engine on an EventBus; this one uses a SyncEventBus: call report_error_sync()"
        raise TypeError(msg)
    event = _tagged(engine, exc, settings, context, attempt, step)
    engine.bus.publish_nowait(event)
    await engine.drain()
    return engine.take_call_decisions(event.retry_id)


def report_error_sync(
    engine: RecoveryEngine,
    exc: BaseException,
    *,
    settings: CallSettings | None = None,
    context: Mapping[str, str] | None = None,
    attempt: int = 1,
    step: int | None = None,
) -> tuple[DecidedAction, ...]:
    """:func:`report_error` for an engine on a :class:`~eventbus_debug.SyncEventBus` (blocks).

    Raises:
        TypeError: if the engine is on an async :class:`~eventbus_debug.EventBus`.
        TimeoutError: if the engine does not answer within its ``drain_timeout``.
    """
    if not engine.blocking:
        msg = "report_error_sync() needs an engine on a SyncEventBus; this one uses an EventBus: await report_error()"
        raise TypeError(msg)
    event = _tagged(engine, exc, settings, context, attempt, step)
    engine.bus.publish_nowait(event)
    engine.drain_sync()
    return engine.take_call_decisions(event.retry_id)
