"""PyTorch Lightning: one callback, ``Trainer(callbacks=[EventBusDebugCallback()])``.

Where it plugs in (Lightning 2.x, automatic optimization):

- ``on_fit_start``: opens a :class:`~eventbus_debug.SyncSession` on the ``LightningModule`` and
  the trainer's optimizer, with the LR schedulers of ``trainer.lr_scheduler_configs`` (so LR
  decisions survive the scheduler's next ``step()``) and, under ``precision="16-mixed"``, the
  precision plugin's ``GradScaler``.
- ``on_before_backward``: keeps the (detached, unscaled) loss of each micro-batch.
- ``on_before_optimizer_step``: the safe point. Lightning calls it after the closure ran
  backward (and after AMP unscaled the gradients) and **before it clips** them
  (``Precision._after_closure``), so the probes see the pre-clip gradient norm. A step the
  session skips has its gradients set to ``None``: Lightning still calls ``optimizer.step()``
  (a no-op for parameters without gradients, exactly as a ``GradScaler`` overflow step is a
  no-op), so ``trainer.global_step`` and the LR schedulers advance as usual while the
  parameters and the optimizer state stay untouched.
- ``on_train_batch_end``: records the step (``StepCompleted``); ``teardown`` /
  ``on_exception``: ends the session, recording why.

Distributed runs: each rank runs its own session, which agrees every decision with the other
ranks (see the README's "Distributed training"), so no rank skips, restores or stops alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ._common import (
    DEFAULT_LOG_DIR,
    FitSession,
    FitViews,
    LossAccumulator,
    batch_size,
    learning_rate,
    require,
)

require("lightning", "lightning")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402

from ..session import Verdict  # noqa: E402

__all__ = ("EventBusDebugCallback",)


class EventBusDebugCallback(Callback, FitViews):
    """Runs the eventbus-debug checks and recovery inside ``Trainer.fit``.

    Example::

        trainer = pl.Trainer(max_epochs=3, callbacks=[EventBusDebugCallback(log_dir="debug_logs")])

    Args:
        log_dir: where the JSON-lines log and the report go (``None``: neither).
        **session_options: any other :class:`~eventbus_debug.SyncSession` keyword argument
            (``level``, ``policy``, ``recovery``, ``alerts``, ``thresholds``, ``sinks``, ...).
            ``scheduler=`` / ``scaler=`` override the ones taken from the trainer.

    Raises:
        TypeError: if a session option names ``model``, ``optimizer`` or ``log_dir``.
    """

    def __init__(
        self, log_dir: str | Path | None = DEFAULT_LOG_DIR, **session_options: Any
    ) -> None:
        super().__init__()
        self._fit = FitSession("lightning", log_dir, session_options)
        self._loss = LossAccumulator()
        self._scaler: torch.amp.GradScaler | None = None
        self._pending: tuple[int, Verdict, float | None] | None = None

    # -- Lightning hooks --------------------------------------------------------------------------

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Open the session on the module, its optimizer, schedulers and AMP scaler.

        Raises:
            ValueError: if the trainer has no optimizer or more than one.
        """
        optimizers = trainer.optimizers
        if len(optimizers) != 1:
            msg = (
                "EventBusDebugCallback checks one optimizer's step; this trainer has "
                f"{len(optimizers)} optimizers (configure_optimizers must return exactly one)"
            )
            raise ValueError(msg)
        optimizer = optimizers[0]
        schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self._scaler = scaler if isinstance(scaler, torch.amp.GradScaler) else None
        self._loss.take()
        self._pending = None
        self._fit.open(pl_module, optimizer, schedulers=schedulers, scaler=self._scaler)

    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        """Keep this micro-batch's loss (Lightning already divided it by the accumulation)."""
        if not self._fit.running:
            return
        scaler = self._scaler
        if scaler is not None and scaler.is_enabled():
            # Under 16-mixed Lightning hands over the scaled loss; the scale stays on the device.
            scale = scaler._get_scale_async()
            if scale is not None:
                loss = loss.detach() / scale
        self._loss.add(loss)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        """The safe point: check the pre-clip gradients; skip the step when told to."""
        if not self._fit.running:
            return
        step = trainer.global_step
        lr = learning_rate(optimizer)
        verdict = self._fit.check(step, self._loss.take())
        self._pending = (step, verdict, lr)

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        """Record the step that just finished (once per optimizer step)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        step, verdict, lr = pending
        self._fit.completed(step, loss=verdict.loss, learning_rate=lr, samples=batch_size(batch))

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        """End the session, recording the exception (``SessionEnded.reason``)."""
        self._fit.close(exception)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """End the session after ``fit``."""
        if stage == "fit":
            self._pending = None
            self._fit.close()
