"""The report escapes everything it did not write itself, live or replayed from a crafted log
(issue 12, point 8): markup in any string of any event shows as text and never runs."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import orjson
import pytest

from eventbus_debug import encode_event
from eventbus_debug.events import (
    AnomalyLocalized,
    AutogradAnomalyDetected,
    ErrorCategory,
    ErrorRaised,
    Event,
    EventsDropped,
    EventsUndelivered,
    GradientExploded,
    GradientVanished,
    LossSpiked,
    MemoryLeakSuspected,
    NonFiniteDetected,
    RecoveryAction,
    RecoveryApplied,
    RecoveryDecided,
    ResourceThresholdExceeded,
    SessionStarted,
    SinkDisabled,
    SinkFailed,
    StepChecked,
    StepCompleted,
    StepSkipped,
    TensorRole,
)
from eventbus_debug.events.recovery import ClipGradients
from eventbus_debug.sinks import build_report, render_html, summarize
from tests.sinks._chromium import dump_dom, needs_chromium

PAYLOADS: tuple[str, ...] = (
    "<script>document.title='pwned-script';document.body.dataset.pwned='1'</script>",
    "<img src=x onerror=\"document.title='pwned-img';document.body.dataset.pwned='1'\">",
    "<svg onload=\"document.title='pwned-svg'\"><circle r=1 /></svg>",
    "<svg><script>document.title='pwned-svg-script'</script></svg>",
    "javascript:document.title='pwned-js'",
    "<a href=\"javascript:document.title='pwned-href'\">click</a>",
    "\"><img src=x onerror=document.title='pwned-attr-dq'>",
    "'><img src=x onerror=document.title='pwned-attr-sq'>",
    "</title><script>document.title='pwned-title'</script>",
    "</style><script>document.title='pwned-style'</script>",
    "<iframe srcdoc=\"<script>parent.document.title='pwned-iframe'</script>\"></iframe>",
    "<math><mi xlink:href=\"javascript:document.title='pwned-math'\">x</mi></math>",
)

_INJECTED = re.compile(
    r"<(script|img|iframe|math|object|embed|base|form|meta\s+http-equiv=.refresh)\b"
    r"|<svg\b[^>]*\bonload"
    r"|<a\b[^>]*javascript:"
    r"|<[a-z][^<>]*\son[a-z]+\s*=",  # an event-handler attribute inside a real tag
    re.IGNORECASE,
)


def crafted_events(payload: str) -> list[Event]:
    """One event of every kind the report shows, with *payload* in every string it carries."""
    p = payload
    out: list[Event] = [
        SessionStarted(
            seq=1, step=None, source=p, name=p, config={"model": p, p: "value"}, run_id="run-a"
        ),
        StepChecked(
            seq=2,
            step=0,
            source=p,
            loss=1.0,
            grad_norm=2.0,
            layer_grad_norms={p: 1.0, "fc.weight": 0.5},
            update_ratios={p: 1e-3},
        ),
        StepCompleted(seq=3, step=0, source=p, loss=1.0, learning_rate=0.1),
        NonFiniteDetected(seq=4, step=1, source=p, role=TensorRole.GRADIENT, names=(p, p)),
        GradientExploded(seq=5, step=1, source=p, total_norm=1e3, threshold=1.0, top=((p, 9.0),)),
        RecoveryDecided(
            seq=6,
            step=1,
            source=p,
            action=RecoveryAction.CLIP_GRADIENTS,
            reason=p,
            strategy=p,
            trigger_kind=p,
            trigger_seq=5,
            decided=ClipGradients(max_norm=1.0, total_norm=2.0),
        ),
        RecoveryApplied(
            seq=7, step=1, source=p, action=RecoveryAction.CLIP_GRADIENTS, detail=p, outcome=p
        ),
        StepSkipped(seq=8, step=1, source=p, reason=p),
        GradientVanished(seq=9, step=2, source=p, mean_abs=0.0, threshold=1e-6, layers=(p,)),
        LossSpiked(seq=10, step=2, source=p, loss=9.0, running_mean=1.0, ratio=9.0, rule=p),
        AnomalyLocalized(
            seq=11, step=2, source=p, module=p, phase=p, role=TensorRole.ACTIVATION, parameter=p
        ),
        AutogradAnomalyDetected(seq=12, step=2, source=p, backward_fn=p, message=p),
        MemoryLeakSuspected(seq=13, step=2, source=p, resource=p, slope=1.0, window=3, retained=p),
        ResourceThresholdExceeded(seq=14, step=2, source=p, metric=p, value=99.0, threshold=90.0),
        ErrorRaised(
            seq=15,
            step=2,
            source=p,
            error_type=p,
            message=p,
            traceback=p,
            category=ErrorCategory.MEMORY,
            context={p: p},
        ),
        SinkFailed(seq=16, step=2, source=p, sink=p, error_type=p, message=p, event_kind=p),
        SinkDisabled(seq=17, step=2, source=p, sink=p, reason=p, consecutive_failures=5),
        EventsDropped(seq=18, source=p, sink=p, dropped=3, total_dropped=3, by_kind={p: 3}),
        EventsUndelivered(seq=19, source=p, sink=p, undelivered=2, timeout_s=1.0, phase=p),
        # a second run in the same log: the runs table shows names and ids
        SessionStarted(seq=1, step=None, source=p, name=p, run_id=p, time_ns=2**62),
        StepCompleted(seq=2, step=0, source=p, loss=1.0, time_ns=2**62 + 1),
    ]
    return out


def assert_inert(page: str, payload: str) -> None:
    """No tag or handler of *payload* survives as markup in *page*."""
    match = _INJECTED.search(page)
    assert match is None, page[max(0, match.start() - 200) : match.end() + 200]
    if "<" in payload or '"' in payload:
        assert payload not in page


@pytest.mark.parametrize("payload", PAYLOADS)
def test_live_summary_escapes_every_string(payload: str) -> None:
    """Rendered straight from live events, every payload shows as text, in both runs."""
    events = crafted_events(payload)
    first = summarize(events[:-2])
    page = render_html(first, title=payload)
    assert_inert(page, payload)
    assert page.count("&lt;") >= 10 or "<" not in payload  # shown, escaped, in many places
    both = summarize(events)  # mixed runs: the runs table with the crafted names and ids
    assert both.mixed_runs
    assert_inert(render_html(both, title=payload), payload)


@dataclass(frozen=True, slots=True, kw_only=True)
class _CustomKind(Event):
    """A user's event whose kind (never registered, so never in a log) carries markup."""

    kind: ClassVar[str] = "<img src=x onerror=\"document.title='pwned-kind'\">"
    message: str = "custom"
    severity: Any = dataclasses.field(default=None)


def test_markup_in_a_kind_is_escaped() -> None:
    """A user-defined kind with markup shows as text in the incident and count tables."""
    from eventbus_debug.events import Severity

    event = _CustomKind(seq=1, step=0, message="<b>hi</b>", severity=Severity.ERROR)
    page = render_html(summarize([event]))
    assert_inert(page, _CustomKind.kind)
    assert "&lt;b&gt;hi&lt;/b&gt;" in page


def write_crafted_log(directory: Path, payload: str) -> Path:
    """A JSON-lines log as an attacker would write it: real events with *payload* strings,
    plus lines whose numeric header fields hold the payload (which the reader may refuse)."""
    directory.mkdir(parents=True, exist_ok=True)
    lines = [encode_event(e) for e in crafted_events(payload)]
    for line in list(lines[:3]):
        for field in ("rank", "step", "seq"):
            doc = orjson.loads(line)
            doc[field] = payload
            lines.append(orjson.dumps(doc) + b"\n")
    (directory / "events.jsonl").write_bytes(b"".join(lines))
    return directory


def test_replayed_report_escapes_every_string(tmp_path: Path) -> None:
    """Rebuilt from a crafted log (the `eventbus-debug report LOGDIR` path), every payload is
    inert in report.html, and report.json round-trips the strings unchanged."""
    for i, payload in enumerate(PAYLOADS):
        log = write_crafted_log(tmp_path / f"log{i}", payload)
        summary, paths = build_report(log, tmp_path / f"out{i}", strict=False, title=payload)
        assert paths.html is not None
        page = paths.html.read_text()
        assert_inert(page, payload)
        assert summary.run_id == payload  # the latest run, named by the payload
        doc = orjson.loads(paths.json.read_bytes())
        assert doc["run_id"] == payload and doc["title"] == payload


def _serve_pages(directory: Path, pages: Sequence[tuple[str, str]]) -> list[Path]:
    out = []
    for name, text in pages:
        path = directory / name
        path.write_text(text)
        out.append(path)
    return out


@needs_chromium
def test_detector_sees_a_payload_that_runs(tmp_path: Path) -> None:
    """Control for the browser tests: unescaped, a payload does change the title in Chromium;
    under the report's Content-Security-Policy the same markup does not."""
    from eventbus_debug.sinks.report.html import CONTENT_SECURITY_POLICY

    markup = PAYLOADS[1]
    bare, fenced = _serve_pages(
        tmp_path,
        [
            ("bare.html", f"<!DOCTYPE html><html><head><title>t</title></head><body>{markup}"),
            (
                "fenced.html",
                f'<!DOCTYPE html><html><head><meta http-equiv="Content-Security-Policy" '
                f'content="{CONTENT_SECURITY_POLICY}"><title>t</title></head><body>{markup}',
            ),
        ],
    )
    assert "<title>pwned-img</title>" in dump_dom(bare.as_uri(), tmp_path / "p1")
    assert "<title>t</title>" in dump_dom(fenced.as_uri(), tmp_path / "p2")


@needs_chromium
def test_crafted_log_report_is_inert_in_chromium(tmp_path: Path) -> None:
    """Every payload, replayed from a crafted log into report.html and opened in Chromium,
    leaves the title and body untouched and shows as literal text."""
    pages = []
    for i, payload in enumerate(PAYLOADS):
        log = write_crafted_log(tmp_path / f"log{i}", payload)
        _, paths = build_report(log, tmp_path / f"out{i}", strict=False, title=f"crafted {i}")
        assert paths.html is not None
        pages.append((i, payload, paths.html))
    for i, payload, html_path in pages:
        dom = dump_dom(html_path.as_uri(), tmp_path / f"profile{i}", budget_ms=1500)
        assert f"<title>crafted {i}</title>" in dom, payload
        assert "pwned" not in dom.split("</title>")[0]
        assert "data-pwned" not in dom
        assert _INJECTED.search(dom) is None, payload
        # shown literally: the browser's serialization of the text node equals our escaping
        literal = payload.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
        assert literal in dom, payload


def test_numeric_header_fields_holding_markup_are_escaped() -> None:
    """Defence in depth: should a reader ever let a string through where a number belongs
    (rank, seq, step), the page still shows it as text."""
    payload = PAYLOADS[1]
    event = ErrorRaised(step=None, error_type="E", message="m")
    # The constructor refuses a string there: set it as a broken reader or a bug would.
    object.__setattr__(event, "seq", payload)
    object.__setattr__(event, "rank", payload)
    page = render_html(summarize([event]))
    assert_inert(page, payload)
    assert "&lt;img src=x onerror=" in page
