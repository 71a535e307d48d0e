"""The seeds' names over the recovery engine: ``ErrorHandler`` and ``DebugDecorator``.

They keep the seeds' call shapes (``success, result = handler.handle_error(error, context,
max_retries)``, ``@DebugDecorator(handler, max_retries=3)``) with the engine's behaviour: each
error is published as an :class:`~eventbus_debug.recovery.ErrorRaised`, the strategies decide,
and the decision changes the handler's :class:`~eventbus_debug.recovery.CallState`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final, TypeVar, final

from .._validate import non_negative_int
from ..events import RecoveryAction
from ..recovery.actions import DecidedAction
from ..recovery.calls import error_context, report_error, report_error_sync
from ..recovery.engine import RecoveryEngine
from ..recovery.registry import Trigger
from ..recovery.retry import CallState, Retrying, _decorate, _RetryRequested
from ..recovery.strategies import Strategy, StrategyFunction

__all__ = ("DebugDecorator", "ErrorHandler", "HandledError")

F = TypeVar("F", bound=Callable[..., Any])

DEFAULT_MAX_RETRIES: Final = 3


@dataclass(frozen=True, slots=True, kw_only=True)
class HandledError:
    """What :meth:`ErrorHandler.handle_error` decided; unpacks as ``(recovered, detail)``.

    Attributes:
        recovered: True when a strategy decided a retry and it was applied to the state: run
            the failed call again (with ``handler.state``).
        detail: what was changed, or why nothing was.
        actions: the actions decided.
        attempt: which failure of this context it was (1 for the first).
        stop: True when recovery decided to stop (strategies exhausted).
    """

    recovered: bool
    detail: str
    actions: tuple[RecoveryAction, ...] = ()
    attempt: int = 1
    stop: bool = False

    def __iter__(self) -> Iterator[object]:
        yield self.recovered
        yield self.detail


def _context(context: str | Mapping[str, str] | None) -> dict[str, str]:
    """*context* as the engine records it; checked like :func:`report_error`'s.

    Raises:
        TypeError: if *context* is neither a str, a mapping with str keys nor ``None`` (the
            message names ``context``), before anything is counted or published.
    """
    return error_context(context)


@final
class ErrorHandler:
    """The seeds' ``ErrorHandler``: report an error, let the engine decide, apply it.

    Example::

        handler = ErrorHandler(engine, state=CallState(batch_size=64))
        try:
            run(handler.state.batch_size)
        except Exception as exc:
            recovered, detail = handler.handle_error(exc, context="train_step")

    Args:
        engine: the recovery engine.
        state: the settings recovery changes (a new :class:`CallState` if ``None``).
        max_retries: the default bound of :meth:`handle_error` per context.

    Raises:
        TypeError: if *engine* is not a :class:`RecoveryEngine`.
        ValueError: if *max_retries* < 0.
    """

    def __init__(
        self,
        engine: RecoveryEngine,
        *,
        state: CallState | None = None,
        max_retries: int = DEFAULT_MAX_RETRIES,
    ) -> None:
        if not isinstance(engine, RecoveryEngine):
            msg = f"engine must be a RecoveryEngine, got {engine!r}"
            raise TypeError(msg)
        non_negative_int("max_retries", max_retries)
        self.engine = engine
        self.max_retries = max_retries
        self._policy = Retrying(engine, state=state)
        self._attempts: dict[str, int] = {}

    @property
    def state(self) -> CallState:
        """The settings the failed code should run with next (``state.batch_size``...)."""
        return self._policy.state

    def register_recovery_strategy(
        self,
        on: Trigger | tuple[Trigger, ...],
        strategy: Strategy | StrategyFunction,
        *,
        max_attempts: int | None = None,
    ) -> None:
        """The seeds' ``register_recovery_strategy("CUDA out of memory", fn)``.

        *strategy* has the engine's shape ``fn(incident, history) -> Decision | None``.

        Raises:
            TypeError, ValueError: as :meth:`RecoveryEngine.register`.
        """
        self.engine.register(strategy, on=on, max_attempts=max_attempts)

    def handle_error(
        self,
        error: Exception,
        context: str | Mapping[str, str] | None = None,
        max_retries: int | None = None,
    ) -> HandledError:
        """Publish *error*, wait for the engine's decision, apply it to :attr:`state`.

        For an engine on a :class:`~eventbus_debug.SyncEventBus` (use :meth:`ahandle_error`
        with an ``EventBus``). Once *context* failed more than *max_retries* times the error is
        still published, but nothing is applied and ``recovered`` is False; :meth:`reset`
        clears the count (call it when the call succeeds).

        Raises:
            TypeError: if the engine is on an async ``EventBus``, or *context* is neither a
                str, a mapping with str keys nor ``None``.
            ValueError: if *max_retries* < 0.
            TimeoutError: if the engine does not answer within its ``drain_timeout``.
        """
        ctx, attempt, limit = self._begin(context, max_retries)
        decided = report_error_sync(
            self.engine, error, settings=self.state.settings(), context=ctx, attempt=attempt
        )
        return self._finish(error, decided, attempt, limit)

    async def ahandle_error(
        self,
        error: Exception,
        context: str | Mapping[str, str] | None = None,
        max_retries: int | None = None,
    ) -> HandledError:
        """:meth:`handle_error` for an engine on an async :class:`~eventbus_debug.EventBus`.

        Raises:
            TypeError: if the engine is on a ``SyncEventBus``, or *context* is neither a str,
                a mapping with str keys nor ``None``.
            ValueError: if *max_retries* < 0.
            TimeoutError: if the engine does not answer within its ``drain_timeout``.
        """
        ctx, attempt, limit = self._begin(context, max_retries)
        decided = await report_error(
            self.engine, error, settings=self.state.settings(), context=ctx, attempt=attempt
        )
        return self._finish(error, decided, attempt, limit)

    def reset(self, context: str | Mapping[str, str] | None = None) -> None:
        """Forget the failures counted for *context* (after the call succeeded)."""
        self._attempts.pop(_key(context), None)

    def _begin(
        self, context: str | Mapping[str, str] | None, max_retries: int | None
    ) -> tuple[dict[str, str], int, int]:
        limit = self.max_retries if max_retries is None else max_retries
        non_negative_int("max_retries", limit)
        key = _key(context)
        attempt = self._attempts.get(key, 0) + 1
        self._attempts[key] = attempt
        self.state.attempt = attempt
        return {**_context(context), **self._policy._ctx()}, attempt, limit

    def _finish(
        self, error: Exception, decided: tuple[DecidedAction, ...], attempt: int, limit: int
    ) -> HandledError:
        actions = tuple(d.kind for d in decided)
        if attempt > limit:
            return HandledError(
                recovered=False,
                detail=f"max_retries={limit} reached ({attempt - 1} retries): not retrying",
                actions=actions,
                attempt=attempt,
            )
        before = len(self.state.changes)
        outcome = self._policy._outcome(error, decided)
        if isinstance(outcome, _RetryRequested):
            detail = "; ".join(self.state.changes[before:])
            return HandledError(recovered=True, detail=detail, actions=actions, attempt=attempt)
        if outcome is error:
            return HandledError(
                recovered=False,
                detail=f"no recovery strategy handles {type(error).__name__}",
                actions=actions,
                attempt=attempt,
            )
        return HandledError(
            recovered=False, detail=str(outcome), actions=actions, attempt=attempt, stop=True
        )


def _key(context: str | Mapping[str, str] | None) -> str:
    return repr(sorted(_context(context).items()))


@final
class DebugDecorator:
    """The seeds' ``@DebugDecorator(error_handler, max_retries=3)``: retry under recovery.

    Each failure of the decorated (sync or async) function is published and decided on by the
    handler's engine, the decision is applied to ``error_handler.state``, and the function runs
    again, at most *max_retries* times after the first call (see
    :class:`~eventbus_debug.recovery.Retrying`; an async function needs an engine on an
    ``EventBus``, a sync one a ``SyncEventBus``).

    Args:
        error_handler: the handler whose engine and state are used.
        max_retries: retries after the first attempt.
        pass_state: pass ``error_handler.state`` to the function as the keyword ``state``.

    Raises:
        TypeError: if *error_handler* is not an :class:`ErrorHandler`.
        ValueError: if *max_retries* < 0.
    """

    def __init__(
        self,
        error_handler: ErrorHandler,
        max_retries: int = DEFAULT_MAX_RETRIES,
        *,
        pass_state: bool = False,
    ) -> None:
        if not isinstance(error_handler, ErrorHandler):
            msg = f"error_handler must be an ErrorHandler, got {error_handler!r}"
            raise TypeError(msg)
        non_negative_int("max_retries", max_retries)
        self.error_handler = error_handler
        self.max_retries = max_retries
        self.pass_state = pass_state

    def __call__(self, fn: F, /) -> F:
        """Decorate *fn*."""
        policy = Retrying(
            self.error_handler.engine,
            state=self.error_handler.state,
            max_attempts=self.max_retries + 1,
            context={"function": getattr(fn, "__qualname__", repr(fn))},
        )
        wrapped = _decorate(policy, fn, pass_state=self.pass_state)
        wrapped.retrying = policy  # type: ignore[attr-defined]
        return wrapped  # type: ignore[return-value]
