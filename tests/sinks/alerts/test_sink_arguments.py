"""AlertSink refuses bad arguments when it is built or a rule is registered, not on every event."""

from __future__ import annotations

from typing import Any

import pytest

from eventbus_debug import EventBus
from eventbus_debug.events import Event, GradientExploded
from eventbus_debug.sinks import Alert, AlertHandlerFailed, AlertRule, AlertSink
from eventbus_debug.testing import capture_events


class _Bus:
    def __init__(self) -> None:
        self.published: list[Event] = []

    def publish_nowait(self, event: Event, /) -> None:
        self.published.append(event)


def _explosion(step: int = 0) -> GradientExploded:
    return GradientExploded(step=step, total_norm=1e4, threshold=10.0)


@pytest.mark.parametrize(
    "bus",
    ["x", None, 5, object(), type("NoCall", (), {"publish_nowait": 1})()],
    ids=["str", "None", "int", "object", "attribute-not-callable"],
)
def test_a_bus_without_publish_nowait_is_refused(bus: Any) -> None:
    """A bus that could not publish handler failures is a TypeError at construction."""
    with pytest.raises(TypeError, match=r"^bus must be .*publish_nowait"):
        AlertSink(bus)


def test_clock_and_name_are_checked() -> None:
    """A clock that is not callable and a name that is not a str name their argument."""
    with pytest.raises(TypeError, match=r"^clock must be a callable"):
        AlertSink(_Bus(), clock=5.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^name must be a str"):
        AlertSink(_Bus(), name=3)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"when": 5}, "when"),
        ({"when": "e.step > 3"}, "when"),
        ({"key": 5}, "key"),
        ({"key": None}, "key"),
    ],
)
def test_on_refuses_non_callable_when_and_key(kwargs: dict[str, Any], argument: str) -> None:
    """on(when=5) / on(key=5) are a TypeError naming the argument, and nothing is registered."""
    sink = AlertSink(_Bus())
    with pytest.raises(TypeError, match=f"^{argument} must be"):
        sink.on(GradientExploded, **kwargs)
    assert sink.rules == ()


@pytest.mark.parametrize(("field", "value"), [("when", 5), ("key", "kind"), ("key", None)])
def test_alert_rule_refuses_non_callable_when_or_key(field: str, value: Any) -> None:
    """An AlertRule built directly with a non-callable when/key is refused when it is built,
    not when the first event reaches it."""
    with pytest.raises(TypeError, match=f"^{field} must be"):
        AlertRule(event_types=(GradientExploded,), **{field: value})


async def test_callable_when_and_key_still_work() -> None:
    """Callables (a lambda, a class with __call__, None for when) are accepted and used."""

    class Key:
        def __call__(self, event: Any) -> Any:
            return event.kind

    got: list[int] = []
    bus = _Bus()
    sink = AlertSink(bus)

    @sink.on(GradientExploded, when=lambda e: e.step >= 1, key=Key(), cooldown=0)
    def handler(alert: Alert) -> None:
        got.append(alert.event.step or 0)

    for step in range(3):
        await sink.handle(_explosion(step))
    assert got == [1, 2] and bus.published == []


async def test_a_real_bus_still_hears_handler_failures() -> None:
    """With a valid bus, a failing handler is still an AlertHandlerFailed incident."""
    async with EventBus() as bus:
        sink = AlertSink(bus)

        @sink.on(GradientExploded, cooldown=0)
        async def broken(alert: Alert) -> None:
            raise RuntimeError("boom")

        bus.subscribe(sink)
        async with capture_events(bus, AlertHandlerFailed) as failures:
            bus.publish_nowait(_explosion())
            await bus.drain()
    assert [f.error_type for f in failures if isinstance(f, AlertHandlerFailed)] == ["RuntimeError"]
    assert len(failures) == 1
