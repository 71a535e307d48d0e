"""A batch's lines for the log, and the report on the events it could not write readably.

The whole batch is encoded in one call (:func:`~eventbus_debug.log.encoding.encode_events`);
only when that refuses an event is the batch encoded one event at a time, so the others are
still written and the refused ones are named (:func:`refused`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from eventbus_debug.diagnostics import get_logger
from eventbus_debug.events import Event
from eventbus_debug.log.encoding import encode_event, encode_events, unwritable_field

from ._jsonl_types import LogWriteError

__all__ = ("encode_all", "refused")

# The writer's records keep the logger name they always had.
_log = get_logger("eventbus_debug.sinks._jsonl_writer")


def encode_all(events: Sequence[Event]) -> tuple[bytes, int, list[tuple[Event, Exception]]]:
    """The lines of *events* that can be written, how many, and the events refused (why)."""
    try:
        return encode_events(events), len(events), []
    except TypeError:
        pass
    lines: list[bytes] = []
    bad: list[tuple[Event, Exception]] = []
    for event in events:
        try:
            lines.append(encode_event(event))
        except TypeError as exc:
            bad.append((event, exc))
    return b"".join(lines), len(lines), bad


def refused(bad: list[tuple[Event, Exception]], path: Path) -> LogWriteError:
    """Report the events the log at *path* could not write readably (counted in encode_errors).

    One diagnostic per kind and field (with how many events and the first one's error);
    the error returned names the first event.
    """
    groups: dict[tuple[str, str | None], tuple[int, Event, Exception]] = {}
    for event, error in bad:
        found = unwritable_field(event)
        key = (event.kind, found[0] if found is not None else None)
        count, first, first_error = groups.get(key, (0, event, error))
        groups[key] = (count + 1, first, first_error)
    for (kind, name), (count, first, first_error) in groups.items():
        _log.error(
            "log_events_not_written",
            path=str(path),
            kind=kind,
            field=name,
            events=count,
            first_seq=first.seq,
            error=str(first_error),
        )
    event, error = bad[0]
    msg = (
        f"{len(bad)} event(s) of the batch could not be encoded and were not written "
        f"(first: {event.kind} event {type(event).__name__} seq={event.seq}: {error})"
    )
    return LogWriteError(msg)
