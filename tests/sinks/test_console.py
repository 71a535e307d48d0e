from __future__ import annotations

import io
import logging
import math
import sys
import threading
from typing import ClassVar

import anyio
import pytest
import structlog

from eventbus_debug import Event, EventBus, Severity, event_type
from eventbus_debug.events import (
    EventsDropped,
    GradientExploded,
    MemorySampled,
    NonFiniteDetected,
    SessionEnded,
    SinkFailed,
    StepCompleted,
    TensorRole,
)
from eventbus_debug.sinks import ConsoleSink
from eventbus_debug.sinks.lines import format_event, format_value
from eventbus_debug.testing import RecordingSink


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


def _nan(step: int = 5) -> NonFiniteDetected:
    return NonFiniteDetected(
        step=step, role=TensorRole.GRADIENT, names=("fc.weight", "fc.bias"), nan_count=3
    )


class TestRendering:
    async def test_step_completed_is_one_compact_line(self) -> None:
        """With telemetry on, a step shows its kind, step, loss and lr, NaN spelled out."""
        sink = ConsoleSink(io.StringIO(), colors=False, telemetry=True)
        lines = await _show(
            sink,
            StepCompleted(step=7, loss=0.123456, learning_rate=1e-3),
            StepCompleted(step=8, loss=math.nan),
        )
        assert len(lines) == 2
        assert "DEBUG" in lines[0] or "INFO" in lines[0]
        assert "step_completed" in lines[0] and "step=7" in lines[0]
        assert "loss=0.1235" in lines[0] and "lr=0.001" in lines[0]
        assert "loss=nan" in lines[1] and "lr=" not in lines[1]

    async def test_incident_is_described_without_reprs(self) -> None:
        """An incident line names its kind once and shows values as text, not Python reprs."""
        (line,) = await _show(ConsoleSink(io.StringIO(), colors=False), _nan())
        assert "ERROR" in line and "non_finite_detected" in line and "step=5" in line
        assert "fc.weight, fc.bias" in line and "3 NaN" in line
        assert "(" + "'" not in line and "None" not in line and "<" not in line

    async def test_sink_failed_keeps_the_traceback_out(self) -> None:
        """A SinkFailed shows sink, error and message; the traceback stays out of the line."""
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
        assert "sink_failed" in line and "step=3" in line and "sink file" in line
        assert "OSError" in line and "disk full" in line and "Traceback" not in line

    async def test_same_line_as_tail(self) -> None:
        """The console line is exactly the line ``eventbus-debug tail`` prints."""
        event = _nan()
        (line,) = await _show(ConsoleSink(io.StringIO(), colors=False), event)
        assert line == format_event(event)

    def test_values_are_readable(self) -> None:
        """Tuples join with commas (cut after 4), enums show their value, None is a dash."""
        assert format_value((1.0, 2.0, 3.0, 4.0, 5.0, 6.0)) == "1,2,3,4,+2"
        assert format_value(TensorRole.GRADIENT) == "gradient"
        assert format_value(None) == "-"
        assert format_value(math.inf) == "inf"
        assert format_value("x" * 500).endswith("…")

    async def test_colors(self) -> None:
        """colors=True emits ANSI codes; the default on a non-terminal stream does not."""
        plain = await _show(ConsoleSink(io.StringIO()), _nan())
        colored = await _show(ConsoleSink(io.StringIO(), colors=True), _nan())
        assert "\x1b[" not in plain[0]
        assert "\x1b[31m" in colored[0]

    async def test_no_color_environment(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """On a terminal colours are on, unless NO_COLOR is set."""

        class Tty(io.StringIO):
            def isatty(self) -> bool:
                return True

        colored = await _show(ConsoleSink(Tty()), _nan())
        monkeypatch.setenv("NO_COLOR", "1")
        plain = await _show(ConsoleSink(Tty()), _nan())
        assert "\x1b[" in colored[0] and "\x1b[" not in plain[0]


class TestFiltering:
    async def test_default_shows_incidents_only(self) -> None:
        """By default per-step telemetry is not shown; incidents and the session end are."""
        sink = ConsoleSink(io.StringIO())
        lines = await _show(
            sink,
            StepCompleted(step=1, loss=1.0),
            MemorySampled(rss_bytes=1),
            GradientExploded(step=2, total_norm=1e4, threshold=10.0),
            SessionEnded(name="run", steps=2),
        )
        assert [line.split()[2] for line in lines] == ["gradient_exploded", "session_ended"]

    async def test_min_severity(self) -> None:
        """Events below min_severity are not shown."""
        sink = ConsoleSink(io.StringIO(), min_severity=Severity.WARNING, telemetry=True)
        lines = await _show(
            sink,
            StepCompleted(step=1, loss=1.0),
            EventsDropped(sink="s", dropped=3, total_dropped=3),
        )
        assert len(lines) == 1 and "events_dropped" in lines[0] and "shed 3" in lines[0]
        assert sink.shown == 1

    async def test_event_types_and_exclude(self) -> None:
        """event_types keeps only those classes; exclude removes classes."""
        only = ConsoleSink(io.StringIO(), event_types=[_Note], telemetry=True)
        skip = ConsoleSink(io.StringIO(), exclude=[StepCompleted], telemetry=True)
        events = (StepCompleted(step=1), _Note(text="hello"))
        assert ["hello" in line for line in await _show(only, *events)] == [True]
        assert ["hello" in line for line in await _show(skip, *events)] == [True]

    async def test_step_every(self) -> None:
        """step_every samples StepCompleted lines; other events are unaffected."""
        sink = ConsoleSink(io.StringIO(), step_every=10, telemetry=True)
        lines = await _show(sink, *(StepCompleted(step=i) for i in range(25)), _Note(text="n"))
        assert [line.split()[3] for line in lines[:3]] == ["step=0", "step=10", "step=20"]
        assert len(lines) == 4

    @pytest.mark.parametrize(
        ("kwargs", "error", "message"),
        [
            ({"step_every": 0}, ValueError, "step_every must be a positive integer, got 0"),
            ({"min_severity": "info"}, ValueError, "min_severity must be a Severity"),
            ({"event_types": [int]}, TypeError, "event_types must hold Event subclasses"),
            ({"telemetry": "yes"}, TypeError, "telemetry must be a bool"),
        ],
    )
    def test_bad_options(
        self, kwargs: dict[str, object], error: type[Exception], message: str
    ) -> None:
        """Bad options raise at construction with a message naming the option."""
        with pytest.raises(error, match=message):
            ConsoleSink(io.StringIO(), **kwargs)  # type: ignore[arg-type]


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


class TestProgressBars:
    async def test_writes_through_an_active_tqdm_bar(self) -> None:
        """With a tqdm bar on the stream, lines go through tqdm.write: the bar is redrawn after."""
        tqdm = pytest.importorskip("tqdm")
        stream = _Tty()
        with tqdm.tqdm(total=10, file=stream, desc="training", mininterval=0) as bar:
            bar.update(3)
            before = stream.getvalue()
            await _show(ConsoleSink(stream, colors=False), _nan())
            after = stream.getvalue()[len(before) :]
        # tqdm cleared the bar (carriage return), wrote the line, and redrew the bar below it.
        line_at = after.index("non_finite_detected")
        assert "\r" in after[:line_at]
        assert "training" in after[line_at:]

    async def test_writes_above_a_rich_progress(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Under a rich Progress that redirects stderr, lines are printed through its console."""
        rich_console = pytest.importorskip("rich.console")
        rich_progress = pytest.importorskip("rich.progress")
        terminal = _Tty()
        monkeypatch.setattr(sys, "stderr", terminal)
        console = rich_console.Console(file=terminal, force_terminal=True, width=200)
        sink = ConsoleSink(terminal, colors=False)  # the stream as given before the bar started
        with rich_progress.Progress(console=console, redirect_stderr=True) as progress:
            progress.add_task("training", total=10)
            assert sys.stderr is not terminal  # rich's proxy
            async with EventBus() as bus:
                bus.subscribe(sink)
                bus.publish_nowait(_nan())
                with anyio.fail_after(5):
                    await bus.drain()
        out = terminal.getvalue()
        assert "non_finite_detected" in out and "training" in out
        assert sink.shown == 1


class TestIsolation:
    async def test_leaves_global_structlog_and_logging_alone(self) -> None:
        """Building and using the sink changes neither structlog's config nor logging's."""
        before = structlog.get_config()
        handlers = list(logging.getLogger().handlers)
        await _show(ConsoleSink(io.StringIO()), _nan())
        assert structlog.get_config() == before
        assert logging.getLogger().handlers == handlers

    async def test_default_stream_is_stderr_at_write_time(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """stream=None writes to sys.stderr as it is when writing, never to stdout."""
        err, out = io.StringIO(), io.StringIO()
        sink = ConsoleSink()
        monkeypatch.setattr(sys, "stderr", err)
        monkeypatch.setattr(sys, "stdout", out)
        async with EventBus() as bus:
            bus.subscribe(sink)
            bus.publish_nowait(_nan())
        assert "non_finite_detected" in err.getvalue() and out.getvalue() == ""

    async def test_writes_off_the_event_loop_thread(self) -> None:
        """The stream is written from a worker thread, never the event loop's."""
        writers: set[int] = set()

        class Stream(io.StringIO):
            def write(self, s: str) -> int:
                writers.add(threading.get_ident())
                return super().write(s)

        await _show(ConsoleSink(Stream()), _nan())
        assert writers and threading.get_ident() not in writers

    async def test_broken_stream_becomes_sink_failed(self) -> None:
        """A stream that raises produces SinkFailed; the bus and other sinks go on."""

        class Broken(io.StringIO):
            def write(self, s: str) -> int:
                raise BrokenPipeError("stream gone")

        recorder = RecordingSink()
        async with EventBus() as bus:
            bus.subscribe(recorder, SinkFailed)
            bus.subscribe(ConsoleSink(Broken()))
            bus.publish_nowait(_nan())
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


async def test_control_characters_in_an_event_reach_the_terminal_escaped() -> None:
    """An exception's message is untrusted text: the console writes its escape sequences shown
    (``\\x1b``), never raw, on a terminal with colours too (the line is then uncoloured)."""
    stream = io.StringIO()
    sink = ConsoleSink(stream, colors=True)
    crafted = "CUDA error\x1b]0;pwned\x07\x1b[2J"
    async with EventBus() as bus:
        bus.subscribe(sink)
        bus.publish_nowait(
            SinkFailed(source="t", sink="log", error_type="RuntimeError", message=crafted)
        )
        bus.publish_nowait(
            SinkFailed(source="t", sink="log", error_type="RuntimeError", message="disk full")
        )
    text = stream.getvalue()
    assert "\x1b" not in text.splitlines()[0] and "\x07" not in text
    assert "\\x1b]0;pwned\\x07\\x1b[2J" in text
    assert "\x1b[" in text.splitlines()[1]  # a clean line keeps its colours
