"""Typed events: header, immutability, delivery class and the @event_type registry."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import pytest

from eventbus_debug import Anomaly, Delivery, Event, Severity, event_type
from eventbus_debug.events import (
    EventsDropped,
    SessionStarted,
    SinkFailed,
    StepCompleted,
    current_rank,
    event_types,
    refresh_rank,
)


@event_type
class _Thing(Event):
    kind: ClassVar[str] = "test.events.thing"
    value: int
    label: str = ""


class TestHeader:
    def test_defaults(self) -> None:
        """A new event has seq -1, a wall time, the current rank and INFO severity."""
        ev = _Thing(value=1)
        assert ev.seq == -1 and ev.step is None and ev.source == ""
        assert ev.time_ns > 1_600_000_000 * 10**9
        assert ev.rank == current_rank()
        assert ev.severity is Severity.INFO

    def test_explicit_header(self) -> None:
        """Header fields can be given explicitly, by keyword only."""
        ev = _Thing(value=1, step=3, time_ns=5, rank=2, source="probe", severity=Severity.ERROR)
        assert (ev.step, ev.time_ns, ev.rank, ev.source) == (3, 5, 2, "probe")
        with pytest.raises(TypeError):
            _Thing(1)  # type: ignore[call-arg]

    def test_frozen_and_slotted(self) -> None:
        """Events are immutable and have no __dict__."""
        ev = _Thing(value=1)
        with pytest.raises(dataclasses.FrozenInstanceError):
            ev.value = 2  # type: ignore[misc]
        assert not hasattr(ev, "__dict__")
        assert dataclasses.replace(ev, value=3).value == 3

    def test_missing_required_field(self) -> None:
        """A required field without a value is a TypeError naming it."""
        with pytest.raises(TypeError, match="value"):
            _Thing()  # type: ignore[call-arg]

    def test_equality(self) -> None:
        """Events compare by value."""
        assert _Thing(value=1, time_ns=1) == _Thing(value=1, time_ns=1)
        assert _Thing(value=1, time_ns=1) != _Thing(value=2, time_ns=1)

    def test_delivery_classes(self) -> None:
        """Incidents and telemetry are declared per class."""
        assert StepCompleted.delivery is Delivery.TELEMETRY
        assert not StepCompleted(step=1).is_incident
        for cls in (SinkFailed, EventsDropped, SessionStarted, _Thing):
            assert cls.delivery is Delivery.INCIDENT
        assert SessionStarted().is_incident

    def test_rank_from_environment(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """The rank comes from RANK when no process group is initialized."""
        try:
            monkeypatch.setenv("RANK", "3")
            assert refresh_rank() == 3
            assert _Thing(value=0).rank == 3
            monkeypatch.setenv("RANK", "garbage")
            assert refresh_rank() == 0
        finally:
            monkeypatch.delenv("RANK", raising=False)
            refresh_rank()


class TestSeverity:
    def test_ordering(self) -> None:
        """Severities order like logging levels."""
        assert Severity.DEBUG < Severity.INFO < Severity.WARNING < Severity.ERROR
        assert Severity.CRITICAL >= Severity.ERROR
        assert max(Severity) is Severity.CRITICAL
        assert Severity.WARNING.level == 30

    def test_not_comparable_with_other_types(self) -> None:
        """Comparing with a non-severity raises TypeError."""
        with pytest.raises(TypeError):
            _ = Severity.INFO < 3


class TestRegistry:
    def test_registered(self) -> None:
        """Decorated classes are registered by kind; the snapshot is a copy."""
        registry = event_types()
        assert registry["test.events.thing"] is _Thing
        assert registry["step_completed"] is StepCompleted
        assert "event" not in registry  # the base is not a concrete kind
        assert Anomaly not in registry.values()

    def test_no_own_kind(self) -> None:
        """A class that does not declare its own kind is rejected."""
        with pytest.raises(TypeError, match=r"_NoKind must declare its own `kind: ClassVar"):

            @event_type
            class _NoKind(_Thing):
                extra: int = 0

    def test_duplicate_kind(self) -> None:
        """Two different classes cannot share a kind."""
        with pytest.raises(ValueError, match=r"event kind 'test.events.thing' is already used by"):

            @event_type
            class _Other(Event):
                kind: ClassVar[str] = "test.events.thing"

    def test_not_an_event(self) -> None:
        """Only Event subclasses can be decorated."""
        with pytest.raises(TypeError, match="@event_type needs a subclass of Event"):

            @event_type
            class _Plain:  # type: ignore[type-var]
                kind: ClassVar[str] = "test.events.plain"

    def test_subclass_of_event_type(self) -> None:
        """A decorated subclass of a decorated event inherits its fields and header."""

        @event_type
        class _Sub(_Thing):
            kind: ClassVar[str] = "test.events.sub"
            more: float = 0.5

        ev = _Sub(value=1, more=2.0, step=4)
        assert (ev.value, ev.more, ev.step) == (1, 2.0, 4)
        assert isinstance(ev, _Thing)
