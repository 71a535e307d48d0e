"""Blocking work off the event loop, in daemon threads that a cancelled caller can abandon.

``anyio.to_thread.run_sync`` runs in non-daemon worker threads: a call that never returns (a
write to a hung network disk, a full pipe, a user's handler stuck on a lock) keeps the process
alive at exit, and without ``abandon_on_cancel`` it also makes its caller uncancellable. The
sinks' I/O therefore goes through :class:`DaemonWorker` instead: one daemon thread per sink that
runs jobs in order; awaiting a job can always be cancelled (the job is then abandoned, its result
discarded), and the thread never delays the interpreter's exit.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import queue
import threading
from collections.abc import Awaitable, Callable
from typing import Any, Final, Generic, TypeVar

import anyio
import anyio.lowlevel

__all__ = ("DaemonWorker", "run_in_daemon_thread", "running_loop", "threadsafe_scheduler")

T = TypeVar("T")

_STOP: Final = object()


class _Job(Generic[T]):
    """One call handed to a worker thread, and its outcome."""

    __slots__ = ("args", "context", "done", "error", "fn", "notify", "result")

    def __init__(
        self, fn: Callable[..., T], args: tuple[Any, ...], notify: Callable[[], object]
    ) -> None:
        self.fn = fn
        self.args = args
        # The caller's context variables, as anyio.to_thread gives them: a sink's worker
        # thread is the sink's (what it publishes while the bus closes is taken, see
        # EventBus.aclose), and the step and log bindings read the same there.
        self.context = contextvars.copy_context()
        self.notify = notify
        self.done = False
        self.result: T | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.context.run(self.fn, *self.args)
        except BaseException as exc:  # handed back to the awaiting task
            self.error = exc
        self.done = True

    def wake(self) -> None:
        try:
            self.notify()
        except RuntimeError:  # the event loop is closed: nobody waits any more
            pass

    def run_and_wake(self) -> None:
        self.run()
        self.wake()


def threadsafe_scheduler() -> Callable[[Callable[[], object]], object]:
    """The running event loop's "run this soon" for other threads: asyncio's
    ``call_soon_threadsafe`` or trio's ``run_sync_soon``. Call it inside the loop."""
    token = anyio.lowlevel.current_token().native_token
    call_soon = getattr(token, "call_soon_threadsafe", None)  # asyncio loop
    if call_soon is None:
        call_soon = getattr(token, "run_sync_soon")  # noqa: B009 - a trio token
    return call_soon  # type: ignore[no-any-return]


async def _await_job(job: _Job[T], done: Awaitable[Any]) -> T:
    await done  # cancellable: the job is abandoned to its thread
    if job.error is not None:
        raise job.error
    return job.result  # type: ignore[return-value]


def _resolve(future: asyncio.Future[None]) -> None:
    """Complete *future* unless its awaiting task was cancelled meanwhile (runs in the loop)."""
    if not future.done():
        future.set_result(None)


def running_loop() -> asyncio.AbstractEventLoop | None:
    """The running asyncio event loop; None on another backend (trio) or outside a loop."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:  # another backend (trio)
        return None


class DaemonWorker:
    """One daemon thread that runs blocking calls in submission order.

    ``await worker.run(fn, *args)`` returns ``fn(*args)``'s result (or raises its exception).
    Cancelling the awaiting task abandons the call: it finishes (or hangs) in the thread, and
    :attr:`busy` tells whether the thread is still inside a call. :meth:`stop` lets the thread
    exit after the calls already submitted. The thread is a daemon: a call that never returns
    never keeps the process alive.
    """

    __slots__ = ("_call_soon", "_loop", "_name", "_queue", "_running", "_thread")

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._running: _Job[Any] | None = None
        # The event loop of the last call, and its call_soon_threadsafe: looked up once per
        # loop, not per call (anyio.Event() + current_token() cost ~6 µs per batch; issue #13).
        self._loop: asyncio.AbstractEventLoop | None = None
        self._call_soon: Callable[..., object] | None = None

    @property
    def busy(self) -> bool:
        """Whether the thread is inside a call now (a hung call keeps it busy)."""
        return self._running is not None

    async def run(self, fn: Callable[..., T], /, *args: Any) -> T:
        """Run ``fn(*args)`` in the thread after the calls submitted before; cancellable.

        On asyncio the call completes a bare future of the loop (awaiting it keeps anyio's
        cancel-scope semantics); on other backends an :class:`anyio.Event`.
        """
        done: Awaitable[Any]
        loop = running_loop()
        if loop is not None:
            call_soon = self._call_soon
            if loop is not self._loop or call_soon is None:
                self._loop = loop
                call_soon = self._call_soon = loop.call_soon_threadsafe
            future: asyncio.Future[None] = loop.create_future()
            job: _Job[T] = _Job(fn, args, functools.partial(call_soon, _resolve, future))
            done = future
        else:
            event = anyio.Event()
            schedule = threadsafe_scheduler()
            job = _Job(fn, args, lambda: schedule(event.set))
            done = event.wait()
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name=self._name, daemon=True)
            self._thread.start()
        self._queue.put(job)
        return await _await_job(job, done)

    def stop(self) -> None:
        """Let the thread exit once the calls already submitted are done (never blocks)."""
        if self._thread is not None:
            self._queue.put(_STOP)
            self._thread = None

    def _work(self) -> None:
        get = self._queue.get
        while True:
            job = get()
            if job is _STOP:
                return
            assert isinstance(job, _Job)
            self._running = job
            job.run()
            self._running = None  # before the wake: the awaiting task sees the thread idle
            job.wake()


async def run_in_daemon_thread(fn: Callable[..., T], /, *args: Any, name: str = "") -> T:
    """Run ``fn(*args)`` in a new daemon thread; cancelling the caller abandons the call.

    For rare calls of code the library does not control (a user's synchronous alert handler):
    a handler that never returns neither blocks the caller's cancellation nor the process's exit.
    """
    event = anyio.Event()
    schedule = threadsafe_scheduler()
    job: _Job[T] = _Job(fn, args, lambda: schedule(event.set))
    thread = threading.Thread(target=job.run_and_wake, name=name or "eventbus-daemon", daemon=True)
    thread.start()
    return await _await_job(job, event.wait())
