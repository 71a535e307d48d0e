"""Report a retried call's error to the engine and wait for the decisions taken about it.

The error is published as an :class:`~eventbus_debug.events.ErrorRaised` tagged with a fresh
``retry_id`` and the call's typed :class:`~eventbus_debug.events.CallSettings`; once the engine
handled it, the decisions filed under that id are the call's (never a safe point's).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Protocol

from ..events import ErrorRaised
from ..events.recovery import CallSettings
from .actions import DecidedAction
from .engine import RecoveryEngine


class CallStateLike(Protocol):
    """What holds a retried call's settings (a :class:`~eventbus_debug.recovery.CallState`):
    its :meth:`settings` as :class:`ErrorRaised` records them."""

    def settings(self) -> CallSettings: ...


__all__ = ("CallStateLike", "ErrorContext", "error_context", "report_error", "report_error_sync")


ErrorContext = str | Mapping[str, object] | None
"""What the caller says about the failed call: a description (the seeds' ``context="train_step"``),
or a mapping of names to values (``{"batch": 3, "phase": "train"}``)."""


def error_context(context: object, /) -> dict[str, str]:
    """*context* as :class:`ErrorRaised` holds it: a dict of strings.

    A string becomes ``{"context": text}`` (nothing for ``""``), as the seeds'
    ``ErrorHandler.handle_error(error, "train_step")`` passed it; a mapping keeps its keys and
    turns each value into ``str(value)`` (``{"batch": 3}`` -> ``{"batch": "3"}``), as
    :class:`~eventbus_debug.compat.ErrorHandler` does; ``None`` is no context.

    Raises:
        TypeError: if *context* is neither, or a key is not a string (the message names
            ``context``).
    """
    if context is None:
        return {}
    if isinstance(context, str):
        return {"context": context} if context else {}
    if not isinstance(context, Mapping):
        msg = (
            "context must be a str (a description of the call) or a mapping of str keys to "
            f"values, got {type(context).__name__} {context!r}"
        )
        raise TypeError(msg)
    out: dict[str, str] = {}
    for key, value in context.items():
        if not isinstance(key, str):
            msg = f"context keys must be str, got {type(key).__name__} {key!r}"
            raise TypeError(msg)
        out[key] = value if isinstance(value, str) else str(value)
    return out


def _call_settings(settings: object, /) -> CallSettings | None:
    """*settings* as :class:`ErrorRaised` holds it: a :class:`CallSettings` or ``None``.

    A :class:`~eventbus_debug.recovery.CallState` (what :func:`retrying` and the seeds'
    ``ErrorHandler`` keep) is taken as its :meth:`~eventbus_debug.recovery.CallState.settings`.

    Raises:
        TypeError: if *settings* is neither (the message names ``settings``).
    """
    if settings is None or isinstance(settings, CallSettings):
        return settings
    read = getattr(settings, "settings", None)  # a CallState (retry imports this module)
    if callable(read):
        held = read()
        if isinstance(held, CallSettings):
            return held
    msg = (
        "settings must be a CallSettings, a CallState or None, got "
        f"{type(settings).__name__} {settings!r}"
    )
    raise TypeError(msg)


def _tagged(
    engine: RecoveryEngine,
    exc: BaseException,
    settings: CallSettings | CallStateLike | None,
    context: ErrorContext,
    attempt: int,
    step: int | None,
) -> ErrorRaised:
    return engine.error_event(
        exc,
        attempt=attempt,
        context=error_context(context),
        settings=_call_settings(settings),
        retry_id=uuid.uuid4().hex,
        step=step,
    )


async def report_error(
    engine: RecoveryEngine,
    exc: BaseException,
    *,
    settings: CallSettings | CallStateLike | None = None,
    context: ErrorContext = None,
    attempt: int = 1,
    step: int | None = None,
) -> tuple[DecidedAction, ...]:
    """Publish *exc* as an :class:`ErrorRaised`, wait for *engine*, return its decisions.

    The async counterpart of the seeds' ``ErrorHandler.handle_error(error, context)``; the
    caller applies the decisions (or use :func:`~eventbus_debug.recovery.retrying`).

    *context* is a string (``"train_step"``, recorded as ``{"context": "train_step"}``) or a
    mapping whose values are recorded as strings (``{"batch": 3}`` -> ``{"batch": "3"}``);
    see :func:`error_context`. *settings* is a :class:`CallSettings` or the
    :class:`~eventbus_debug.recovery.CallState` the call ran with.

    Raises:
        TypeError: if the engine is on a :class:`~eventbus_debug.SyncEventBus` (use
            :func:`report_error_sync`), *context* is neither a str nor a mapping with str
            keys, or *settings* is neither a ``CallSettings``, a ``CallState`` nor ``None``
            (the message names the argument).
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
    settings: CallSettings | CallStateLike | None = None,
    context: ErrorContext = None,
    attempt: int = 1,
    step: int | None = None,
) -> tuple[DecidedAction, ...]:
    """:func:`report_error` for an engine on a :class:`~eventbus_debug.SyncEventBus` (blocks).

    Raises:
        TypeError: if the engine is on an async :class:`~eventbus_debug.EventBus`, *context*
            is neither a str nor a mapping with str keys, or *settings* is neither a
            ``CallSettings``, a ``CallState`` nor ``None``.
        TimeoutError: if the engine does not answer within its ``drain_timeout``.
    """
    if not engine.blocking:
        msg = "report_error_sync() needs an engine on a SyncEventBus; this one uses an EventBus: await report_error()"
        raise TypeError(msg)
    event = _tagged(engine, exc, settings, context, attempt, step)
    engine.bus.publish_nowait(event)
    engine.drain_sync()
    return engine.take_call_decisions(event.retry_id)
