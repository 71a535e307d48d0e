"""Bounded running state behind a summary: running statistics, downsampled series (buckets that
merge pairwise), per-rank throughput sums, per-layer grids, a least-squares trend.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, Final

from .summary import LayerSeries, SeriesPoint, Stat

RANK_SUM_WINDOW: Final = 64
"""Throughput is summed over the ranks at each step; a step's values wait among this many most
recent steps for the other ranks' (a merged log interleaves the ranks by time, so the ranks of a
data-parallel job are at most a step or two apart in it)."""


class _RunningStat:
    __slots__ = ("max", "min", "n", "total")

    def __init__(self) -> None:
        self.n = 0
        self.total = 0.0
        self.min: float | None = None
        self.max: float | None = None

    def add(self, value: float | None) -> None:
        if value is None or not math.isfinite(value):
            return
        self.n += 1
        self.total += value
        self.min = value if self.min is None else min(self.min, value)
        self.max = value if self.max is None else max(self.max, value)

    def freeze(self) -> Stat:
        return Stat(self.n, self.total / self.n if self.n else None, self.min, self.max)


_isfinite = math.isfinite


class _Bucket:
    __slots__ = ("count", "index", "max", "min", "nonfinite", "step", "total")

    def __init__(self, index: int, step: int) -> None:
        self.index = index
        self.step = step
        self.count = 0
        self.nonfinite = 0
        self.total = 0.0
        self.min: float | None = None
        self.max: float | None = None

    def add(self, value: float) -> None:
        self.count += 1
        if not _isfinite(value):
            self.nonfinite += 1
            return
        self.total += value
        low = self.min
        if low is None or value < low:
            self.min = value
        high = self.max
        if high is None or value > high:
            self.max = value

    def merge(self, other: _Bucket) -> None:
        self.step = min(self.step, other.step)
        self.count += other.count
        self.nonfinite += other.nonfinite
        self.total += other.total
        for v in (other.min, other.max):
            if v is not None:
                self.min = v if self.min is None else min(self.min, v)
                self.max = v if self.max is None else max(self.max, v)

    def freeze(self) -> SeriesPoint:
        finite = self.count - self.nonfinite
        mean = self.total / finite if finite else None
        return SeriesPoint(self.step, mean, self.min, self.max, self.count, self.nonfinite)


class _Series:
    """A series over steps in at most *max_points* buckets; the stride doubles when full."""

    __slots__ = ("buckets", "max_points", "stride")

    def __init__(self, max_points: int) -> None:
        self.max_points = max_points
        self.stride = 1
        self.buckets: list[_Bucket] = []

    def add(self, step: int, value: float) -> None:
        index = step // self.stride
        buckets = self.buckets
        if buckets:
            last = buckets[-1]
            if last.index == index:  # the common case, inlined: one call per value
                last.count += 1
                if not _isfinite(value):
                    last.nonfinite += 1
                    return
                last.total += value
                low = last.min
                if low is None or value < low:
                    last.min = value
                high = last.max
                if high is None or value > high:
                    last.max = value
                return
        if buckets and index < buckets[-1].index:
            # Out-of-order step (a restored checkpoint replays steps): find its bucket.
            for b in reversed(buckets):
                if b.index == index:
                    b.add(value)
                    return
        bucket = _Bucket(index, step)
        bucket.add(value)
        buckets.append(bucket)
        if len(buckets) > 1 and buckets[-2].index > index:
            buckets.sort(key=lambda b: b.index)
        if len(buckets) > self.max_points:
            self._halve()

    def _halve(self) -> None:
        self.stride *= 2
        merged: list[_Bucket] = []
        for b in self.buckets:
            b.index //= 2
            if merged and merged[-1].index == b.index:
                merged[-1].merge(b)
            else:
                merged.append(b)
        self.buckets = merged

    def freeze(self) -> tuple[SeriesPoint, ...]:
        return tuple(b.freeze() for b in self.buckets)

    def clone(self) -> _Series:
        copy = _Series(self.max_points)
        copy.stride = self.stride
        for b in self.buckets:
            c = _Bucket(b.index, b.step)
            c.count, c.nonfinite, c.total, c.min, c.max = (
                b.count,
                b.nonfinite,
                b.total,
                b.min,
                b.max,
            )
            copy.buckets.append(c)
        return copy


class _RankSum:
    """A per-rank quantity summed over the ranks at each step (the global throughput of a
    data-parallel job), fed to a :class:`_Series` one value per step.

    While the events name one rank (the live writer, a single-rank log), the aggregator holds
    only the latest value back in ``held`` (it goes to the series when the next one comes), so
    a second rank appearing within a step still adds to it; then :meth:`add` sums. A step's sum
    waits among the :data:`RANK_SUM_WINDOW` most recent steps for the other ranks'
    values; it goes to the series when it leaves that window, when the same rank gives a value
    for the same step again (a replayed step: everything waiting goes first, so one rank's
    values reach the series in the order they came), or, on a copy, when the summary is frozen.
    O(1) per value.
    """

    __slots__ = ("held", "pending", "series", "window")

    def __init__(self, series: _Series, window: int = RANK_SUM_WINDOW) -> None:
        self.series = series
        self.window = window
        # step -> [sum over the ranks so far, the first rank, the other ranks (or None)]
        self.pending: dict[int, list[Any]] = {}
        self.held: tuple[int, int, float] | None = None  # (step, rank, value) of add_one

    def add(self, step: int, rank: int, value: float) -> float | None:
        """Add *rank*'s *value* at *step*; the step's sum so far when it is the newest step
        waiting (``None`` for a value that completes an older step)."""
        pending = self.pending
        held = self.held
        if held is not None:
            self.held = None
            pending[held[0]] = [held[2], held[1], None]
        entry = pending.get(step)
        if entry is not None:
            others: set[int] | None = entry[2]
            if rank != entry[1] and (others is None or rank not in others):
                entry[0] += value
                if others is None:
                    entry[2] = {rank}
                else:
                    others.add(rank)
                return float(entry[0]) if next(reversed(pending)) == step else None
            self.flush()
        pending[step] = [value, rank, None]
        if len(pending) > self.window:
            oldest = next(iter(pending))
            self.series.add(oldest, pending.pop(oldest)[0])
        return value

    def flush(self) -> None:
        series = self.series
        for step, entry in self.pending.items():
            series.add(step, entry[0])
        self.pending.clear()

    def freeze(self) -> tuple[SeriesPoint, ...]:
        if not self.pending and self.held is None:
            return self.series.freeze()
        copy = self.series.clone()
        if self.held is not None:
            copy.add(self.held[0], self.held[2])
        for step, entry in self.pending.items():
            copy.add(step, entry[0])
        return copy.freeze()


class _Column:
    __slots__ = ("cells", "index", "step")

    def __init__(self, index: int, step: int) -> None:
        self.index = index
        self.step = step
        # name -> [sum of finite values, finite count, non-finite count]
        self.cells: dict[str, list[float]] = {}

    def merge(self, other: _Column) -> None:
        self.step = min(self.step, other.step)
        cells = self.cells
        for name, (total, finite, nonfinite) in other.cells.items():
            cell = cells.get(name)
            if cell is None:
                cells[name] = [total, finite, nonfinite]
            else:
                cell[0] += total
                cell[1] += finite
                cell[2] += nonfinite


class _LayerGrid:
    """Per-layer values over steps, for a heatmap: one column per bucket of steps shared by
    every layer (at most *max_points*; the stride doubles when full), the bucket mean per
    layer. O(1) per value (a dict lookup and two additions), and once *max_layers* layers are
    known, O(max_layers) per step whatever the model's size."""

    __slots__ = ("columns", "max_layers", "max_points", "names", "omitted", "stride")

    def __init__(self, max_points: int, max_layers: int) -> None:
        self.max_points = max_points
        self.max_layers = max_layers
        self.stride = 1
        self.columns: list[_Column] = []
        self.names: dict[str, None] = {}
        self.omitted = 0

    def _column(self, step: int) -> _Column:
        index = step // self.stride
        columns = self.columns
        if columns and columns[-1].index == index:
            return columns[-1]
        if columns and index < columns[-1].index:
            for column in reversed(columns):
                if column.index == index:
                    return column
        column = _Column(index, step)
        columns.append(column)
        if len(columns) > 1 and columns[-2].index > index:
            columns.sort(key=lambda c: c.index)
        if len(columns) > self.max_points:
            self.stride *= 2
            merged: list[_Column] = []
            for c in columns:
                c.index //= 2
                if merged and merged[-1].index == c.index:
                    merged[-1].merge(c)
                else:
                    merged.append(c)
            self.columns = merged
            return self._column(step)
        return column

    def add(self, step: int, values: Mapping[str, float]) -> None:
        cells = self._column(step).cells
        names = self.names
        if len(names) >= self.max_layers:
            # full: look up the kept layers only, never walk a huge model's every parameter
            pairs: Iterable[tuple[str, float | None]] = [(n, values.get(n)) for n in names]
            kept = sum(1 for _, v in pairs if v is not None)
            self.omitted = max(self.omitted, len(values) - kept)
        else:
            pairs = values.items()
        for name, value in pairs:
            if value is None:
                continue
            cell = cells.get(name)
            if cell is None:
                if name not in names:
                    if len(names) >= self.max_layers:
                        self.omitted = max(self.omitted, len(values) - len(names))
                        continue
                    names[name] = None
                cell = cells[name] = [0.0, 0, 0]
            if _isfinite(value):
                cell[0] += value
                cell[1] += 1
            else:
                cell[2] += 1

    def freeze(self) -> tuple[LayerSeries, ...]:
        out = []
        for name in self.names:
            points = []
            for column in self.columns:
                cell = column.cells.get(name)
                if cell is None:
                    continue
                total, finite, nonfinite = cell[0], int(cell[1]), int(cell[2])
                mean = total / finite if finite else None
                points.append(
                    SeriesPoint(column.step, mean, None, None, finite + nonfinite, nonfinite)
                )
            out.append(LayerSeries(name, tuple(points)))
        return tuple(out)


class _Trend:
    """Online least-squares slope of y over x."""

    __slots__ = ("n", "sx", "sxx", "sxy", "sy")

    def __init__(self) -> None:
        self.n = 0
        self.sx = self.sy = self.sxx = self.sxy = 0.0

    def add(self, x: float, y: float) -> None:
        self.n += 1
        self.sx += x
        self.sy += y
        self.sxx += x * x
        self.sxy += x * y

    def slope(self) -> float | None:
        if self.n < 2:
            return None
        den = self.n * self.sxx - self.sx * self.sx
        if den <= 0:
            return None
        return (self.n * self.sxy - self.sx * self.sy) / den
