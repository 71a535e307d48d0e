"""HTTP endpoints: the live report, Prometheus metrics, summaries, the debug level, clearing.

Needs the optional ``http`` extra (starlette, uvicorn, prometheus-client):
``pip install 'eventbus-debug[http]'``. It is not imported by ``sinks`` itself; import it as
``from sinks.http import DebugServer``.

======================================  =========================================================
``GET  /``                              the live ``report.html`` of the run (the same page as
                                        :class:`~sinks.ReportWriter` writes)
``GET  /metrics``                       Prometheus text format: events by kind, incidents,
                                        anomalies, steps, recovery decisions, drops, last loss,
                                        gradient norm, learning rate, throughput, memory peaks
``GET  /debug/summary``                 the full run summary, the training summary and the level
``GET  /debug/training/summary``        step counts and anomaly / explosion / vanishing rates
``GET  /debug/events?since=SEQ``        recent events with ``seq > SEQ`` (bounded ring buffer)
``POST /debug/level/{level}``           set the probes' debug level (``off`` ... ``extreme``)
``POST /debug/clear``                   reset the summary and the ring buffer
======================================  =========================================================

Safe by default: a debug server on a training node must not let a web page, or anyone on the
network, steer the run.

- It binds ``127.0.0.1``. Bound to any other address it refuses to start without a token,
  and with a token **every** endpoint (reads included) needs ``Authorization: Bearer
  <token>``; the comparison is constant-time on bytes, and a malformed or non-ASCII header is
  a plain 401.
- The ``Host`` header must name the bound address (or ``localhost`` on loopback, or one of
  ``allowed_hosts``): a DNS-rebinding page, whose requests carry its own host name, gets 400.
- Mutations (``POST``) are accepted only as requests a page cannot send without a CORS
  preflight — ``Content-Type: application/json`` (415 otherwise) — and the server answers no
  preflight; a browser's ``Origin`` must be the server's own (or in ``allowed_origins``),
  and ``Sec-Fetch-Site: cross-site``/``same-site`` is refused (403).
- Every answer carries ``X-Content-Type-Options: nosniff``, ``X-Frame-Options: DENY``,
  ``Cache-Control: no-store`` and, for the page, a Content-Security-Policy without scripts.

Example::

    async with EventBus() as bus, DebugServer(report=report, level=probe) as server:
        bus.subscribe(server)          # feeds /debug/events
        print(server.url)              # http://127.0.0.1:PORT
        ...
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections import deque
from collections.abc import Callable, Generator, Mapping, Sequence
from types import TracebackType
from typing import Any, Final, Protocol, TypeAlias, runtime_checkable

import anyio
import anyio.to_thread
import orjson
from typing_extensions import Self

from eventbus_debug import DebugLevel
from eventbus_debug.diagnostics import get_logger
from eventbus_debug.events import Event
from eventbus_debug.exceptions import ArgumentTypeError
from eventbus_debug.log.encoding import encode_event
from eventbus_debug.threads import running_loop

from ._checks import brief, count
from .report import RunAggregator, RunSummary, render_html, summary_to_dict
from .report.html import CONTENT_SECURITY_POLICY

try:
    import uvicorn
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route
    from starlette.types import ASGIApp
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    msg = (
        "sinks.http needs starlette, uvicorn and prometheus-client, the optional 'http' extra: "
        f"pip install 'eventbus-debug[http]' ({exc})"
    )
    raise ImportError(msg) from None

# The request guard and the metrics collector need the extra too: imported once it is known
# to be there. Their helpers stay importable from here, as they always were.
from ._http_guard import (
    _CROSS_SITE as _CROSS_SITE,
    _LOOPBACK_NAMES as _LOOPBACK_NAMES,
    _SAFE_METHODS as _SAFE_METHODS,
    _SECURITY_HEADERS as _SECURITY_HEADERS,
    _WILDCARDS as _WILDCARDS,
    _allowed_hosts,
    _bearer_matches as _bearer_matches,
    _check_token,
    _Guard,
    _host_of,
    _hosts,
    _is_loopback,
    _norm_host as _norm_host,
)
from ._http_metrics import _labelled as _labelled, _Metrics

__all__ = ("DebugServer", "LevelHolder", "LevelSetter", "LevelTarget", "SummarySource")

_log = get_logger(__name__)

DEFAULT_RING_SIZE: Final = 2000
MAX_EVENTS_PER_PAGE: Final = 1000
MAX_BODY_BYTES: Final = 64 * 1024
_MAX_PORT: Final = 65535


@runtime_checkable
class SummarySource(Protocol):
    """Anything that gives a :class:`~sinks.RunSummary` and can be cleared (a ReportWriter)."""

    def summary(self) -> RunSummary: ...

    def clear(self) -> None: ...


@runtime_checkable
class LevelSetter(Protocol):
    """An object whose debug level is changed by calling ``set_level(level)``."""

    def set_level(self, level: DebugLevel, /) -> object: ...


@runtime_checkable
class LevelHolder(Protocol):
    """An object with a settable ``level`` attribute."""

    level: DebugLevel


LevelTarget: TypeAlias = LevelSetter | LevelHolder | Callable[[DebugLevel], object]
"""What ``POST /debug/level`` changes: an object with a ``set_level(level)`` method, an object
with a settable ``level`` attribute, or a callable taking the new :class:`DebugLevel`."""


class _JSON(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        data: bytes = orjson.dumps(content)
        return data


class _Server(uvicorn.Server):
    """uvicorn's server without its signal handlers: the library never owns the process."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def _release(server: uvicorn.Server) -> None:
    """Stop listening and close the connections of *server*, even if its shutdown never ran.

    uvicorn closes them itself when it stops gracefully; when its task is cancelled instead (the
    ``async with`` body raised or was cancelled), its listening socket would stay registered with
    the event loop. Closing that socket behind the loop's back leaves a stale registration that
    breaks the next server to get the same file descriptor (its requests hang). Idempotent.
    """
    for listener in getattr(server, "servers", ()):
        listener.close()
    for connection in list(server.server_state.connections):
        connection.shutdown()


class DebugServer:
    """An HTTP server for the live report, metrics and debug endpoints, and a sink that feeds
    ``/debug/events``.

    Args:
        report: where summaries come from and what ``/debug/clear`` resets (a
            :class:`~sinks.ReportWriter`); by default the server aggregates the events it
            receives as a sink itself.
        level: what ``POST /debug/level/{level}`` changes (see :data:`LevelTarget`); without
            it that endpoint answers 409.
        host: the address to bind; ``127.0.0.1`` by default.
        port: the port, an ``int`` in ``0..65535``; ``0`` picks a free one (read it back
            from :attr:`port`).
        token: the bearer token every endpoint then requires; mandatory when *host* is not a
            loopback address. Printable ASCII without spaces.
        allowed_hosts: more names the ``Host`` header may carry (the bound address, and on
            loopback or a wildcard address ``localhost``/``127.0.0.1``/``::1``, are always
            allowed; a wildcard bind also allows this machine's host name). ``"*"`` turns the
            check off (only behind a proxy that checks it).
        allowed_origins: more browser origins (``"https://dash.example:8443"``) allowed to
            send mutations; the server's own origin always is.
        ring_size: how many recent events ``/debug/events`` can return.
        title: the title of the live report at ``/``.

    A server serves once: ``async with server:`` starts it and waits for it to stop;
    entering it again after that is a ``RuntimeError`` (create a new one). A start that
    failed (the port in use) leaves nothing open and may be retried. It serves on asyncio
    only (uvicorn); entering it on trio is a ``RuntimeError`` that says so, before any socket
    is opened.

    Raises:
        ValueError: if *host* is not loopback and no *token* is given, a token or host name
            is malformed, *port* is outside ``0..65535``, or *ring_size* < 1.
        ArgumentTypeError: if *port* or *ring_size* is not an ``int`` (``bool`` and ``float``
            included), or an entry of *allowed_hosts* or *allowed_origins* is not a string (a
            ``TypeError``, and the ``ValueError`` earlier releases raised).
        TypeError: if *level* is not a level target, or *token* or *host* is not a string.
    """

    def __init__(
        self,
        *,
        report: SummarySource | None = None,
        level: LevelTarget | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        allowed_hosts: Sequence[str] = (),
        allowed_origins: Sequence[str] = (),
        ring_size: int = DEFAULT_RING_SIZE,
        title: str = "eventbus-debug live report",
        name: str = "debug-http",
    ) -> None:
        if not isinstance(host, str):
            msg = f"host must be a str, got {type(host).__name__}"
            raise TypeError(msg)
        if isinstance(port, bool) or not isinstance(port, int):
            msg = f"port must be an int in 0..65535 (0: a free port), got {type(port).__name__} {brief(port)}"
            raise ArgumentTypeError(msg)
        if not 0 <= port <= _MAX_PORT:
            msg = f"port must be in 0..65535 (0: a free port), got {port}"
            raise ValueError(msg)
        token_bytes = _check_token(token)
        if not _is_loopback(host) and token_bytes is None:
            msg = (
                f"host={host!r} is not a loopback address: pass token=... so that every "
                "endpoint requires 'Authorization: Bearer <token>'"
            )
            raise ValueError(msg)
        count("ring_size", ring_size, rule="an integer >= 1")
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
        self.allowed_hosts: frozenset[str] = _allowed_hosts(host, allowed_hosts)
        """The names the ``Host`` header may carry."""
        self._origins = _hosts(allowed_origins, "allowed_origins")
        self.name = name
        self.host = host
        self.title = title
        self._port = port
        self._token = token_bytes
        self._own = RunAggregator() if report is None else None
        self._report = report
        self._level_target = level
        self._level_set: DebugLevel | None = None  # the last level set here (a callable target)
        self._ring: deque[Event] = deque(maxlen=ring_size)
        self._refused: dict[str, int] = {}
        self._server: _Server | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._socket: socket.socket | None = None
        self._closed = False
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(_Metrics(self))
        routes = Starlette(
            routes=[
                Route("/", self._page, methods=["GET"]),
                Route("/metrics", self._metrics, methods=["GET"]),
                Route("/debug/summary", self._summary, methods=["GET"]),
                Route("/debug/training/summary", self._training_summary, methods=["GET"]),
                Route("/debug/events", self._events, methods=["GET"]),
                Route("/debug/level/{level}", self._set_level, methods=["POST"]),
                Route("/debug/clear", self._clear, methods=["POST"]),
            ]
        )
        self.app: ASGIApp = _Guard(routes, self)
        """The ASGI application (checks included), to mount in your own server instead."""

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

    @property
    def refused(self) -> Mapping[str, int]:
        """Requests refused so far, by reason: ``host``, ``token``, ``origin``, ``preflight``,
        ``content_type``, ``websocket`` (also exported at ``/metrics``)."""
        return dict(self._refused)

    def _count_refusal(self, reason: str) -> None:
        first = reason not in self._refused
        self._refused[reason] = self._refused.get(reason, 0) + 1
        if first:
            _log.warning("debug_server_refused_request", reason=reason, url=self.url)

    def _host_allowed(self, host: str) -> bool:
        return "*" in self.allowed_hosts or host in self.allowed_hosts

    def _origin_allowed(self, origin: bytes) -> bool:
        try:
            text = origin.decode("ascii").strip().lower().rstrip("/")
        except UnicodeDecodeError:
            return False
        if text in self._origins:
            return True
        scheme, sep, rest = text.partition("://")
        if not sep or scheme != "http":
            return False
        host = _host_of(rest.encode())
        if host is None or not self._host_allowed(host):
            return False
        port = rest[rest.find("]") + 2 :] if rest.startswith("[") else rest.partition(":")[2]
        return (port or "80") == str(self.port)

    async def __aenter__(self) -> Self:
        if self._closed:
            msg = (
                f"this DebugServer ({self.url}) has been stopped and serves only once; "
                "create a new DebugServer to serve again"
            )
            raise RuntimeError(msg)
        if self._server is not None:
            msg = f"this DebugServer is already running on {self.url}; create a new one"
            raise RuntimeError(msg)
        if running_loop() is None:
            msg = (
                "DebugServer serves with uvicorn, which runs only on asyncio; this event loop is "
                "another anyio backend (trio). Run the loop on asyncio to serve, or leave the "
                "server out: the log and the report files work on every backend"
            )
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
        except BaseException:  # never leak the socket, whatever bind raised
            sock.close()
            raise
        self._socket = sock
        self._port = int(sock.getsockname()[1])
        config = uvicorn.Config(
            self.app,
            log_config=None,
            log_level="warning",
            access_log=False,
            lifespan="off",
            server_header=False,
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
            try:
                await tg.__aexit__(None, None, None)
            finally:
                _release(self._server)
                sock.close()
                self._server = self._tg = self._socket = None
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
                if exc is not None:
                    # The body failed or was cancelled: stop serving, and let its exception
                    # propagate as it is (a task group would wrap it in an ExceptionGroup).
                    tg.cancel_scope.cancel()
                    await tg.__aexit__(None, None, None)
                    return None
                return await tg.__aexit__(None, None, None)
            return None
        finally:
            if server is not None:
                _release(server)
            if sock is not None:
                sock.close()
            self._tg = self._socket = None
            if server is not None:
                self._closed = True
            _log.info("debug_server_stopped", url=self.url)

    # -- endpoints -----------------------------------------------------------------------------

    def _summary_now(self) -> RunSummary:
        if self._report is not None:
            return self._report.summary()
        assert self._own is not None
        return self._own.summary()

    def _current_level(self) -> str | None:
        """The target's ``level`` if it has one, else the last level set through the server."""
        target = self._level_target
        value = getattr(target, "level", None) if target is not None else None
        if value is None:
            value = self._level_set
        if isinstance(value, DebugLevel):
            return value.value
        return None if value is None else str(value)

    async def _page(self, request: Request) -> Response:
        summary = self._summary_now()
        page = await anyio.to_thread.run_sync(self._render, summary)
        return Response(
            page,
            media_type="text/html; charset=utf-8",
            headers={"content-security-policy": CONTENT_SECURITY_POLICY},
        )

    def _render(self, summary: RunSummary) -> bytes:
        return render_html(summary, title=self.title, generated_ns=time.time_ns()).encode("utf-8")

    async def _metrics(self, request: Request) -> Response:
        return Response(generate_latest(self._registry), media_type=CONTENT_TYPE_LATEST)

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
        more = False
        for event in self._ring:
            if event.seq > since and (not kinds or event.kind in kinds):
                if len(picked) >= limit:  # one more match than the page holds
                    more = True
                    break
                picked.append(event)
        last = picked[-1].seq if picked else since
        return _JSON(
            {
                "events": [orjson.loads(encode_event(e)) for e in picked],
                "last_seq": last,
                "more": more,
            }
        )

    async def _json_body(self, request: Request) -> Response | None:
        """Refuse a body that is not one JSON object (an empty body is ``{}``)."""
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_BODY_BYTES:
                return _JSON({"error": f"body larger than {MAX_BODY_BYTES} bytes"}, 413)
        if not body.strip():
            return None
        try:
            value = orjson.loads(body)
        except orjson.JSONDecodeError:
            return _JSON({"error": "the body is not valid JSON"}, status_code=400)
        if not isinstance(value, dict):
            return _JSON({"error": "the body must be a JSON object"}, status_code=400)
        return None

    async def _set_level(self, request: Request) -> Response:
        bad = await self._json_body(request)
        if bad is not None:
            return bad
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
        if isinstance(target, LevelSetter):
            target.set_level(level)
        elif isinstance(target, LevelHolder):
            target.level = level
        else:
            target(level)
        self._level_set = level
        _log.info("debug_level_changed", new_level=level.value, previous=previous, via="http")
        return _JSON({"level": level.value, "previous": previous})

    async def _clear(self, request: Request) -> Response:
        bad = await self._json_body(request)
        if bad is not None:
            return bad
        if self._report is not None:
            self._report.clear()
        if self._own is not None:
            self._own.clear()
        dropped = len(self._ring)
        self._ring.clear()
        return _JSON({"cleared": True, "events_dropped_from_buffer": dropped})
