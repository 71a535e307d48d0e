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
- ``on_train_batch_end``: records the step (``StepCompleted``): its loss, and its samples (the
  batch sizes of its micro-batches); ``teardown`` / ``on_exception``: ends the session,
  recording why.

With ``accumulate_grad_batches``, Lightning divides each micro-batch's loss by the full
accumulation count, also in an epoch's last, shorter window: the step's loss is the mean over
the micro-batches actually accumulated. Manual optimization (``automatic_optimization =
False``): ``self.clip_gradients(...)`` in ``training_step`` clips before ``opt.step()`` reaches
``on_before_optimizer_step``, so the callback checks the step when that call starts, before it
clips (the precision plugin's ``clip_gradients`` is wrapped for the fit, on that plugin
object); the loss is the sum of the ``manual_backward`` losses since the last check. A batch
that clips but never calls ``opt.step()`` has its check dropped at its end: the next batch is
checked on its own gradients. Not
covered: under ``precision="16-mixed"`` a step skipped there would leave the ``GradScaler`` no
gradient to unscale at ``opt.step()`` (``scaler.step`` then fails), so the check stays at
``opt.step()``, after your clip; and a clip by ``torch.nn.utils.clip_grad_norm_`` in your own
code is never seen before it happens.
Two ``EventBusDebugCallback`` entries in ``Trainer(callbacks=...)`` (the same one listed twice)
are a ``ValueError``.

Checkpoints: ``on_save_checkpoint`` stores the session's state (what the detectors learned of
the run) in every ``.ckpt``, under ``checkpoint["callbacks"]["EventBusDebugCallback"]`` (the
callback's ``state_key``, where Lightning keeps callback states; not through
``Callback.state_dict``, which would make Lightning refuse a callback listed twice with an
error of its own). ``trainer.fit(ckpt_path=...)`` calls ``load_state_dict`` before
``on_fit_start``, when the fit's session does not exist yet: the state is kept and handed to
the session when it opens (a strategy that restores after setup loads it into the running
session), so the resumed run is judged as the uninterrupted run would have been.

Distributed runs: each rank runs its own session, which agrees every decision with the other
ranks (see the README's "Distributed training"), so no rank skips, restores or stops alone.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ._common import (
    DEFAULT_LOG_DIR,
    FitSession,
    FitViews,
    LossAccumulator,
    SampleCounter,
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

    _RUN_SCOPED = ("_scaler", "_pending", "_early", "_plugin", "_clip_wrapper")

    def __init__(
        self, log_dir: str | Path | None = DEFAULT_LOG_DIR, **session_options: Any
    ) -> None:
        super().__init__()
        self._fit = FitSession("lightning", log_dir, session_options)
        self._loss = LossAccumulator()
        self._samples = SampleCounter()
        self._checked_samples = SampleCounter()  # the micro-batches since the last check
        self._scaler: torch.amp.GradScaler | None = None
        self._accumulation = 1  # Lightning divides each micro-batch loss by this (automatic)
        self._pending: tuple[int, Verdict, float | None] | None = None
        self._early: tuple[int, Verdict, float | None] | None = None  # manual: checked at the clip
        self._plugin: Any = None  # the precision plugin whose clip_gradients is wrapped
        self._clip_wrapper: Any = None

    # -- checkpoints ------------------------------------------------------------------------------
    #
    # Saved from on_save_checkpoint rather than by overriding Callback.state_dict: Lightning
    # refuses, at Trainer(...), two callbacks of one class that override state_dict, with an
    # error of its own that would replace the clear ValueError of on_fit_start for a callback
    # listed twice. The entry is the one state_dict would have made (same key, same value).

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Store the session's state in the checkpoint, where Lightning keeps the callbacks'
        states: ``checkpoint["callbacks"][self.state_key]`` (see :meth:`FitViews.state_dict`:
        between fits, the last fit's state)."""
        checkpoint.setdefault("callbacks", {})[self.state_key] = self._fit.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Lightning's restore from ``trainer.fit(ckpt_path=...)``: before ``on_fit_start``,
        the state is kept and handed to the session when it opens; during the fit, it is
        loaded into the running session (see :meth:`FitViews.load_state_dict`).

        Raises:
            ValueError: if *state_dict* is not a session's state dict.
        """
        FitViews.load_state_dict(self, state_dict)

    # -- Lightning hooks --------------------------------------------------------------------------

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Open the session on the module, its optimizer, schedulers and AMP scaler.

        Raises:
            ValueError: if the trainer has no optimizer or more than one, or if its callbacks
                hold more than one ``EventBusDebugCallback``.
        """
        callbacks = trainer.callbacks  # type: ignore[attr-defined]
        listed = sum(isinstance(c, EventBusDebugCallback) for c in callbacks)
        if listed > 1:
            msg = (
                f"Trainer(callbacks=...) holds {listed} EventBusDebugCallback entries (the same "
                "one listed twice, or two): keep one, or every step is checked again"
            )
            raise ValueError(msg)
        # configure_optimizers returning None: Lightning steps a _MockOptimizer (no parameters)
        optimizers = [o for o in trainer.optimizers if type(o).__name__ != "_MockOptimizer"]
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
        self._samples.take()
        self._checked_samples.take()
        self._pending = self._early = None
        automatic = pl_module.automatic_optimization
        self._accumulation = int(trainer.accumulate_grad_batches) if automatic else 1
        self._fit.open(pl_module, optimizer, schedulers=schedulers, scaler=self._scaler)
        if not automatic:
            self._wrap_clip(trainer.precision_plugin, trainer)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Count this micro-batch's samples for its step's check (an epoch's last batch may be
        a few samples: the detectors then judge it leniently)."""
        if self._fit.running:
            self._checked_samples.add(batch_size(batch))

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
        early, self._early = self._early, None
        if early is not None and early[0] == trainer.global_step:
            self._pending = early  # manual optimization: checked before the user's clip
            return
        self._pending = self._check(trainer.global_step, optimizer)

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        """Record the step that just finished (once per optimizer step).

        Manual optimization: a batch that called ``self.clip_gradients`` but never
        ``opt.step()`` leaves its early verdict behind; it is dropped here, so the next batch
        is checked on its own gradients rather than judged by this batch's.
        """
        if not self._fit.running:
            return
        self._early = None
        self._samples.add(batch_size(batch))
        pending, self._pending = self._pending, None
        if pending is None:
            return
        step, verdict, lr = pending
        samples = self._samples.take()
        self._fit.completed(step, loss=verdict.loss, learning_rate=lr, samples=samples)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        """End the session, recording the exception (``SessionEnded.reason``)."""
        self._end(exception)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """End the session after ``fit``."""
        if stage == "fit":
            self._end(None)

    # -- internals --------------------------------------------------------------------------------

    def _check(
        self, step: int, optimizer: torch.optim.Optimizer
    ) -> tuple[int, Verdict, float | None]:
        """Check *step* with the loss of its window (see the module docstring)."""
        lr = learning_rate(optimizer)
        count = self._loss.count
        loss = self._loss.take()
        if loss is not None and 0 < count != self._accumulation:
            # A short window (an epoch's last): Lightning still divided by the full count.
            loss = loss * (self._accumulation / count)
        return step, self._fit.check(step, loss, self._checked_samples.take()), lr

    def _wrap_clip(self, plugin: Any, trainer: pl.Trainer) -> None:
        """Manual optimization: check the step when ``self.clip_gradients`` starts, before it
        clips (``LightningModule.clip_gradients`` calls the precision plugin's)."""
        original = plugin.clip_gradients

        @functools.wraps(original)
        def clip_gradients(optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            self._check_before_clip(trainer, optimizer)
            return original(optimizer, *args, **kwargs)

        plugin.clip_gradients = clip_gradients
        self._plugin, self._clip_wrapper = plugin, clip_gradients

    def _check_before_clip(self, trainer: pl.Trainer, optimizer: torch.optim.Optimizer) -> None:
        if not self._fit.running or self._early is not None:
            return
        scaler = self._scaler
        if scaler is not None and scaler.is_enabled():
            # A skip here would leave the scaler no gradient to unscale at opt.step(), and
            # scaler.step() fails: checked there, after the unscale (and after the clip).
            return
        self._early = self._check(trainer.global_step, optimizer)

    def _end(self, exc: BaseException | None) -> None:
        plugin, self._plugin = self._plugin, None
        wrapper, self._clip_wrapper = self._clip_wrapper, None
        if plugin is not None and vars(plugin).get("clip_gradients") is wrapper:
            del plugin.clip_gradients
        self._pending = self._early = None
        self._loss.take()
        self._samples.take()
        self._checked_samples.take()
        self._fit.close(exc)
