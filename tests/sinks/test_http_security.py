"""The debug server is safe by default: no token, Host, Origin or simple-request trick lets a
web page or a network neighbour read or steer a run (issue 12, point 7)."""

from __future__ import annotations

import functools
import hmac
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import httpx
import pytest

from eventbus_debug import DebugLevel
from eventbus_debug.sinks import ReportWriter, _http_guard, http as http_module
from eventbus_debug.sinks.http import DebugServer
from tests.sinks._chromium import dump_dom, needs_chromium
from tests.sinks.report.test_writer import scripted_events
from tests.sinks.test_http import LevelHolder

pytestmark = pytest.mark.asyncio_only("uvicorn (DebugServer) runs only on asyncio")

JSON = {"content-type": "application/json"}


async def _post(client: httpx.AsyncClient, path: str, **headers: str) -> httpx.Response:
    return await client.post(path, content=b"{}", headers={**JSON, **headers})


class TestHost:
    async def test_foreign_host_header_is_refused(self) -> None:
        """A Host header naming another site (DNS rebinding) gets 400 on reads and writes."""
        holder = LevelHolder()
        async with (
            DebugServer(level=holder) as server,
            httpx.AsyncClient(base_url=server.url, timeout=10) as client,
        ):
            with anyio.fail_after(10):
                evil = {"host": f"rebind.example:{server.port}"}
                for path in ("/", "/metrics", "/debug/summary", "/debug/events"):
                    r = await client.get(path, headers=evil)
                    assert r.status_code == 400, path
                    assert "Host header" in r.json()["error"]
                r = await _post(client, "/debug/level/off", **evil)
                assert r.status_code == 400
                for good in (f"localhost:{server.port}", f"127.0.0.1:{server.port}", "LOCALHOST"):
                    r = await client.get("/debug/training/summary", headers={"host": good})
                    assert r.status_code == 200, good
        assert holder.level is DebugLevel.BASIC
        assert server.refused["host"] == 5

    async def test_malformed_host_headers_are_refused(self) -> None:
        """Empty, spaced, userinfo-carrying, bracket-broken or non-ASCII Host headers: 400."""
        async with (
            DebugServer() as server,
            httpx.AsyncClient(base_url=server.url, timeout=10) as client,
        ):
            with anyio.fail_after(10):
                for bad in (
                    b"",
                    b"127.0.0.1 evil",
                    b"evil.example@127.0.0.1",
                    b"[::1",
                    b"[::1]:x",
                    b"[::1]80",
                    b"127.0.0.1:80:80",
                    b"127.0.0.1:x",
                    "lоcalhost".encode(),  # Cyrillic o
                ):
                    r = await client.get("/debug/summary", headers=[(b"host", bad)])
                    assert r.status_code == 400, bad

    async def test_allowed_hosts_extend_the_check(self) -> None:
        """allowed_hosts adds names; '*' turns the check off (behind a checking proxy)."""
        async with (
            DebugServer(allowed_hosts=["Debug.Internal."]) as named,
            DebugServer(allowed_hosts=["*"]) as anything,
            httpx.AsyncClient(timeout=10) as client,
        ):
            with anyio.fail_after(10):
                host = {"host": "debug.internal:1234"}
                assert (
                    await client.get(f"{named.url}/debug/summary", headers=host)
                ).status_code == 200
                other = {"host": "other.internal"}
                assert (
                    await client.get(f"{named.url}/debug/summary", headers=other)
                ).status_code == 400
                assert (
                    await client.get(f"{anything.url}/debug/summary", headers=other)
                ).status_code == 200


class TestMutations:
    async def test_cross_origin_mutations_are_refused(self) -> None:
        """A POST from another origin, a 'null' origin or a cross-site fetch gets 403."""
        holder = LevelHolder()
        async with (
            DebugServer(level=holder, allowed_origins=["https://dash.example"]) as server,
            httpx.AsyncClient(base_url=server.url, timeout=10) as client,
        ):
            with anyio.fail_after(10):
                for origin in (
                    "http://evil.example",
                    "null",
                    f"http://127.0.0.1:{server.port + 1}",
                    f"https://127.0.0.1:{server.port}",
                    f"http://rebind.example:{server.port}",
                ):
                    r = await _post(client, "/debug/level/off", origin=origin)
                    assert r.status_code == 403, origin
                r = await _post(client, "/debug/clear", **{"sec-fetch-site": "cross-site"})
                assert r.status_code == 403
                r = await _post(client, "/debug/clear", **{"sec-fetch-site": "same-site"})
                assert r.status_code == 403
                assert holder.level is DebugLevel.BASIC
                for origin in (
                    server.url,
                    f"http://localhost:{server.port}",
                    "https://dash.example",
                ):
                    r = await _post(client, "/debug/level/advanced", origin=origin)
                    assert r.status_code == 200, origin
                r = await _post(client, "/debug/clear", **{"sec-fetch-site": "same-origin"})
                assert r.status_code == 200
        assert holder.level.value == "advanced"
        assert server.refused["origin"] == 7

    async def test_simple_requests_cannot_mutate(self) -> None:
        """Requests a page can send without a preflight (form, text/plain, no type) get 415;
        a preflight is never answered."""
        holder = LevelHolder()
        async with (
            DebugServer(level=holder) as server,
            httpx.AsyncClient(base_url=server.url, timeout=10) as client,
        ):
            with anyio.fail_after(10):
                for ctype in (
                    "text/plain",
                    "application/x-www-form-urlencoded",
                    "multipart/form-data; boundary=x",
                    "application/jsonp",
                ):
                    r = await client.post(
                        "/debug/level/off", content=b"{}", headers={"content-type": ctype}
                    )
                    assert r.status_code == 415, ctype
                r = await client.post("/debug/clear")
                assert r.status_code == 415
                r = await client.request("OPTIONS", "/debug/clear")
                assert r.status_code == 403
                assert "access-control-allow-origin" not in r.headers
                r = await client.post(
                    "/debug/level/off",
                    content=b"{}",
                    headers={"content-type": "Application/JSON; charset=utf-8"},
                )
                assert r.status_code == 200
        assert holder.level is DebugLevel.OFF
        assert server.refused == {"content_type": 5, "preflight": 1}

    async def test_bodies_must_be_one_json_object(self) -> None:
        """A JSON request whose body is not a JSON object is a 400; a huge one a 413."""
        holder = LevelHolder()
        async with (
            DebugServer(level=holder) as server,
            httpx.AsyncClient(base_url=server.url, timeout=10) as client,
        ):
            with anyio.fail_after(10):
                for body in (b"[1]", b"not json", b'"text"'):
                    r = await client.post("/debug/level/off", content=body, headers=JSON)
                    assert r.status_code == 400, body
                huge = b'{"x": "' + b"a" * (http_module.MAX_BODY_BYTES + 10) + b'"}'
                r = await client.post("/debug/clear", content=huge, headers=JSON)
                assert r.status_code == 413
        assert holder.level is DebugLevel.BASIC


class TestToken:
    async def test_off_loopback_every_endpoint_needs_the_token(self, tmp_path: Path) -> None:
        """Bound to all interfaces, reads and writes need the token; bad headers are 401s."""
        holder = LevelHolder()
        report = ReportWriter(tmp_path, interval=None)
        await report.handle_batch(scripted_events(5))
        async with DebugServer(host="0.0.0.0", token="tok-123", report=report, level=holder) as s:
            base = f"http://127.0.0.1:{s.port}"
            async with httpx.AsyncClient(base_url=base, timeout=10) as client:
                with anyio.fail_after(10):
                    for path in ("/", "/metrics", "/debug/summary", "/debug/events"):
                        assert (await client.get(path)).status_code == 401, path
                    for header in (
                        "Bearer tok-12",
                        "Bearer tok-1234",
                        "Basic tok-123",
                        "Bearer",
                        "tok-123",
                        "Bearer  tok-123 extra",
                    ):
                        r = await client.get("/debug/summary", headers={"authorization": header})
                        assert r.status_code == 401, header
                    for raw in (
                        "Bearer tök-123".encode(),
                        b"Bearer \xff\xfe",
                        "Bearer 🔑".encode(),
                    ):
                        r = await client.get("/debug/summary", headers=[(b"authorization", raw)])
                        assert r.status_code == 401, raw
                    assert (await _post(client, "/debug/clear")).status_code == 401
                    ok = {"authorization": "bearer tok-123"}
                    for path in ("/", "/metrics", "/debug/summary", "/debug/events"):
                        assert (await client.get(path, headers=ok)).status_code == 200, path
        assert report.summary().events > 0  # never cleared
        assert holder.level is DebugLevel.BASIC
        assert s.refused["token"] == 14

    async def test_token_is_compared_in_constant_time_on_bytes(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Every token check goes through hmac.compare_digest on bytes, never on str."""
        seen: list[tuple[type, type]] = []
        original = hmac.compare_digest

        def spy(a: Any, b: Any) -> bool:
            seen.append((type(a), type(b)))
            return original(a, b)

        monkeypatch.setattr(hmac, "compare_digest", spy)
        async with (
            DebugServer(token="abc") as server,
            httpx.AsyncClient(base_url=server.url, timeout=10) as client,
        ):
            with anyio.fail_after(10):
                await client.get("/debug/summary", headers={"authorization": "Bearer abd"})
                await client.get("/debug/summary", headers=[(b"authorization", b"Bearer \xe9")])
                r = await client.get("/debug/summary", headers={"authorization": "Bearer abc"})
        assert r.status_code == 200
        assert seen == [(bytes, bytes)] * 3

    async def test_security_headers_on_every_answer(self) -> None:
        """Refusals and successes alike carry nosniff, DENY framing and no-store."""
        async with (
            DebugServer(token="abc") as server,
            httpx.AsyncClient(base_url=server.url, timeout=10) as client,
        ):
            with anyio.fail_after(10):
                refused = await client.get("/debug/summary")
                ok = await client.get("/debug/summary", headers={"authorization": "Bearer abc"})
        for r in (refused, ok):
            assert r.headers["x-content-type-options"] == "nosniff"
            assert r.headers["x-frame-options"] == "DENY"
            assert r.headers["cache-control"] == "no-store"
            assert "server" not in r.headers


# -- a real browser -----------------------------------------------------------------------------

ATTACK_PAGE = """<!DOCTYPE html><html><head><title>attacker</title></head><body>
<pre id="log"></pre>
<iframe name="sink" id="sink"></iframe>
<form id="form" method="POST" action="__DEBUG__/debug/clear" target="sink">
<input name="x" value="1"></form>
<script>
const D = "__DEBUG__";
const log = (k, v) => { document.getElementById("log").textContent += k + "=" + v + "\\n"; };
async function attempt(name, url, opts) {
  try { const r = await fetch(url, opts); log(name, "status:" + r.status); }
  catch (e) { log(name, "blocked:" + e.name); }
}
(async () => {
  await attempt("json", D + "/debug/level/extreme",
    {method: "POST", headers: {"Content-Type": "application/json"}, body: "{}"});
  await attempt("simple", D + "/debug/level/extreme",
    {method: "POST", mode: "no-cors", headers: {"Content-Type": "text/plain"}, body: "{}"});
  await attempt("custom", D + "/debug/clear",
    {method: "POST", headers: {"X-Requested-With": "fetch"}, body: "{}"});
  await attempt("read", D + "/debug/summary", {});
  document.getElementById("form").submit();
  setTimeout(() => { log("done", "1"); document.title = "finished"; }, 800);
})();
</script></body></html>
"""


@pytest.fixture
def attacker_site() -> Iterator[tuple[str, dict[str, str]]]:
    """A second tiny local server, on another port (another origin), serving one page."""
    pages: dict[str, str] = {}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = pages.get(self.path, "not found").encode()
            self.send_response(200 if self.path in pages else 404)
            self.send_header("content-type", "text/html; charset=utf-8")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", pages
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


@needs_chromium
async def test_page_of_another_origin_cannot_steer_the_run(
    tmp_path: Path, attacker_site: tuple[str, dict[str, str]]
) -> None:
    """In Chromium, a page of another origin tries fetch() (JSON, no-cors text/plain, custom
    header), a read, and a form POST against the debug server: nothing changes, nothing is
    read, and the server saw and refused the requests that reached it."""
    site, pages = attacker_site
    holder = LevelHolder()
    report = ReportWriter(tmp_path / "report", interval=None)
    await report.handle_batch(scripted_events(10))
    events_before = report.summary().events
    async with DebugServer(report=report, level=holder) as server:
        pages["/attack.html"] = ATTACK_PAGE.replace("__DEBUG__", server.url)
        dom = await anyio.to_thread.run_sync(
            functools.partial(dump_dom, f"{site}/attack.html", tmp_path / "profile", budget_ms=5000)
        )
    assert "done=1" in dom, dom  # the attack script ran to its end
    assert "json=blocked:TypeError" in dom  # preflight not answered: the browser gave up
    assert "custom=blocked:TypeError" in dom
    assert "read=blocked:TypeError" in dom  # no CORS: the summary cannot be read
    assert "simple=status:0" in dom  # opaque: sent, but refused by the server
    assert holder.level is DebugLevel.BASIC
    assert report.summary().events == events_before
    # the no-cors fetch and the form POST reached the server and were refused for their Origin;
    # the preflights (OPTIONS with an Origin) as well
    assert server.refused.get("origin", 0) >= 3, server.refused


@needs_chromium
async def test_dns_rebinding_page_gets_no_report(tmp_path: Path) -> None:
    """In Chromium, a host name that resolves to 127.0.0.1 (a rebinding attacker's) gets a
    400 instead of the report, while http://localhost:PORT/ shows it."""
    report = ReportWriter(tmp_path / "report", interval=None)
    await report.handle_batch(scripted_events(10))
    async with DebugServer(report=report) as server:
        rules = "--host-resolver-rules=MAP rebind.test 127.0.0.1"
        rebound = await anyio.to_thread.run_sync(
            functools.partial(
                dump_dom, f"http://rebind.test:{server.port}/", tmp_path / "p1", rules
            )
        )
        direct = await anyio.to_thread.run_sync(
            functools.partial(dump_dom, f"http://localhost:{server.port}/", tmp_path / "p2")
        )
    assert "Host header" in rebound and 'id="chart-loss"' not in rebound
    assert 'id="chart-loss"' in direct and "gradient norm 500" in direct
    assert server.refused["host"] >= 1


@pytest.mark.parametrize(
    ("header", "host"),
    [
        (b"127.0.0.1:8080", "127.0.0.1"),
        (b"LocalHost.", "localhost"),
        (b"[::1]:8080", "::1"),
        (b"[::1]", "::1"),
        (b"[::1]:", None),
        (b"a:1:2", None),
        (b"\xffhost", None),
        (b"host/path", None),
    ],
)
def test_host_header_parsing(header: bytes, host: str | None) -> None:
    """The Host header's name is parsed strictly: port removed, anything odd refused."""
    assert _http_guard._host_of(header) == host
