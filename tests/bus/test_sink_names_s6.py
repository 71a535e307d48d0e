"""Subscription names derived from a sink are readable and stable, on a bus and in a session.

A sink's ``name`` attribute, else a function's name without the functions it is nested in
(``hangs``, never ``main.<locals>.hangs``), else the sink's class name; ``-2``, ``-3``... for a
name already taken; a session prefixes its own name (``training.hangs``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
from torch import nn

from eventbus_debug import Event, EventBus, Session, read_events
from eventbus_debug._bus._adapter import default_name
from eventbus_debug.events import EventsUndelivered, StepCompleted
from eventbus_debug.testing import RecordingSink


async def module_handler(event: Event) -> None:
    del event


class LossTracker:
    async def handle_batch(self, events: Sequence[Event]) -> None:
        del events


class Named:
    name = "loss-tracker"

    async def handle(self, event: Event) -> None:
        del event


class TestDefaultName:
    def test_nested_function_is_named_without_its_enclosing_functions(self) -> None:
        """A function defined inside another is named by its own name, no '<locals>'."""

        async def hangs(event: Event) -> None:
            del event

        assert "<locals>" in hangs.__qualname__
        assert default_name(hangs) == "hangs"
        assert default_name(module_handler) == "module_handler"

    def test_methods_classes_and_name_attributes(self) -> None:
        """A bound method keeps its class; an instance is named by its class or its name."""

        class Local:
            async def handle(self, event: Event) -> None:
                del event

        assert default_name(LossTracker()) == "LossTracker"
        assert default_name(Local()) == "Local"
        assert default_name(Local().handle) == "Local.handle"
        assert default_name(Named()) == "loss-tracker"
        assert default_name(RecordingSink()) == "recorder"

    def test_objects_without_a_qualname_use_their_type(self) -> None:
        """A partial (no __qualname__) is named by its type, as any instance."""
        assert default_name(functools.partial(module_handler)) == "partial"


class TestOnABus:
    async def test_the_docs_example_works_inside_a_function(self) -> None:
        """docs/bus.md's `undelivered.sink == "hangs"`, with `hangs` defined in a function."""

        async def hangs(event: StepCompleted) -> None:
            await anyio.sleep_forever()

        recorder = RecordingSink()
        async with EventBus(close_timeout=0.2) as bus:
            bus.subscribe(recorder)
            bus.subscribe(hangs, StepCompleted)
            bus.publish_nowait(StepCompleted(step=0))
            bus.publish_nowait(StepCompleted(step=1))
        (undelivered,) = recorder.of_type(EventsUndelivered)
        assert undelivered.sink == "hangs"

    async def test_clashes_get_a_suffix(self) -> None:
        """Two sinks with the same derived name: the second is `-2`, the third `-3`."""
        async with EventBus() as bus:
            names = [bus.subscribe(LossTracker()).name for _ in range(3)]
        assert names == ["LossTracker", "LossTracker-2", "LossTracker-3"]


class TestInASession:
    async def test_sinks_are_named_after_their_function_or_class(self, tmp_path: Path) -> None:
        """`sinks=[hangs, LossTracker(), ...]` subscribe as training.hangs, training.LossTracker."""

        async def hangs(event: Event) -> None:
            await anyio.sleep(3600)

        sinks: list[Any] = [hangs, LossTracker(), LossTracker(), Named(), RecordingSink()]
        async with Session(
            nn.Linear(4, 1), log_dir=tmp_path, sinks=sinks, close_timeout=0.5, system_interval=None
        ) as s:
            names = [x.name for x in s.bus.statistics().subscriptions]
            await s.step_completed(0, loss=1.0)
        assert names[:3] == ["training.log", "training.report", "training.alerts"]
        assert names[3:8] == [
            "training.hangs",
            "training.LossTracker",
            "training.LossTracker-2",
            "training.loss-tracker",
            "training.recorder",
        ]
        reported = [
            (e.kind, e.sink)  # type: ignore[attr-defined]
            for e in read_events(tmp_path)
            if e.kind in ("events_undelivered", "sink_unresponsive")
        ]
        assert ("events_undelivered", "training.hangs") in reported

    async def test_a_sink_named_like_a_session_part_gets_a_suffix(self, tmp_path: Path) -> None:
        """A sink whose name is one the session uses itself (log, recovery...) gets `-2`."""
        log, recovery = RecordingSink(name="log"), RecordingSink(name="recovery")
        async with Session(
            nn.Linear(4, 1), log_dir=tmp_path, sinks=[log, recovery], system_interval=None
        ) as s:
            names = [x.name for x in s.bus.statistics().subscriptions]
        assert "training.log-2" in names and "training.recovery-2" in names
        assert "training.log" in names and "training.recovery" in names
