"""describe(): one non-empty line per event, for every registered kind; the words of each kind."""

from __future__ import annotations

import math
import re

import pytest

import eventbus_debug.sinks  # noqa: F401  (registers the sinks' own event kinds)
from eventbus_debug.events import (
    Event,
    EventsDropped,
    GradientExploded,
    LoopStalled,
    NonFiniteDetected,
    SampleSkipped,
    Severity,
    StepCompleted,
    SystemSampled,
    TensorRole,
    event_types,
)
from eventbus_debug.events.describe import describe, describe_line, format_clock, format_value
from eventbus_debug.testing import make_sample_event

KINDS = sorted(event_types().items())


@pytest.mark.parametrize(("kind", "cls"), KINDS, ids=[k for k, _ in KINDS])
def test_every_registered_kind_reads_as_one_line(kind: str, cls: type[Event]) -> None:
    """Every registered kind gives a non-empty single line, and so does its full line."""
    event = make_sample_event(cls)
    text = describe(event)
    assert text and "\n" not in text and text == text.strip(), (kind, text)
    line = describe_line(event)
    assert "\n" not in line and f" {kind} " in f"{line} " and text in line


@pytest.mark.parametrize(("kind", "cls"), KINDS, ids=[k for k, _ in KINDS])
def test_multiline_messages_stay_on_one_line(kind: str, cls: type[Event]) -> None:
    """A traceback or a crafted newline in any text field never breaks the line."""
    texts = {
        f.name: "first\nlast line"
        for f in cls.__dataclass_fields__.values()
        if f.init and f.type in ("str", str) and f.name not in ("kind", "source")
    }
    event = make_sample_event(cls, **texts)
    assert "\n" not in describe(event)


def test_incident_wording() -> None:
    """Known incidents read as a sentence, with readable numbers and at most three names."""
    nan = NonFiniteDetected(
        role=TensorRole.GRADIENT, names=("a", "b", "c", "d"), nan_count=3, step=4
    )
    assert describe(nan) == "non-finite gradient: a, b, c... (3 NaN)"
    boom = GradientExploded(total_norm=12345.0, threshold=100.0, top=(("fc.weight", 9000.0),))
    assert describe(boom) == "gradient norm 1.234e+04 > 100; largest fc.weight=9000"
    shed = EventsDropped(sink="console", dropped=5, total_dropped=7)
    assert describe(shed) == "sink console shed 5 telemetry event(s) (7 total)"


def test_telemetry_shows_its_few_fields() -> None:
    """Frequent telemetry shows its telling fields only; unset ones are left out."""
    assert describe(StepCompleted(step=1, loss=0.5, learning_rate=None)) == "loss=0.5"
    sys_line = describe(SystemSampled(cpu_percent=12.5, memory_percent=50.0, disk_percent=1.0))
    assert sys_line == "cpu%=12.5 mem%=50 disk%=1"


def test_an_event_without_fields_reads_as_its_kind() -> None:
    """An event with nothing but its header still gives a line: its kind."""
    assert describe(StepCompleted(step=1)) == "step_completed"


def test_other_incidents_show_their_message_then_their_fields() -> None:
    """An incident without its own wording shows its message's last line, else its fields."""
    skipped = make_sample_event(SampleSkipped, message="Traceback ...\nValueError: bad sample")
    assert describe(skipped) == "ValueError: bad sample"
    stalled = make_sample_event(LoopStalled)
    assert describe(stalled).startswith("sink=sample-sink stall_s=0.5")


def test_describe_line_header_and_colors() -> None:
    """The line starts with HH:MM:SS.mmm, severity, kind; colours wrap severity and incidents."""
    event = NonFiniteDetected(role=TensorRole.LOSS, names=("loss",), step=7, rank=2)
    plain = describe_line(event)
    assert re.match(r"\d\d:\d\d:\d\d\.\d{3} ERROR +non_finite_detected +step=7 rank=2 ", plain)
    colored = describe_line(event, colors=True)
    assert "\x1b[31m" in colored and "\x1b[1m" in colored
    assert (
        describe_line(StepCompleted(step=1, severity=Severity.DEBUG), colors=True).count("\x1b[1m")
        == 0
    )


def test_format_value_and_clock() -> None:
    """Values read without reprs; the clock has millisecond precision."""
    assert format_value(math.nan) == "nan" and format_value(None) == "-"
    assert format_value(True) == "yes" and format_value({"a": 1.0}) == "a:1"
    assert format_value("x" * 500).endswith("…") and len(format_value("x" * 500)) == 160
    assert re.fullmatch(r"\d\d:\d\d:\d\d\.\d{3}", format_clock(1_700_000_000_123_000_000))
