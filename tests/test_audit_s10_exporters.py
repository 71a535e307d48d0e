"""Audit regressions for the exporter and view sinks (the debug server)."""

from __future__ import annotations

import anyio
import pytest

from eventbus_debug import DebugLevel
from eventbus_debug.events import StepCompleted

pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from eventbus_debug.sinks.http import DebugServer  # noqa: E402

pytestmark = pytest.mark.asyncio_only("uvicorn (DebugServer) runs only on asyncio")


async def test_server_after_a_cancelled_server_answers() -> None:
    """A server whose ``async with`` body was cancelled releases its listener with the loop:
    the next server (often on the same file descriptor) answers instead of hanging."""
    with anyio.move_on_after(0.2):
        async with DebugServer():
            await anyio.sleep(10)
    async with DebugServer() as server, httpx.AsyncClient(base_url=server.url, timeout=3) as c:
        assert (await c.get("/debug/summary")).status_code == 200


async def test_server_after_a_failed_body_answers() -> None:
    """An exception in the body propagates as it is (no ExceptionGroup); the next server answers."""
    with pytest.raises(KeyError):
        async with DebugServer():
            raise KeyError("boom")
    async with DebugServer() as server, httpx.AsyncClient(base_url=server.url, timeout=3) as c:
        assert (await c.get("/metrics")).status_code == 200


async def test_callable_level_target_reports_the_level_set() -> None:
    """With a callable ``level=`` target, the summary and ``/metrics`` show the level set."""
    seen: list[DebugLevel] = []
    async with (
        DebugServer(level=seen.append) as server,
        httpx.AsyncClient(base_url=server.url, timeout=3) as c,
    ):
        assert (await c.get("/debug/summary")).json()["level"] is None
        assert (await c.post("/debug/level/ADVANCED", json={})).status_code == 200
        assert seen == [DebugLevel.ADVANCED]
        assert (await c.get("/debug/summary")).json()["level"] == "advanced"
        assert 'eventbus_debug_level{level="advanced"} 1.0' in (await c.get("/metrics")).text
        again = (await c.post("/debug/level/basic", json={})).json()
        assert again == {"level": "basic", "previous": "advanced"}


async def test_events_more_is_false_on_the_last_full_page() -> None:
    """``more`` says whether events are left: not when the page ends exactly at the last one."""
    server = DebugServer()
    await server.handle_batch([StepCompleted(step=i, loss=1.0, seq=i + 1) for i in range(4)])
    async with server, httpx.AsyncClient(base_url=server.url, timeout=3) as c:
        first = (await c.get("/debug/events", params={"since": 0, "limit": 2})).json()
        assert [e["seq"] for e in first["events"]] == [1, 2] and first["more"] is True
        last = (await c.get("/debug/events", params={"since": 2, "limit": 2})).json()
        assert [e["seq"] for e in last["events"]] == [3, 4] and last["more"] is False
        assert last["last_seq"] == 4
