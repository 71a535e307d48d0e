"""How the bus talks to one sink: its methods looked up and checked once, at subscribe time."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, final

from ..events import Event
from ..exceptions import SubscriptionError

__all__ = ("SinkAdapter", "default_name", "is_async_callable")


@final
class SinkAdapter:
    """A sink's ``handle``/``handle_batch``/``start``/``aclose``, resolved once.

    Raises:
        SubscriptionError: if *sink* is a class, or a method the bus awaits is not async, or
            *sink* is neither an async callable nor an object with ``handle``/``handle_batch``.
    """

    __slots__ = ("aclose", "handle", "handle_batch", "start")

    def __init__(self, sink: object, name: str) -> None:
        self.handle: Callable[[Event], Awaitable[Any]] | None = None
        self.handle_batch: Callable[[Sequence[Event]], Awaitable[Any]] | None = None
        self.start: Callable[[], Awaitable[Any]] | None = None
        self.aclose: Callable[[], Any] | None = None
        if inspect.isclass(sink):
            msg = f"sink {name!r} is a class ({sink.__qualname__}); pass an instance of it"
            raise SubscriptionError(msg)
        batch = getattr(sink, "handle_batch", None)
        single = getattr(sink, "handle", None)
        if batch is not None or single is not None:
            for attr, fn in (("handle_batch", batch), ("handle", single)):
                if fn is not None and not is_async_callable(fn):
                    msg = (
                        f"sink {name!r}: {attr} must be an `async def` method, got {fn!r}; "
                        "blocking work belongs in a worker thread the bus can abandon if it "
                        "hangs: `await anyio.to_thread.run_sync(fn, abandon_on_cancel=True)`"
                    )
                    raise SubscriptionError(msg)
            self.handle_batch = batch
            self.handle = single
            start = getattr(sink, "start", None)
            if start is not None:
                if not is_async_callable(start):
                    msg = f"sink {name!r}: start must be an `async def` method, got {start!r}"
                    raise SubscriptionError(msg)
                self.start = start
            self.aclose = getattr(sink, "aclose", None) or getattr(sink, "close", None)
            return
        if callable(sink):
            if not is_async_callable(sink):
                msg = (
                    f"{sink!r} is not an async function; pass an `async def handler(event)` or "
                    "an object with an async handle(event) / handle_batch(events) method"
                )
                raise SubscriptionError(msg)
            self.handle = sink
            return
        msg = (
            f"{sink!r} is not a sink: pass an `async def handler(event)` or an object with an "
            "async handle(event) / handle_batch(events) method"
        )
        raise SubscriptionError(msg)


def is_async_callable(fn: object) -> bool:
    """Whether calling *fn* returns a coroutine (an ``async def`` or an async ``__call__``)."""
    if inspect.iscoroutinefunction(fn):
        return True
    call = getattr(fn, "__call__", None)  # noqa: B004 - instances with an async __call__
    return call is not None and inspect.iscoroutinefunction(call)


def default_name(sink: object) -> str:
    """A subscription's name when none is given, readable and stable.

    The sink's ``name`` attribute when it is a non-empty string; else, for a function, its
    qualified name without the functions it is nested in (``hangs``, not
    ``main.<locals>.hangs``; a bound method gives ``LossTracker.handle``); else the name of
    the sink's class (``LossTracker``). The bus adds ``-2``, ``-3``... to a name already used.
    """
    name = getattr(sink, "name", None)
    if isinstance(name, str) and name:
        return name
    qualname = getattr(sink, "__qualname__", None)
    if isinstance(qualname, str) and qualname:
        return qualname.rpartition("<locals>.")[2]
    return type(sink).__name__
