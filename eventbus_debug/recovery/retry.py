"""Retrying calls under recovery: OOM → smaller batch, data loading → fallbacks, and so on.

Each failure is published as an :class:`ErrorRaised` incident (type, message, traceback,
category, attempt, context); the engine's strategies decide; the decision is applied to a
:class:`CallState` that the retried code reads (``state.batch_size``...), and the call runs
again with backoff. The loop, the stop condition and the waits are tenacity's.

Two shapes, each sync and async::

    @retrying(engine, state=CallState(batch_size=64), pass_state=True)
    async def train_step(batch, *, state: CallState) -> float: ...

    async for attempt in Retrying(engine, state=CallState(batch_size=64)):
        async with attempt:
            run(attempt.state.batch_size)
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
import traceback
from collections.abc import AsyncGenerator, Awaitable, Callable, Generator, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Final, ParamSpec, TypeVar, final, overload

import anyio
import tenacity

from eventbus_debug.diagnostics import get_logger

from .._validate import non_negative, non_negative_int, positive_int, positive_number
from ..events import RecoveryAction, RecoveryApplied
from ..events.recovery import CallSettings
from ..exceptions import TrainingStopped
from ..step_context import StepSource, current_step
from .actions import CALL_ACTIONS, DecidedAction, Decision, Fallback, Retry, ShrinkBatch
from .calls import report_error, report_error_sync
from .engine import RecoveryEngine
from .memory import free_memory

__all__ = ("Attempt", "CallState", "Retrying", "retrying")

_log = get_logger(__name__)

P = ParamSpec("P")
R = TypeVar("R")

SOURCE: Final = "recovery.retry"


@dataclass(slots=True, kw_only=True)
class CallState:
    """The settings a retried call runs with; recovery decisions change them between attempts.

    The retried code reads them (``state.batch_size``) so a retry really runs differently.
    They persist on the :class:`Retrying` object: later calls keep the smaller batch.

    Attributes:
        batch_size: the batch size to use (SHRINK_BATCH lowers it).
        num_workers: data loader workers (FALLBACK lowers it, down to 0 = main process).
        pin_memory: data loader pinned memory (FALLBACK turns it off).
        device: the device to run on (FALLBACK may switch to ``"cpu"``).
        half_precision: load/run the model in half precision (FALLBACK may turn it on).
        smaller_model: use the user's smaller model factory (FALLBACK may turn it on).
        attempt: the current attempt, 1 for the first.
        changes: every change applied so far, in words.
    """

    batch_size: int | None = None
    num_workers: int | None = None
    pin_memory: bool | None = None
    device: str | None = None
    half_precision: bool = False
    smaller_model: bool | None = None
    attempt: int = 1
    changes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        """Refuse settings no call can run with (a batch of 0, -1 workers), naming them.

        Raises:
            ArgumentTypeError: if *batch_size* or *num_workers* is not an int (or None).
            ValueError: if *batch_size* is < 1 or *num_workers* < 0.
        """
        if self.batch_size is not None:
            positive_int("batch_size", self.batch_size)
        if self.num_workers is not None:
            non_negative_int("num_workers", self.num_workers)

    def settings(self) -> CallSettings:
        """The state as the typed :class:`CallSettings` of an :class:`ErrorRaised`."""
        return CallSettings(
            batch_size=self.batch_size,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            device=self.device,
            half_precision=self.half_precision,
            smaller_model=self.smaller_model,
        )

    def apply(self, decision: Decision) -> str:
        """Apply a call-level decision; returns what changed, in words.

        Other actions than :class:`ShrinkBatch`, :class:`Retry` and :class:`Fallback` change
        nothing (the reason is recorded).
        """
        action = decision.action
        done: list[str] = []
        if isinstance(action, (ShrinkBatch, Retry, Fallback)) and action.free_memory:
            done.append(f"freed memory ({free_memory().describe()})")
        if isinstance(action, ShrinkBatch):
            done.append(f"batch_size {self.batch_size} -> {action.size}")
            self.batch_size = action.size
        if isinstance(action, Fallback):
            if action.num_workers is not None:
                done.append(f"num_workers {self.num_workers} -> {action.num_workers}")
                self.num_workers = action.num_workers
            if action.pin_memory is not None:
                done.append(f"pin_memory {self.pin_memory} -> {action.pin_memory}")
                self.pin_memory = action.pin_memory
            if action.cpu:
                done.append(f"device {self.device} -> cpu")
                self.device = "cpu"
            if action.half_precision:
                done.append("half precision on")
                self.half_precision = True
            if action.smaller_model:
                done.append("smaller model factory")
                self.smaller_model = True
        detail = "; ".join(done) or f"retry ({decision.reason})"
        self.changes.append(detail)
        return detail


class _RetryRequested(Exception):
    """Internal: tells tenacity to retry; carries the original failure as ``__cause__``."""


class _PeerFailed(_RetryRequested):
    """Internal: this rank's attempt succeeded but another rank's failed (retry or stop too)."""

    def __init__(self, message: str, *, fatal: bool) -> None:
        super().__init__(message)
        self.fatal = fatal


@final
class Attempt:
    """One attempt of a retried block; use it as ``with attempt:`` / ``async with attempt:``."""

    __slots__ = ("_retrying", "_tenacity", "number", "state")

    def __init__(self, retrying: Retrying, manager: tenacity.AttemptManager, number: int) -> None:
        self._retrying = retrying
        self._tenacity = manager
        self.number = number
        self.state = retrying.state
        self.state.attempt = number

    def _retryable(self, exc: BaseException | None) -> bool:
        """Whether the attempt's outcome goes to the engine; records a success on the way.

        In a process group (the engine has an agreement) a success is agreed first: when
        another rank's attempt failed, this rank re-runs too, with the agreed batch size.
        """
        if exc is None:
            peer = self._retrying._agree(failed=False, fatal=False)
            if peer is not None:
                raise peer
            self._retrying._succeeded(self.number)
            self._tenacity.__exit__(None, None, None)
            return False
        return isinstance(exc, Exception) and not isinstance(exc, TrainingStopped)

    def __enter__(self) -> Attempt:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        settled = self._settled(exc)
        if settled is not None:
            return settled
        assert isinstance(exc, Exception)
        return self._feed(exc, self._retrying._report_sync(exc, self.number))

    async def __aenter__(self) -> Attempt:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        settled = self._settled(exc)
        if settled is not None:
            return settled
        assert isinstance(exc, Exception)
        return self._feed(exc, await self._retrying._report_async(exc, self.number))

    def _settled(self, exc: BaseException | None) -> bool | None:
        """The exit's answer when nothing is to be reported (None: report *exc*, then feed)."""
        try:
            retryable = self._retryable(exc)
        except _PeerFailed as peer:
            return self._feed_peer(peer)
        return None if retryable else False

    def _feed(self, exc: Exception, decided: tuple[DecidedAction, ...]) -> bool:
        outcome = self._retrying._outcome(exc, decided)
        retrying = isinstance(outcome, _RetryRequested)
        last = self.number >= self._retrying.max_attempts
        self._retrying._agree(failed=retrying, fatal=not retrying or last)
        self._tenacity.__exit__(type(outcome), outcome, outcome.__traceback__)
        return True  # tenacity re-raises what must propagate on the next iteration

    def _feed_peer(self, peer: _PeerFailed) -> bool:
        """Another rank's attempt failed: retry (or stop) here too, as agreed."""
        outcome: BaseException = peer
        if peer.fatal:
            outcome = TrainingStopped(str(peer))
        self._tenacity.__exit__(type(outcome), outcome, outcome.__traceback__)
        return True


@final
class Retrying:
    """Runs a block or a function again after recovering from its failures.

    Iterate it (``for`` or ``async for``) to get :class:`Attempt` objects, or use it as a
    decorator (see :func:`retrying`). Between attempts it waits ``initial_delay``,
    then ``multiplier`` times longer each time, at most ``max_delay`` seconds (tenacity's
    exponential wait). An error no strategy handles propagates unchanged; an error whose
    strategies are exhausted, or that still fails after *max_attempts*, raises
    :class:`~eventbus_debug.TrainingStopped` (the original error is its ``__cause__``).

    Args:
        engine: the recovery engine that decides.
        state: the settings the block reads; decisions change them. Kept across calls.
        max_attempts: the most attempts per call, the first included.
        initial_delay: seconds before the first retry (0: retry at once).
        max_delay: the longest wait between attempts.
        multiplier: the growth of the wait per attempt.
        operation: what the call does (``"data_loading"``, ``"model_loading"``, ``"train_step"``):
            it is in the error's context and guides the classification.
        context: more context for the error incidents.
        step: returns the training step the events are stamped with; ``None`` (default): the
            step bound by the session the call runs in
            (:func:`~eventbus_debug.step_context.current_step`), else no step.

    Raises:
        TypeError: if *engine* is not a :class:`RecoveryEngine` or *step* not callable.
        ValueError: if *max_attempts* < 1, a delay is negative or *multiplier* < 1.
    """

    def __init__(
        self,
        engine: RecoveryEngine,
        *,
        state: CallState | None = None,
        max_attempts: int = 5,
        initial_delay: float = 0.0,
        max_delay: float = 10.0,
        multiplier: float = 2.0,
        operation: str = "",
        context: Mapping[str, str] | None = None,
        step: StepSource | None = None,
    ) -> None:
        if not isinstance(engine, RecoveryEngine):
            msg = f"engine must be a RecoveryEngine, got {engine!r}"
            raise TypeError(msg)
        positive_int("max_attempts", max_attempts)
        non_negative("initial_delay", initial_delay)
        non_negative("max_delay", max_delay)
        if initial_delay > max_delay:
            msg = (
                f"initial_delay ({initial_delay!r} s) must be <= max_delay ({max_delay!r} s): "
                "the first wait would be cut to max_delay"
            )
            raise ValueError(msg)
        if positive_number("multiplier", multiplier) < 1:
            msg = f"multiplier must be a number >= 1, got {multiplier!r}"
            raise ValueError(msg)
        if step is not None and not callable(step):
            msg = f"step must be a callable returning the current step, or None, got {step!r}"
            raise TypeError(msg)
        self.engine = engine
        self.step = step
        self.state = state if state is not None else CallState()
        self.max_attempts = max_attempts
        self.operation = operation
        self.context = dict(context or {})
        self._wait: tenacity.wait.wait_base = (
            tenacity.wait_exponential(multiplier=initial_delay, exp_base=multiplier, max=max_delay)
            if initial_delay > 0
            else tenacity.wait_none()
        )
        self._changes_at_start = 0
        self._shrunk = False  # the batch size changed since the call started
        self._last_error: Exception | None = None

    # -- iteration ---------------------------------------------------------------------------

    def __iter__(self) -> Generator[Attempt, None, None]:
        if not self.engine.blocking:
            msg = (
                "a sync retry needs the engine on a SyncEventBus; with an async EventBus use "
                "`async for attempt in Retrying(...)` or decorate an `async def`"
            )
            raise TypeError(msg)
        self._start()
        loop = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(self.max_attempts),
            wait=self._wait,
            retry=tenacity.retry_if_exception_type(_RetryRequested),
            reraise=True,
            sleep=time.sleep,
        )
        try:
            for manager in loop:
                yield Attempt(self, manager, manager.retry_state.attempt_number)
        except _RetryRequested as exc:
            raise self._exhausted() from exc.__cause__

    async def __aiter__(self) -> AsyncGenerator[Attempt, None]:
        if self.engine.blocking:
            msg = "an async retry needs the engine on an EventBus; with a SyncEventBus use `for attempt in ...`"
            raise TypeError(msg)
        self._start()
        loop = tenacity.AsyncRetrying(
            stop=tenacity.stop_after_attempt(self.max_attempts),
            wait=self._wait,
            retry=tenacity.retry_if_exception_type(_RetryRequested),
            reraise=True,
            sleep=anyio.sleep,
        )
        try:
            async for manager in loop:
                yield Attempt(self, manager, manager.retry_state.attempt_number)
        except _RetryRequested as exc:
            raise self._exhausted() from exc.__cause__

    # -- decorator ---------------------------------------------------------------------------

    @overload
    def __call__(self, fn: Callable[P, Awaitable[R]], /) -> Callable[P, Awaitable[R]]: ...
    @overload
    def __call__(self, fn: Callable[P, R], /) -> Callable[P, R]: ...

    def __call__(self, fn: Callable[P, Any], /) -> Callable[P, Any]:
        """Decorate *fn* (sync or async) so each call runs under this retry policy."""
        return _decorate(self, fn, pass_state=False)

    # -- internals ---------------------------------------------------------------------------

    def _start(self) -> None:
        self._changes_at_start = len(self.state.changes)
        self._shrunk = False

    def _ctx(self) -> dict[str, str]:
        """The error context: the caller's, with the operation."""
        if not self.operation:
            return dict(self.context)
        return {**self.context, "operation": self.operation}

    def current_step(self) -> int | None:
        """The step this call's events are stamped with (see the *step* argument)."""
        return current_step(self.step)

    async def _report_async(self, exc: Exception, attempt: int) -> tuple[DecidedAction, ...]:
        return await report_error(
            self.engine,
            exc,
            settings=self.state.settings(),
            context=self._ctx(),
            attempt=attempt,
            step=self.current_step(),
        )

    def _report_sync(self, exc: Exception, attempt: int) -> tuple[DecidedAction, ...]:
        return report_error_sync(
            self.engine,
            exc,
            settings=self.state.settings(),
            context=self._ctx(),
            attempt=attempt,
            step=self.current_step(),
        )

    def _outcome(self, exc: Exception, decided: tuple[DecidedAction, ...]) -> BaseException:
        self._last_error = exc
        for d in decided:
            if d.kind is RecoveryAction.STOP:
                self._publish(RecoveryAction.STOP, d.reason, "exhausted")
                stopped = TrainingStopped(d.reason)
                stopped.__cause__ = exc
                return stopped
        calls = [d for d in decided if d.kind in CALL_ACTIONS]
        if not calls:
            return exc
        _release_frames(exc)  # before any free_memory(): the failed attempt's tensors go too
        for d in calls:
            detail = self.state.apply(d.decision)
            self._shrunk = self._shrunk or isinstance(d.action, ShrinkBatch)
            self._publish(d.kind, detail, "applied")
            _log.info("call_recovery_applied", action=d.kind.value, detail=detail)
        retry = _RetryRequested(f"retrying after {type(exc).__name__}")
        retry.__cause__ = exc
        return retry

    def _agree(self, *, failed: bool, fatal: bool) -> _PeerFailed | None:
        """Agree on this attempt's outcome with the other ranks (no-op outside a group).

        Returns the reason to re-run (or stop) when this rank succeeded and another did not.
        """
        agreement = getattr(self.engine, "agreement", None)
        agree_call = getattr(agreement, "agree_call", None)
        if agree_call is None:
            return None
        agreed = agree_call(failed=failed, fatal=fatal, batch_size=self.state.batch_size)
        if agreed.batch_size is not None and agreed.batch_size != self.state.batch_size:
            detail = (
                f"batch_size {self.state.batch_size} -> {agreed.batch_size} (agreed across ranks)"
            )
            self.state.batch_size = agreed.batch_size
            self.state.changes.append(detail)
            self._shrunk = True
            self._publish(RecoveryAction.SHRINK_BATCH, detail, "applied")
        if failed or fatal or not (agreed.failed or agreed.fatal):
            return None
        what = "failed for good" if agreed.fatal else "failed"
        return _PeerFailed(
            f"another rank's attempt {what}; re-running as agreed", fatal=agreed.fatal
        )

    def _exhausted(self) -> TrainingStopped:
        err = self._last_error
        reason = f"still failing after {self.max_attempts} attempts" + (
            f": {type(err).__name__}: {err}" if err is not None else ""
        )
        self._publish(RecoveryAction.RETRY, reason, "exhausted")
        return TrainingStopped(reason)

    def _succeeded(self, attempt: int) -> None:
        changes = self.state.changes[self._changes_at_start :]
        if attempt > 1 or changes:
            detail = f"succeeded on attempt {attempt}" + (
                f" with batch_size={self.state.batch_size}"
                if self.state.batch_size is not None
                else ""
            )
            if changes:
                detail += f" after: {'; '.join(changes)}"
            action = RecoveryAction.SHRINK_BATCH if self._shrunk else RecoveryAction.RETRY
            self._publish(action, detail, "applied")
        self._start()

    def _publish(self, action: RecoveryAction, detail: str, outcome: str) -> None:
        self.engine.bus.publish_nowait(
            RecoveryApplied(
                step=self.current_step(),
                source=SOURCE,
                action=action,
                detail=detail,
                outcome=outcome,
            )
        )


def _release_frames(exc: BaseException) -> None:
    """Drop the local variables of the frames *exc* unwound, keeping its traceback's lines.

    The error is kept (tenacity's outcome, the ``__cause__`` of a later
    :class:`~eventbus_debug.TrainingStopped`, the exhausted message), and its traceback keeps
    the failed attempt's frames alive with their locals: the activations and the batch of the
    attempt that ran out of memory. ``gc.collect()`` and ``torch.cuda.empty_cache()`` cannot
    free what they hold, and the retry at a smaller batch runs without that memory. The first
    frame is the one that caught the error (the ``with attempt:`` block's, still running) and
    is left alone; every frame after it was exited by the error. The error event already holds
    the formatted traceback.
    """
    tb = exc.__traceback__
    if tb is not None and tb.tb_next is not None:
        traceback.clear_frames(tb.tb_next)


def _decorate(policy: Retrying, fn: Callable[P, Any], *, pass_state: bool) -> Callable[P, Any]:
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def async_wrapper(*args: P.args, **kwargs: P.kwargs) -> Any:
            if pass_state:
                kwargs["state"] = policy.state
            async with contextlib.aclosing(policy.__aiter__()) as attempts:
                async for attempt in attempts:
                    async with attempt:
                        return await fn(*args, **kwargs)
            raise AssertionError(
                "unreachable: tenacity either returns or raises"
            )  # pragma: no cover

        return async_wrapper

    @functools.wraps(fn)
    def sync_wrapper(*args: P.args, **kwargs: P.kwargs) -> Any:
        if pass_state:
            kwargs["state"] = policy.state
        with contextlib.closing(policy.__iter__()) as attempts:
            for attempt in attempts:
                with attempt:
                    return fn(*args, **kwargs)
        raise AssertionError("unreachable: tenacity either returns or raises")  # pragma: no cover

    return sync_wrapper


def retrying(
    engine: RecoveryEngine,
    *,
    state: CallState | None = None,
    pass_state: bool = False,
    max_attempts: int = 5,
    initial_delay: float = 0.0,
    max_delay: float = 10.0,
    multiplier: float = 2.0,
    operation: str = "",
    context: Mapping[str, str] | None = None,
    step: StepSource | None = None,
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorator: run a sync or async function under recovery (the seeds' ``DebugDecorator``).

    With ``pass_state=True`` the function receives the :class:`CallState` as the keyword
    argument ``state`` (read ``state.batch_size`` there). The other arguments are those of
    :class:`Retrying`; the function's name is added to the error context.

    Raises:
        TypeError, ValueError: as :class:`Retrying`.
    """

    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        ctx = {"function": getattr(fn, "__qualname__", repr(fn)), **(context or {})}
        policy = Retrying(
            engine,
            state=state,
            max_attempts=max_attempts,
            initial_delay=initial_delay,
            max_delay=max_delay,
            multiplier=multiplier,
            operation=operation,
            context=ctx,
            step=step,
        )
        wrapped = _decorate(policy, fn, pass_state=pass_state)
        wrapped.retrying = policy  # type: ignore[attr-defined]
        return wrapped

    return decorate
