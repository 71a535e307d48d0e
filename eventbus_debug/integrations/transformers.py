"""Hugging Face ``Trainer``: one callback, ``Trainer(..., callbacks=[EventBusDebugCallback()])``.

No ``TrainerCallback`` hook sees the pre-clip gradients: ``Trainer`` clips (``_clip_grad_norm``,
when ``args.max_grad_norm > 0``) right after the last backward of a step and only then calls
``on_pre_optimizer_step``. An injected explosion would show a norm of exactly
``max_grad_norm`` and no incident. So this callback **takes over the clipping**, without
changing what anything else reads:

- ``on_train_begin``: replaces ``args.max_grad_norm`` by an equal float whose one difference is
  that the ``max_grad_norm > 0`` test made by a ``Trainer`` running this callback is false.
  That ``Trainer`` then does not clip, but still measures the norm it logs as ``grad_norm``
  (through ``accelerator.clip_grad_norm_(..., inf)``, which also unscales fp16 gradients), so
  ``on_pre_optimizer_step`` sees unscaled, **unclipped** gradients. Everything else reads and
  uses your value: your code and other callbacks, the ``training_args.bin`` of checkpoints
  (the value pickles as a plain float), and a ``Trainer`` without this callback that shares the
  arguments, even after a ``train()`` that raised. The plain float is put back at
  ``on_train_end``. It opens a :class:`~eventbus_debug.SyncSession` on the model, the
  optimizer (unwrapped from accelerate's ``AcceleratedOptimizer``), the ``lr_scheduler`` and
  accelerate's ``GradScaler`` (fp16), and wraps the trainer's ``training_step`` for the run (on
  that ``Trainer`` object only) to keep what each micro-batch's ``training_step`` returns and
  the batch size of its inputs. ``Trainer`` adds up exactly those returns into the loss it
  logs, so the step's loss is the figure ``Trainer`` logs, however it was computed
  (``outputs.loss``, token-normalized losses, ``label_smoothing_factor``,
  ``compute_loss_func``, your own ``compute_loss``), whatever ``gradient_accumulation_steps``.
- ``on_pre_optimizer_step``: the safe point. The session checks the pre-clip gradients and the
  loss; a skipped step has its gradients set to ``None`` (``optimizer.step()`` is then a no-op
  for the parameters and the optimizer state; ``global_step`` and the scheduler advance as
  usual); otherwise the gradients are clipped to your ``max_grad_norm`` with
  ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)``, the very call
  accelerate makes for ``Trainer``: the run's parameters are bit for bit those of the run
  without the callback.
- ``on_step_end``: records the step (its loss, learning rate and samples);
  ``on_train_end``: ends the session.
- ``on_save``: writes the session's state (what the detectors learned of the run) as
  ``eventbus_debug_state.json`` into the checkpoint folder ``Trainer`` just wrote
  (``<output_dir>/checkpoint-<global_step>``), on the process that saves (``args.should_save``).
  ``train(resume_from_checkpoint=...)`` reads it back at ``on_train_begin`` and hands it to the
  session, so the resumed run is judged as the uninterrupted run would have been; a checkpoint
  without the file is resumed with a warning, the detectors starting afresh. (``Trainer``
  persists only ``ExportableState`` callbacks, and rebuilds them from JSON arguments, which this
  callback's options are not: hence a file of its own.)

``Trainer`` has no hook for a ``train()`` that raises. An error inside ``training_step`` (the
wrapper sees it) ends the session there, with that error as its reason, before it leaves
``train()``. One raised elsewhere (the data loader, another callback) leaves the session open;
it is then closed (``SessionEnded`` saying so, the log flushed, the report written) by the
next ``train()`` with this callback, or with another one on the same arguments or model, or
when the callback is garbage-collected, or at the interpreter's exit.

Not covered: DeepSpeed and FSDP clip sharded gradients inside their engines; the callback
refuses them with a clear error rather than checking a shard-local norm. Distributed (DDP)
runs: the session agrees every decision across the ranks (see the README's "Distributed
training"): a NaN or a spike on one rank is skipped or rolled back on all of them.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
import weakref
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any, Final

from ._common import (
    DEFAULT_LOG_DIR,
    FitSession,
    FitViews,
    LossAccumulator,
    SampleCounter,
    batch_size,
    clip_gradients,
    learning_rate,
    require,
)

require("transformers", "transformers")

import torch  # noqa: E402
from torch import nn  # noqa: E402
from transformers import (  # noqa: E402
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR  # noqa: E402

from ..session import Verdict  # noqa: E402
from ..sinks.report.writer import write_atomically  # noqa: E402

__all__ = ("STATE_FILE", "EventBusDebugCallback")

STATE_FILE: Final = "eventbus_debug_state.json"
"""The file, in each checkpoint folder, that holds the session's state (``on_save``)."""

_log = logging.getLogger("eventbus_debug.integrations")

# How far up from on_train_begin the Trainer's own frame is looked for (CallbackHandler's two
# frames, then Trainer's training loop; a few more for wrappers such as accelerate's
# find_executable_batch_size).
_TRAINER_FRAMES = 8

# The attribute of our training_step wrapper holding what the Trainer object had before it.
_WRAPPED_BEFORE = "_eventbus_debug_wrapped_before"
_NOTHING = object()

# Callbacks whose session is open, to close one a train() left open when the next run starts.
_OPEN: weakref.WeakSet[EventBusDebugCallback] = weakref.WeakSet()


def _lists(owner: object, callback: EventBusDebugCallback) -> bool:
    """Whether *owner* (a ``Trainer``) runs *callback*: it is in its ``callback_handler``."""
    try:
        callbacks = getattr(getattr(owner, "callback_handler", None), "callbacks", None)
    except Exception:  # an object whose attribute lookup fails: not a Trainer
        return False
    return isinstance(callbacks, list) and any(c is callback for c in callbacks)


class _ClipHandover(float):
    """``args.max_grad_norm`` while the callback clips: your value for everything, except the
    ``> 0`` test of a ``Trainer`` that runs the callback, which then does not clip before the
    check. Pickles and copies as a plain float."""

    __slots__ = ("_owner", "asked")

    _owner: weakref.ref[EventBusDebugCallback]
    asked: bool  # the Trainer made its test since the last safe point

    def __new__(cls, value: float, owner: EventBusDebugCallback) -> _ClipHandover:
        self = super().__new__(cls, value)
        self._owner = weakref.ref(owner)
        self.asked = False
        return self

    def __gt__(self, value: float, /) -> bool:
        owner = self._owner()
        if owner is not None and owner._clips_for(sys._getframe(1)):
            self.asked = True
            return False
        return float(self) > value

    def __reduce__(self) -> tuple[type[float], tuple[float]]:
        return (float, (float(self),))


def _checkpoint_folder(args: TrainingArguments, state: TrainerState) -> str:
    """The folder ``Trainer`` saves the checkpoint of ``state.global_step`` in (outside a
    hyperparameter search): ``<output_dir>/checkpoint-<global_step>``."""
    return os.path.join(args.output_dir or "", f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")


def _end_left_open(fit: FitSession) -> None:
    """The finalizer of a callback whose session is open: it was collected, or the interpreter
    exits, with a ``train()`` that never reached ``on_train_end``."""
    fit.close(RuntimeError("Trainer.train() ended without on_train_end"))


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

    _RUN_SCOPED = (
        "_args",
        "_handover",
        "_model",
        "_trainer",
        "_training_step",
        "_finalizer",
        "_pending",
    )

    def __init__(
        self, log_dir: str | Path | None = DEFAULT_LOG_DIR, **session_options: Any
    ) -> None:
        self._fit = FitSession("transformers", log_dir, session_options)
        self._loss = LossAccumulator()
        self._samples = SampleCounter()
        self._args: TrainingArguments | None = None
        self._max_grad_norm = 0.0
        self._handover: _ClipHandover | None = None
        self._warned_unasked = False
        self._model: nn.Module | None = None
        self._trainer: Any = None
        self._training_step: Callable[..., Any] | None = None  # our wrapper, on self._trainer
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self._pending: tuple[int, Verdict, float | None, int | None] | None = None

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
        """Take over clipping, wrap ``training_step``, open the session.

        Raises:
            ValueError: under DeepSpeed or FSDP, without a model or optimizer, or when the
                ``Trainer``'s callbacks hold more than one ``EventBusDebugCallback``.
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
        trainer, resumed_from = self._find_trainer()
        if trainer is not None:
            listed = sum(
                isinstance(c, EventBusDebugCallback) for c in trainer.callback_handler.callbacks
            )
            if listed > 1:
                msg = (
                    f"the Trainer's callbacks hold {listed} EventBusDebugCallback entries (the "
                    "same one listed twice, or two): keep one, or every step is checked and "
                    "clipped again"
                )
                raise ValueError(msg)
        self._close_left_open(args, model)
        raw = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer
        if not isinstance(raw, torch.optim.Optimizer):
            msg = f"the Trainer's optimizer is not a torch.optim.Optimizer: {type(raw).__name__}"
            raise ValueError(msg)
        scaler = getattr(optimizer, "scaler", None)
        scheduler = kwargs.get("lr_scheduler")
        self._args = args
        self._max_grad_norm = float(args.max_grad_norm or 0.0)  # a handover left behind: its value
        if self._max_grad_norm > 0:
            self._handover = _ClipHandover(self._max_grad_norm, self)
            args.max_grad_norm = self._handover
        self._model = model
        self._loss.take()
        self._samples.take()
        self._pending = None
        if state.global_step > 0 and self._fit.pending_state is None:
            self._load_checkpoint_state(args, state, resumed_from)
        if trainer is not None:
            self._wrap_training_step(trainer)
            if self._handover is not None and not hasattr(trainer, "_get_grad_norm"):
                _log.warning(
                    "this transformers version (before 5.3) logs no grad_norm while the "
                    "callback does the clipping: the checked norm is in StepChecked events; "
                    "pip install 'transformers>=5.3' for both"
                )
        else:
            _log.warning(
                "EventBusDebugCallback was not called by a transformers Trainer's train(): the "
                "loss is not checked (the gradients are)"
            )
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
        _OPEN.add(self)
        self._finalizer = weakref.finalize(self, _end_left_open, self._fit)

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
        self._warn_if_trainer_clipped()
        step = state.global_step
        lr = learning_rate(fit.optimizer)
        samples = self._samples.take()
        try:
            verdict = fit.check(step, self._loss.take(), samples)
        except BaseException as exc:  # TrainingStopped: no Trainer hook runs after this
            self._teardown(exc)
            raise
        if verdict.should_step and self._max_grad_norm > 0 and self._model is not None:
            clip_gradients(self._model.parameters(), self._max_grad_norm)
        self._pending = (step, verdict, lr, samples)

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
            step, verdict, lr, samples = pending
            self._fit.completed(step, loss=verdict.loss, learning_rate=lr, samples=samples)

    def on_train_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        """Give ``max_grad_norm`` back, unwrap ``training_step``, end the session."""
        self._teardown()

    def on_save(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        """Write the session's state into the checkpoint folder just saved (:data:`STATE_FILE`),
        on the process that saves; a folder not found is a warning, never an error."""
        if not args.should_save:
            return
        folder = _checkpoint_folder(args, state)
        if not os.path.isdir(folder):
            _log.warning(
                "no checkpoint folder %s to save the debug session's state in (a hyperparameter "
                "search's run folder?): a run resumed from this checkpoint starts its detectors "
                "afresh",
                folder,
            )
            return
        data = json.dumps(self._fit.state_dict()).encode("utf-8")
        write_atomically(Path(folder) / STATE_FILE, data)

    # -- checkpoints ------------------------------------------------------------------------------

    def _load_checkpoint_state(
        self, args: TrainingArguments, state: TrainerState, resumed_from: object
    ) -> None:
        """A resumed ``train()``: read :data:`STATE_FILE` from the checkpoint it resumes from
        (``Trainer``'s ``resume_from_checkpoint``, else ``<output_dir>/checkpoint-<step>``) and
        keep it for the session. Missing or unreadable: a warning, the detectors start afresh."""
        folders = [_checkpoint_folder(args, state)]
        if isinstance(resumed_from, str | os.PathLike):
            folders.insert(0, os.fspath(resumed_from))
        path = next(
            (p for p in (os.path.join(f, STATE_FILE) for f in folders) if os.path.isfile(p)),
            None,
        )
        if path is None:
            _log.warning(
                "the checkpoint resumed from (step %d) holds no %s (saved without "
                "EventBusDebugCallback, or by an older version): the debug detectors start "
                "afresh, and may report incidents in the first steps that the uninterrupted "
                "run would not have",
                state.global_step,
                STATE_FILE,
            )
            return
        try:
            with open(path, encoding="utf-8") as file:
                saved = json.load(file)
            self._fit.load_state_dict(saved)
        except (OSError, ValueError) as exc:  # json's errors are ValueErrors too
            _log.warning(
                "the debug session's state in %s cannot be read (%s): the debug detectors "
                "start afresh",
                path,
                exc,
            )

    # -- internals --------------------------------------------------------------------------------

    def _clips_for(self, frame: FrameType) -> bool:
        """Whether the code running in *frame* is a ``Trainer`` whose clipping this callback
        has taken over (it runs this callback, whose session is open)."""
        return self._fit.running and _lists(frame.f_locals.get("self"), self)

    def _find_trainer(self) -> tuple[Any, object]:
        """The ``Trainer`` whose ``train()`` calls this hook (``None`` if there is none), and
        the ``resume_from_checkpoint`` of its training loop (``None`` when not resuming)."""
        frame: FrameType | None = sys._getframe(2)  # the caller of on_train_begin
        for _ in range(_TRAINER_FRAMES):
            if frame is None:
                break
            owner = frame.f_locals.get("self")
            if _lists(owner, self) and callable(getattr(owner, "training_step", None)):
                return owner, frame.f_locals.get("resume_from_checkpoint")
            frame = frame.f_back
        return None, None

    def _close_left_open(self, args: TrainingArguments, model: nn.Module) -> None:
        """Close a session that a ``train()`` which raised left open: this callback's, or
        another callback's on the same arguments or model (a notebook cell run again)."""
        reason = RuntimeError("Trainer.train() ended without on_train_end")
        for other in list(_OPEN):
            if other is self or other._args is args or other._model is model:
                other._teardown(reason)

    def _wrap_training_step(self, trainer: Any) -> None:
        """Wrap *trainer*'s ``training_step`` (on the object, for this run) to keep what each
        micro-batch's call returns (the loss ``Trainer`` adds up and logs) and its batch size.

        A wrapper of ours left behind by a ``train()`` that raised is replaced, not wrapped
        again; the teardown puts back what the object had before (usually nothing: the class's
        method)."""
        current = trainer.training_step
        before: Any = vars(trainer).get("training_step", _NOTHING)
        if _WRAPPED_BEFORE in getattr(current, "__dict__", {}):  # ours, left behind
            before = vars(current)[_WRAPPED_BEFORE]
            current = current.__wrapped__
        original = current
        callback = weakref.ref(self)

        @functools.wraps(original)
        def training_step(model: nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            size = batch_size(inputs)
            try:
                loss = original(model, inputs, *args, **kwargs)
            except BaseException as exc:
                # Trainer has no hook for it and train() ends here: the session ends now with
                # the error itself (log flushed, report written, clipping given back), not at
                # the next train() as one "ended without on_train_end".
                failed = callback()
                if failed is not None and failed._training_step is not None:
                    failed._teardown(exc)
                raise
            owner = callback()
            if owner is not None:
                owner._micro_batch(loss, size)
            return loss

        vars(training_step)[_WRAPPED_BEFORE] = before
        trainer.training_step = training_step
        self._trainer = trainer
        self._training_step = training_step

    def _micro_batch(self, loss: Any, size: int | None) -> None:
        if self._fit.running and isinstance(loss, torch.Tensor):
            self._loss.add(loss)
            self._samples.add(size)

    def _warn_if_trainer_clipped(self) -> None:
        """A ``Trainer`` that did not make its ``max_grad_norm > 0`` test before this step may
        have clipped before the check (a transformers version that tests it differently)."""
        handover = self._handover
        if handover is None:
            return
        asked, handover.asked = handover.asked, False
        if not asked and not self._warned_unasked:
            self._warned_unasked = True
            _log.warning(
                "Trainer did not test args.max_grad_norm before this step's check: it may "
                "have clipped the gradients already, and an explosion then shows a norm of "
                "max_grad_norm (this transformers version clips differently)"
            )

    def _teardown(self, exc: BaseException | None = None) -> None:
        _OPEN.discard(self)
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        args, self._args = self._args, None
        handover, self._handover = self._handover, None
        if args is not None and handover is not None and args.max_grad_norm is handover:
            args.max_grad_norm = float(handover)
        trainer, self._trainer = self._trainer, None
        wrapper, self._training_step = self._training_step, None
        if wrapper is not None and vars(trainer).get("training_step") is wrapper:
            before = vars(wrapper)[_WRAPPED_BEFORE]
            if before is _NOTHING:
                del trainer.training_step
            else:
                trainer.training_step = before
        self._model = None
        self._pending = None
        self._loss.take()
        self._samples.take()
        self._fit.close(exc)
