"""``LogFollower`` across rotation, whatever the moment a poll meets it, and backups it cannot read.

A rotation of ``RotatingFileSink`` is a sequence of file-system operations: the backups shift
(``.1`` → ``.2`` …), the live file is renamed to ``.1`` (or gzipped into ``.1.gz.tmp``, renamed
to ``.1.gz``, then deleted), and a new live file starts. A poll can meet the log between any two
of them, and a rotation can go on *during* a poll: the directory listed before ``.1.gz`` exists,
the files read after it does (how ``tail --follow`` printed the whole history again). Here the
follower polls between every phase of the sink's own rotation; a model of that rotation (checked
against the sink's calls) advances at every file-system call a poll makes, and on seeded
schedules; and a bounded stress follows a real sink rotating every few events. Every event is
returned exactly once, in order (but those of backups deleted before any poll could read them).

A backup that cannot be read to its end (a corrupt or cut-short gzip): ``strict`` says so,
naming it; ``strict=False`` (``tail --skip-bad-lines``) keeps what it read, as ``summary`` and
``report`` do.
"""

from __future__ import annotations

import gzip
import logging
import os
import random
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from itertools import chain
from pathlib import Path
from typing import Any

import anyio
import pytest

import eventbus_debug.log.follow as follow
import eventbus_debug.sinks._jsonl_file as jsonl_file
import eventbus_debug.sinks.rotating_file as rotating_file
from eventbus_debug import encode_event
from eventbus_debug.cli import main
from eventbus_debug.events import Event, StepCompleted
from eventbus_debug.exceptions import LogReadError
from eventbus_debug.log import log_files as log_files_unhooked
from eventbus_debug.log.encoding import decode_event
from eventbus_debug.log.follow import LogFollower
from eventbus_debug.sinks import RotatingFileSink

LIVE = "events.jsonl"

_STRESS_RUNS = 25
"""Real-sink stress runs per mode (each about 0.1 s, some 35 rotations)."""
_STRESS_EVENTS = 300
_STRESS_BUDGET_S = 30.0
"""No stress run starts after this long (the test's own time limit is 120 s)."""
_RUN_LIMIT_S = 30.0
"""The longest one run may take (its writer is joined with what is left of it)."""
_POLL_PAUSES = (0.0, 0.0002, 0.0005, 0.001)


def _line(step: int) -> bytes:
    return encode_event(StepCompleted(step=step, loss=1.0))


def _steps(events: Iterable[Event]) -> list[int]:
    out = []
    for event in events:
        assert isinstance(event, StepCompleted) and event.step is not None
        out.append(event.step)
    return out


# -- a model of the sink's rotation -------------------------------------------------------------


class _Log:
    """One rank's log written as ``RotatingFileSink`` writes it, one file-system operation at a
    time: ``JsonlFile._rename_backups``, then ``_gzip_rotator`` or ``_default_rotator``, then the
    new live file (``JsonlFile._ensure_open``). :func:`test_the_model_rotates_as_the_sink_does`
    holds it to the sink's own calls.

    It knows which steps each file holds, so which were deleted (:attr:`lost`: a follower that
    did not poll in time cannot read them).
    """

    def __init__(self, directory: Path, *, compress: bool, backup_count: int) -> None:
        self.dir = directory
        self.compress = compress
        self.backup_count = backup_count
        self.written = 0
        self.contents: dict[str, list[int]] = {}
        self.lost: set[int] = set()
        directory.mkdir(parents=True, exist_ok=True)
        self._create_live()

    def backup(self, i: int) -> str:
        return f"{LIVE}.{i}{'.gz' if self.compress else ''}"

    def write(self, count: int = 1) -> None:
        steps = range(self.written, self.written + count)
        with (self.dir / LIVE).open("ab") as fh:
            fh.write(b"".join(map(_line, steps)))
        self.contents[LIVE].extend(steps)
        self.written += count

    def writes(self, count: int, *, split: bool = False) -> Iterator[str]:
        """*count* lines, each one action (*split*: the first in two writes, a poll between)."""
        for i in range(count):
            if split and i == 0:
                line = _line(self.written)
                with (self.dir / LIVE).open("ab") as fh:
                    fh.write(line[:9])
                yield "write half a line"
                with (self.dir / LIVE).open("ab") as fh:
                    fh.write(line[9:])
                self.contents[LIVE].append(self.written)
                self.written += 1
            else:
                self.write()
            yield "write"

    def rotation(self) -> Iterator[str]:
        """One rotation, pausing after each file-system operation (yielding its name)."""
        for i in range(self.backup_count - 1, 0, -1):
            src, dst = self.backup(i), self.backup(i + 1)
            if (self.dir / src).exists():
                self._replace(src, dst)
                yield f"replace {src} {dst}"
        first = self.backup(1)
        if (self.dir / first).exists():
            self._remove(first, lost=True)
            yield f"remove {first}"
        if self.compress:
            tmp = first + ".tmp"
            (self.dir / tmp).write_bytes(gzip.compress((self.dir / LIVE).read_bytes()))
            self.contents[tmp] = list(self.contents[LIVE])
            yield f"gzip {tmp}"
            self._replace(tmp, first)
            yield f"replace {tmp} {first}"
            self._remove(LIVE, lost=False)  # its lines are in .1.gz
            yield f"remove {LIVE}"
        else:
            self._replace(LIVE, first)
            yield f"replace {LIVE} {first}"
        self._create_live()
        yield f"open {LIVE}"

    def rotate(self) -> None:
        for _ in self.rotation():
            pass

    def _replace(self, src: str, dst: str) -> None:
        self.lost.update(self.contents.pop(dst, []))
        self.contents[dst] = self.contents.pop(src)
        os.replace(self.dir / src, self.dir / dst)

    def _remove(self, name: str, *, lost: bool) -> None:
        steps = self.contents.pop(name)
        if lost:
            self.lost.update(steps)
        os.remove(self.dir / name)

    def _create_live(self) -> None:
        os.close(os.open(self.dir / LIVE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644))
        self.contents.setdefault(LIVE, [])


def _check(got: list[int], log: _Log, start: int = 0) -> None:
    """*got* holds every step from *start* on once, in order, but lost ones may be missing."""
    assert got == sorted(set(got)), f"repeated or out of order: {got}"
    expected = set(range(start, log.written))
    assert set(got) <= expected
    assert expected - log.lost <= set(got), f"missed {sorted(expected - log.lost - set(got))}"


# -- hooks: the follower's file-system calls -----------------------------------------------------


class _Touches:
    """Counts the follower's file-system calls (its ``os`` calls and directory listings) and
    runs ``at(n)`` before the n-th (from 0): a test advances a rotation there."""

    _CALLS = frozenset({"stat", "open", "fstat", "pread", "read", "lseek", "dup", "fdopen"})

    def __init__(self) -> None:
        self.count = 0
        self.at: Callable[[int], None] = lambda n: None

    def tick(self) -> None:
        n = self.count
        self.count += 1
        self.at(n)

    def os_module(self) -> Any:
        touches = self

        class _Os:
            def __getattr__(self, name: str) -> Any:
                attr = getattr(os, name)
                if name not in _Touches._CALLS:
                    return attr

                def call(*args: Any, **kwargs: Any) -> Any:
                    touches.tick()
                    return attr(*args, **kwargs)

                return call

        return _Os()


@pytest.fixture(name="touches")
def _touches_fixture(monkeypatch: pytest.MonkeyPatch) -> _Touches:
    touches = _Touches()
    listing = log_files_unhooked

    def log_files(directory: Path) -> dict[int, list[Path]]:
        files = listing(directory)
        touches.tick()  # listed: what happens now makes the listing stale
        return files

    monkeypatch.setattr(follow, "log_files", log_files)
    monkeypatch.setattr(follow, "os", touches.os_module())
    return touches


class _Script:
    """Actions (file-system operations of a writer) run one at a time."""

    def __init__(self, actions: Iterable[str]) -> None:
        self._actions = iter(actions)
        self.done = False
        self.ran: list[str] = []

    def step(self, count: int = 1) -> None:
        for _ in range(count):
            action = next(self._actions, None)
            if action is None:
                self.done = True
                return
            self.ran.append(action)

    def finish(self) -> None:
        while not self.done:
            self.step()


# -- polls between the phases of the sink's own rotation ------------------------------------------


class _PhasedOs:
    """The ``os`` of the sink's rotation code: calls *phase* before each rename and removal and
    after the live file is opened, and records them (names only)."""

    def __init__(self, phase: Callable[[str], None]) -> None:
        self._phase = phase
        self.ops: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def _record(self, op: str) -> None:
        self.ops.append(op)
        self._phase(op)

    def replace(self, src: str | Path, dst: str | Path) -> None:
        self._record(f"replace {Path(src).name} {Path(dst).name}")
        os.replace(src, dst)

    def remove(self, path: str | Path) -> None:
        self._record(f"remove {Path(path).name}")
        os.remove(path)

    def open(self, path: str | Path, flags: int, mode: int = 0o777) -> int:
        fd = os.open(path, flags, mode)
        if flags & os.O_CREAT and Path(path).name == LIVE:
            self._record(f"open {LIVE}")
        return fd


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "gzip"])
@pytest.mark.parametrize("backup_count", [1, 3])
async def test_polled_between_every_phase_of_the_sinks_rotation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compress: bool, backup_count: int
) -> None:
    """The sink's rotations (by rotate() and by size), a poll before each of its renames and
    removals (the backups shifted, the temporary .gz written, the .gz named, the live file
    deleted) and after the new live file: every event once, in order."""
    got: list[int] = []
    follower = LogFollower(tmp_path, from_end=False)
    proxy = _PhasedOs(lambda op: got.extend(_steps(follower.poll())))
    monkeypatch.setattr(jsonl_file, "os", proxy)
    monkeypatch.setattr(rotating_file, "os", proxy)
    size = len(_line(0))
    sink = RotatingFileSink(
        tmp_path, max_bytes=3 * size, backup_count=backup_count, compress=compress, wake_interval=0
    )
    step = 0
    with follower:
        for rotation in range(6):
            batch = [StepCompleted(step=step + i, loss=1.0) for i in range(2)]
            step += 2
            await sink.handle_batch(batch)
            got.extend(_steps(follower.poll()))
            if rotation % 2:
                await sink.rotate()
            else:  # past max_bytes: the rotation between the lines of a batch
                await sink.handle_batch([StepCompleted(step=step, loss=1.0)])
                step += 1
        await sink.aclose()
        got.extend(_steps(follower.poll()))
        assert follower.poll() == []
    assert sink.statistics().rotations >= 6
    assert sum(op.startswith("open") for op in proxy.ops) >= 6
    assert got == list(range(step))


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "gzip"])
@pytest.mark.parametrize("backup_count", [1, 2, 4])
async def test_the_model_rotates_as_the_sink_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compress: bool, backup_count: int
) -> None:
    """The model's rotation makes the sink's renames and removals, in the same order, and leaves
    the same files (the other tests drive the model one operation at a time)."""
    proxy = _PhasedOs(lambda op: None)
    monkeypatch.setattr(jsonl_file, "os", proxy)
    monkeypatch.setattr(rotating_file, "os", proxy)
    sink = RotatingFileSink(
        tmp_path / "sink",
        max_bytes=0,
        backup_count=backup_count,
        compress=compress,
        wake_interval=0,
    )
    log = _Log(tmp_path / "model", compress=compress, backup_count=backup_count)
    for _ in range(backup_count + 2):
        await sink.handle_batch([StepCompleted(step=0, loss=1.0)])
        log.write()
        proxy.ops.clear()
        await sink.rotate()
        assert proxy.ops == [op for op in log.rotation() if not op.startswith("gzip")]
        assert sorted(os.listdir(tmp_path / "sink")) == sorted(os.listdir(tmp_path / "model"))
    await sink.aclose()


# -- polls between the phases of the model's rotation ---------------------------------------------


def _one_rotation(log: _Log) -> Iterator[str]:
    yield from log.writes(2, split=True)
    yield from log.rotation()
    yield from log.writes(2)


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "gzip"])
@pytest.mark.parametrize("backup_count", [1, 3])
def test_polled_after_any_subset_of_the_phases(
    tmp_path: Path, compress: bool, backup_count: int
) -> None:
    """Every subset of the moments of one rotation (and the writes around it) for the polls:
    every event once, in order; a poll before the new live file exists waits for it."""

    def prepared(name: str) -> _Log:
        log = _Log(tmp_path / name, compress=compress, backup_count=backup_count)
        log.write(2)
        log.rotate()  # a backup to tell from the new ones
        log.write(2)
        return log

    phases = len(list(_one_rotation(prepared("count"))))
    assert phases >= 8
    for mask in range(1 << phases):
        log = prepared(f"{mask}")
        got: list[int] = []
        with LogFollower(log.dir, from_end=False) as follower:
            got.extend(_steps(follower.poll()))
            for i, _ in enumerate(_one_rotation(log)):
                if mask >> i & 1:
                    got.extend(_steps(follower.poll()))
            got.extend(_steps(follower.poll()))
        _check(got, log)
        assert got == list(range(log.written)), bin(mask)


# -- a rotation going on during a poll -----------------------------------------------------------


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "gzip"])
@pytest.mark.parametrize("pace", ["one operation", "one per call", "all at once"])
def test_a_rotation_advancing_at_any_call_of_a_poll(
    tmp_path: Path, touches: _Touches, compress: bool, pace: str
) -> None:
    """The writer (two rotations, writes around them) stopped after each of its operations in
    turn; then a poll, the writer advancing at its k-th file-system call, for every k the poll
    makes: one operation there, one at each call from there on, or all at once (the listing
    taken before the .gz exists, the files read after). Every event once, in order."""

    def prepared(name: str) -> _Log:
        log = _Log(tmp_path / name, compress=compress, backup_count=4)
        log.write(2)
        log.rotate()
        log.write(2)
        return log

    tried = 0
    for before in range(len(list(_one_rotation(prepared("count")))) + 1):
        k = 0
        while True:
            log = prepared(f"{before}-{k}")
            writer = _Script(chain(_one_rotation(log), _one_rotation(log)))
            got: list[int] = []
            with LogFollower(log.dir, from_end=False) as follower:
                got.extend(_steps(follower.poll()))
                writer.step(before)
                touches.count = 0

                def at(n: int, k: int = k, writer: _Script = writer) -> None:
                    if n == k or (pace == "one per call" and n > k):
                        writer.step(1 if pace != "all at once" else 1000)

                touches.at = at
                got.extend(_steps(follower.poll()))
                calls = touches.count
                touches.at = lambda n: None
                got.extend(_steps(follower.poll()))
                writer.finish()
                got.extend(_steps(follower.poll()))
            assert got == list(range(log.written)), (before, k, writer.ran)
            tried += 1
            if k >= calls:  # the poll made fewer calls: every moment of it was tried
                break
            k += 1
    assert tried > 100


@pytest.mark.parametrize("backup_count", [3, 6])
def test_the_listing_taken_before_the_gzip_exists(
    tmp_path: Path, touches: _Touches, backup_count: int
) -> None:
    """The audit's case: a poll lists the directory while the rotation compresses (no .1.gz
    yet); the .gz is named, the followed file deleted and a new live file written before the
    poll goes on. Before the fix no backup of the stale listing matched the deleted file and
    all of them were read again (the whole history printed twice)."""
    log = _Log(tmp_path, compress=True, backup_count=backup_count)
    for _ in range(backup_count - 1):
        log.write(3)
        log.rotate()
    log.write(3)
    with LogFollower(tmp_path, from_end=False) as follower:
        got = _steps(follower.poll())
        log.write(2)
        script = _Script(chain(log.rotation(), log.writes(2)))
        while not script.ran or not script.ran[-1].startswith("gzip"):
            script.step()  # the shift done, the .gz.tmp written: no .1.gz yet
        assert not (tmp_path / "events.jsonl.1.gz").exists()
        touches.count = 0
        touches.at = lambda n: script.finish() if n == 0 else None  # right after the listing
        got += _steps(follower.poll())
        assert script.done
        touches.at = lambda n: None
        got += _steps(follower.poll())
    assert got == list(range(log.written))


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "gzip"])
@pytest.mark.parametrize("listed", [True, False], ids=["listed", "gone"])
def test_a_poll_before_the_new_live_file_exists_does_not_start_over(
    tmp_path: Path, touches: _Touches, compress: bool, listed: bool
) -> None:
    """The live file rotated away (renamed, or gzipped and deleted) and no new one yet, at a
    poll: right after its listing (which still showed it) or before it. The follower waits for
    the new file. Before the fix, the listed-then-gone case dropped the rank and read every
    backup again at the next poll (plain rotation too)."""
    log = _Log(tmp_path, compress=compress, backup_count=5)
    for _ in range(3):
        log.write(2)
        log.rotate()
    log.write(2)
    with LogFollower(tmp_path, from_end=False) as follower:
        got = _steps(follower.poll())
        log.write()
        writer = _Script(chain(log.rotation(), log.writes(2)))

        def to_the_gap(n: int) -> None:
            if n == 0:
                gap = (f"replace {LIVE} {LIVE}.1", f"remove {LIVE}")
                while not writer.done and not (writer.ran and writer.ran[-1] in gap):
                    writer.step()  # up to the rename, or the removal after the .gz
                assert not (tmp_path / LIVE).exists()

        touches.count = 0
        if listed:
            touches.at = to_the_gap
        else:
            to_the_gap(0)
        got += _steps(follower.poll())
        assert writer.ran[-1] in (f"replace {LIVE} {LIVE}.1", f"remove {LIVE}")
        touches.at = lambda n: None
        got += _steps(follower.poll())
        writer.finish()
        got += _steps(follower.poll())
        got += _steps(follower.poll())
    assert got == list(range(log.written))


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "gzip"])
def test_more_rotations_than_backups_between_two_polls(tmp_path: Path, compress: bool) -> None:
    """The followed file's backup deleted by later rotations: every backup left is newer and
    read once; the deleted files' events are the only ones missing."""
    log = _Log(tmp_path, compress=compress, backup_count=2)
    log.write(2)
    with LogFollower(tmp_path, from_end=False) as follower:
        got = _steps(follower.poll())
        for _ in range(4):
            log.write(2)
            log.rotate()
        log.write(2)
        got += _steps(follower.poll())
        assert follower.poll() == []
    # The second file (steps 4, 5), never opened by the follower, was deleted; so was the
    # first (0-3), read through the open file.
    assert log.lost == set(range(6))
    assert got == [0, 1, 2, 3, 6, 7, 8, 9, 10, 11]


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "gzip"])
def test_the_live_file_deleted_by_hand(tmp_path: Path, compress: bool) -> None:
    """The live file removed (rm) and started again: its backups are older, not read again."""
    log = _Log(tmp_path, compress=compress, backup_count=3)
    for _ in range(2):
        log.write(2)
        log.rotate()
    log.write(2)
    with LogFollower(tmp_path, from_end=False) as follower:
        got = _steps(follower.poll())
        (tmp_path / LIVE).unlink()
        log.contents[LIVE] = []
        got += _steps(follower.poll())
        log.write(2)
        got += _steps(follower.poll())
    assert got == list(range(log.written))


# -- seeded schedules ----------------------------------------------------------------------------


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "gzip"])
@pytest.mark.parametrize("backup_count", [1, 2, 5, 100])
def test_seeded_schedules(
    tmp_path: Path, touches: _Touches, compress: bool, backup_count: int
) -> None:
    """Writes (a line sometimes in two pieces), rotations (twice in a row: an empty file
    rotated), and polls, interleaved by a seeded schedule: the writer advances between polls
    and at random file-system calls inside them; the follower starts at the beginning or at
    the end. Every event once, in order, but those of files deleted before a poll could
    read them (with 100 backups, none)."""
    for seed in range(30):
        rng = random.Random(seed)
        log = _Log(tmp_path / f"{seed}", compress=compress, backup_count=backup_count)

        def script(log: _Log = log, rng: random.Random = rng) -> Iterator[str]:
            for _ in range(10):
                yield from log.writes(rng.randint(0, 3), split=rng.random() < 0.3)
                for _ in range(rng.choice([0, 1, 1, 1, 2])):
                    yield from log.rotation()

        writer = _Script(script())
        writer.step(rng.randint(0, 20))
        from_end = rng.random() < 0.3
        start = log.written if from_end else 0
        touches.at = lambda n: None
        got: list[int] = []
        with LogFollower(log.dir, from_end=from_end) as follower:
            inside = rng.choice([0.0, 0.05, 0.3])

            def at(
                n: int, writer: _Script = writer, rng: random.Random = rng, p: float = inside
            ) -> None:
                if rng.random() < p:
                    writer.step()

            touches.at = at
            while not writer.done:
                writer.step(rng.randint(0, 4))
                got.extend(_steps(follower.poll()))
            touches.at = lambda n: None
            got.extend(_steps(follower.poll()))
            assert follower.poll() == []
        _check(got, log, start)
        if not log.lost:
            assert got == list(range(start, log.written)), seed


# -- stress: a real sink rotating fast -----------------------------------------------------------


def _stress_run(directory: Path, seed: int, compress: bool, deadline: float) -> list[int]:
    """A sink writes _STRESS_EVENTS events in small batches (rotating every few events, in its
    own thread) while the follower polls as fast as it can; what the follower returned."""
    rng = random.Random(seed)
    sink = RotatingFileSink(
        directory, max_bytes=1500, backup_count=100, compress=compress, wake_interval=0
    )
    pauses = [rng.random() < 0.05 for _ in range(_STRESS_EVENTS)]
    sizes = [rng.randint(1, 6) for _ in range(_STRESS_EVENTS)]
    failure: list[BaseException] = []

    async def write() -> None:
        step = 0
        for pause, size in zip(pauses, sizes, strict=True):
            batch = [StepCompleted(step=s, loss=1.0) for s in range(step, step + size)]
            await sink.handle_batch(batch[: _STRESS_EVENTS - step])
            step = min(step + size, _STRESS_EVENTS)
            if pause:
                await anyio.sleep(rng.random() / 1000)
        await sink.aclose()

    def run() -> None:
        try:
            anyio.run(write)
        except BaseException as exc:  # reported by the test
            failure.append(exc)

    thread = threading.Thread(target=run, name=f"stress-writer-{seed}", daemon=True)
    got: list[int] = []
    with LogFollower(directory, from_end=False) as follower:
        thread.start()
        while thread.is_alive() and time.monotonic() < deadline:
            got.extend(_steps(follower.poll()))
            time.sleep(rng.choice(_POLL_PAUSES))  # lets the writer run (the GIL), varies the phase
        thread.join(max(0.0, deadline - time.monotonic()))
        assert not thread.is_alive(), "the writer did not finish in time"
        got.extend(_steps(follower.poll()))
    assert not failure, failure
    return got


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "gzip"])
def test_stress_every_event_once_over_fast_rotations(tmp_path: Path, compress: bool) -> None:
    """A real sink rotating at 1,500 bytes (every few events; gzipped or not) and a follower
    polling all the while, on seeded runs: every event once, in order, every time (before the
    fix, many plain runs and most gzipped ones repeated or missed events). Bounded:
    the runs stop at the time limit (at least a few must have run), a run's writer is joined
    with a timeout."""
    start = time.monotonic()
    clean = 0
    for seed in range(_STRESS_RUNS):
        if time.monotonic() - start > _STRESS_BUDGET_S:
            break  # a slow machine: fewer runs
        got = _stress_run(tmp_path / f"{seed}", seed, compress, time.monotonic() + _RUN_LIMIT_S)
        backups = len(os.listdir(tmp_path / f"{seed}")) - 1
        assert backups >= 20, backups  # many rotations, none deleted
        assert got == list(range(_STRESS_EVENTS)), (seed, len(got))
        clean += 1
    assert clean >= min(5, _STRESS_RUNS)


# -- backups that cannot be read to their end ----------------------------------------------------


def _damaged(data: bytes, how: str) -> bytes:
    """*data* gzipped, then damaged as *how* says."""
    packed = gzip.compress(data)
    if how == "cut short":
        return packed[: len(packed) // 2]
    if how == "not gzip":
        return b"this is not gzip data\n"
    if how == "corrupt data":  # a zlib.error after the first half of the lines
        half = data.index(b"\n", len(data) // 2) + 1
        packer = zlib.compressobj(6, zlib.DEFLATED, 31)  # 31: with a gzip header
        first = packer.compress(data[:half]) + packer.flush(zlib.Z_FULL_FLUSH)
        return first + b"\x07" + bytes(32)  # a block of the reserved type 3
    assert how == "bad checksum"  # every line readable, the error at the end
    return packed[:-8] + bytes(b ^ 0xFF for b in packed[-8:-4]) + packed[-4:]


_DAMAGE = ["cut short", "not gzip", "corrupt data", "bad checksum"]


def _damaged_log(directory: Path, how: str) -> list[int]:
    """events.jsonl.2.gz damaged (steps 0-199), .1.gz (200-209) and the live file (210-214);
    returns the steps after the damaged backup."""
    directory.mkdir(parents=True, exist_ok=True)
    raw = b"".join(map(_line, range(200)))
    (directory / "events.jsonl.2.gz").write_bytes(_damaged(raw, how))
    (directory / "events.jsonl.1.gz").write_bytes(
        gzip.compress(b"".join(map(_line, range(200, 210))))
    )
    (directory / LIVE).write_bytes(b"".join(map(_line, range(210, 215))))
    return list(range(200, 215))


@pytest.mark.parametrize("how", _DAMAGE)
def test_a_damaged_backup_strict_is_an_error_naming_it(tmp_path: Path, how: str) -> None:
    _damaged_log(tmp_path, how)
    with (
        LogFollower(tmp_path, from_end=False, strict=True) as follower,
        pytest.raises(LogReadError, match=r"events\.jsonl\.2\.gz' past line \d+: "),
    ):
        follower.poll()


@pytest.mark.parametrize("how", _DAMAGE)
def test_a_damaged_backup_not_strict_keeps_what_was_read(
    tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    """strict=False: the lines before the stop, then the rest of the log; the stop counted
    and logged (log_read_stopped) once, and the backup not read again."""
    after = _damaged_log(tmp_path, how)
    with (
        caplog.at_level(logging.WARNING, logger="eventbus_debug"),
        LogFollower(tmp_path, from_end=False, strict=False) as follower,
    ):
        got = _steps(follower.poll())
        assert got[len(got) - len(after) :] == after
        before = got[: len(got) - len(after)]
        assert before == list(range(len(before)))  # the lines before the stop
        if how == "not gzip":
            assert before == []
        elif how == "bad checksum":  # found at the end of the stream
            assert len(before) == 200
        else:
            assert 0 < len(before) < 200
        assert follower.read_stops == 1
        stops = [r.getMessage() for r in caplog.records if "log_read_stopped" in r.getMessage()]
        assert len(stops) == 1 and "events.jsonl.2.gz" in stops[0]
        # A rotation: the backups are looked up again, the damaged one is not read again.
        for n in (2, 1):
            os.replace(tmp_path / f"events.jsonl.{n}.gz", tmp_path / f"events.jsonl.{n + 1}.gz")
        (tmp_path / "events.jsonl.1.gz").write_bytes(gzip.compress((tmp_path / LIVE).read_bytes()))
        (tmp_path / LIVE).unlink()
        (tmp_path / LIVE).write_bytes(_line(215))
        assert _steps(follower.poll()) == [215]
        assert follower.read_stops == 1


@pytest.mark.parametrize("how", _DAMAGE)
def test_a_damaged_backup_met_while_following(tmp_path: Path, how: str) -> None:
    """A file the follower never saw live, rotated into a damaged .gz between two polls: its
    readable lines, then the new live file; strict=True names it."""
    for strict in (False, True):
        d = tmp_path / str(strict)
        log = _Log(d, compress=True, backup_count=5)
        log.write(2)
        with LogFollower(d, from_end=False, strict=strict) as follower:
            got = _steps(follower.poll())
            log.write(2)
            log.rotate()
            log.write(50)
            log.rotate()
            raw = b"".join(map(_line, range(4, 54)))  # the second file, damaged
            (d / "events.jsonl.1.gz").write_bytes(_damaged(raw, how))
            log.write(2)
            if strict:
                with pytest.raises(LogReadError, match=r"events\.jsonl\.1\.gz' past line"):
                    follower.poll()
                continue
            got += _steps(follower.poll())
            assert follower.read_stops == 1
            assert got[:4] == [0, 1, 2, 3] and got[-2:] == [54, 55]
            assert got[4:-2] == list(range(4, len(got) - 2))  # the damaged file's first lines
            assert follower.poll() == [] and follower.read_stops == 1


@pytest.mark.parametrize("how", _DAMAGE)
@pytest.mark.parametrize("follow_flag", [[], ["--follow", "--timeout", "0"]], ids=["", "follow"])
def test_tail_skip_bad_lines_keeps_going_as_summary_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], how: str, follow_flag: list[str]
) -> None:
    """tail --skip-bad-lines on a damaged gzip backup: exit 0, the readable events printed and
    the stop on standard error, as summary --skip-bad-lines; without it, a one-line error."""
    after = _damaged_log(tmp_path, how)
    argv = ["tail", str(tmp_path), "--all", "--json", *follow_flag]
    assert main([*argv, "--skip-bad-lines"]) == 0
    out, err = capsys.readouterr()
    printed = _steps(decode_event(line) for line in out.splitlines())
    assert printed[len(printed) - len(after) :] == after
    assert printed == sorted(set(printed))
    assert "log_read_stopped" in err and "events.jsonl.2.gz" in err
    assert main(["summary", str(tmp_path), "--skip-bad-lines"]) == 0
    capsys.readouterr()
    assert main(argv) == 1
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and "events.jsonl.2.gz" in err and "past line" in err
