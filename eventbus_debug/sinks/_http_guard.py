"""The debug server's gate: every request passes these checks before any endpoint sees it.

The rules (see :mod:`eventbus_debug.sinks.http`): the ``Host`` header must name the server (DNS
rebinding), a server with a token wants ``Authorization: Bearer <token>`` on every request,
mutations come only as same-origin JSON requests a page cannot send without a CORS preflight,
and every answer carries the security headers. Also the checks of the server's own arguments
that these rules read (its token, its host names).
"""

from __future__ import annotations

import hmac
import ipaddress
import socket
from collections.abc import Iterable
from typing import TYPE_CHECKING, Final, Protocol

import orjson

from eventbus_debug.exceptions import ArgumentTypeError

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

_LOOPBACK_NAMES: Final = frozenset({"localhost", "127.0.0.1", "::1"})
_WILDCARDS: Final = frozenset({"0.0.0.0", "::", ""})
_SAFE_METHODS: Final = frozenset({"GET", "HEAD"})
_CROSS_SITE: Final = frozenset({b"cross-site", b"same-site"})
_SECURITY_HEADERS: Final = (
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"cache-control", b"no-store"),
    (b"referrer-policy", b"no-referrer"),
)


class _Guarded(Protocol):
    """The server, as its guard sees it: what it allows, and where refusals are counted."""

    allowed_hosts: frozenset[str]
    _token: bytes | None

    def _host_allowed(self, host: str) -> bool: ...

    def _origin_allowed(self, origin: bytes) -> bool: ...

    def _count_refusal(self, reason: str) -> None: ...


def _is_loopback(host: str) -> bool:
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _norm_host(host: str) -> str:
    host = host.strip().lower().rstrip(".")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host


def _host_of(header: bytes) -> str | None:
    """The host name of a ``Host`` header (port removed), or ``None`` when malformed."""
    try:
        text = header.decode("ascii").strip().lower()
    except UnicodeDecodeError:
        return None
    if not text or any(c in text for c in " /\\@?#"):
        return None
    if text.startswith("["):
        end = text.find("]")
        rest = text[end + 1 :] if end > 0 else ""
        if end < 0 or (rest and not (rest[0] == ":" and rest[1:].isdigit())):
            return None
        return text[1:end]
    name, _, port = text.partition(":")
    if ":" in port or (port and not port.isdigit()):
        return None
    return name.rstrip(".")


def _check_token(token: str | None) -> bytes | None:
    if token is None:
        return None
    if not isinstance(token, str):
        msg = f"token must be a str, got {type(token).__name__}"
        raise TypeError(msg)
    if not token or not token.isascii() or not token.isprintable() or " " in token:
        msg = "token must be a non-empty string of printable ASCII characters without spaces"
        raise ValueError(msg)
    return token.encode("ascii")


def _hosts(values: Iterable[str], name: str) -> frozenset[str]:
    """*values*, stripped, lowercased, without a trailing ``/``.

    Raises:
        TypeError: if *values* is one string.
        ArgumentTypeError: if *values* is not iterable (None) or an entry is not a string.
        ValueError: if an entry is empty.
    """
    if isinstance(values, str):
        msg = f"{name} must be a sequence of strings, not one string ({values!r})"
        raise TypeError(msg)
    if not isinstance(values, Iterable):
        msg = f"{name} must be a sequence of strings, got {type(values).__name__} {values!r}"
        raise ArgumentTypeError(msg)
    out = set()
    for value in values:
        if not isinstance(value, str):
            msg = f"{name} must hold non-empty strings, got {type(value).__name__} {value!r}"
            raise ArgumentTypeError(msg)
        if not value.strip():
            msg = f"{name} must hold non-empty strings, got {value!r}"
            raise ValueError(msg)
        out.add(value.strip().lower().rstrip("/"))
    return frozenset(out)


class _Guard:
    """ASGI middleware in front of every endpoint: Host, token, and the mutation rules."""

    def __init__(self, app: ASGIApp, server: _Guarded) -> None:
        self.app = app
        self.server = server

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":
            await self._refuse(send, 403, "websocket", "this server speaks plain HTTP only")
            return
        headers: dict[bytes, bytes] = {}
        for key, value in scope.get("headers", ()):
            headers.setdefault(bytes(key).lower(), bytes(value))
        server = self.server
        host = _host_of(headers.get(b"host", b""))
        if host is None or not server._host_allowed(host):
            await self._refuse(
                send,
                400,
                "host",
                "the Host header does not name this server (allowed: "
                + ", ".join(sorted(server.allowed_hosts))
                + "; pass allowed_hosts=... to add names)",
            )
            return
        if server._token is not None and not _bearer_matches(
            headers.get(b"authorization"), server._token
        ):
            await self._refuse(
                send,
                401,
                "token",
                "this server needs 'Authorization: Bearer <token>'",
                extra=((b"www-authenticate", b'Bearer realm="eventbus-debug"'),),
            )
            return
        method = str(scope.get("method", "GET")).upper()
        if method not in _SAFE_METHODS:
            if headers.get(b"sec-fetch-site", b"").strip().lower() in _CROSS_SITE:
                await self._refuse(send, 403, "origin", "cross-site requests are refused")
                return
            origin = headers.get(b"origin")
            if origin is not None and not server._origin_allowed(origin):
                await self._refuse(send, 403, "origin", "requests from another origin are refused")
                return
            if method == "OPTIONS":
                await self._refuse(send, 403, "preflight", "this server answers no CORS preflight")
                return
            media = headers.get(b"content-type", b"").split(b";", 1)[0].strip().lower()
            if media != b"application/json":
                await self._refuse(
                    send,
                    415,
                    "content_type",
                    "changes need a JSON request: 'Content-Type: application/json'",
                )
                return

        async def send_secured(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = dict(message)
                message["headers"] = [*message.get("headers", ()), *_SECURITY_HEADERS]
            await send(message)

        await self.app(scope, receive, send_secured)

    async def _refuse(
        self,
        send: Send,
        status: int,
        reason: str,
        message: str,
        extra: tuple[tuple[bytes, bytes], ...] = (),
    ) -> None:
        self.server._count_refusal(reason)
        body = orjson.dumps({"error": message})
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    *extra,
                    *_SECURITY_HEADERS,
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def _bearer_matches(header: bytes | None, token: bytes) -> bool:
    """Constant-time check of ``Authorization: Bearer <token>`` on raw bytes."""
    if header is None:
        return False
    scheme, _, given = header.strip().partition(b" ")
    ok_scheme = scheme.lower() == b"bearer"
    # compare_digest on bytes never raises, whatever the header holds (non-ASCII included)
    return hmac.compare_digest(given.strip(), token) and ok_scheme


def _allowed_hosts(host: str, extra: Iterable[str]) -> frozenset[str]:
    """The names the ``Host`` header may carry for a server bound to *host*: the bound address,
    *extra* (``allowed_hosts``), the loopback names on loopback or a wildcard address, and this
    machine's names on a wildcard address.

    Raises:
        TypeError: if *extra* is one string.
        ArgumentTypeError: if *extra* holds a name that is not a string (a ``TypeError``,
            and the ``ValueError`` earlier releases raised).
        ValueError: if *extra* holds an empty name.
    """
    bound = _norm_host(host)
    hosts = set(_hosts(extra, "allowed_hosts"))
    hosts.add(bound)
    if _is_loopback(bound) or bound in _WILDCARDS:
        hosts |= _LOOPBACK_NAMES
    if bound in _WILDCARDS:
        hosts.discard(bound)
        for name_ in (socket.gethostname(), socket.getfqdn()):
            if name_:
                hosts.add(name_.lower().rstrip("."))
    return frozenset(_norm_host(h) for h in hosts)
