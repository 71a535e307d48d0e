"""Hugging Face ``Trainer``: one callback, ``Trainer(..., callbacks=[EventBusDebugCallback()])``.

No ``TrainerCallback`` hook sees the pre-clip gradients: ``Trainer`` clips
(``_clip_grad_norm``, ``args.max_grad_norm``) right after the last backward of a step and only
then calls ``on_pre_optimizer_step``. An injected explosion would show a norm of exactly
``max_grad_norm`` and no incident. So this callback **takes over the clipping**:

- ``on_train_begin``: remembers ``args.max_grad_norm`` and sets it to 0 for the run (restored at
  ``on_train_end``). With 0, ``Trainer`` does not clip but still measures the gradient norm it
  logs as ``grad_norm`` (through ``accelerator.clip_grad_norm_(..., inf)``, which also unscales
  fp16 gradients), so ``on_pre_optimizer_step`` sees unscaled, **unclipped** gradients. It opens
  a :class:`~eventbus_debug.SyncSession` on the model, the optimizer (unwrapped from
  accelerate's ``AcceleratedOptimizer``), the ``lr_scheduler`` and accelerate's ``GradScaler``
  (fp16), and registers a forward hook on the model that keeps ``outputs.loss`` of each
  training micro-batch. The step's loss is their mean; when ``Trainer`` passes the model
  ``num_items_in_batch`` (causal LMs and other models that take loss kwargs), each
  micro-batch's loss is already divided by the whole step's token count, so the step's loss is
  their sum (times the number of processes when ``average_tokens_across_devices`` counts
  tokens over all ranks, as ``Trainer`` does for the loss it logs): the same figure ``Trainer``
  logs, whatever ``gradient_accumulation_steps``.
- ``on_pre_optimizer_step``: the safe point. The session checks the pre-clip gradients and the
  loss; a skipped step has its gradients set to ``None`` (``optimizer.step()`` is then a no-op
  for the parameters and the optimizer state; ``global_step`` and the scheduler advance as
  usual); otherwise the gradients are clipped to the remembered ``max_grad_norm`` with the norm
  the probe already computed (no second pass), exactly as ``Trainer`` would have.
- ``on_step_end``: records the step; ``on_train_end``: ends the session.

Not covered: DeepSpeed and FSDP clip sharded gradients inside their engines; the callback
refuses them with a clear error rather than checking a shard-local norm. A loss computed
outside the model (a custom ``compute_loss``) is not seen: the gradients are still checked.
Distributed (DDP) runs: the session agrees every decision across the ranks (see the README's
"Distributed training"): a NaN or a spike on one rank is skipped or rolled back on all of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ._common import (
    DEFAULT_LOG_DIR,
    FitSession,
    FitViews,
    LossAccumulator,
    clip_after_check,
    learning_rate,
    require,
)

require("transformers", "transformers")

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.hooks import RemovableHandle  # noqa: E402
from transformers import (  # noqa: E402
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

from ..session import Verdict  # noqa: E402

__all__ = ("EventBusDebugCallback",)


class EventBusDebugCallback(TrainerCallback, FitViews):
    """Runs the eventbus-debug checks and recovery inside ``Trainer.train``.

    Example::

        trainer = Trainer(model, args, train_dataset=ds, callbacks=[EventBusDebugCallback()])

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
        self._fit = FitSession("transformers", log_dir, session_options)
        self._loss = LossAccumulator()
        self._normalized = False  # the step's micro-batch losses were divided by its item count
        self._hook: RemovableHandle | None = None
        self._args: TrainingArguments | None = None
        self._max_grad_norm = 0.0
        self._model: nn.Module | None = None
        self._pending: tuple[int, Verdict, float | None] | None = None

    @property
    def max_grad_norm(self) -> float:
        """The ``max_grad_norm`` this callback clips to (taken over from the arguments)."""
        return self._max_grad_norm

    # -- Trainer hooks ----------------------------------------------------------------------------

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        """Take over clipping, hook the loss, open the session.

        Raises:
            ValueError: under DeepSpeed or FSDP, or without a model or optimizer.
        """
        if getattr(args, "deepspeed", None) or getattr(args, "fsdp", None):
            msg = (
                "EventBusDebugCallback does not support DeepSpeed or FSDP: they clip sharded "
                "gradients inside their engines, where no callback sees the full norm"
            )
            raise ValueError(msg)
        model, optimizer = kwargs.get("model"), kwargs.get("optimizer")
        if not isinstance(model, nn.Module) or optimizer is None:
            msg = "EventBusDebugCallback needs the Trainer's model and optimizer (on_train_begin)"
            raise ValueError(msg)
        if self._fit.running:  # a previous train() raised and never reached on_train_end
            self._teardown(RuntimeError("Trainer.train() ended without on_train_end"))
        raw = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer
        if not isinstance(raw, torch.optim.Optimizer):
            msg = f"the Trainer's optimizer is not a torch.optim.Optimizer: {type(raw).__name__}"
            raise ValueError(msg)
        scaler = getattr(optimizer, "scaler", None)
        scheduler = kwargs.get("lr_scheduler")
        self._args = args
        self._max_grad_norm = float(args.max_grad_norm or 0.0)
        args.max_grad_norm = 0.0
        self._model = model
        self._loss.take()
        self._normalized = False
        self._pending = None
        self._hook = model.register_forward_hook(self._keep_loss, with_kwargs=True)
        try:
            self._fit.open(
                model,
                raw,
                schedulers=[scheduler] if scheduler is not None else [],
                scaler=scaler if isinstance(scaler, torch.amp.GradScaler) else None,
            )
        except BaseException:
            self._teardown()
            raise

    def on_pre_optimizer_step(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        """The safe point: check the unclipped gradients, then skip or clip."""
        fit = self._fit
        if not fit.running or fit.optimizer is None:
            return
        step = state.global_step
        lr = learning_rate(fit.optimizer)
        try:
            verdict = fit.check(step, self._step_loss(args))
        except BaseException as exc:  # TrainingStopped: no Trainer hook runs after this
            self._teardown(exc)
            raise
        if verdict.should_step and self._max_grad_norm > 0:
            self._clip(verdict)
        self._pending = (step, verdict, lr)

    def on_step_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        """Record the step that just finished."""
        pending, self._pending = self._pending, None
        if pending is not None:
            step, verdict, lr = pending
            self._fit.completed(step, loss=verdict.loss, learning_rate=lr)

    def on_train_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        """Give ``max_grad_norm`` back, remove the hook, end the session."""
        self._teardown()

    # -- internals --------------------------------------------------------------------------------

    def _keep_loss(
        self, module: nn.Module, args: Any, kwargs: Mapping[str, Any], output: Any
    ) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
        if isinstance(loss, torch.Tensor):
            self._loss.add(loss)
            if kwargs.get("num_items_in_batch") is not None:
                self._normalized = True

    def _step_loss(self, args: TrainingArguments) -> torch.Tensor | None:
        """The step's loss from its micro-batches' (see the module's docstring)."""
        normalized, self._normalized = self._normalized, False
        if not normalized:
            return self._loss.take(mean=True)
        total = self._loss.take()
        world = int(getattr(args, "world_size", 1) or 1)
        if (
            total is not None
            and world > 1
            and getattr(args, "average_tokens_across_devices", False)
        ):
            total = total * world  # Trainer divides by the tokens of every rank
        return total

    def _clip(self, verdict: Verdict) -> None:
        if self._model is not None:
            clip_after_check(self._model, self._max_grad_norm, verdict)

    def _teardown(self, exc: BaseException | None = None) -> None:
        if self._args is not None:
            self._args.max_grad_norm = self._max_grad_norm
            self._args = None
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._model = None
        self._pending = None
        self._fit.close(exc)
