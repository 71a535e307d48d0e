from __future__ import annotations

from pathlib import Path

import anyio
import httpx
import pytest

from eventbus_debug import DebugLevel, EventBus
from eventbus_debug.events import StepCompleted
from eventbus_debug.sinks import ReportWriter
from eventbus_debug.sinks.http import DebugServer
from tests.sinks.report.test_writer import scripted_events

pytestmark = pytest.mark.asyncio_only("uvicorn (DebugServer) runs only on asyncio")


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
    from eventbus_debug import sinks

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

                r = await client.post("/debug/level/ADVANCED", json={})
                assert r.json() == {"level": "advanced", "previous": "basic"}
                assert holder.level is DebugLevel.ADVANCED

                r = await client.post("/debug/clear", json={})
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
                r = await client.post("/debug/level/verbose", json={})
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
                assert (await client.post(f"{a.url}/debug/level/off", json={})).status_code == 200
                assert (await client.post(f"{b.url}/debug/level/off", json={})).status_code == 409
        assert setter.calls == [DebugLevel.OFF]

    async def test_token_guards_every_endpoint(self) -> None:
        """With a token, every endpoint (reads included) needs the bearer token."""
        holder = LevelHolder()
        async with (
            DebugServer(level=holder, token="s3cret") as server,
            httpx.AsyncClient(base_url=server.url, timeout=10) as client,
        ):
            with anyio.fail_after(10):
                assert (await client.post("/debug/level/extreme", json={})).status_code == 401
                bad = {"authorization": "Bearer wrong"}
                assert (await client.post("/debug/clear", headers=bad, json={})).status_code == 401
                assert holder.level.value == "basic"  # unchanged
                for path in ("/", "/metrics", "/debug/summary", "/debug/training/summary"):
                    r = await client.get(path)
                    assert r.status_code == 401, path
                    assert r.headers["www-authenticate"].startswith("Bearer")
                good = {"authorization": "Bearer s3cret"}
                r = await client.post("/debug/level/extreme", headers=good, json={})
                assert r.status_code == 200
                assert (await client.post("/debug/clear", headers=good, json={})).status_code == 200
                r = await client.get("/debug/training/summary", headers=good)
                assert r.status_code == 200
        assert holder.level is DebugLevel.EXTREME
        assert server.refused["token"] == 6

    def test_non_loopback_requires_a_token(self) -> None:
        """Binding to a public address without a token is refused before anything listens."""
        with pytest.raises(ValueError, match="not a loopback address"):
            DebugServer(host="0.0.0.0")
        with pytest.raises(ValueError, match="non-empty string"):
            DebugServer(host="0.0.0.0", token="")
        DebugServer(host="0.0.0.0", token="t")  # accepted, not started

    def test_malformed_tokens_and_hosts_are_refused(self) -> None:
        """A token that cannot travel in a header, or a bad allowed host, is a clear error."""
        for token in ("has space", "ünïcode", "tab\there"):
            with pytest.raises(ValueError, match="printable ASCII"):
                DebugServer(token=token)
        with pytest.raises(TypeError, match="token must be a str"):
            DebugServer(token=b"bytes")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="not one string"):
            DebugServer(allowed_hosts="example.org")
        with pytest.raises(ValueError, match="non-empty strings"):
            DebugServer(allowed_origins=[""])

    def test_bad_level_target(self) -> None:
        """A level target without set_level, level or __call__ is refused."""
        with pytest.raises(TypeError, match="set_level"):
            DebugServer(level=42)  # type: ignore[arg-type]

    async def test_live_report_at_root(self, tmp_path: Path) -> None:
        """GET / serves the live report page, with a script-free Content-Security-Policy."""
        report = ReportWriter(tmp_path, interval=None)
        await report.handle_batch(scripted_events(20))
        async with (
            DebugServer(report=report, title="live run") as server,
            httpx.AsyncClient(base_url=server.url, timeout=10) as client,
        ):
            with anyio.fail_after(10):
                r = await client.get("/")
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/html")
        assert "script-src" not in r.headers["content-security-policy"]
        assert "default-src 'none'" in r.headers["content-security-policy"]
        assert r.headers["x-frame-options"] == "DENY"
        assert r.headers["x-content-type-options"] == "nosniff"
        page = r.text
        assert page.startswith("<!DOCTYPE html>") and "<title>live run</title>" in page
        assert 'id="chart-loss"' in page and "gradient norm 500 &gt; 10" in page
        assert (tmp_path / "report.html").exists() is False  # served, never written

    async def test_prometheus_metrics(self) -> None:
        """/metrics exposes the run's counters and gauges in the Prometheus text format."""
        from prometheus_client.parser import text_string_to_metric_families

        holder = LevelHolder()
        events = [
            *scripted_events(20),
            StepCompleted(seq=999, step=20, loss=0.25, learning_rate=0.01, samples_per_s=128.0),
        ]
        async with (
            DebugServer(level=holder) as server,
            httpx.AsyncClient(base_url=server.url, timeout=10) as client,
        ):
            await server.handle_batch(events)
            with anyio.fail_after(10):
                r = await client.get("/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text)
            for s in family.samples
        }
        assert samples[("eventbus_debug_steps_total", ())] == 21
        assert samples[("eventbus_debug_events_total", (("kind", "step_checked"),))] == 20
        assert samples[("eventbus_debug_anomalies_total", (("kind", "gradient_exploded"),))] == 1
        assert samples[("eventbus_debug_incidents_total", ())] == sum(
            1 for e in events if e.is_incident
        )
        assert samples[("eventbus_debug_events_dropped_total", (("sink", "slow"),))] == 7
        assert samples[("eventbus_debug_recovery_decisions_total", (("action", "skip_step"),))] == 1
        assert samples[("eventbus_debug_loss", ())] == 0.25
        assert samples[("eventbus_debug_learning_rate", ())] == 0.01
        assert samples[("eventbus_debug_samples_per_second", ())] == 128.0
        assert samples[("eventbus_debug_grad_norm", ())] == pytest.approx(1.0 + 19 * 0.1)
        assert samples[("eventbus_debug_rss_bytes_peak", ())] == 119 * 1024 * 1024
        assert samples[("eventbus_debug_level", (("level", "basic"),))] == 1

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
