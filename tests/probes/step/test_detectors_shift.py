"""A distribution shift back within the run's own range is the data, not a spike or an explosion.

A converged model that meets harder or noisier data (a curriculum step, a data-mix change) sees
its loss and gradient norm climb many-fold over their converged baselines, back toward their
early-training levels. The sequences here are deterministic (seeded ``random.Random``) and
shaped after two healthy runs that were reported: a classifier given 10 % label noise after
converging (loss 0.012 -> 1.2 with a first baseline of 2.3; norm 0.047 -> 1.55 with an early
largest of 1.28) and a WGAN-GP generator whose loss drifts from 0.03 to -0.28 and back. Each
``*_is_quiet`` test fired on the detectors before the rule (5 loss reports and 3 to 12 explosion
reports for the curriculum, 1 sustained report for the WGAN drift); the others show what is
still reported, and what the rule gives up. The range is the run's recent one (its last
*memory* observations, 1,000 by default): :class:`TestTheRangeIsRecent` shows that a late climb
back to early-training levels, long after convergence, is reported.
"""

from __future__ import annotations

import math
import random

import pytest

from eventbus_debug.probes.levels import Thresholds
from eventbus_debug.probes.step._explosions import ExplosionDetector
from eventbus_debug.probes.step._spikes import LossSpikeDetector

SEEDS = range(6)


def spikes(**kw: float) -> LossSpikeDetector:
    if not kw:
        return LossSpikeDetector.from_thresholds(Thresholds())
    base: dict[str, float] = {
        "window": 50, "warmup": 1, "rtol": 2.0, "atol": 0.0, "mad_factor": 8.0,
        "scale_tol": 0.05, "patience": 5,
    }  # fmt: skip
    return LossSpikeDetector(**{**base, **kw})  # type: ignore[arg-type]


def explosions() -> ExplosionDetector:
    return ExplosionDetector.from_thresholds(Thresholds())


def loss_flags(
    values: list[float], detector: LossSpikeDetector | None = None
) -> list[tuple[int, str]]:
    detector = detector or spikes()
    out = []
    for i, v in enumerate(values):
        verdict = detector.observe(v)
        if verdict is not None:
            out.append((i, verdict.rule.value))
    return out


def norm_flags(values: list[float], detector: ExplosionDetector | None = None) -> list[int]:
    detector = detector or explosions()
    return [i for i, v in enumerate(values) if detector.observe(v) is not None]


def converging_losses(rng: random.Random, start: float = 2.3, end: float = 0.012) -> list[float]:
    """50 early losses from *start*, then a geometric descent to *end* over 450 steps."""
    out = [start * 0.99**i * rng.uniform(0.95, 1.05) for i in range(50)]
    last = out[-1]
    out += [last * (end / last) ** (i / 450) * rng.uniform(0.8, 1.2) for i in range(1, 451)]
    return out


def curriculum_losses(seed: int) -> list[float]:
    """500 steps to a converged 0.012, then 500 of noisier data: 0.6 to 1.5 (below 2.3)."""
    rng = random.Random(seed)
    out = converging_losses(rng)
    out += [(1.0 - 0.4 * i / 500) * rng.uniform(0.6, 1.5) for i in range(500)]
    return out


def converging_norms(rng: random.Random, early: float = 1.1, end: float = 0.05) -> list[float]:
    """50 early norms around *early* (x/÷ 1.2), then a geometric descent to *end*."""
    out = [early * rng.uniform(0.82, 1.18) for _ in range(50)]
    last = out[-1]
    out += [last * (end / last) ** (i / 450) * rng.uniform(0.8, 1.2) for i in range(1, 451)]
    return out


def curriculum_norms(seed: int) -> list[float]:
    """Converged norms at 0.05, then 300 at 0.6x to 1.2x the largest early norm."""
    rng = random.Random(seed)
    out = converging_norms(rng)
    largest = max(out[:50])
    out += [rng.uniform(0.6, 1.2) * largest for _ in range(300)]
    return out


def wgan_generator_losses(seed: int) -> list[float]:
    """A WGAN generator's loss: 0.03 down to -0.28, held, back up to -0.05 (+-0.01 noise)."""
    rng = random.Random(seed)
    down = [0.03 - 0.31 * i / 30 for i in range(30)]
    up = [-0.28 + 0.23 * i / 40 for i in range(40)]
    return [v + rng.uniform(-0.01, 0.01) for v in down + [-0.28] * 40 + up + [-0.05] * 300]


class TestLossBackWithinTheRunsRange:
    @pytest.mark.parametrize("seed", SEEDS)
    def test_a_converged_model_meeting_noisier_data_is_quiet(self, seed: int) -> None:
        """0.012 -> 0.6..1.5 (100x the baseline, below the first baseline 2.3): no report."""
        assert loss_flags(curriculum_losses(seed)) == []

    @pytest.mark.parametrize("seed", [0, 1])
    def test_a_wgan_generator_drifting_back_is_quiet(self, seed: int) -> None:
        """A loss drifting back toward where it started (a sustained report before)."""
        assert loss_flags(wgan_generator_losses(seed)) == []

    def test_a_single_spike_beyond_the_range_is_reported(self) -> None:
        """After the shift, a loss of 10 (above the run's largest baseline) is a spike."""
        values = curriculum_losses(0)
        values[700] = 10.0
        assert loss_flags(values) == [(700, "spike")]

    def test_a_sustained_shift_beyond_the_range_is_reported_at_once(self) -> None:
        """Always-wrong labels on a converged classifier (3.7 to 5.0 over a baseline of 0.45
        and a first one of 2.3): four spikes, then sustained, from the first step."""
        rng = random.Random(1)
        values = converging_losses(rng, end=0.45)
        at = len(values)
        values += [rng.uniform(3.7, 5.0) for _ in range(5)] + [0.45] * 20
        assert loss_flags(values) == [(at + i, "spike") for i in range(4)] + [(at + 4, "sustained")]

    def test_a_streak_crossing_the_range_is_one_streak(self) -> None:
        """Losses alternating above (4.0) and within (2.0) the run's range after converging:
        those above are spikes, those within keep the streak going, the fifth is sustained."""
        values = converging_losses(random.Random(2))
        at = len(values)
        values += [4.0, 2.0, 4.0, 2.0, 4.0]
        assert loss_flags(values) == [(at, "spike"), (at + 2, "spike"), (at + 4, "sustained")]

    def test_a_reported_level_does_not_widen_the_range(self) -> None:
        """A sustained shift to 3.0 (above the first baseline 1.0) is reported; once it is
        forgotten (memory 100), the same shift is reported again: the level a reported shift
        moved the baseline to is not a healthy baseline of the run."""
        rng = random.Random(3)
        values = converging_losses(rng, start=1.0, end=0.1)
        first = len(values)
        values += [3.0 * rng.uniform(0.95, 1.05) for _ in range(100)]
        values += [0.1 * rng.uniform(0.9, 1.1) for _ in range(300)]
        second = len(values)
        values += [3.0 * rng.uniform(0.95, 1.05) for _ in range(5)]
        fired = loss_flags(values, spikes(memory=100))
        assert (first + 4, "sustained") in fired
        assert [f for f in fired if f[0] >= second] == [
            *[(second + i, "spike") for i in range(4)],
            (second + 4, "sustained"),
        ]

    def test_the_trade_a_late_spike_below_the_first_baseline_is_not_reported(self) -> None:
        """What the rule gives up: a language model that converged from 10.8 to 2.5 and,
        within *memory* steps of its early baselines, spikes back to 8.0 stays within its
        recent range (not reported here); one at 12.0 is beyond it and reported. Long after,
        8.0 is reported (:class:`TestTheRangeIsRecent`)."""
        values = converging_losses(random.Random(4), start=10.8, end=2.5)
        at = len(values)
        values += [8.0] + [2.5] * 20 + [12.0]
        assert loss_flags(values) == [(at + 21, "spike")]


class TestNormBackWithinTheRunsScale:
    @pytest.mark.parametrize("seed", SEEDS)
    def test_a_converged_model_meeting_harder_data_is_quiet(self, seed: int) -> None:
        """Norms 0.05 -> up to 1.2x the largest early norm (20x and more the converged
        median, within twice the early median): no report."""
        assert norm_flags(curriculum_norms(seed)) == []

    def test_a_planted_explosion_after_the_shift_is_reported_at_once(self) -> None:
        """A norm x1e6 (the loss scaled by 1e6) and one x1000 are reported at their step."""
        values = curriculum_norms(0)
        values[600] *= 1e6
        values[700] = 1000.0
        assert norm_flags(values) == [600, 700]

    def test_a_planted_explosion_on_a_converged_run_is_reported_at_once(self) -> None:
        """Converged at 0.05 (early median 1.1): a norm of 162 (an input x100) is reported."""
        values = converging_norms(random.Random(5))
        at = len(values)
        values += [162.0] + [0.05] * 10
        assert norm_flags(values) == [at]

    def test_the_trade_a_late_explosion_within_the_early_scale(self) -> None:
        """Early norms around 100, converged at 1.0, within *memory* checks of the early ones.
        A norm of 30 (30x the converged median) or of 150 (1.5x the early median, beyond the
        early largest) is within twice the run's recent baseline: not reported. A climb from the converged baseline (x3 a
        step) is reported at its first norm beyond that scale (243), not earlier."""
        values = converging_norms(random.Random(6), early=100.0, end=1.0)
        values += [1.0 * random.Random(7).uniform(0.9, 1.1) for _ in range(200)]
        detector = explosions()
        assert norm_flags(values, detector) == []
        early_peak = max(values[:50])
        assert detector.observe(30.0) is None
        assert 150.0 > early_peak
        assert detector.observe(150.0) is None
        for _ in range(20):
            assert detector.observe(1.0) is None
        climb = [3.0**k for k in range(1, 7)]  # 3, 9, 27, 81, 243, 729
        assert [n for n in climb if detector.observe(n) is not None] == [243.0, 729.0]

    def test_one_hard_batch_does_not_widen_the_scale(self) -> None:
        """The scale is a baseline (a median of many norms), not one norm: after a single
        early hard batch at 8x a median of 1.0, a late norm of 12 on a converged 0.5 is an
        explosion (twice the early median is 2, the largest accepted is 8)."""
        detector = explosions()
        early = [8.0 if i == 10 else 1.0 for i in range(60)]
        late = [0.5] * 200
        assert norm_flags([*early, *late, 12.0], detector) == [260]

    def test_the_scale_survives_a_reset(self) -> None:
        """After a restore, the run's early scale is still the run's: a norm within twice the
        early median, 30x over the first norms after the reset, is not reported."""
        detector = explosions()
        assert norm_flags([1.0] * 50 + [0.05] * 100, detector) == []
        detector.reset()
        assert norm_flags([0.05, 0.05, 1.5], detector) == []

    def test_a_huge_first_norm_is_not_the_scale(self) -> None:
        """A baseline is a median of at least five norms: a first norm of 50 over a run at 1.0
        widens nothing beyond itself (the largest accepted), so a late 80 is reported."""
        detector = explosions()
        assert norm_flags([50.0] + [1.0] * 100 + [0.05] * 100 + [80.0], detector) == [201]

    @pytest.mark.parametrize("reach", [0, -1.0, math.nan, math.inf, "2"])
    def test_a_bad_reach_is_refused(self, reach: object) -> None:
        with pytest.raises(ValueError, match="reach must be a finite number > 0"):
            ExplosionDetector(window=50, factor=10.0, cap=None, reach=reach)  # type: ignore[arg-type]

    def test_reach_sets_the_scale(self) -> None:
        """reach 1: a norm beyond the early median (and the largest norm) is an explosion."""
        detector = ExplosionDetector(window=50, factor=10.0, cap=None, reach=1.0)
        assert norm_flags([1.0] * 50 + [0.05] * 100 + [1.5], detector) == [150]


MEMORY = 1000
"""The detectors' default *memory*: how far back the run's range reaches."""
PAST_MEMORY = 1100
"""Steps beyond which the range has surely forgotten a level (*memory* plus its last block,
1,000 to 1,049 observations, and some margin)."""


def converged_for(rng: random.Random, steps: int, level: float) -> list[float]:
    """*steps* values around *level* (+-3 %)."""
    return [level * rng.uniform(0.97, 1.03) for _ in range(steps)]


class TestTheRangeIsRecent:
    """The range vouches for what the run showed in its last *memory* observations only: a
    multi-day run whose loss or norm climbs back to early-training levels long after it
    converged is reported (each test here passed silently when the range was the whole run's).
    """

    def test_a_late_single_spike_to_an_early_level_is_reported(self) -> None:
        """A language model converged from 10.8 to 2.5 and held there for more than *memory*
        steps: a loss of 8.0 is a spike again (within *memory* steps it is not, see the trade
        above)."""
        rng = random.Random(10)
        values = converging_losses(rng, start=10.8, end=2.5)
        values += converged_for(rng, PAST_MEMORY, 2.5)
        at = len(values)
        values += [8.0, *converged_for(rng, 20, 2.5)]
        assert loss_flags(values) == [(at, "spike")]

    def test_a_late_sustained_climb_to_an_early_level_is_reported_as_sustained(self) -> None:
        """The same model whose loss goes back to 8 and stays: four spikes, then sustained."""
        rng = random.Random(11)
        values = converging_losses(rng, start=10.8, end=2.5)
        values += converged_for(rng, PAST_MEMORY, 2.5)
        at = len(values)
        values += converged_for(rng, 5, 8.0) + converged_for(rng, 20, 8.0)
        assert loss_flags(values) == [(at + i, "spike") for i in range(4)] + [(at + 4, "sustained")]

    @pytest.mark.parametrize(("after", "fired"), [(150, False), (260, True)])
    def test_the_range_reaches_back_memory_observations(self, after: int, fired: bool) -> None:
        """A baseline of 10 that drops to 2.5 (the median of 50 is below 8 some 25 steps
        later): with memory 200 (blocks of 10), a loss of 8.0 150 steps after the drop is
        within the range, one 260 steps after it is reported."""
        rng = random.Random(12)
        values = converged_for(rng, 100, 10.0)
        drop = len(values)
        values += converged_for(rng, after, 2.5)
        values += [8.0]
        expected = [(drop + after, "spike")] if fired else []
        assert loss_flags(values, spikes(memory=200)) == expected

    def test_the_range_survives_a_reset_and_still_expires(self) -> None:
        """After a restore the range is the run's (8.0 quiet just after it), until *memory*
        observations have passed (8.0 reported)."""
        rng = random.Random(13)
        detector = spikes()
        early = converging_losses(rng, start=10.8, end=2.5)
        assert loss_flags(early, detector) == []
        detector.reset()
        assert loss_flags([*converged_for(rng, 30, 2.5), 8.0], detector) == []
        late = [*converged_for(rng, PAST_MEMORY, 2.5), 8.0]
        assert loss_flags(late, detector) == [(len(late) - 1, "spike")]

    def test_a_reported_level_held_for_memory_observations_is_the_runs(self) -> None:
        """A sustained shift to 3.0 (memory 100) is reported once; held for 150 steps it is the
        run's level, so 2.5 (below it, above the first baseline 1.0) 60 steps after the loss
        fell back to 0.1 (the median too) is within the range. Held for less, the level is not
        the run's (see above)."""
        rng = random.Random(14)
        values = converging_losses(rng, start=1.0, end=0.1)
        first = len(values)
        values += converged_for(rng, 150, 3.0) + converged_for(rng, 60, 0.1)
        values += converged_for(rng, 5, 2.5)
        assert loss_flags(values, spikes(memory=100)) == [
            *[(first + i, "spike") for i in range(4)],
            (first + 4, "sustained"),
        ]

    def test_a_late_norm_150x_its_converged_median_is_an_explosion(self) -> None:
        """Early norms around 10 (the largest 11.8), converged at 0.1 for more than *memory*
        checks: a norm of 15 (150x the median, 1.5x the early one) is an explosion; within
        *memory* checks of the early median it is not (the trade)."""
        rng = random.Random(15)
        values = converging_norms(rng, early=10.0, end=0.1)
        values += converged_for(rng, PAST_MEMORY, 0.1)
        at = len(values)
        values += [15.0, *converged_for(rng, 10, 0.1)]
        assert max(values[:at]) < 15.0 < 2 * 10.0 * 0.82
        assert norm_flags(values) == [at]
        soon = converging_norms(random.Random(15), early=10.0, end=0.1)
        soon += [*converged_for(rng, 100, 0.1), 15.0]
        assert norm_flags(soon) == []

    def test_the_scale_survives_a_reset_and_still_expires(self) -> None:
        """After a restore the early scale is the run's (1.5 quiet just after it, and accepted)
        until *memory* checks have passed; then 2.0 (40x the median of 0.05, beyond the largest
        accepted) is an explosion."""
        detector = explosions()
        assert norm_flags([1.0] * 50 + [0.05] * 100, detector) == []
        detector.reset()
        assert norm_flags([0.05, 0.05, 1.5], detector) == []
        late = [0.05] * PAST_MEMORY + [2.0]
        assert norm_flags(late, detector) == [PAST_MEMORY]

    @pytest.mark.parametrize("memory", [1, 7, 20, 1000, 1001])
    def test_the_range_is_at_least_memory_and_less_than_two_blocks_more(self, memory: int) -> None:
        """A median of 1.0, then 0.01: 1.5 (beyond the largest norm, within twice the old
        median) is quiet *memory* checks after the last median of 1.0, and an explosion once
        *memory* plus two blocks (of memory // 20, at least 1) have passed."""
        block = max(1, memory // 20)
        for distance, fired in ((memory, False), (memory + 2 * block, True)):
            detector = ExplosionDetector(window=5, factor=10.0, cap=None, memory=memory)
            # the median of 5 is 1.0 for the last time at the third 0.01 (check 12 from 0),
            # so 1.5 comes *distance* checks after it
            after = distance + 2
            flags = norm_flags([1.0] * 10 + [0.01] * after + [1.5], detector)
            assert flags == ([10 + after] if fired else []), (memory, distance)

    def test_the_default_memory_is_the_outliers(self) -> None:
        """One horizon: the range reaches as far back as the outliers are remembered."""
        assert spikes().memory == explosions().memory == MEMORY
