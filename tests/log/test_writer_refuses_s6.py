"""The log never holds a line its own reader refuses: the writer counts and names such events.

Wrong-typed fields that reach the writer (the per-step records are not checked when built; any
event's dict can be changed after construction) are not written: ``encode_errors`` counts them,
the sink raises ``LogWriteError`` naming the kind and field (one ``SinkFailed`` incident), and
a diagnostic names each. The rest of the batch is written and the log reads back strictly.
"""

from __future__ import annotations

import logging
from pathlib import Path

import anyio
import pytest

from eventbus_debug import EventBus, read_events
from eventbus_debug.cli import main
from eventbus_debug.events import ErrorRaised, SinkFailed, StepChecked, StepCompleted
from eventbus_debug.log.encoding import encode_event, encode_events, unwritable_field
from eventbus_debug.sinks import LogWriteError, RotatingFileSink
from eventbus_debug.testing import RecordingSink

WRONG = [
    (StepCompleted(step=1, loss="0.5"), "loss"),  # type: ignore[arg-type]
    (StepCompleted(step=1, loss=True), "loss"),
    (StepCompleted(step="2"), "step"),  # type: ignore[arg-type]
    (StepCompleted(step=1.5), "step"),  # type: ignore[arg-type]
    (StepCompleted(step=1, learning_rate=2**70), "learning_rate"),
    (StepChecked(step=1, layer_grad_norms={"w": "x"}), "layer_grad_norms"),  # type: ignore[dict-item]
    (StepChecked(step=1, fired=("a", 3)), "fired"),  # type: ignore[arg-type]
    (StepChecked(step=1, finite=1), "finite"),  # type: ignore[arg-type]
]


def _mutated_error() -> ErrorRaised:
    """A checked event whose dict was changed after construction (an int context value)."""
    event = ErrorRaised(error_type="E", message="m", context={"phase": "train"})
    event.context["batch"] = 3  # type: ignore[index]
    return event


class TestEncoder:
    @pytest.mark.parametrize(("event", "name"), WRONG)
    def test_encoder_refuses_and_names_the_field(self, event: StepCompleted, name: str) -> None:
        """encode_event refuses a line the reader would refuse; the message names the field."""
        with pytest.raises(
            TypeError, match=rf"cannot encode {type(event).__name__}: field '{name}'"
        ):
            encode_event(event)
        assert unwritable_field(event) is not None
        assert unwritable_field(event)[0] == name  # type: ignore[index]

    def test_batch_encoder_refuses_too(self) -> None:
        """encode_events (one call per batch) refuses the same events."""
        with pytest.raises(TypeError, match=r"field 'loss'"):
            encode_events([StepCompleted(step=0), StepCompleted(step=1, loss="x")])  # type: ignore[arg-type]

    def test_mutated_dict_is_refused(self) -> None:
        """A dict changed after construction is checked when written."""
        with pytest.raises(TypeError, match=r"field 'context' .* value of 'batch': got int 3"):
            encode_event(_mutated_error())

    def test_valid_events_encode_as_before(self) -> None:
        """Ints for floats, NaN, None: written (the careful path only checks)."""
        line = encode_event(StepCompleted(step=1, loss=float("nan"), learning_rate=1))
        assert b'"loss":"NaN"' in line and b'"learning_rate":1' in line
        assert unwritable_field(StepCompleted(step=1)) is None


class TestFileSink:
    @pytest.mark.parametrize("wake_interval", [0.0, 3600.0])
    async def test_sink_counts_and_names_what_it_does_not_write(
        self, tmp_path: Path, wake_interval: float, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Each wrong-typed event: counted, logged with kind and field, not written.

        Written at once (``wake_interval=0``) the batch raises; handed to the writer thread,
        the flush (or the next batch) does.
        """
        sink = RotatingFileSink(tmp_path, wake_interval=wake_interval)
        batch = [StepCompleted(step=0), *(e for e, _ in WRONG)]
        expected = (
            rf"{len(WRONG)} event\(s\) of the batch could not be encoded and were not written "
            r"\(first: step_completed event StepCompleted seq=-1: cannot encode StepCompleted: "
            r"field 'loss' must be a float or None, got str '0\.5'"
        )
        with caplog.at_level(logging.ERROR, logger="eventbus_debug"):
            with pytest.raises(LogWriteError, match=expected):
                await sink.handle_batch(batch)
                await sink.flush()
            await sink.handle_batch([StepCompleted(step=99)])
            await sink.aclose()
        assert sink.statistics().encode_errors == len(WRONG)
        assert [e.step for e in read_events(tmp_path)] == [0, 99]  # strict: every line reads
        messages = [r.getMessage() for r in caplog.records]
        messages = [m for m in messages if "log_events_not_written" in m]
        pairs = list(dict.fromkeys((event.kind, name) for event, name in WRONG))
        assert len(messages) == len(pairs) == 6  # one per kind and field, with a count
        for (kind, name), message in zip(pairs, messages, strict=True):
            assert kind in message and name in message, message
        assert "events=2" in messages[0] or "'events': 2" in messages[0], messages[0]

    async def test_a_mutated_incident_is_refused_at_once(self, tmp_path: Path) -> None:
        """An incident is written before handle_batch returns: its refusal raises there."""
        sink = RotatingFileSink(tmp_path)  # write-behind, the default
        with pytest.raises(LogWriteError, match=r"first: error_raised event .*field 'context'"):
            await sink.handle_batch([StepCompleted(step=0), _mutated_error()])
        await sink.aclose()
        assert sink.statistics().encode_errors == 1
        assert [e.kind for e in read_events(tmp_path)] == ["step_completed"]

    async def test_on_a_bus_one_sink_failed_and_the_log_reads(self, tmp_path: Path) -> None:
        """Through a bus: a SinkFailed incident names the kind and the field; the log holds the
        valid event only and `eventbus-debug summary` reads it (exit 0)."""
        recorder = RecordingSink()
        async with EventBus() as bus:
            bus.subscribe(recorder, SinkFailed)
            bus.subscribe(RotatingFileSink(tmp_path, wake_interval=0))
            bus.publish_nowait(StepCompleted(step=1, loss="0.5"))  # type: ignore[arg-type]
            bus.publish_nowait(StepCompleted(step=2, loss=0.5))
            with anyio.fail_after(5):
                await bus.drain()
        (failed,) = recorder.of_type(SinkFailed)
        assert "field 'loss'" in failed.message and "step_completed" in failed.message
        steps = [e.step for e in read_events(tmp_path) if isinstance(e, StepCompleted)]
        assert steps == [2]
        assert main(["summary", str(tmp_path)]) == 0
