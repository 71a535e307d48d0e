"""HTTP endpoints to read summaries, change the debug level and clear, while training runs.

Needs the optional ``http`` extra (starlette and uvicorn): ``pip install 'eventbus-debug[http]'``.
It is not imported by ``sinks`` itself; import it as ``from sinks.http import DebugServer``.

Endpoints (JSON):

======================================  =========================================================
``GET  /debug/summary``                 the full run summary, the training summary and the level
``GET  /debug/training/summary``        step counts and anomaly / explosion / vanishing rates
``GET  /debug/events?since=SEQ``        recent events with ``seq > SEQ`` (bounded ring buffer)
``POST /debug/level/{level}``           set the probes' debug level (``off`` ... ``extreme``)
``POST /debug/clear``                   reset the summary and the ring buffer
======================================  =========================================================

The server binds to 127.0.0.1 by default. Bound to any other address it refuses to start
without a token, and the mutating endpoints then require ``Authorization: Bearer <token>``.

Example::

    async with EventBus() as bus, DebugServer(report=report, level=probe) as server:
        bus.subscribe(server)          # feeds /debug/events
        print(server.url)              # http://127.0.0.1:PORT
        ...
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import socket
from collections import deque
from collections.abc import Generator, Sequence
from types import TracebackType
from typing import Any, Final, Protocol, runtime_checkable

import anyio
import orjson
from typing_extensions import Self

from eventbus_debug import DebugLevel
from eventbus_debug._logging import get_logger
from eventbus_debug.encoding import encode_event
from eventbus_debug.events import Event

from .report_summary import RunAggregator, RunSummary, summary_to_dict

try:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    msg = (
        "sinks.http needs starlette and uvicorn, the optional 'http' extra: "
        f"pip install 'eventbus-debug[http]' ({exc})"
    )
    raise ImportError(msg) from None

__all__ = ("DebugServer", "LevelTarget", "SummarySource")

_log = get_logger(__name__)

DEFAULT_RING_SIZE: Final = 2000
MAX_EVENTS_PER_PAGE: Final = 1000
_LOOPBACK_NAMES: Final = frozenset({"localhost"})


@runtime_checkable
class SummarySource(Protocol):
    """Anything that gives a :class:`~sinks.RunSummary` and can be cleared (a ReportWriter)."""

    def summary(self) -> RunSummary: ...

    def clear(self) -> None: ...


LevelTarget = Any
"""What ``POST /debug/level`` changes: an object with a ``set_level(level)`` method, an object
with a settable ``level`` attribute, or a callable taking the new :class:`DebugLevel`."""


class _JSON(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


class _Server(uvicorn.Server):
    """uvicorn's server without its signal handlers: the library never owns the process."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def _is_loopback(host: str) -> bool:
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class DebugServer:
    """An HTTP server for the debug endpoints, and a sink that feeds ``/debug/events``.

    Args:
        report: where summaries come from and what ``/debug/clear`` resets (a
            :class:`~sinks.ReportWriter`); by default the server aggregates the events it
            receives as a sink itself.
        level: what ``POST /debug/level/{level}`` changes (see :data:`LevelTarget`); without
            it that endpoint answers 409.
        host: the address to bind; ``127.0.0.1`` by default.
        port: the port; ``0`` picks a free one (read it back from :attr:`port`).
        token: the bearer token the mutating endpoints require; mandatory when *host* is not
            a loopback address.
        ring_size: how many recent events ``/debug/events`` can return.

    Raises:
        ValueError: if *host* is not loopback and no *token* is given, or *ring_size* < 1.
    """

    def __init__(
        self,
        *,
        report: SummarySource | None = None,
        level: LevelTarget | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        ring_size: int = DEFAULT_RING_SIZE,
        name: str = "debug-http",
    ) -> None:
        if not _is_loopback(host) and not token:
            msg = (
                f"host={host!r} is not a loopback address: pass token=... so that the mutating "
                "endpoints (/debug/level, /debug/clear) require 'Authorization: Bearer <token>'"
            )
            raise ValueError(msg)
        if isinstance(ring_size, bool) or not isinstance(ring_size, int) or ring_size < 1:
            msg = f"ring_size must be an integer >= 1, got {ring_size!r}"
            raise ValueError(msg)
        if level is not None and not (
            callable(getattr(level, "set_level", None))
            or hasattr(level, "level")
            or callable(level)
        ):
            msg = (
                f"level must have a set_level(level) method, a settable `level` attribute, or be "
                f"a callable taking a DebugLevel; got {level!r}"
            )
            raise TypeError(msg)
        self.name = name
        self.host = host
        self._port = port
        self._token = token
        self._own = RunAggregator() if report is None else None
        self._report = report
        self._level_target = level
        self._ring: deque[Event] = deque(maxlen=ring_size)
        self._server: _Server | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._socket: socket.socket | None = None
        self.app = Starlette(
            routes=[
                Route("/debug/summary", self._summary, methods=["GET"]),
                Route("/debug/training/summary", self._training_summary, methods=["GET"]),
                Route("/debug/events", self._events, methods=["GET"]),
                Route("/debug/level/{level}", self._set_level, methods=["POST"]),
                Route("/debug/clear", self._clear, methods=["POST"]),
            ]
        )
        """The ASGI application, to mount in your own server instead of running this one."""

    # -- the sink side -----------------------------------------------------------------------

    async def handle_batch(self, events: Sequence[Event], /) -> None:
        """Keep *events* in the ring buffer (and in the own summary when no report is given)."""
        self._ring.extend(events)
        if self._own is not None:
            self._own.add_all(events)

    async def aclose(self) -> None:
        """Ask the server to stop (the bus calls this at close); ``async with`` waits for it."""
        if self._server is not None:
            self._server.should_exit = True

    # -- running -------------------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The bound port (the real one once started, when created with ``port=0``)."""
        return self._port

    @property
    def url(self) -> str:
        """The base URL, e.g. ``http://127.0.0.1:8123``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def __aenter__(self) -> Self:
        if self._server is not None:
            msg = "this DebugServer is already running; create a new one"
            raise RuntimeError(msg)
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self._port))
        except OSError as exc:
            sock.close()
            msg = f"cannot bind the debug server to {self.host}:{self._port}: {exc.strerror or exc}"
            raise OSError(msg) from None
        self._socket = sock
        self._port = int(sock.getsockname()[1])
        config = uvicorn.Config(
            self.app, log_config=None, log_level="warning", access_log=False, lifespan="off"
        )
        self._server = _Server(config)
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        tg.start_soon(self._server.serve, [sock])
        try:
            with anyio.fail_after(10):
                while not self._server.started:
                    if self._server.should_exit:
                        msg = f"the debug server on {self.url} failed to start"
                        raise RuntimeError(msg)
                    await anyio.sleep(0.01)
        except BaseException:
            self._server.should_exit = True
            await tg.__aexit__(None, None, None)
            sock.close()
            raise
        _log.info("debug_server_started", url=self.url)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        server, tg, sock = self._server, self._tg, self._socket
        if server is not None:
            server.should_exit = True
        try:
            if tg is not None:
                return await tg.__aexit__(exc_type, exc, tb)
            return None
        finally:
            if sock is not None:
                sock.close()
            self._tg = None
            _log.info("debug_server_stopped", url=self.url)

    # -- endpoints -----------------------------------------------------------------------------

    def _summary_now(self) -> RunSummary:
        if self._report is not None:
            return self._report.summary()
        assert self._own is not None
        return self._own.summary()

    def _current_level(self) -> str | None:
        target = self._level_target
        value = getattr(target, "level", None) if target is not None else None
        if isinstance(value, DebugLevel):
            return value.value
        return None if value is None else str(value)

    async def _summary(self, request: Request) -> Response:
        summary = self._summary_now()
        return _JSON(
            {
                "level": self._current_level(),
                "events_buffered": len(self._ring),
                "training": summary.training_summary(),
                "report": summary_to_dict(summary),
            }
        )

    async def _training_summary(self, request: Request) -> Response:
        return _JSON(self._summary_now().training_summary())

    async def _events(self, request: Request) -> Response:
        params = request.query_params
        try:
            since = int(params.get("since", "-1"))
            limit = int(params.get("limit", str(MAX_EVENTS_PER_PAGE)))
        except ValueError:
            return _JSON(
                {"error": "since and limit must be integers", "since": params.get("since")},
                status_code=400,
            )
        limit = max(1, min(limit, MAX_EVENTS_PER_PAGE))
        kinds = set(params.getlist("kind"))
        picked: list[Event] = []
        for event in self._ring:
            if event.seq > since and (not kinds or event.kind in kinds):
                picked.append(event)
                if len(picked) >= limit:
                    break
        last = picked[-1].seq if picked else since
        return _JSON(
            {
                "events": [orjson.loads(encode_event(e)) for e in picked],
                "last_seq": last,
                "more": bool(picked) and len(picked) >= limit,
            }
        )

    def _authorized(self, request: Request) -> Response | None:
        if self._token is None:
            return None
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip(), self._token):
            return _JSON(
                {"error": "this endpoint needs 'Authorization: Bearer <token>'"},
                status_code=401,
                headers={"www-authenticate": "Bearer"},
            )
        return None

    async def _set_level(self, request: Request) -> Response:
        denied = self._authorized(request)
        if denied is not None:
            return denied
        raw = str(request.path_params["level"]).lower()
        valid = [lvl.value for lvl in DebugLevel]
        try:
            level = DebugLevel(raw)
        except ValueError:
            return _JSON({"error": f"unknown debug level {raw!r}", "valid": valid}, status_code=400)
        target = self._level_target
        if target is None:
            return _JSON(
                {"error": "this server was created without a level target (level=...)"},
                status_code=409,
            )
        previous = self._current_level()
        setter = getattr(target, "set_level", None)
        if callable(setter):
            setter(level)
        elif hasattr(target, "level"):
            target.level = level
        else:
            target(level)
        _log.info("debug_level_changed", new_level=level.value, previous=previous, via="http")
        return _JSON({"level": level.value, "previous": previous})

    async def _clear(self, request: Request) -> Response:
        denied = self._authorized(request)
        if denied is not None:
            return denied
        if self._report is not None:
            self._report.clear()
        if self._own is not None:
            self._own.clear()
        dropped = len(self._ring)
        self._ring.clear()
        return _JSON({"cleared": True, "events_dropped_from_buffer": dropped})
