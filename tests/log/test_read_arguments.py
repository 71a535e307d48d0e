"""read_events / log_files: a wrong argument type is a TypeError naming it, at the call."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from eventbus_debug import encode_event, read_events
from eventbus_debug.events import StepCompleted
from eventbus_debug.exceptions import LogReadError
from eventbus_debug.log import log_files
from eventbus_debug.log.files import ReadStatistics


class _BytesPath(os.PathLike):  # type: ignore[type-arg]
    def __fspath__(self) -> bytes:
        return b"/tmp"


@pytest.mark.parametrize(
    "path",
    [123, None, 1.5, b"/tmp", ["events.jsonl"], _BytesPath()],
    ids=lambda v: type(v).__name__,
)
def test_read_events_bad_path_type(path: Any) -> None:
    """The TypeError is raised by the call itself (before iterating) and names `path` and the
    accepted types."""
    with pytest.raises(TypeError, match=r"^path must be a str or an os\.PathLike") as info:
        read_events(path)
    assert type(path).__name__ in str(info.value)


@pytest.mark.parametrize("path", [123, None, b"/tmp"], ids=lambda v: type(v).__name__)
def test_log_files_bad_directory_type(path: Any) -> None:
    """log_files names its own argument."""
    with pytest.raises(TypeError, match=r"^directory must be a str or an os\.PathLike"):
        log_files(path)


def test_strict_and_stats_are_checked(tmp_path: Path) -> None:
    """strict must be a bool and stats a ReadStatistics (or None)."""
    with pytest.raises(TypeError, match=r"^strict must be a bool, got int"):
        read_events(tmp_path, strict=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^stats must be a ReadStatistics or None, got dict"):
        read_events(tmp_path, stats={})  # type: ignore[arg-type]


def test_str_and_pathlike_still_read(tmp_path: Path) -> None:
    """str and Path (and any os.PathLike of str) are read as before."""
    (tmp_path / "events.jsonl").write_bytes(encode_event(StepCompleted(step=7, loss=1.0)))

    class StrPath(os.PathLike):  # type: ignore[type-arg]
        def __fspath__(self) -> str:
            return str(tmp_path)

    stats = ReadStatistics()
    for where in (str(tmp_path), tmp_path, StrPath(), tmp_path / "events.jsonl"):
        assert [e.step for e in read_events(where, stats=stats)] == [7]
    assert stats.events == 4


def test_a_missing_path_still_fails_when_read(tmp_path: Path) -> None:
    """Existence is still checked as the events are read: LogReadError, not TypeError."""
    events = read_events(tmp_path / "nope")
    with pytest.raises(LogReadError, match="does not exist"):
        next(iter(events))
