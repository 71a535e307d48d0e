"""The loss-spike and explosion detectors: what they flag, and what a healthy run never shows."""

from __future__ import annotations

import math
import random

import pytest

from eventbus_debug.probes.levels import Thresholds
from eventbus_debug.probes.step._detectors import (
    ExplosionDetector,
    LossSpikeDetector,
    SpikeRule,
    _RunningMedian,
)


def spikes() -> LossSpikeDetector:
    return LossSpikeDetector.from_thresholds(Thresholds())


def flagged(values: list[float]) -> list[tuple[int, str]]:
    detector = spikes()
    out = []
    for i, v in enumerate(values):
        verdict = detector.observe(v)
        if verdict is not None:
            out.append((i, verdict.rule.value))
    return out


class TestLossSpikes:
    def test_lightning_sequence_is_flagged_at_step_4(self) -> None:
        """Lightning's own SpikeDetection test sequence (1/i with a 3 at index 4) fires at 4."""
        values = [1 / i for i in range(1, 10)]
        values[4] = 3.0
        assert flagged(values) == [(4, "spike")]

    def test_a_drop_is_never_a_spike(self) -> None:
        """Losses that fall, however fast, never fire."""
        assert flagged([10.0 * 0.5**i for i in range(60)]) == []

    @pytest.mark.parametrize(
        "values",
        [
            [0.0] * 200,
            [1e-17 * (1 + (i % 7)) for i in range(200)],
            [-float(i) for i in range(200)],
            [-5.0 + 0.01 * ((i * 37) % 11) for i in range(300)],
        ],
        ids=["zero", "converged_1e-17", "negative_improving", "negative_noisy"],
    )
    def test_zero_negative_and_converged_losses_are_quiet(self, values: list[float]) -> None:
        """Zero, converged (1e-17) and negative losses raise nothing."""
        assert flagged(values) == []

    def test_converged_wobble_after_a_real_descent_is_quiet(self) -> None:
        """A loss that fell from 2.0 to ~1e-12 may wobble by orders of magnitude near zero."""
        rng = random.Random(0)
        values = [2.0 * 0.8**i for i in range(120)]
        values += [1e-12 * rng.uniform(0.1, 100.0) for _ in range(2000)]
        assert flagged(values) == []

    def test_noisy_minibatch_losses_raise_nothing_over_20000_steps(self) -> None:
        """Skewed per-batch noise (a mean of 16 exponential draws) around a decaying mean."""
        rng = random.Random(1)
        values = []
        for i in range(20_000):
            level = 0.3 + 2.0 * math.exp(-i / 2000)
            values.append(level * sum(rng.expovariate(1.0) for _ in range(16)) / 16)
        assert flagged(values) == []

    def test_sustained_spike_then_new_level(self) -> None:
        """Five spikes in a row: four 'spike', then 'sustained'; the new level is the baseline."""
        values = [1.0] * 20 + [5.0] * 10
        assert flagged(values) == [(20, "spike"), (21, "spike"), (22, "spike"), (23, "spike"),
                                   (24, "sustained")]  # fmt: skip

    def test_reset_restarts_the_window(self) -> None:
        """After reset() the next loss seeds the baseline and is never a spike."""
        detector = spikes()
        for _ in range(20):
            assert detector.observe(0.1) is None
        detector.reset()
        assert detector.observe(10.0) is None
        assert detector.observe(10.5) is None

    def test_verdict_carries_baseline_and_tolerance(self) -> None:
        """A spike reports its baseline, tolerance and streak."""
        detector = spikes()
        for _ in range(10):
            detector.observe(1.0)
        verdict = detector.observe(4.0)
        assert verdict is not None and verdict.rule is SpikeRule.SPIKE
        assert (verdict.baseline, verdict.tolerance, verdict.streak) == (1.0, 2.0, 1)


class TestExplosions:
    def test_cap_applies_from_the_first_check(self) -> None:
        """With no history, only the absolute cap can fire."""
        detector = ExplosionDetector(window=50, factor=10.0, cap=1e6)
        assert detector.observe(1e5) is None
        fresh = ExplosionDetector(window=50, factor=10.0, cap=1e6)
        verdict = fresh.observe(1e7)
        assert verdict is not None and verdict.rule == "cap" and verdict.threshold == 1e6

    def test_growth_rule_from_the_second_check(self) -> None:
        """The second norm may not be 10x the first; the explosion stays out of the baseline."""
        detector = ExplosionDetector(window=50, factor=10.0, cap=None)
        assert detector.observe(1.0) is None
        verdict = detector.observe(20.0)
        assert verdict is not None and verdict.rule == "growth" and verdict.baseline == 1.0
        again = detector.observe(20.0)
        assert again is not None and again.baseline == 1.0  # 20 never entered the window
        assert detector.largest == 1.0

    def test_healthy_noisy_norms_are_quiet(self) -> None:
        """Log-normal norm noise (x/÷ 3) over 20,000 checks raises nothing."""
        rng = random.Random(2)
        detector = ExplosionDetector(window=50, factor=10.0, cap=1e6)
        fired = [i for i in range(20_000) if detector.observe(rng.lognormvariate(0.0, 0.5))]
        assert fired == []


def test_detectors_are_built_from_the_thresholds() -> None:
    """from_thresholds reads the spike_* and explosion* fields of a Thresholds."""
    th = Thresholds(spike_window=7, spike_patience=3, explosion=5.0, explosion_factor=4.0)
    spike = LossSpikeDetector.from_thresholds(th)
    boom = ExplosionDetector.from_thresholds(th)
    assert (spike.patience, spike.rtol, spike.mad_factor) == (3, th.spike_rtol, th.spike_mad)
    assert (boom.cap, boom.factor) == (5.0, 4.0)
    assert boom.observe(6.0) is not None  # the cap applies from the first check


class TestRunningMedian:
    @staticmethod
    def brute_mad(values: list[float]) -> float:
        """The median of the absolute deviations from the median, by sorting them."""
        ordered = sorted(values)
        n = len(ordered)
        median = ordered[n // 2] if n % 2 else 0.5 * (ordered[n // 2 - 1] + ordered[n // 2])
        below = [median - v for v in ordered if v < median]
        above = [v - median for v in ordered if v >= median]
        devs = sorted(below + above)
        return devs[n // 2] if n % 2 else 0.5 * (devs[n // 2 - 1] + devs[n // 2])

    def test_mad_equals_the_sorted_deviations_median(self) -> None:
        """The O(log n) MAD equals sorting the deviations, odd and even windows, with ties."""
        rng = random.Random(0)
        for _ in range(3000):
            window = _RunningMedian(rng.randint(1, 60))
            for _ in range(rng.randint(1, 120)):
                if rng.random() < 0.3:
                    window.add(rng.choice([0.0, 1.0, 2.5, -1.0]))  # ties and exact medians
                else:
                    window.add(rng.gauss(0.0, 1.0) * 10.0 ** rng.randint(-12, 12))
            kept = list(window._order)
            assert window.mad(window.median()) == self.brute_mad(kept), kept

    def test_mad_of_small_windows(self) -> None:
        """One value: 0; two: half their distance; a constant window: 0."""
        for values, expected in (([3.0], 0.0), ([1.0, 4.0], 1.5), ([2.0] * 7, 0.0)):
            window = _RunningMedian(10)
            for v in values:
                window.add(v)
            assert window.mad(window.median()) == expected
