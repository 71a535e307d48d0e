from __future__ import annotations

import contextlib
import io
import logging
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import orjson
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from eventbus_debug import EventBus
from eventbus_debug.events import (
    Event,
    GradientExploded,
    NonFiniteDetected,
    ResourceThresholdExceeded,
    Severity,
    StepCompleted,
    SystemSampled,
    TensorRole,
)
from eventbus_debug.sinks import (
    Alert,
    AlertHandlerFailed,
    AlertRule,
    AlertSink,
    FileAlert,
    LogAlert,
    StderrAlert,
    WebhookAlert,
    alert_to_dict,
    rules,
)
from eventbus_debug.sinks.lines import format_event
from eventbus_debug.testing import capture_events


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class _NullBus:
    def __init__(self) -> None:
        self.published: list[Event] = []

    def publish_nowait(self, event: Event, /) -> None:
        self.published.append(event)


def explosion(step: int, norm: float = 100.0, rank: int = 0) -> GradientExploded:
    return GradientExploded(step=step, rank=rank, total_norm=norm, threshold=10.0)


@pytest.fixture(name="clock")
def _clock() -> FakeClock:
    return FakeClock()


class TestCooldown:
    async def test_thousand_repeats_in_a_minute_reach_the_handler_twice(
        self, clock: FakeClock
    ) -> None:
        """1,000 identical alerts within the cooldown: the first is delivered at once, the
        other 999 in one summary once the cooldown is over."""
        sink = AlertSink(_NullBus(), clock=clock)
        got: list[Alert] = []

        @sink.on(GradientExploded, cooldown=60.0)
        async def handler(alert: Alert) -> None:
            got.append(alert)

        for i in range(1000):
            clock.now += 0.05
            await sink.handle(explosion(i))
        assert [(a.count, a.suppressed, a.summary) for a in got] == [(1, 0, False)]
        assert sink.statistics().pending == 999
        assert await sink.flush() == 0  # cooldown not over yet
        clock.now += 60.0
        assert await sink.flush() == 1
        assert [(a.count, a.suppressed, a.summary) for a in got] == [
            (1, 0, False),
            (999, 999, True),
        ]
        assert got[1].event.step == 999
        assert "x999" in got[1].message
        stats = sink.statistics()
        assert (stats.matched, stats.delivered, stats.suppressed, stats.pending) == (
            1000,
            2,
            999,
            0,
        )

    async def test_next_event_after_cooldown_carries_the_count(self, clock: FakeClock) -> None:
        """A repeat arriving after the cooldown is delivered with the held-back count."""
        sink = AlertSink(_NullBus(), clock=clock)
        got: list[Alert] = []
        sink.add_rule(AlertRule(event_types=(GradientExploded,), cooldown=10.0), got.append)
        await sink.handle(explosion(0))
        clock.now += 1
        await sink.handle(explosion(1))
        await sink.handle(explosion(2))
        clock.now += 10
        await sink.handle(explosion(3))
        assert [(a.event.step, a.count, a.suppressed) for a in got] == [(0, 1, 0), (3, 3, 2)]

    async def test_keys_dedup_separately(self, clock: FakeClock) -> None:
        """Different dedup keys (here: ranks) do not suppress each other."""
        sink = AlertSink(_NullBus(), clock=clock)
        got: list[Alert] = []
        sink.add_rule(AlertRule(event_types=(GradientExploded,)), got.append)
        for rank in (0, 1, 0, 1):
            await sink.handle(explosion(1, rank=rank))
        assert [a.event.rank for a in got] == [0, 1]

    async def test_close_delivers_pending_summaries(self, clock: FakeClock) -> None:
        """aclose() reports every held-back repeat, whatever the cooldown."""
        sink = AlertSink(_NullBus(), clock=clock)
        got: list[Alert] = []
        sink.add_rule(AlertRule(event_types=(GradientExploded,), cooldown=3600), got.append)
        for i in range(5):
            await sink.handle(explosion(i))
        await sink.aclose()
        await sink.aclose()
        assert [(a.count, a.summary) for a in got] == [(1, False), (4, True)]

    async def test_run_flusher_delivers_summaries_when_events_stop(self, clock: FakeClock) -> None:
        """With run_flusher in a task group, a summary goes out once the cooldown is over even
        though no further event arrives."""
        sink = AlertSink(_NullBus(), clock=clock, flush_interval=0.01)
        got: list[Alert] = []
        summary_seen = anyio.Event()

        async def handler(alert: Alert) -> None:
            got.append(alert)
            if alert.summary:
                summary_seen.set()

        sink.add_rule(AlertRule(event_types=(GradientExploded,), cooldown=30.0), handler)
        for i in range(3):
            await sink.handle(explosion(i))
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                await tg.start(sink.run_flusher)
                clock.now += 30.0
                await summary_seen.wait()
                tg.cancel_scope.cancel()
        assert [(a.count, a.summary) for a in got] == [(1, False), (2, True)]


class TestRateLimit:
    async def test_rate_limit_caps_deliveries_per_window(self, clock: FakeClock) -> None:
        """At most rate_limit deliveries per window; the rest arrive later as summaries."""
        sink = AlertSink(_NullBus(), clock=clock)
        got: list[Alert] = []
        sink.add_rule(
            AlertRule(
                event_types=(GradientExploded,),
                cooldown=0,
                rate_limit=3,
                rate_window=60.0,
                key=lambda e: e.step,
            ),
            got.append,
        )
        for i in range(10):
            clock.now += 1
            await sink.handle(explosion(i))
        assert [a.event.step for a in got] == [0, 1, 2]
        assert sink.statistics().pending == 7
        clock.now += 60
        assert await sink.flush() == 3  # still rate limited: 3 summaries per window
        clock.now += 60
        assert await sink.flush() == 3
        clock.now += 60
        assert await sink.flush() == 1
        assert sum(a.count for a in got) == 10


class TestMatching:
    async def test_severity_and_predicate_filter(self, clock: FakeClock) -> None:
        """min_severity and when= both have to pass."""
        sink = AlertSink(_NullBus(), clock=clock)
        got: list[Alert] = []

        @sink.on(Event, min_severity=Severity.ERROR, cooldown=0)
        def errors(alert: Alert) -> None:
            got.append(alert)

        @sink.on(GradientExploded, when=lambda e: e.total_norm > 1000, cooldown=0)
        def huge(alert: Alert) -> None:
            got.append(alert)

        await sink.handle(StepCompleted(step=1, loss=1.0))
        await sink.handle(explosion(2, norm=50.0))
        await sink.handle(explosion(3, norm=5000.0))
        await sink.handle(NonFiniteDetected(step=4, role=TensorRole.LOSS, names=("loss",)))
        assert sorted((a.rule.name, a.event.step) for a in got) == [
            ("Event", 4),
            ("GradientExploded", 3),
        ]

    def test_rule_validation(self) -> None:
        """Bad rules are refused with messages naming the argument."""
        with pytest.raises(ValueError, match="event_types must name"):
            AlertRule(event_types=())
        with pytest.raises(TypeError, match="Event subclasses"):
            AlertRule(event_types=(int,))  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="cooldown"):
            AlertRule(event_types=(Event,), cooldown=-1)
        with pytest.raises(ValueError, match="rate_limit"):
            AlertRule(event_types=(Event,), rate_limit=0)
        with pytest.raises(TypeError, match="handler must be"):
            AlertSink(_NullBus()).add_rule(AlertRule(event_types=(Event,)), 3)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="timeout"):
            AlertSink(_NullBus(), timeout=0)

    def test_rules_are_frozen_values(self) -> None:
        """Rules compare by value and cannot be mutated; ready rules are equal when rebuilt."""
        assert rules.cpu_above(90) == rules.cpu_above(90)
        assert rules.cpu_above(90) != rules.cpu_above(80)
        with pytest.raises(AttributeError):
            rules.non_finite().cooldown = 1.0  # type: ignore[misc]
        assert AlertRule(event_types=GradientExploded).event_types == (GradientExploded,)  # type: ignore[arg-type]

    @pytest.mark.parametrize(
        ("rule", "event", "fires"),
        [
            (
                rules.cpu_above(sustain=1),
                SystemSampled(cpu_percent=95, memory_percent=1, disk_percent=1),
                True,
            ),
            (
                rules.cpu_above(),
                SystemSampled(cpu_percent=95, memory_percent=1, disk_percent=1),
                False,
            ),
            (
                rules.cpu_above(),
                SystemSampled(cpu_percent=50, memory_percent=1, disk_percent=1),
                False,
            ),
            (
                rules.memory_above(sustain=1),
                SystemSampled(cpu_percent=1, memory_percent=93, disk_percent=1),
                True,
            ),
            (
                rules.gpu_memory_above(),
                SystemSampled(cpu_percent=1, memory_percent=1, disk_percent=1),
                False,
            ),
            (
                rules.gpu_memory_above(),
                ResourceThresholdExceeded(metric="gpu_memory_percent", value=97, threshold=90),
                True,
            ),
            (
                rules.cpu_above(),
                ResourceThresholdExceeded(metric="memory_percent", value=97, threshold=90),
                False,
            ),
            (rules.gradient_explosion(), explosion(1), True),
            (rules.non_finite(), NonFiniteDetected(role=TensorRole.GRADIENT, names=("w",)), True),
            (rules.non_finite(), explosion(1), False),
        ],
    )
    def test_ready_rules(self, rule: AlertRule, event: Event, fires: bool) -> None:
        """The ready rules fire on the seeds' thresholds, from samples or threshold incidents."""
        assert rule.matches(event) is fires

    def test_resource_rules_need_sustained_pressure(self) -> None:
        """A busy reading is not an alert; three in a row are; a dip below starts over."""
        rule = rules.cpu_above(90)

        def cpu(value: float, rank: int = 0) -> SystemSampled:
            return SystemSampled(cpu_percent=value, memory_percent=1, disk_percent=1, rank=rank)

        seen = [rule.matches(cpu(v)) for v in (95, 96, 50, 95, 97, 99, 99)]
        assert seen == [False, False, False, False, False, True, True]
        # Ranks count separately: rank 1's first busy reading is not an alert.
        assert rule.matches(cpu(99, rank=1)) is False
        with pytest.raises(ValueError, match="sustain must be an integer >= 1"):
            rules.memory_above(sustain=0)

    def test_defaults(self) -> None:
        """rules.defaults() covers memory, GPU memory, explosion and NaN (a busy CPU is normal)."""
        names = [r.name for r in rules.defaults()]
        assert names == [
            "memory_percent>90",
            "gpu_memory_percent>90",
            "gradient_explosion",
            "non_finite",
        ]


class TestIsolation:
    async def test_raising_handler_is_reported_and_others_run(self, bus: EventBus) -> None:
        """A handler that raises becomes an AlertHandlerFailed incident; the others still run."""
        sink = AlertSink(bus)
        got: list[Alert] = []

        @sink.on(GradientExploded)
        async def broken(alert: Alert) -> None:
            raise RuntimeError("pager service down")

        @sink.on(GradientExploded)
        async def fine(alert: Alert) -> None:
            got.append(alert)

        sub = bus.subscribe(sink)
        async with capture_events(bus, AlertHandlerFailed) as failures:
            bus.publish_nowait(explosion(7))
            with anyio.fail_after(5):
                await bus.drain(sub)
        assert len(got) == 1
        [failure] = failures
        assert isinstance(failure, AlertHandlerFailed)
        assert failure.handler.endswith("broken")
        assert failure.error_type == "RuntimeError"
        assert "pager service down" in failure.message
        assert failure.event_kind == "gradient_exploded" and failure.step == 7
        assert not failure.timed_out
        assert sink.statistics().failed == 1

    async def test_hanging_handlers_time_out_without_blocking_others(self) -> None:
        """An async handler and a sync handler that hang are cancelled at the timeout and
        reported; a third handler is not delayed by them."""
        bus = _NullBus()
        sink = AlertSink(bus, timeout=0.2)
        release = threading.Event()
        got: list[Alert] = []

        @sink.on(GradientExploded, name="async-hang")
        async def hang_async(alert: Alert) -> None:
            await anyio.sleep_forever()

        @sink.on(GradientExploded, name="sync-hang")
        def hang_sync(alert: Alert) -> None:
            release.wait(10)

        @sink.on(GradientExploded, name="quick")
        async def quick(alert: Alert) -> None:
            got.append(alert)

        try:
            with anyio.fail_after(5):
                await sink.handle(explosion(1))
        finally:
            release.set()
        assert len(got) == 1
        failed = sorted(
            (e.rule, e.timed_out) for e in bus.published if isinstance(e, AlertHandlerFailed)
        )
        assert failed == [("async-hang", True), ("sync-hang", True)]
        assert sink.statistics().timed_out == 2

    async def test_sync_handlers_run_in_a_worker_thread(self) -> None:
        """A sync handler never runs on the event loop's thread."""
        sink = AlertSink(_NullBus())
        threads: list[int] = []
        sink.add_rule(
            AlertRule(event_types=(GradientExploded,)),
            lambda a: threads.append(threading.get_ident()),
        )
        await sink.handle(explosion(1))
        assert threads and threads[0] != threading.get_ident()

    async def test_own_failures_are_not_alerted_on(self, bus: EventBus) -> None:
        """A catch-all rule whose handler fails does not loop on its own failure incidents."""
        sink = AlertSink(bus)
        calls: list[str] = []

        @sink.on(Event, min_severity=Severity.WARNING, cooldown=0)
        async def broken(alert: Alert) -> None:
            calls.append(alert.event.kind)
            raise ValueError("nope")

        sub = bus.subscribe(sink)
        bus.publish_nowait(explosion(1))
        with anyio.fail_after(5):
            await bus.drain(sub)
            await bus.drain(sub)
        assert calls == ["gradient_exploded"]


class TestBuiltinHandlers:
    async def test_file_alert_appends_json_lines(self, tmp_path: Path) -> None:
        """FileAlert appends one decodable JSON object per alert, NaN kept as a token."""
        path = tmp_path / "alerts" / "alerts.jsonl"
        sink = AlertSink(_NullBus())
        sink.add_rule(AlertRule(event_types=(GradientExploded,), cooldown=0), FileAlert(path))
        await sink.handle(explosion(1, norm=float("nan")))
        await sink.handle(explosion(2))
        lines = [orjson.loads(line) for line in path.read_bytes().splitlines()]
        assert [line["step"] for line in lines] == [1, 2]
        assert lines[0]["event"]["total_norm"] == "NaN"
        assert lines[0]["rule"] == "GradientExploded"

    async def test_stderr_alert_writes_one_line(self) -> None:
        """StderrAlert writes the alert's message as one line."""
        stream = io.StringIO()
        sink = AlertSink(_NullBus())
        sink.add_rule(rules.gradient_explosion(), StderrAlert(stream))
        event = explosion(3)
        await sink.handle(event)
        out = stream.getvalue()
        assert out == format_event(event) + "\n"  # the console's line, the same words
        assert " WARNING  gradient_exploded" in out and "step=3" in out
        assert "gradient norm 100 > 10" in out and "(" + "'" not in out

    async def test_log_alert_goes_through_stdlib_logging(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        """LogAlert emits a stdlib record under eventbus_debug at the event's severity."""
        sink = AlertSink(_NullBus())
        sink.add_rule(rules.non_finite(), LogAlert())
        with caplog.at_level(logging.DEBUG, logger="eventbus_debug"):
            await sink.handle(NonFiniteDetected(step=2, role=TensorRole.LOSS, names=("loss",)))
        [record] = [r for r in caplog.records if r.name == "eventbus_debug.alerts"]
        assert record.levelno == logging.ERROR
        assert record.getMessage().startswith("alert ")
        assert "rule=non_finite" in record.getMessage() and "step=2" in record.getMessage()

    @pytest.mark.asyncio_only("the receiving server is uvicorn")
    async def test_webhook_posts_json(self) -> None:
        """WebhookAlert POSTs the alert as JSON to a real local server; a 500 is a failure."""
        received: list[dict[str, object]] = []

        async def hook(request: Request) -> Response:
            received.append(orjson.loads(await request.body()))
            return Response(status_code=500 if len(received) > 1 else 204)

        async with _serve(Starlette(routes=[Route("/hook", hook, methods=["POST"])])) as port:
            bus = _NullBus()
            sink = AlertSink(bus)
            sink.add_rule(
                AlertRule(event_types=(GradientExploded,), cooldown=0),
                WebhookAlert(f"http://127.0.0.1:{port}/hook", timeout=5.0, headers={"x-t": "1"}),
            )
            with anyio.fail_after(10):
                await sink.handle(explosion(1))
                await sink.handle(explosion(2))
        assert [r["step"] for r in received] == [1, 2]
        assert received[0]["kind"] == "gradient_exploded"
        [failure] = bus.published
        assert isinstance(failure, AlertHandlerFailed) and "500" in failure.message

    def test_webhook_rejects_bad_url(self) -> None:
        """A URL that is not http(s) is refused."""
        with pytest.raises(ValueError, match="url must be"):
            WebhookAlert("ftp://example")

    def test_alert_to_dict(self) -> None:
        """alert_to_dict is JSON-ready."""
        alert = Alert(rule=rules.gradient_explosion(), event=explosion(4), count=3, suppressed=2)
        data = orjson.loads(orjson.dumps(alert_to_dict(alert)))
        assert data["count"] == 3 and data["event"]["total_norm"] == 100.0


class _QuietServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@contextlib.asynccontextmanager
async def _serve(app: Starlette) -> AsyncIterator[int]:
    """Run *app* on a free loopback port for the block; yields the port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = _QuietServer(uvicorn.Config(app, log_config=None, log_level="warning", lifespan="off"))
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(server.serve, [sock])
            with anyio.fail_after(10):
                while not server.started:
                    await anyio.sleep(0.01)
            try:
                yield port
            finally:
                server.should_exit = True
    finally:
        sock.close()
