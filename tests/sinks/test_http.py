from __future__ import annotations

from pathlib import Path

import anyio
import httpx
import pytest

from eventbus_debug import DebugLevel, EventBus
from eventbus_debug.events import StepCompleted
from sinks import ReportWriter
from sinks.http import DebugServer
from tests.sinks.test_report import scripted_events


class LevelHolder:
    """Like the probes' level-carrying objects: a settable ``level`` attribute."""

    def __init__(self) -> None:
        self.level: DebugLevel = DebugLevel.BASIC


class Setter:
    def __init__(self) -> None:
        self.calls: list[DebugLevel] = []

    def set_level(self, level: DebugLevel) -> None:
        self.calls.append(level)


def test_sinks_package_does_not_export_http() -> None:
    """`import sinks` works without the optional extra: sinks.http is imported on demand."""
    import sinks

    assert "DebugServer" not in sinks.__all__
    assert not hasattr(sinks, "DebugServer")


class TestEndpoints:
    async def test_summaries_level_clear_and_events(self, tmp_path: Path) -> None:
        """Every endpoint on a real server bound to a loopback ephemeral port."""
        report = ReportWriter(tmp_path, interval=None)
        await report.handle_batch(scripted_events(20))
        holder = LevelHolder()
        async with (
            DebugServer(report=report, level=holder) as server,
            httpx.AsyncClient(base_url=server.url, timeout=10) as client,
        ):
            assert server.port > 0 and server.url.startswith("http://127.0.0.1:")
            await server.handle_batch([StepCompleted(seq=i, step=i, loss=1.0) for i in range(1, 6)])
            with anyio.fail_after(10):
                r = await client.get("/debug/training/summary")
                assert r.status_code == 200
                training = r.json()
                assert training["total_steps"] == 20
                assert training["gradient_explosions"] == 1
                assert training["anomaly_rate"] == pytest.approx(0.25)

                r = await client.get("/debug/summary")
                body = r.json()
                assert body["level"] == "basic" and body["events_buffered"] == 5
                assert body["report"]["recovery_decisions"] == {"clip_gradients": 1, "skip_step": 1}

                r = await client.get("/debug/events", params={"since": 3})
                assert [e["seq"] for e in r.json()["events"]] == [4, 5]
                assert r.json()["last_seq"] == 5
                r = await client.get("/debug/events", params={"since": 0, "limit": 2})
                assert [e["seq"] for e in r.json()["events"]] == [1, 2] and r.json()["more"]
                r = await client.get("/debug/events", params={"since": "x"})
                assert r.status_code == 400

                r = await client.post("/debug/level/ADVANCED")
                assert r.json() == {"level": "advanced", "previous": "basic"}
                assert holder.level is DebugLevel.ADVANCED

                r = await client.post("/debug/clear")
                assert r.json()["cleared"] is True
                assert report.summary().events == 0
                r = await client.get("/debug/events")
                assert r.json()["events"] == []

    async def test_unknown_level_lists_valid_ones(self) -> None:
        """An unknown level is a 400 that lists the valid levels; nothing changes."""
        setter = Setter()
        async with (
            DebugServer(level=setter) as server,
            httpx.AsyncClient(base_url=server.url, timeout=10) as client,
        ):
            with anyio.fail_after(10):
                r = await client.post("/debug/level/verbose")
        assert r.status_code == 400
        assert r.json()["valid"] == ["off", "basic", "advanced", "extreme"]
        assert "verbose" in r.json()["error"]
        assert setter.calls == []

    async def test_level_via_set_level_and_missing_target(self) -> None:
        """set_level(level) is preferred; without a target the endpoint answers 409."""
        setter = Setter()
        async with (
            DebugServer(level=setter) as a,
            DebugServer() as b,
            httpx.AsyncClient(timeout=10) as client,
        ):
            with anyio.fail_after(10):
                assert (await client.post(f"{a.url}/debug/level/off")).status_code == 200
                assert (await client.post(f"{b.url}/debug/level/off")).status_code == 409
        assert setter.calls == [DebugLevel.OFF]

    async def test_token_guards_mutating_endpoints(self) -> None:
        """With a token, POSTs need the bearer token; GETs stay open."""
        holder = LevelHolder()
        async with (
            DebugServer(level=holder, token="s3cret") as server,
            httpx.AsyncClient(base_url=server.url, timeout=10) as client,
        ):
            with anyio.fail_after(10):
                assert (await client.post("/debug/level/extreme")).status_code == 401
                bad = {"authorization": "Bearer wrong"}
                assert (await client.post("/debug/clear", headers=bad)).status_code == 401
                assert holder.level.value == "basic"  # unchanged
                good = {"authorization": "Bearer s3cret"}
                assert (await client.post("/debug/level/extreme", headers=good)).status_code == 200
                assert (await client.post("/debug/clear", headers=good)).status_code == 200
                assert (await client.get("/debug/training/summary")).status_code == 200
        assert holder.level is DebugLevel.EXTREME

    def test_non_loopback_requires_a_token(self) -> None:
        """Binding to a public address without a token is refused before anything listens."""
        with pytest.raises(ValueError, match="not a loopback address"):
            DebugServer(host="0.0.0.0")
        DebugServer(host="0.0.0.0", token="t")  # accepted, not started

    def test_bad_level_target(self) -> None:
        """A level target without set_level, level or __call__ is refused."""
        with pytest.raises(TypeError, match="set_level"):
            DebugServer(level=42)

    async def test_as_a_bus_sink(self) -> None:
        """Subscribed to a bus, the server serves its events and its own summary."""
        async with (
            EventBus(close_timeout=5) as bus,
            DebugServer() as server,
            httpx.AsyncClient(base_url=server.url, timeout=10) as client,
        ):
            sub = bus.subscribe(server)
            for event in scripted_events(5):
                bus.publish_nowait(event)
            with anyio.fail_after(10):
                await bus.drain(sub)
                events = (
                    await client.get("/debug/events", params={"kind": "step_completed"})
                ).json()
                summary = (await client.get("/debug/training/summary")).json()
        assert [e["step"] for e in events["events"]] == [0, 1, 2, 3, 4]
        assert summary["total_steps"] == 5
