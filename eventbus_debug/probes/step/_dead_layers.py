"""Dead layers: which parameters' gradients really died, each judged against its own history.

A parameter's *share* is its gradient RMS over the whole model's gradient RMS (scale-free: a
learning-rate schedule, a loss scale or a converging loss move every share together). Shares
differ by orders of magnitude between healthy parameters: in a Hugging Face transformer at its
std-0.02 init, attention query/key weights sit at 1e-5..1e-4 of the model and wander by 10x,
while an attention key bias (zero by construction) measures 1e-11..1e-7, rounding noise. So no
fixed fraction of the model tells a dead layer from a quiet one.

:class:`DeadLayers` keeps, per parameter, a *reference*: the largest share it had, decaying
slowly (half-life :data:`HALF_LIFE` checks, so it follows slow trends) and growing at most
:data:`GROW` times per update (one outlier check barely moves it). A parameter is *low* when its
share falls below ``min(vanishing_relative, FALL x reference)``: a thousandfold under what it
used to be, and under ``vanishing_relative`` of the model. It is dead after
``vanishing_patience`` low checks in a row, reported once, and alive again only when its share
climbs :data:`REVIVE` times above that threshold (hysteresis: a share hovering at the threshold
never flaps). A reference below :data:`ALIVE` is rounding noise: such a parameter is never low.

Cost per check in the healthy steady state: one C-level pass, ``any(map(lt, l2, floors))``,
over per-position absolute floors cached for a band of model RMS values (rebuilt when the RMS
leaves the band); candidates are then checked exactly. Every :data:`REFRESH` checks one Python
pass updates the references. Per-parameter Python work otherwise runs only for parameters that
are low or dead.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from itertools import compress, repeat
from typing import Any, Final

from ..._saved import StateReader
from ..._validate import non_negative, positive_int

__all__ = ("ALIVE", "FALL", "GROW", "HALF_LIFE", "REFRESH", "REVIVE", "DeadLayers")

FALL: Final = 1e-3
"""A dead parameter's share fell below this fraction of its reference (three orders of
magnitude; the shares of healthy transformers stay above 1/20 of their running maximum)."""
ALIVE: Final = 1e-6
"""A reference share below this is rounding noise (a zero-by-construction gradient): never dead."""
REVIVE: Final = 10.0
"""A dead parameter is alive again once its share is this many times its threshold."""
REFRESH: Final = 32
"""Checks between two updates of the references (the first check updates them too)."""
GROW: Final = 4.0
"""A reference grows at most this many times per update, but for its first value."""
HALF_LIFE: Final = 1024
"""Checks over which a reference halves while the share stays below it."""
_DECAY: Final = 0.5 ** (REFRESH / HALF_LIFE)
_HEADROOM: Final = 4.0
"""The cached floors are computed for ``_HEADROOM`` x the model RMS of the step that built
them: they stay valid (never below the exact floors) while the RMS is below that ..."""
_LOOSE: Final = 32.0
"""... and are rebuilt when it falls this many times below it (floors that loose would make
healthy parameters candidates, each checked exactly)."""
_INF: Final = math.inf
_lt = operator.lt


class DeadLayers:
    """Per-parameter gradient history of one model: which parameters died.

    Args:
        n: the number of parameters (slots ``0 .. n - 1``).
        relative: ``vanishing_relative``: a dead parameter's share is also below this.
        patience: ``vanishing_patience``: low checks in a row before a parameter is dead.
    """

    __slots__ = (
        "_dead",
        "_floors",
        "_inv_sqrt",
        "_patience",
        "_position",
        "_ref",
        "_relative",
        "_rms_high",
        "_rms_low",
        "_slots",
        "_streak",
        "_tick",
        "_unit",
    )

    def __init__(self, n: int, *, relative: float, patience: int) -> None:
        self._ref = [0.0] * n  # per slot; 0: never had a gradient
        self._streak: dict[int, int] = {}  # low or dead slots: low checks in a row
        self._dead: set[int] = set()  # reported, not revived
        self._relative = relative
        self._patience = patience
        self._tick = 0  # checks left before the next refresh (0: refresh at the first check)
        # the layout the floors are for: slot and 1/sqrt(numel) per position
        self._slots: tuple[int, ...] = ()
        self._inv_sqrt: Sequence[float] = ()
        self._position: dict[int, int] = {}
        self._unit: list[float] = []  # per position: low iff l2 < unit x model RMS (0: never)
        self._floors: list[float] = []  # unit x _rms_high: never below the exact floors
        self._rms_high = -1.0  # the floors hold for model RMS values in [_rms_low, _rms_high]
        self._rms_low = _INF

    def configure(self, *, relative: float, patience: int) -> None:
        """New thresholds; the history is kept."""
        self._relative = relative
        self._patience = patience
        self._unit = [
            self._unit_of(s, inv) for s, inv in zip(self._slots, self._inv_sqrt, strict=True)
        ]
        self._rms_high = -1.0  # rebuild the floors at the next check

    def threshold(self, slot: int) -> float:
        """The share below which *slot* is low (0 while it never had a gradient)."""
        ref = self._ref[slot]
        return min(self._relative, FALL * ref) if ref >= ALIVE else 0.0

    def observe(
        self, slots: tuple[int, ...], inv_sqrt: Sequence[float], l2: Sequence[float], rms: float
    ) -> list[int]:
        """Judge one check's gradient 2-norms; the slots that just died (each reported once).

        Args:
            slots: the parameter slot of each position of *l2* (the same tuple object for the
                same layout: a new one rebuilds the per-position state).
            inv_sqrt: ``1/sqrt(numel)`` per position (``nan`` for empty tensors).
            l2: the gradient 2-norm per position.
            rms: the model's gradient RMS (total norm over the square root of the total numel).
        """
        if not 0.0 < rms < _INF:
            return []  # no gradient, or an overflowed norm: no share to judge
        if slots is not self._slots:
            self._bind(slots, inv_sqrt)
        if not self._rms_low <= rms <= self._rms_high:
            self._rescale(rms)
        died: list[int] = []
        if self._streak or any(map(_lt, l2, self._floors)):
            died = self._judge(l2, rms)  # else the healthy steady state: nothing low or dead
        self._tick -= 1
        if self._tick <= 0:
            self._refresh(l2, rms)
        return died

    def state(self, names: Sequence[str]) -> dict[str, Any]:
        """The references, low streaks and dead parameters, by parameter name (*names*: by
        slot), and the checks left before the next refresh."""
        return {
            "references": {names[s]: ref for s, ref in enumerate(self._ref) if ref > 0.0},
            "streaks": {names[s]: n for s, n in self._streak.items()},
            "dead": sorted(names[s] for s in self._dead),
            "tick": self._tick,
        }

    def load(self, state: StateReader, names: Sequence[str]) -> None:
        """Continue from a :meth:`state`; names not in *names* (by slot) are dropped, and a
        parameter the state does not name starts afresh.

        Raises:
            ValueError: if a field is missing or malformed (the message names it).
        """
        references: dict[str, float] = state.named("references", non_negative)
        streaks: dict[str, int] = state.named("streaks", positive_int)
        dead = state.names("dead")
        tick = state.count("tick")
        slot = {name: s for s, name in enumerate(names)}
        ref = [0.0] * len(self._ref)
        for name, value in references.items():
            if name in slot:
                ref[slot[name]] = value
        self._ref = ref
        self._streak = {slot[n]: c for n, c in streaks.items() if n in slot}
        self._dead = {slot[n] for n in dead if n in slot}
        self._tick = tick
        self._slots = ()  # rebind (and rebuild the floors) at the next check
        self._rms_high = -1.0
        self._rms_low = _INF

    def calm(self) -> None:
        """The loss converged: low streaks restart (dead parameters stay dead)."""
        dead = self._dead
        for slot in [s for s in self._streak if s not in dead]:
            del self._streak[slot]

    # -- parts ----------------------------------------------------------------------------------

    def _judge(self, l2: Sequence[float], rms: float) -> list[int]:
        """Exact low test of the candidates; streaks, deaths and revivals."""
        slots, unit = self._slots, self._unit
        low = [
            slots[j]
            for j in compress(range(len(l2)), map(_lt, l2, self._floors))
            if l2[j] < unit[j] * rms
        ]
        streak, dead, position = self._streak, self._dead, self._position
        if streak:
            is_low = set(low)
            for slot in [s for s in streak if s not in is_low]:
                pos = position.get(slot)
                if pos is None:
                    continue  # no gradient at this check: no news
                if slot not in dead:
                    del streak[slot]  # back above its threshold before it was dead
                elif l2[pos] >= REVIVE * unit[pos] * rms:
                    dead.discard(slot)
                    del streak[slot]
        patience = self._patience
        died: list[int] = []
        for slot in low:
            count = streak[slot] = streak.get(slot, 0) + 1
            if count >= patience and slot not in dead:
                dead.add(slot)
                died.append(slot)
        return died

    def _refresh(self, l2: Sequence[float], rms: float) -> None:
        """Fold this check's shares into the references; rebuild the floors they change.

        A reference decays towards the share and grows at most :data:`GROW` times per refresh,
        except the first time, when it takes the share. Low and dead parameters keep theirs:
        what they used to be.
        """
        self._tick = REFRESH
        ref, streak, relative = self._ref, self._streak, self._relative
        unit, floors, high = self._unit, self._floors, self._rms_high
        scale = 1.0 / rms
        for j, (slot, inv, norm) in enumerate(zip(self._slots, self._inv_sqrt, l2, strict=True)):
            if slot in streak:
                continue
            share = norm * inv * scale
            if not share < _INF:  # nan (an empty tensor) or inf (an overflowed norm)
                share = 0.0
            old = ref[slot]
            if old > 0.0:
                new = old * _DECAY
                if share > new:
                    new = min(share, old * GROW)
            else:
                new = share
            ref[slot] = new
            if new < ALIVE:
                u = 0.0
            else:
                fall = FALL * new
                u = (fall if fall < relative else relative) / inv
            unit[j] = u
            floors[j] = u * high

    def _bind(self, slots: tuple[int, ...], inv_sqrt: Sequence[float]) -> None:
        """Another gradient layout (a parameter gained or lost its gradient)."""
        self._slots = slots
        self._inv_sqrt = inv_sqrt
        self._position = {s: j for j, s in enumerate(slots)}
        self._unit = [self._unit_of(s, inv) for s, inv in zip(slots, inv_sqrt, strict=True)]
        self._rms_high = -1.0  # rebuild the floors

    def _rescale(self, rms: float) -> None:
        """Floors for a band of model RMS values around *rms* (one C-level pass)."""
        high = _HEADROOM * rms
        self._rms_high = high
        self._rms_low = high / _LOOSE
        self._floors = list(map(operator.mul, self._unit, repeat(high)))

    def _unit_of(self, slot: int, inv: float) -> float:
        """``sqrt(numel) x threshold``: the slot is low when its 2-norm is below this x RMS."""
        threshold = self.threshold(slot)
        return threshold / inv if threshold else 0.0
