"""The loss-spike and explosion detectors: what they flag, and what a healthy run never shows."""

from __future__ import annotations

import math
import random

import pytest

from eventbus_debug.probes.levels import Thresholds
from eventbus_debug.probes.step._explosions import ExplosionDetector
from eventbus_debug.probes.step._spikes import LossSpikeDetector, SpikeRule
from eventbus_debug.probes.step._windows import RunningMedian


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


def two_tasks(steps: int, seed: int, share: float = 0.3) -> list[float]:
    """A multi-task mix: each batch is the easy task (~0.3) or, with *share*, the hard (~2.3)."""
    rng = random.Random(seed)
    return [(2.3 if rng.random() < share else 0.3) * rng.uniform(0.85, 1.15) for _ in range(steps)]


class TestRecurringLevels:
    """A level the run keeps reaching is the data's distribution; a new one is still a spike.

    A level is learned from two earlier outliers at it (or from one, when they are frequent),
    so a mode costs at most two incidents, at its first appearances.
    """

    @pytest.mark.parametrize("seed", [3, 4, 5, 8])
    def test_a_second_task_is_learned_at_its_first_batches(self, seed: int) -> None:
        """Over 5,000 steps of a 30 % / 70 % task mix (7.7x apart), at most the first two hard
        batches fire (kept out of the window, the same loss fired 1,400 times before)."""
        fired = flagged(two_tasks(5000, seed=seed))
        assert len(fired) <= 2
        assert all(i < 50 and rule == "spike" for i, rule in fired)

    def test_a_single_spike_inside_the_mix_still_fires(self) -> None:
        """A loss 10x the hard task's level is new, in either task's batch."""
        values = two_tasks(3000, seed=4)
        values[1500] = values[2500] = 23.0
        assert [f for f in flagged(values) if f[0] >= 50] == [(1500, "spike"), (2500, "spike")]

    def test_a_sustained_shift_inside_the_mix_is_sustained(self) -> None:
        """Both tasks jump 50x and stay: four spikes, then sustained, then quiet."""
        values = two_tasks(3000, seed=5)
        values[2000:2100] = [v * 50.0 for v in values[2000:2100]]
        fired = [f for f in flagged(values) if f[0] >= 50]
        assert fired == [(2000, "spike"), (2001, "spike"), (2002, "spike"), (2003, "spike"),
                         (2004, "sustained")]  # fmt: skip

    def test_length_buckets_are_learned_after_the_first_bucket(self) -> None:
        """Runs of 16 batches at 4x (a long-sequence bucket) every 100-300 steps: the first run
        is a sustained shift, the later ones are the data."""
        rng = random.Random(6)
        values: list[float] = []
        while len(values) < 4000:
            values += [rng.uniform(9.0, 11.0) for _ in range(rng.randint(100, 300))]
            values += [rng.uniform(36.0, 44.0) for _ in range(16)]
        start = next(i for i, v in enumerate(values) if v > 30.0)
        fired = flagged(values)
        assert [i for i, _ in fired] == list(range(start, start + 5))
        assert fired[-1][1] == "sustained"

    def test_rare_heavy_batches_are_learned(self) -> None:
        """3 % of the batches at 20x (full-length sequences in a token-sum loss): the first two
        fire, the next 140 do not."""
        rng = random.Random(7)
        values = [rng.uniform(8.0, 12.0) * (20.0 if rng.random() < 0.03 else 1.0)
                  for _ in range(5000)]  # fmt: skip
        heavy = [i for i, v in enumerate(values) if v > 100.0]
        assert len(heavy) > 140
        assert flagged(values) == [(heavy[0], "spike"), (heavy[1], "spike")]

    def test_one_spike_never_vouches_for_the_next(self) -> None:
        """Two earlier outliers at a level are needed: the second spike fires, the third
        (within the memory) is recurring."""
        values = [1.0 + 0.01 * (i % 5) for i in range(600)]
        for at in (200, 300, 400):
            values[at] = 10.0
        assert flagged(values) == [(200, "spike"), (300, "spike")]

    def test_an_explosion_vouches_for_nothing_ten_times_smaller(self) -> None:
        """Two huge spikes do not teach the detector that a 10x spike is normal."""
        values = [1.0 + 0.01 * (i % 5) for i in range(600)]
        values[100] = values[150] = 1e6
        values[300] = 10.0
        assert flagged(values) == [(100, "spike"), (150, "spike"), (300, "spike")]

    def test_what_is_learned_is_forgotten_after_the_memory(self) -> None:
        """A level not seen for `memory` (1,000) observations is new again."""
        values = [1.0 + 0.01 * (i % 5) for i in range(3000)]
        for at in (100, 200, 300, 400, 1500):
            values[at] = 10.0
        assert [i for i, _ in flagged(values)] == [100, 200, 1500]

    def test_reset_forgets_the_learned_levels(self) -> None:
        """After a restore the hard task is new again (the undone steps vouch for nothing) and
        the next loss seeds the baseline."""
        detector = spikes()
        values = [0.3] * 20 + two_tasks(2000, seed=4)
        fired = [i for i, v in enumerate(values) if detector.observe(v) is not None]
        assert 1 <= len(fired) <= 2 and fired[-1] < 70
        detector.reset()
        assert detector.observe(0.3) is None  # seeds the baseline
        again = [0.3] * 20 + [2.3] + [0.3] * 20 + [2.3]
        refired = [i for i, v in enumerate(again) if detector.observe(v) is not None]
        assert refired == [20, 41]

    def test_a_repeated_shift_is_learned_but_a_higher_one_is_not(self) -> None:
        """The same 5x shift for 50 steps, three times: the first is sustained, the later ones
        are a known level; a 100x shift after them is still sustained."""
        values = [1.0 + 0.05 * (i % 7) for i in range(1200)]
        for at in (200, 400, 600):
            values[at : at + 50] = [5.0 + 0.05 * (i % 7) for i in range(50)]
        values[900:950] = [100.0] * 50
        assert flagged(values) == [
            (200, "spike"), (201, "spike"), (202, "spike"), (203, "spike"), (204, "sustained"),
            (900, "spike"), (901, "spike"), (902, "spike"), (903, "spike"), (904, "sustained"),
        ]  # fmt: skip

    def test_a_sign_flipping_loss_near_zero_is_quiet_from_the_start(self) -> None:
        """With fewer than five losses the spread of those seen stands in for the noise: a
        policy-gradient loss hovering around zero does not fire on its fifth step."""
        assert flagged([-0.153, -0.107, -0.0337, 0.171, 0.263, -0.373, 0.16, -0.131]) == []

    @pytest.mark.parametrize("zeros", [1, 10])
    def test_a_loss_rising_from_exactly_zero_is_its_scale_not_a_spike(self, zeros: int) -> None:
        """A run whose first losses are exactly 0 (a loss weight ramped up from 0, first
        batches all padding) has no scale to judge against: 0 -> 0.003 was five reports, one
        loss of 0 then 1.38 too. Its first positive losses set the scale; a spike planted
        later is still flagged at once."""
        rng = random.Random(0)
        ramp = [min(1.0, i / 500) * rng.uniform(1.3, 1.5) for i in range(zeros, 1500)]
        assert flagged([0.0] * zeros + ramp) == []
        jump = [1.38 + rng.uniform(-0.05, 0.05) for _ in range(1500)]
        assert flagged([0.0] * zeros + jump) == []
        jump[1000] = 20.0
        assert flagged([0.0] * zeros + jump) == [(zeros + 1000, "spike")]

    def test_a_configured_absolute_tolerance_still_judges_a_zero_start(self) -> None:
        """With ``spike_atol`` set, the scale is the user's: 0 then 5 is 5 above it."""
        detector = LossSpikeDetector.from_thresholds(Thresholds(spike_atol=1.0))
        assert detector.observe(0.0) is None
        verdict = detector.observe(5.0)
        assert verdict is not None and verdict.rule is SpikeRule.SPIKE

    def test_the_memory_stays_bounded(self) -> None:
        """Outliers on every other step for 5,000 steps: at most `memory` are kept."""
        detector = spikes()
        for i in range(5000):
            detector.observe(1.0 if i % 2 else 1.0 + 5.0 * (i % 7))
        assert 0 < len(detector._outliers.order) <= detector.memory
        assert len(detector._outliers.ordered) == len(detector._outliers.order)
        assert len(detector._runs.order) <= detector.memory

    @pytest.mark.parametrize(
        ("kwargs", "match"),
        [
            ({"memory": 0}, "memory must be an int >= 1"),
            ({"memory": 10.0}, "memory must be an int >= 1"),
            ({"recurrence": True}, "recurrence must be an int >= 1"),
            ({"frequent": 0.0}, "frequent must be a finite number > 0"),
            ({"frequent": 1.5}, r"frequent must be a number in \(0, 1\]"),
            ({"frequent": math.nan}, "frequent must be a finite number > 0"),
        ],
    )
    def test_bad_memory_arguments_are_refused(self, kwargs: dict[str, object], match: str) -> None:
        """memory, recurrence and frequent are checked at construction, naming the argument."""
        base: dict[str, object] = {
            "window": 50, "warmup": 1, "rtol": 2.0, "atol": 0.0, "mad_factor": 8.0,
            "scale_tol": 0.05, "patience": 5,
        }  # fmt: skip
        with pytest.raises(ValueError, match=match):
            LossSpikeDetector(**{**base, **kwargs})  # type: ignore[arg-type]


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

    def test_a_raw_scale_run_is_reported_once_then_learned(self) -> None:
        """Norms of 3e6 growing to 1e8 from the first step (a regression on raw prices): the
        first is above the cap with nothing to compare with and is reported; the next, of the
        same order, is the run's scale and starts the window, so growth is judged from there."""
        detector = ExplosionDetector(window=50, factor=10.0, cap=1e6)
        first = detector.observe(3.4e6)
        assert first is not None and first.rule == "cap" and first.largest == 0.0
        norms = [3.4e6 * 1.002**i for i in range(2000)]  # 3.4e6 -> 1.8e8, slowly
        assert [n for n in norms if detector.observe(n)] == []
        assert detector.largest == norms[-1]

    def test_the_cap_does_not_judge_a_run_with_history(self) -> None:
        """Norms accepted below the cap that then grow past it stay quiet: once the run has
        history its own median is the reference, not the absolute cap."""
        detector = ExplosionDetector(window=50, factor=10.0, cap=1e6)
        norms = [8.7e5, 9.8e5, 1.4e6, 2.2e6, 2.1e6, 2.7e6, 3.0e6, 3.7e6]
        assert [n for n in norms if detector.observe(n)] == []

    def test_a_norm_far_above_the_one_reported_is_reported_too(self) -> None:
        """With the window empty, only a norm within factor of the smallest reported one is the
        run's scale; one 100x larger is reported as well and vouches for nothing."""
        detector = ExplosionDetector(window=50, factor=10.0, cap=1e6)
        assert detector.observe(2e6) is not None
        huge = detector.observe(2e8)
        assert huge is not None and huge.rule == "cap"
        assert detector.largest == 0.0  # neither entered the window
        assert detector.observe(5e6) is None  # of the first one's order: the run's scale
        boom = detector.observe(5e8)
        assert boom is not None and boom.rule == "growth" and boom.baseline == 5e6

    def test_planted_explosions_still_fire_after_the_scale_is_learned(self) -> None:
        """One batch x1000 on a learned raw scale is a growth explosion, and it never raises
        its own bar: the same norm again fires again."""
        detector = ExplosionDetector(window=50, factor=10.0, cap=1e6)
        assert detector.observe(3e6) is not None
        for _ in range(100):
            assert detector.observe(3e6) is None
        verdicts = [detector.observe(3e9), detector.observe(3e9)]
        assert all(v is not None and v.rule == "growth" and v.baseline == 3e6 for v in verdicts)
        assert detector.largest == 3e6

    def test_reset_forgets_the_reported_norm(self) -> None:
        """After a restore the window is empty and what was reported above the cap vouches for
        nothing: the next norm above the cap is reported again."""
        detector = ExplosionDetector(window=50, factor=10.0, cap=1e6)
        assert detector.observe(2e6) is not None
        detector.reset()
        assert detector.observe(2e6) is not None
        assert detector.observe(2e6) is None

    @staticmethod
    def heavy_tailed(detector: ExplosionDetector) -> None:
        """300 checks around 1.0 with hard batches at 7x, 8x and 9.5x the median, apart."""
        for i in range(300):
            hard = {100: 7.0, 180: 8.0, 260: 9.5}.get(i)
            assert detector.observe(hard if hard else 1.0 + 0.01 * (i % 7)) is None

    def test_a_recurring_heavy_tail_is_learned(self) -> None:
        """A hard batch at 13x the median (hf BART late in a linear decay: 18.6 vs 10x 1.44)
        is quiet when earlier hard batches reached within 2x of it; it joins the window."""
        detector = ExplosionDetector(window=50, factor=10.0, cap=1e6)
        self.heavy_tailed(detector)
        assert detector.observe(13.0) is None
        assert detector.largest == 13.0

    def test_a_planted_explosion_after_a_heavy_tail_still_fires(self) -> None:
        """The tail vouches only within 2x: a batch x1000 fires, and never vouches for the
        next one (exploded norms are not remembered)."""
        detector = ExplosionDetector(window=50, factor=10.0, cap=1e6)
        self.heavy_tailed(detector)
        assert [detector.observe(1000.0) is not None for _ in range(3)] == [True, True, True]

    def test_a_climbing_norm_never_vouches_for_itself(self) -> None:
        """Norms growing 1.4x a step (a diverging run) are one streak of tail norms: they do
        not vouch for each other, so the growth rule fires once 10x the median is crossed."""
        detector = ExplosionDetector(window=50, factor=10.0, cap=1e6)
        for _ in range(100):
            assert detector.observe(1.0) is None
        climbing = [1.4**i for i in range(1, 12)]
        fired = [n for n in climbing if detector.observe(n)]
        assert fired and fired[0] == climbing[6]  # 1.4**7 = 10.5

    def test_a_single_earlier_hard_batch_is_not_enough(self) -> None:
        """recurrence 2: one earlier tail norm within 2x does not make a 12x norm the data."""
        detector = ExplosionDetector(window=50, factor=10.0, cap=1e6)
        for i in range(200):
            assert detector.observe(8.0 if i == 100 else 1.0) is None
        assert detector.observe(12.0) is not None

    @pytest.mark.parametrize(
        ("kwargs", "match"),
        [({"memory": 0}, "memory"), ({"recurrence": 0.5}, "recurrence")],
    )
    def test_bad_tail_arguments_are_refused(self, kwargs: dict[str, object], match: str) -> None:
        """memory and recurrence are checked at construction, naming the argument."""
        with pytest.raises((TypeError, ValueError), match=match):
            ExplosionDetector(window=50, factor=10.0, cap=None, **kwargs)  # type: ignore[arg-type]

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
            window = RunningMedian(rng.randint(1, 60))
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
            window = RunningMedian(10)
            for v in values:
                window.add(v)
            assert window.mad(window.median()) == expected
