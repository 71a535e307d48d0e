"""AMP: report the optimizer steps a ``GradScaler`` skips because of inf/NaN gradients.

How it stays cheap: ``GradScaler.step`` already synchronizes once (it reads ``found_inf`` with
``.item()`` to decide whether to call ``optimizer.step()``). We do not read anything to learn
its decision: an optimizer step pre-hook records whether ``optimizer.step()`` ran. Only on a
skipped step — rare — the scale is read (``get_scale()``, one sync each before and after
``update()``) to report it. A normal step costs a flag assignment. A fused optimizer
(``fused=True``: ``_step_supports_amp_scaling``) is the exception: ``GradScaler.step`` calls its
``step()`` every time, with the scaler's ``found_inf`` flag, and the kernel skips the update on
the device; the pre-hook keeps that flag and it is read once (one sync the scaler did not make).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, final

import torch

from ..events import Event, ScalerInTrouble, StepSkipped
from .engine import RecoveryEngine

__all__ = ("ScalerMonitor", "ScalerStepWatcher")

SCALE_FLOOR: Final = 1.0
"""A loss scale below 1 means fp16 overflows even unscaled: the scaler is in trouble."""

MAX_CONSECUTIVE_SKIPS: Final = 50
"""Overflow steps in a row before the scaler is reported in trouble."""

SOURCE: Final = "recovery.amp"


@final
class ScalerStepWatcher:
    """Runs ``scaler.step(optimizer)`` + ``scaler.update()`` and publishes skipped steps.

    Example::

        watcher = ScalerStepWatcher(scaler, optimizer, engine)
        scaler.scale(loss).backward()
        stepped = watcher.step(step)   # instead of scaler.step(optimizer); scaler.update()

    Args:
        scaler: the ``torch.amp.GradScaler``.
        optimizer: the optimizer it steps.
        engine: the recovery engine whose bus receives :class:`StepSkipped`.

    Raises:
        TypeError: if *scaler* is not a ``GradScaler`` or *optimizer* not an optimizer.
    """

    def __init__(
        self, scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer, engine: RecoveryEngine
    ) -> None:
        if not isinstance(scaler, torch.amp.GradScaler):
            msg = f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}"
            raise TypeError(msg)
        if not isinstance(optimizer, torch.optim.Optimizer):
            msg = f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            raise TypeError(msg)
        self.scaler = scaler
        self.optimizer = optimizer
        self.engine = engine
        self.skipped = 0
        self._ran = False
        self._found_inf: torch.Tensor | None = None
        self._handle = optimizer.register_step_pre_hook(self._mark)

    def _mark(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._ran = True
        # A fused optimizer is stepped even on an overflow: the flag tells its kernel to skip.
        found = optimizer.__dict__.get("found_inf")
        self._found_inf = found if isinstance(found, torch.Tensor) else None

    def step(self, step: int | None = None) -> bool:
        """``scaler.step(optimizer)`` then ``scaler.update()``; returns whether the step ran
        (for a fused optimizer: whether its kernel applied the update)."""
        self._ran = False
        self._found_inf = None
        self.scaler.step(self.optimizer)
        found, self._found_inf = self._found_inf, None
        ran = self._ran and (found is None or not bool(found))
        if ran or not self.scaler.is_enabled():
            self.scaler.update()
            return True
        before = float(self.scaler.get_scale())
        self.scaler.update()
        after = float(self.scaler.get_scale())
        self.skipped += 1
        self.engine.bus.publish_nowait(
            StepSkipped(
                source=SOURCE,
                step=step,
                reason="GradScaler found inf/NaN gradients and skipped optimizer.step()",
                scale_before=before,
                scale_after=after,
            )
        )
        return False

    def close(self) -> None:
        """Remove the optimizer hook. Idempotent."""
        self._handle.remove()


@final
class ScalerMonitor:
    """Turns a ``GradScaler``'s overflow steps into :class:`StepSkipped` events (not incidents).

    The session calls :meth:`overflowed` at the check of a step whose gradients overflowed
    (one scale read, only then) and :meth:`completed` when the step completed (after the loop's
    ``scaler.update()``). The scaler skips those steps itself; an incident,
    :class:`ScalerInTrouble`, is published only when the scale falls below *floor* or
    *max_skips* steps in a row overflowed.

    Args:
        scaler: the ``torch.amp.GradScaler``.
        publish: where events go.
        source: the ``source`` of the events.
        floor: the scale below which the scaler is in trouble.
        max_skips: overflow steps in a row before it is.

    Raises:
        TypeError: if *scaler* is not a ``GradScaler``.
        ValueError: if *floor* is not positive or *max_skips* < 1.
    """

    def __init__(
        self,
        scaler: torch.amp.GradScaler,
        publish: Callable[[Event], None],
        *,
        source: str = SOURCE,
        floor: float = SCALE_FLOOR,
        max_skips: int = MAX_CONSECUTIVE_SKIPS,
    ) -> None:
        if not isinstance(scaler, torch.amp.GradScaler):
            msg = f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}"
            raise TypeError(msg)
        if not (isinstance(floor, (int, float)) and floor > 0):
            msg = f"floor must be a number > 0, got {floor!r}"
            raise ValueError(msg)
        if isinstance(max_skips, bool) or not isinstance(max_skips, int) or max_skips < 1:
            msg = f"max_skips must be an int >= 1, got {max_skips!r}"
            raise ValueError(msg)
        self.scaler = scaler
        self._publish = publish
        self.source = source
        self.floor = float(floor)
        self.max_skips = max_skips
        self.skipped = 0
        self._pending: tuple[int, float] | None = None
        self._run = 0
        self._streak_reported = False  # this streak of overflows was reported
        self._floor_reported = False  # the scale's fall below the floor was reported

    def overflowed(self, step: int) -> None:
        """The gradients of *step* overflowed: remember the scale before ``update()``."""
        self._pending = (step, float(self.scaler.get_scale()))

    def completed(self, step: int) -> None:
        """*step* completed: report it if it overflowed (the scaler updated its scale by now)."""
        pending, self._pending = self._pending, None
        if pending is None:
            self._run = 0
            self._streak_reported = False
            return
        before = pending[1]
        after = float(self.scaler.get_scale())
        self.skipped += 1
        self._run += 1
        self._publish(
            StepSkipped(
                source=self.source,
                step=pending[0],
                reason="AMP overflow: the GradScaler skipped optimizer.step() and lowered its "
                f"scale ({before:g} -> {after:g})",
                scale_before=before,
                scale_after=after,
            )
        )
        below = after < self.floor
        if not below:
            self._floor_reported = False  # climbed back: a later fall is news again
        # Once per streak; a scale that stays below the floor is reported once, not again at
        # each growth interval's overflow (every 2,000 steps by default, for days).
        if not self._streak_reported and (
            (below and not self._floor_reported) or self._run >= self.max_skips
        ):
            self._streak_reported = True
            self._floor_reported = below
            self._publish(
                ScalerInTrouble(
                    source=self.source,
                    step=pending[0],
                    scale=after,
                    floor=self.floor,
                    consecutive_skips=self._run,
                )
            )
