from __future__ import annotations

import io
import logging
import math
import threading
from typing import ClassVar

import anyio
import pytest
import structlog

from eventbus_debug import (
    Event,
    EventBus,
    EventsDropped,
    Severity,
    SinkFailed,
    StepCompleted,
    event_type,
)
from eventbus_debug.testing import RecordingSink
from sinks import ConsoleSink


@event_type
class _Note(Event):
    """An event the console has no special layout for."""

    kind: ClassVar[str] = "tests.console.note"
    severity: Severity = Severity.WARNING
    text: str = ""
    values: tuple[float, ...] = ()
    unset: float | None = None


async def _show(sink: ConsoleSink, *events: Event) -> list[str]:
    async with EventBus() as bus:
        bus.subscribe(sink)
        for event in events:
            bus.publish_nowait(event)
        with anyio.fail_after(5):
            await bus.drain()
    stream = sink._stream
    assert isinstance(stream, io.StringIO)
    return stream.getvalue().splitlines()


class TestRendering:
    async def test_step_completed_is_one_compact_line(self) -> None:
        """A step shows as 'step N' with loss and lr, NaN spelled out."""
        sink = ConsoleSink(io.StringIO(), colors=False)
        lines = await _show(
            sink,
            StepCompleted(step=7, loss=0.123456, learning_rate=1e-3),
            StepCompleted(step=8, loss=math.nan),
        )
        assert len(lines) == 2
        assert "[debug" in lines[0] and "step 7" in lines[0]
        assert "loss=0.1235" in lines[0] and "lr=0.001" in lines[0]
        assert "loss=nan" in lines[1] and "lr=" not in lines[1]

    async def test_incident_shows_its_important_fields(self) -> None:
        """A SinkFailed shows sink, error and message, and the traceback stays out of the line."""
        sink = ConsoleSink(io.StringIO(), colors=False)
        (line,) = await _show(
            sink,
            SinkFailed(
                step=3,
                sink="file",
                error_type="OSError",
                message="disk full",
                traceback="Traceback (most recent call last):\n  ...\nOSError: disk full",
            ),
        )
        assert "[error" in line and "sink_failed" in line
        assert "step=3" in line and "sink=file" in line and "error=OSError" in line
        assert "disk full" in line and "Traceback" not in line

    async def test_unknown_kind_shows_every_set_field(self) -> None:
        """Other events show their non-empty fields, long text and tuples shortened."""
        sink = ConsoleSink(io.StringIO(), colors=False)
        (line,) = await _show(
            sink, _Note(text="x" * 500, values=(1.0, 2.0, 3.0, 4.0, 5.0, 6.0), rank=2)
        )
        assert "tests.console.note" in line and "rank=2" in line
        assert "unset" not in line
        assert "…" in line and "'+2'" in line
        assert len(line) < 400

    async def test_colors(self) -> None:
        """colors=True emits ANSI codes; the default on a non-terminal stream does not."""
        plain = await _show(ConsoleSink(io.StringIO()), StepCompleted(step=1, loss=1.0))
        colored = await _show(
            ConsoleSink(io.StringIO(), colors=True), StepCompleted(step=1, loss=1.0)
        )
        assert "\x1b[" not in plain[0]
        assert "\x1b[" in colored[0]


class TestFiltering:
    async def test_min_severity(self) -> None:
        """Events below min_severity are not shown."""
        sink = ConsoleSink(io.StringIO(), min_severity=Severity.WARNING)
        lines = await _show(
            sink,
            StepCompleted(step=1, loss=1.0),
            EventsDropped(sink="s", dropped=3, total_dropped=3),
        )
        assert len(lines) == 1 and "events_dropped" in lines[0] and "dropped=3" in lines[0]
        assert sink.shown == 1

    async def test_event_types_and_exclude(self) -> None:
        """event_types keeps only those classes; exclude removes classes."""
        only = ConsoleSink(io.StringIO(), event_types=[_Note])
        skip = ConsoleSink(io.StringIO(), exclude=[StepCompleted])
        events = (StepCompleted(step=1), _Note(text="hello"))
        assert ["hello" in line for line in await _show(only, *events)] == [True]
        assert ["hello" in line for line in await _show(skip, *events)] == [True]

    async def test_step_every(self) -> None:
        """step_every samples StepCompleted lines; other events are unaffected."""
        sink = ConsoleSink(io.StringIO(), step_every=10)
        lines = await _show(sink, *(StepCompleted(step=i) for i in range(25)), _Note(text="n"))
        assert [line.split("]")[1].split()[:2] for line in lines[:3]] == [
            ["step", "0"],
            ["step", "10"],
            ["step", "20"],
        ]
        assert len(lines) == 4

    @pytest.mark.parametrize(
        ("kwargs", "error", "message"),
        [
            ({"step_every": 0}, ValueError, "step_every must be a positive integer, got 0"),
            ({"min_severity": "info"}, ValueError, "min_severity must be a Severity"),
            ({"event_types": [int]}, TypeError, "event_types must hold Event subclasses"),
        ],
    )
    def test_bad_options(
        self, kwargs: dict[str, object], error: type[Exception], message: str
    ) -> None:
        """Bad options raise at construction with a message naming the option."""
        with pytest.raises(error, match=message):
            ConsoleSink(io.StringIO(), **kwargs)  # type: ignore[arg-type]


class TestIsolation:
    async def test_leaves_global_structlog_and_logging_alone(self) -> None:
        """Building and using the sink changes neither structlog's config nor logging's."""
        before = structlog.get_config()
        handlers = list(logging.getLogger().handlers)
        await _show(ConsoleSink(io.StringIO()), StepCompleted(step=1))
        assert structlog.get_config() == before
        assert logging.getLogger().handlers == handlers

    async def test_writes_off_the_event_loop_thread(self) -> None:
        """The stream is written from a worker thread, never the event loop's."""
        writers: set[int] = set()

        class Stream(io.StringIO):
            def write(self, s: str) -> int:
                writers.add(threading.get_ident())
                return super().write(s)

        await _show(ConsoleSink(Stream()), StepCompleted(step=1))
        assert writers and threading.get_ident() not in writers

    async def test_broken_stream_becomes_sink_failed(self) -> None:
        """A stream that raises produces SinkFailed; the bus and other sinks go on."""

        class Broken(io.StringIO):
            def write(self, s: str) -> int:
                raise OSError("stream gone")

        recorder = RecordingSink()
        async with EventBus() as bus:
            bus.subscribe(recorder, SinkFailed)
            bus.subscribe(ConsoleSink(Broken()))
            bus.publish_nowait(StepCompleted(step=1))
            with anyio.fail_after(5):
                await bus.drain()
        (failure,) = recorder.of_type(SinkFailed)
        assert failure.sink == "console" and "stream gone" in failure.message

    async def test_aclose_twice(self) -> None:
        """aclose flushes the stream, is idempotent, and the sink refuses events afterwards."""
        sink = ConsoleSink(io.StringIO())
        await sink.aclose()
        await sink.aclose()
        with pytest.raises(RuntimeError, match="is closed"):
            await sink.handle(StepCompleted(step=1))
