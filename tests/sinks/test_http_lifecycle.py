"""DebugServer: its port is checked when built, a failed start leaves nothing open, and a
stopped server says so when entered again."""

from __future__ import annotations

import contextlib
import gc
import socket
import warnings
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from eventbus_debug.sinks import http as http_module
from eventbus_debug.sinks.http import DebugServer

pytestmark = pytest.mark.asyncio_only("uvicorn (DebugServer) runs only on asyncio")


@contextlib.contextmanager
def _no_resource_warning() -> Iterator[None]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
        gc.collect()
    leaked = [w for w in caught if issubclass(w.category, ResourceWarning)]
    assert leaked == [], [str(w.message) for w in leaked]


@contextlib.contextmanager
def _busy_port() -> Iterator[int]:
    blocker = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        yield int(blocker.getsockname()[1])
    finally:
        blocker.close()


class TestPortArgument:
    @pytest.mark.parametrize("port", [-1, 65536, 70000])
    def test_out_of_range_is_a_value_error(self, port: int) -> None:
        """Ports outside 0..65535 are refused when the server is built, naming `port`."""
        with pytest.raises(ValueError, match=r"^port must be in 0\.\.65535"):
            DebugServer(port=port)

    @pytest.mark.parametrize("port", ["x", "8080", 80.0, True, None])
    def test_non_int_is_a_type_error(self, port: Any) -> None:
        """A str, float, bool or None port is a TypeError naming `port` and the type."""
        with pytest.raises(TypeError, match=r"^port must be an int in 0\.\.65535"):
            DebugServer(port=port)

    @pytest.mark.parametrize("port", [0, 1, 65535])
    def test_bounds_are_accepted(self, port: int) -> None:
        """0 (a free port) and the ends of the range are valid; nothing is bound yet."""
        assert DebugServer(port=port).port == port


class TestFailedStart:
    async def test_port_in_use_leaks_no_socket_and_can_be_retried(self) -> None:
        """A bind that fails closes its socket; once the port is free the same server starts."""
        with _busy_port() as port:
            server = DebugServer(port=port)
            with _no_resource_warning(), pytest.raises(OSError, match="cannot bind"):
                await server.__aenter__()
        async with server:
            assert server.port == port
            async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
                assert (await client.get("/debug/training/summary")).status_code == 200

    async def test_any_bind_error_closes_the_socket(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """An error of another kind from bind (not OSError) closes the socket as well."""
        made: list[socket.socket] = []

        class _BadBind(socket.socket):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                made.append(self)

            def bind(self, address: Any, /) -> None:
                msg = "bind exploded"
                raise OverflowError(msg)

        monkeypatch.setattr(f"{http_module.__name__}.socket.socket", _BadBind)
        with _no_resource_warning(), pytest.raises(OverflowError, match="bind exploded"):
            await DebugServer().__aenter__()
        assert made and all(s.fileno() == -1 for s in made)


class TestReentry:
    async def test_entering_a_stopped_server_is_a_clear_error(self) -> None:
        """A server serves once: entering it after it stopped says so."""
        server = DebugServer()
        async with server:
            url = server.url
        with _no_resource_warning(), pytest.raises(RuntimeError, match="serves only once"):
            await server.__aenter__()
        assert url in str(server.url)

    async def test_entering_a_running_server_is_a_clear_error(self) -> None:
        """Entering a server that is running is refused, and the running one keeps serving."""
        async with DebugServer() as server:
            with pytest.raises(RuntimeError, match="already running"):
                await server.__aenter__()
            async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
                assert (await client.get("/debug/training/summary")).status_code == 200

    async def test_stopped_after_aclose(self) -> None:
        """aclose (what the bus calls) then the end of `async with` leaves it stopped too."""
        server = DebugServer()
        async with server:
            await server.aclose()
        with pytest.raises(RuntimeError, match="serves only once"):
            await server.__aenter__()
