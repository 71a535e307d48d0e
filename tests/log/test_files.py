"""read_events / log_files: rotated, gzipped, multi-rank and crash-truncated logs."""

from __future__ import annotations

import gzip
import math
from pathlib import Path

import pytest

from eventbus_debug import encode_event, read_events
from eventbus_debug.events import StepCompleted
from eventbus_debug.exceptions import EventDecodeError, LogReadError
from eventbus_debug.log import log_file_name, log_files
from eventbus_debug.log.encoding import encode_events
from eventbus_debug.log.files import ReadStatistics


def _steps(n0: int, n1: int, *, rank: int = 0, t0: int = 0) -> list[StepCompleted]:
    return [
        StepCompleted(step=i, seq=i + 1, rank=rank, time_ns=t0 + 10 * i, loss=float(i))
        for i in range(n0, n1)
    ]


def test_file_names() -> None:
    """Rank 0 writes events.jsonl; other ranks name their rank."""
    assert log_file_name() == "events.jsonl"
    assert log_file_name(3) == "events.rank3.jsonl"
    with pytest.raises(ValueError, match="rank must be a non-negative integer, got -1"):
        log_file_name(-1)


def test_single_file_round_trip(tmp_path: Path) -> None:
    """A file yields its typed events, NaN and ±Inf included."""
    evs = [*_steps(0, 3), StepCompleted(step=3, loss=math.nan, learning_rate=math.inf)]
    f = tmp_path / "events.jsonl"
    f.write_bytes(encode_events(evs))
    back = list(read_events(f))
    assert [e.step for e in back] == [0, 1, 2, 3]
    last = back[-1]
    assert isinstance(last, StepCompleted)
    assert last.loss is not None and math.isnan(last.loss)
    assert last.learning_rate == math.inf


def test_truncated_last_line_is_skipped(tmp_path: Path) -> None:
    """A crash mid-write loses at most the cut line."""
    data = encode_events(_steps(0, 5))
    f = tmp_path / "events.jsonl"
    f.write_bytes(data + encode_event(StepCompleted(step=5))[:20])
    assert [e.step for e in read_events(f)] == [0, 1, 2, 3, 4]


def test_last_line_without_newline_but_whole(tmp_path: Path) -> None:
    """A complete last line missing only its newline is kept."""
    f = tmp_path / "events.jsonl"
    f.write_bytes(encode_events(_steps(0, 2)).rstrip(b"\n"))
    assert [e.step for e in read_events(f)] == [0, 1]


def test_rotated_and_gzipped_backups_in_order(tmp_path: Path) -> None:
    """Backups are read oldest first (.N … .1), gzipped or not, then the live file."""
    (tmp_path / "events.jsonl.3.gz").write_bytes(gzip.compress(encode_events(_steps(0, 3))))
    (tmp_path / "events.jsonl.2").write_bytes(encode_events(_steps(3, 6)))
    (tmp_path / "events.jsonl.1.gz").write_bytes(gzip.compress(encode_events(_steps(6, 9))))
    (tmp_path / "events.jsonl").write_bytes(encode_events(_steps(9, 12)))
    (tmp_path / "notes.txt").write_text("not a log")
    files = log_files(tmp_path)
    assert [p.name for p in files[0]] == [
        "events.jsonl.3.gz",
        "events.jsonl.2",
        "events.jsonl.1.gz",
        "events.jsonl",
    ]
    assert [e.step for e in read_events(tmp_path)] == list(range(12))


def test_ranks_merged_by_time(tmp_path: Path) -> None:
    """A directory with several ranks yields one stream ordered by event time."""
    (tmp_path / "events.jsonl").write_bytes(encode_events(_steps(0, 5, rank=0, t0=0)))
    (tmp_path / log_file_name(1)).write_bytes(encode_events(_steps(0, 5, rank=1, t0=5)))
    (tmp_path / log_file_name(2)).write_bytes(encode_events(_steps(0, 5, rank=2, t0=3)))
    events = list(read_events(tmp_path))
    assert len(events) == 15
    times = [e.time_ns for e in events]
    assert times == sorted(times)
    assert sorted(log_files(tmp_path)) == [0, 1, 2]
    for rank in (0, 1, 2):
        assert [e.step for e in events if e.rank == rank] == list(range(5))


def test_missing_and_empty_directory(tmp_path: Path) -> None:
    """A missing path or a directory without logs is a LogReadError naming the path."""
    with pytest.raises(LogReadError, match="does not exist"):
        list(read_events(tmp_path / "nope"))
    with pytest.raises(LogReadError, match=r"log directory .* does not exist"):
        log_files(tmp_path / "nope")
    with pytest.raises(LogReadError, match=r"no event log \(events\*.jsonl\) in directory"):
        list(read_events(tmp_path))
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(LogReadError, match="is not a directory"):
        log_files(f)


def test_empty_file(tmp_path: Path) -> None:
    """An empty log file yields nothing."""
    (tmp_path / "events.jsonl").write_bytes(b"")
    assert list(read_events(tmp_path)) == []


def test_bad_line_strict_and_lenient(tmp_path: Path) -> None:
    """A corrupt complete line raises with file:line, or is skipped with strict=False."""
    f = tmp_path / "events.jsonl"
    f.write_bytes(
        encode_event(StepCompleted(step=0)) + b"garbage\n\n" + encode_event(StepCompleted(step=1))
    )
    with pytest.raises(EventDecodeError, match=r"events.jsonl:2: not a JSON event line"):
        list(read_events(f))
    assert [e.step for e in read_events(f, strict=False)] == [0, 1]


def test_truncated_gzip_backup(tmp_path: Path) -> None:
    """A gzip backup cut short raises in strict mode and keeps what was read otherwise."""
    blob = gzip.compress(encode_events(_steps(0, 200)))
    (tmp_path / "events.jsonl.1.gz").write_bytes(blob[: len(blob) // 2])
    (tmp_path / "events.jsonl").write_bytes(encode_events(_steps(200, 201)))
    with pytest.raises(LogReadError, match=r"cannot read log file .*events\.jsonl\.1\.gz"):
        list(read_events(tmp_path))
    steps = [e.step for e in read_events(tmp_path, strict=False)]
    assert steps[-1] == 200 and steps[:3] == [0, 1, 2] and len(steps) < 201


def test_torn_line_in_the_middle_is_skipped_and_counted(tmp_path: Path) -> None:
    """A line cut by a crash in the middle of a file is skipped, even in strict mode."""
    f = tmp_path / "events.jsonl"
    whole = encode_event(StepCompleted(step=1, loss=0.5))
    f.write_bytes(encode_event(StepCompleted(step=0)) + whole[:25] + b"\n" + whole)
    stats = ReadStatistics()
    assert [e.step for e in read_events(f, stats=stats)] == [0, 1]
    assert (stats.events, stats.torn_lines, stats.invalid_lines) == (2, 1, 0)


def test_event_glued_after_a_torn_prefix_is_recovered(tmp_path: Path) -> None:
    """A restart that appended to a cut line: the whole event after the cut is recovered."""
    f = tmp_path / "events.jsonl"
    torn = encode_event(StepCompleted(step=1))[:30]
    f.write_bytes(encode_event(StepCompleted(step=0)) + torn + encode_event(StepCompleted(step=2)))
    stats = ReadStatistics()
    assert [e.step for e in read_events(f, stats=stats)] == [0, 2]
    assert (stats.torn_lines, stats.recovered) == (1, 1)


def test_wrong_field_type_names_file_line_and_field(tmp_path: Path) -> None:
    """`step: "abc"` is rejected with the file, the line number and the field's name."""
    f = tmp_path / "events.jsonl"
    bad = encode_event(StepCompleted(step=1)).replace(b'"step":1', b'"step":"abc"')
    f.write_bytes(encode_event(StepCompleted(step=0)) + bad)
    with pytest.raises(EventDecodeError, match=r"events.jsonl:2: .*field 'step'.*integer.*'abc'"):
        list(read_events(f))


def test_tolerant_mode_skips_and_counts_invalid_lines(tmp_path: Path) -> None:
    """With strict=False, lines with wrong types are skipped and counted; the rest is read."""
    f = tmp_path / "events.jsonl"
    good = encode_event(StepCompleted(step=0, loss=1.0))
    f.write_bytes(
        good
        + good.replace(b'"step":0', b'"step":"abc"')
        + good.replace(b'"loss":1.0', b'"loss":{"x":1}')
        + good.replace(b'"source":""', b'"source":[1,2]')
        + b"[1,2,3]\n"
        + good
    )
    stats = ReadStatistics()
    assert [e.step for e in read_events(f, strict=False, stats=stats)] == [0, 0]
    assert (stats.invalid_lines, stats.torn_lines) == (4, 0)


def test_corrupt_gzip_backup_is_a_read_stop_not_a_crash(tmp_path: Path) -> None:
    """Corrupt deflate data (a zlib.error, not an OSError) in a backup: strict mode names the
    file, lenient mode keeps every event before and after it (summary --skip-bad-lines)."""
    blob = bytearray(gzip.compress(encode_events(_steps(0, 200))))
    blob[10] ^= 0xFF  # the first byte of the deflate stream
    (tmp_path / "events.jsonl.1.gz").write_bytes(bytes(blob))
    (tmp_path / "events.jsonl").write_bytes(encode_events(_steps(200, 201)))
    with pytest.raises(LogReadError, match=r"cannot read log file .*events\.jsonl\.1\.gz"):
        list(read_events(tmp_path))
    assert [e.step for e in read_events(tmp_path, strict=False)][-1] == 200
