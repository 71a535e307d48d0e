"""Loop holds: the per-window meter and the timed await of a sink's call."""

from __future__ import annotations

import anyio
import pytest

from eventbus_debug._bus import _stalls
from eventbus_debug._bus._stalls import StallMeter, Timed


@pytest.fixture(name="clock")
def _clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [100.0]
    monkeypatch.setattr(_stalls, "_clock", lambda: now[0])
    return now


class TestStallMeter:
    def test_one_long_hold_is_reported_at_once(self, clock: list[float]) -> None:
        """A single hold at the threshold is reported, naming the sink and the hold."""
        meter = StallMeter(0.25)
        report = meter.note("slow", 0.3, 0.3)
        assert report is not None
        assert (report.sink, report.stall_s, report.threshold_s) == ("slow", 0.3, 0.25)

    def test_short_holds_within_a_window_are_not(self, clock: list[float]) -> None:
        """Short holds inside one window are summed, not reported."""
        meter = StallMeter(0.25)
        clock[0] += 0.5
        assert meter.note("s", 0.01, 0.05) is None
        assert meter.note("s", 0.01, 0.05) is None

    def test_a_large_share_of_a_window_is_reported(self, clock: list[float]) -> None:
        """Holds adding up to the share of a full window are reported without one long hold."""
        meter = StallMeter(0.25)
        clock[0] += 0.6
        assert meter.note("s", 0.1, 0.15) is None
        clock[0] += 0.6  # the window is now 1.2 s; 0.3 s held is over 20 %
        report = meter.note("s", 0.1, 0.15)
        assert report is not None
        assert report.blocked_s == pytest.approx(0.3)
        assert report.window_s == pytest.approx(1.2)

    def test_a_quiet_full_window_starts_a_new_one(self, clock: list[float]) -> None:
        """A full window with few holds is forgotten: its holds do not add to the next."""
        meter = StallMeter(0.25)
        clock[0] += 1.5
        assert meter.note("s", 0.01, 0.1) is None  # 0.1 of 1.5 s: under the share; reset
        clock[0] += 1.0
        assert meter.note("s", 0.01, 0.1) is None  # 0.1 of 1.0 s: still under


class TestTimed:
    async def test_returns_the_result_and_notes_once(self) -> None:
        """A timed call returns the coroutine's value and notes its holds once."""
        notes: list[tuple[float, float]] = []

        async def call() -> int:
            await anyio.lowlevel.checkpoint()
            return 5

        assert await Timed(call(), lambda longest, total: notes.append((longest, total))) == 5
        assert len(notes) == 1 and 0.0 <= notes[0][0] <= notes[0][1]

    async def test_an_exception_passes_through_and_is_noted(self) -> None:
        """A raising call raises to the awaiting pump; its holds are still noted."""
        notes: list[tuple[float, float]] = []

        async def call() -> None:
            raise ValueError("boom")

        with pytest.raises(ValueError, match="boom"):
            await Timed(call(), lambda longest, total: notes.append((longest, total)))
        assert len(notes) == 1
