"""AMP: report the optimizer steps a ``GradScaler`` skips because of inf/NaN gradients.

How it stays cheap: ``GradScaler.step`` already synchronizes once (it reads ``found_inf`` with
``.item()`` to decide whether to call ``optimizer.step()``). We do not read anything to learn
its decision: an optimizer step pre-hook records whether ``optimizer.step()`` ran. Only on a
skipped step — rare — the scale is read (``get_scale()``, one sync each before and after
``update()``) to report it. A normal step costs a flag assignment.
"""

from __future__ import annotations

from typing import Any, Final, final

import torch

from .engine import RecoveryEngine
from .events import StepSkipped

__all__ = ("ScalerStepWatcher",)

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
        self._handle = optimizer.register_step_pre_hook(self._mark)

    def _mark(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._ran = True

    def step(self, step: int | None = None) -> bool:
        """``scaler.step(optimizer)`` then ``scaler.update()``; returns whether the step ran."""
        self._ran = False
        self.scaler.step(self.optimizer)
        if self._ran or not self.scaler.is_enabled():
            self.scaler.update()
            return True
        before = float(self.scaler.get_scale())
        self.scaler.update()
        after = float(self.scaler.get_scale())
        self.skipped += 1
        self.engine.publish(
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
