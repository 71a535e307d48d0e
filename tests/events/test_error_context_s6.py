"""report_error's ``context``: the seeds' string, or a mapping whose values are recorded as str.

``ErrorRaised.context`` is a dict of strings, so the log and its reader always agree on it:
``"train_step"`` is recorded as ``{"context": "train_step"}`` (as ``ErrorHandler.handle_error``
records it), ``{"batch": 3}`` as ``{"batch": "3"}``; anything else is a TypeError naming
``context``, raised before anything is published.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from eventbus_debug import EventBus, RecoveryEngine, SyncEventBus, read_events
from eventbus_debug.cli import main
from eventbus_debug.events import ErrorRaised
from eventbus_debug.recovery import report_error, report_error_sync
from eventbus_debug.recovery.calls import error_context
from eventbus_debug.sinks import RotatingFileSink
from eventbus_debug.testing import RecordingSink


class TestErrorContext:
    @pytest.mark.parametrize(
        ("context", "recorded"),
        [
            (None, {}),
            ("", {}),
            ("train_step", {"context": "train_step"}),
            ({"phase": "train"}, {"phase": "train"}),
            (
                {"batch": 3, "lr": 0.5, "ok": True, "none": None},
                {"batch": "3", "lr": "0.5", "ok": "True", "none": "None"},
            ),
        ],
    )
    def test_accepted_shapes(self, context: Any, recorded: dict[str, str]) -> None:
        """A str, a mapping (values through str()) or None."""
        assert error_context(context) == recorded

    @pytest.mark.parametrize(
        ("context", "message"),
        [
            (["train"], r"context must be a str .* or a mapping of str keys to values, got list"),
            (3, r"context must be a str .*, got int 3"),
            ({1: "a"}, r"context keys must be str, got int 1"),
        ],
    )
    def test_other_shapes_are_refused_naming_context(self, context: Any, message: str) -> None:
        """Anything else is a TypeError that names the argument."""
        with pytest.raises(TypeError, match=message):
            error_context(context)


class TestReportError:
    async def test_string_and_int_contexts_are_logged_and_read_back(self, tmp_path: Path) -> None:
        """The seed's string context and an int value reach the log as strings; it reads back."""
        recorder = RecordingSink()
        async with EventBus() as bus:
            bus.subscribe(recorder, ErrorRaised)
            bus.subscribe(RotatingFileSink(tmp_path))
            engine = RecoveryEngine(bus)
            await report_error(engine, KeyError("x"), context="train_step")
            await report_error(engine, KeyError("x"), context={"batch": 3, "phase": "train"})
        contexts = [e.context for e in recorder.of_type(ErrorRaised)]
        assert contexts == [{"context": "train_step"}, {"batch": "3", "phase": "train"}]
        logged = [e.context for e in read_events(tmp_path) if isinstance(e, ErrorRaised)]
        assert logged == contexts
        assert main(["summary", str(tmp_path)]) == 0

    async def test_a_bad_context_publishes_nothing(self) -> None:
        """A refused context raises before the error is published."""
        recorder = RecordingSink()
        async with EventBus() as bus:
            bus.subscribe(recorder, ErrorRaised)
            engine = RecoveryEngine(bus)
            with pytest.raises(TypeError, match="context must be a str"):
                await report_error(engine, KeyError("x"), context=["train"])  # type: ignore[arg-type]
            await bus.drain()
        assert recorder.of_type(ErrorRaised) == []

    def test_sync_variant_takes_the_same_contexts(self) -> None:
        """report_error_sync converts and refuses the same way."""
        recorder = RecordingSink()
        with SyncEventBus() as bus:
            bus.subscribe(recorder, ErrorRaised)
            engine = RecoveryEngine(bus)
            report_error_sync(engine, KeyError("x"), context="train_step")
            with pytest.raises(TypeError, match="context keys must be str"):
                report_error_sync(engine, KeyError("x"), context={2: "b"})  # type: ignore[dict-item]
        assert [e.context for e in recorder.of_type(ErrorRaised)] == [{"context": "train_step"}]
