"""``debug_context``: time a block or a function and record its memory delta as an event.

Per-operation metrics. Works as a ``with`` block, an ``async with`` block and a decorator of
sync or async functions::

    with debug_context("forward", publish=bus.publish_nowait) as op:
        out = model(x)
    op.result.duration_s

    @debug_context("train_step", publish=bus.publish_nowait)
    def train_step(batch): ...

Each use publishes one :class:`OperationCompleted` (through *publish*, when given) and keeps it
on :attr:`DebugContext.result`.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable, Coroutine
from contextlib import ExitStack
from types import TracebackType
from typing import Any, ParamSpec, TypeVar, cast, overload

import psutil
import torch

from ..events import Event, OperationCompleted, Severity

__all__ = ("DebugContext", "debug_context")

P = ParamSpec("P")
R = TypeVar("R")
Publish = Callable[[Event], object]
_Start = tuple[float, float, int, int | None, ExitStack]
"""One use's start: wall time, CPU time, RSS, CUDA bytes, and its anomaly-mode switch."""


class DebugContext:
    """The object :func:`debug_context` returns: a context manager and a decorator.

    Re-entrant use (the same object around several blocks) is supported: each exit publishes
    one event and replaces :attr:`result`. Each call of a decorated function is timed on its
    own, also when calls of an async function overlap in concurrent tasks.
    """

    def __init__(
        self,
        name: str,
        *,
        publish: Publish | None,
        step: int | Callable[[], int | None] | None,
        detect_anomaly: bool,
        cuda: bool | None,
    ) -> None:
        self.name = name
        self.publish = publish
        self.detect_anomaly = detect_anomaly
        self._step = step
        self._cuda = torch.cuda.is_available() if cuda is None else cuda
        self._process = psutil.Process()
        self._starts: list[_Start] = []
        self.result: OperationCompleted | None = None
        """The event of the last completed use (None before the first)."""

    def _enter(self) -> _Start:
        """Start one use: its start time, CPU time, memory and anomaly-mode switch."""
        stack = ExitStack()
        if self.detect_anomaly:
            # set_detect_anomaly: the same switch as detect_anomaly, without its UserWarning.
            stack.enter_context(torch.autograd.set_detect_anomaly(True, check_nan=True))
        cuda0: int | None = None
        if self._cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            cuda0 = int(torch.cuda.memory_allocated())
        rss0 = int(self._process.memory_info().rss)
        return (time.perf_counter(), time.process_time(), rss0, cuda0, stack)

    def _exit(self, start: _Start, exc_type: type[BaseException] | None) -> None:
        """End the use begun at *start*: publish its :class:`OperationCompleted`."""
        t0, c0, rss0, cuda0, stack = start
        stack.close()
        cuda_delta: int | None = None
        cuda_peak: int | None = None
        if self._cuda and cuda0 is not None:
            torch.cuda.synchronize()
            cuda_delta = int(torch.cuda.memory_allocated()) - cuda0
            cuda_peak = int(torch.cuda.max_memory_allocated())
        rss = int(self._process.memory_info().rss)
        step = self._step() if callable(self._step) else self._step
        event = OperationCompleted(
            step=step,
            source="debug_context",
            severity=Severity.WARNING if exc_type is not None else Severity.DEBUG,
            name=self.name,
            duration_s=time.perf_counter() - t0,
            cpu_time_s=time.process_time() - c0,
            rss_delta_bytes=rss - rss0,
            rss_bytes=rss,
            cuda_allocated_delta_bytes=cuda_delta,
            cuda_peak_bytes=cuda_peak,
            error=exc_type.__name__ if exc_type is not None else None,
        )
        self.result = event
        if self.publish is not None:
            self.publish(event)

    def __enter__(self) -> DebugContext:
        self._starts.append(self._enter())
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._exit(self._starts.pop(), exc_type)

    async def __aenter__(self) -> DebugContext:
        self._starts.append(self._enter())
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._exit(self._starts.pop(), exc_type)

    @overload
    def __call__(
        self, fn: Callable[P, Coroutine[Any, Any, R]]
    ) -> Callable[P, Coroutine[Any, Any, R]]: ...
    @overload
    def __call__(self, fn: Callable[P, R]) -> Callable[P, R]: ...
    def __call__(self, fn: Callable[P, Any]) -> Callable[P, Any]:
        """Decorate *fn*: every call is timed as one operation."""
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def async_wrapper(*args: P.args, **kwargs: P.kwargs) -> Any:
                # the call's own start, not the shared stack: concurrent calls may overlap
                start = self._enter()
                try:
                    result = await fn(*args, **kwargs)
                except BaseException as exc:
                    self._exit(start, type(exc))
                    raise
                self._exit(start, None)
                return result

            return async_wrapper

        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> Any:
            start = self._enter()  # the call's own start (calls from several threads overlap)
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:
                self._exit(start, type(exc))
                raise
            self._exit(start, None)
            return result

        return cast(Callable[P, Any], wrapper)


def debug_context(
    name: str,
    *,
    publish: Publish | None = None,
    step: int | Callable[[], int | None] | None = None,
    detect_anomaly: bool = False,
    cuda: bool | None = None,
) -> DebugContext:
    """Time a block or a function and record its CPU/GPU memory delta as an event.

    Args:
        name: the operation's name, written in the event.
        publish: where the :class:`OperationCompleted` goes (``bus.publish_nowait``,
            ``sync_bus.publish``, a session's ``publish``); None keeps it on ``.result`` only.
        step: the training step to stamp, or a callable returning it at exit.
        detect_anomaly: run the block under ``torch.autograd.detect_anomaly`` (slow; for
            development: an anomaly-detection mode for one block).
        cuda: measure CUDA memory (synchronizes the device at entry and exit); default: when
            CUDA is available.

    Raises:
        ValueError: if *name* is empty.
        TypeError: if *publish* is not callable (pass ``bus.publish_nowait``, not the bus), or
            *step* is neither an int, a callable nor ``None`` (checked here, not at the end of
            the block, where the block's work would be lost to the error).
    """
    if not isinstance(name, str) or not name:
        msg = f"name must be a non-empty string, got {name!r}"
        raise ValueError(msg)
    if publish is not None and not callable(publish):
        hint = (
            " (pass its publish_nowait method, or sync_bus.publish)"
            if callable(getattr(publish, "publish_nowait", None))
            else ""
        )
        msg = f"publish must be a callable taking an event, or None, got {type(publish).__qualname__}{hint}"
        raise TypeError(msg)
    if (
        step is not None
        and not callable(step)
        and (isinstance(step, bool) or not isinstance(step, int))
    ):
        msg = f"step must be an int, a callable returning one, or None, got {type(step).__qualname__} {step!r}"
        raise TypeError(msg)
    return DebugContext(name, publish=publish, step=step, detect_anomaly=detect_anomaly, cuda=cuda)
