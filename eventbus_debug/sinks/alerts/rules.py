"""Ready-made alert rules: ``rules.memory_above(90)``, ``rules.non_finite()``, ``rules.defaults()``..."""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Final

from eventbus_debug.events import (
    Event,
    GradientExploded,
    NonFiniteDetected,
    ResourceThresholdExceeded,
    SystemSampled,
)
from eventbus_debug.exceptions import ArgumentTypeError

from .._checks import brief, count
from .alert import DEFAULT_COOLDOWN, AlertRule

__all__ = ("rules",)


@dataclass(frozen=True, slots=True)
class _SustainedAbove:
    """Predicate: a system metric above a threshold for *sustain* readings in a row (per rank),
    or a threshold incident for it (the sampler already requires sustained pressure)."""

    metric: str
    threshold: float
    sustain: int
    _runs: dict[int, int] = field(default_factory=dict, compare=False, repr=False)
    # rank -> the published event judged last and the answer: one rule registered with several
    # handlers (or in several sinks) is asked about the same event once per registration, and
    # that must count as one reading, not several
    _last: dict[int, tuple[Event, bool]] = field(default_factory=dict, compare=False, repr=False)

    def __call__(self, event: Event) -> bool:
        if isinstance(event, ResourceThresholdExceeded):
            return event.metric == self.metric and event.value > self.threshold
        rank = event.rank
        if event.seq >= 0:  # published: judged once, whoever asks again
            last = self._last.get(rank)
            if last is not None and last[0] is event:
                return last[1]
        value = getattr(event, self.metric, None)
        if not isinstance(value, (int, float)) or math.isnan(value) or value <= self.threshold:
            self._runs.pop(rank, None)
            matched = False
        else:
            run = self._runs[rank] = self._runs.get(rank, 0) + 1
            matched = run >= self.sustain
        if event.seq >= 0:
            self._last[rank] = (event, matched)
        return matched


@dataclass(frozen=True, slots=True)
class _ConstantKey:
    """Dedup key: one alert stream per rule and rank, whichever event class triggered it."""

    name: str

    def __call__(self, event: Event) -> Hashable:
        return (self.name, event.rank)


class _Rules:
    """Ready-made rules for the thresholds the seed documents use (``rules.memory_above()``...).

    The resource rules fire on sustained pressure only: *sustain* readings in a row above the
    threshold (``SystemSampled``), or the sampler's ``ResourceThresholdExceeded`` incident
    (which has its own sustain count). A single busy reading is not an alert.
    """

    def cpu_above(
        self, percent: float = 90.0, *, sustain: int = 3, cooldown: float = 300.0
    ) -> AlertRule:
        """CPU utilization above *percent* for *sustain* readings in a row.

        Not among :meth:`defaults`: a CPU kept busy by training is normal.
        """
        return self._metric("cpu_percent", percent, sustain, cooldown)

    def memory_above(
        self, percent: float = 90.0, *, sustain: int = 3, cooldown: float = 300.0
    ) -> AlertRule:
        """Host memory use above *percent* for *sustain* readings in a row."""
        return self._metric("memory_percent", percent, sustain, cooldown)

    def gpu_memory_above(
        self, percent: float = 90.0, *, sustain: int = 3, cooldown: float = 300.0
    ) -> AlertRule:
        """GPU memory use above *percent* for *sustain* readings (silent without a GPU)."""
        return self._metric("gpu_memory_percent", percent, sustain, cooldown)

    def gradient_explosion(self, *, cooldown: float = DEFAULT_COOLDOWN) -> AlertRule:
        """Every :class:`~eventbus_debug.events.GradientExploded` incident."""
        return AlertRule(
            event_types=(GradientExploded,), name="gradient_explosion", cooldown=cooldown
        )

    def non_finite(self, *, cooldown: float = DEFAULT_COOLDOWN) -> AlertRule:
        """Every :class:`~eventbus_debug.events.NonFiniteDetected` incident (NaN or Inf anywhere)."""
        return AlertRule(event_types=(NonFiniteDetected,), name="non_finite", cooldown=cooldown)

    def defaults(self) -> tuple[AlertRule, ...]:
        """Memory, GPU memory, gradient explosion and non-finite rules, default thresholds."""
        return (
            self.memory_above(),
            self.gpu_memory_above(),
            self.gradient_explosion(),
            self.non_finite(),
        )

    @staticmethod
    def _metric(metric: str, threshold: float, sustain: int, cooldown: float) -> AlertRule:
        if isinstance(threshold, bool) or not isinstance(threshold, int | float):
            msg = f"percent must be a number in (0, 100], got {brief(threshold)}"
            raise ArgumentTypeError(msg)
        if not 0 < threshold <= 100:
            msg = f"percent must be in (0, 100], got {threshold!r}"
            raise ValueError(msg)
        count("sustain", sustain, rule="an integer >= 1 (readings in a row)")
        name = f"{metric}>{threshold:g}"
        return AlertRule(
            event_types=(SystemSampled, ResourceThresholdExceeded),
            name=name,
            when=_SustainedAbove(metric, float(threshold), sustain),
            cooldown=cooldown,
            key=_ConstantKey(name),
        )


rules: Final = _Rules()
"""Ready rules: ``rules.cpu_above(90)``, ``rules.memory_above(90)``, ``rules.gpu_memory_above(90)``,
``rules.gradient_explosion()``, ``rules.non_finite()``, ``rules.defaults()``."""
