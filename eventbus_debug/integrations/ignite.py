"""PyTorch Ignite: one handler, ``EventBusDebugHandler(model, optimizer).attach(trainer)``.

Ignite's update functions (``supervised_training_step`` and its AMP variant, or your own) run
backward and ``optimizer.step()`` in one call, with no event in between. So the safe point is
an **optimizer step pre-hook** (``optimizer.register_step_pre_hook``), installed when the engine
starts and removed when it stops: it runs inside ``optimizer.step()`` before any parameter
changes, after backward and (under ``GradScaler``) after unscaling. It works unchanged with
every update function, and with gradient accumulation (it runs once per real step). A step
the session skips has its gradients set to ``None``, which makes that ``optimizer.step()`` a
no-op for the parameters and the optimizer state.

- ``Events.STARTED``: opens a :class:`~eventbus_debug.SyncSession`, installs the hook and the
  handlers below (:meth:`EventBusDebugHandler.attach` registers exactly this). Registered twice
  on the same engine (``attach`` and ``add_event_handler``), it still opens one session; started
  by a second engine while the first one's run is going on (attached to an evaluator that runs
  inside the training run, too), it raises a ``ValueError`` saying so.
- optimizer step pre-hook: checks the gradients, and the loss when ``loss_fn`` was wrapped
  with :meth:`EventBusDebugHandler.track_loss`.
- ``Events.ITERATION_COMPLETED``: checks ``engine.state.output`` as Ignite's
  ``TerminateOnNan`` does (NaN, +Inf, -Inf in numbers, tensors, and tuples, lists and dicts of
  them, nested), and numpy arrays too; what holds nothing to check (``None``, strings, other
  objects) is left out, never raised; a non-finite value not already reported by the step's
  check becomes a ``NonFiniteDetected`` (role OUTPUT: reported, never acted on after the fact;
  the run is not terminated: add ``TerminateOnNan`` beside the handler for that). With
  gradient accumulation, an iteration that does not step waits for the step that closes its
  window: one fault, one incident (the step's own check usually reports it, through the
  gradients). Then the step is recorded (``StepCompleted``: its loss the checked one, else the
  output when it is a number; its samples the batch sizes of the window's iterations, the
  leading dimension of the first tensor in ``engine.state.batch``).
- ``Events.COMPLETED`` / ``TERMINATE`` / ``EXCEPTION_RAISED``: ends the session.

Clipping: an update function that clips (``torch.nn.utils.clip_grad_norm_`` before
``optimizer.step()``; Ignite's ``supervised_training_step`` has no clipping argument) hands the
check clipped gradients, and an explosion then shows a norm of ``max_norm``. Leave it out of the
update function and pass ``max_grad_norm=`` to the handler: after the check it calls
``torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)``, the call your update
function would have made, so the parameters are bit for bit those of that update function.

Checkpoints: the handler has ``state_dict()`` / ``load_state_dict()`` (the session's state, what
the detectors learned of the run), so it goes into Ignite's ``Checkpoint(to_save={...,
"debug": handler})`` beside the model, the optimizer and the engine, and
``Checkpoint.load_objects(to_load=..., checkpoint=...)`` restores it; loaded before
``engine.run``, the state is kept and handed to the session at ``Events.STARTED``, so the
resumed run is judged as the uninterrupted run would have been.

Steps are numbered by Ignite's iteration (``engine.state.iteration - 1``). Under AMP an
overflow step never reaches the hook (``scaler.step`` skips ``optimizer.step()`` itself).
Ignite's own parameter schedulers are not torch LR schedulers: pass the underlying
``torch.optim.lr_scheduler`` objects as ``scheduler=`` so LR decisions survive them.
"""

from __future__ import annotations

import logging
import numbers
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, final

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

require("ignite", "ignite")

import torch  # noqa: E402
from ignite.engine import Engine, Events  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.hooks import RemovableHandle  # noqa: E402

from .._validate import positive_number  # noqa: E402
from ..events import NonFiniteDetected, TensorRole  # noqa: E402
from ..probes.finite import non_finite_counts  # noqa: E402
from ..session import Verdict  # noqa: E402

__all__ = ("EventBusDebugHandler",)

OUTPUT_NAME = "engine.state.output"
_log = logging.getLogger(__name__)


def _identity(output: Any) -> Any:
    return output


@final
class EventBusDebugHandler(FitViews):
    """Runs the eventbus-debug checks and recovery inside an Ignite training ``Engine``.

    Example::

        trainer = create_supervised_trainer(model, optimizer, loss_fn)
        EventBusDebugHandler(model, optimizer, log_dir="debug_logs").attach(trainer)

    Args:
        model: the trained module.
        optimizer: its optimizer (the one the update function steps).
        log_dir: where the JSON-lines log and the report go (``None``: neither).
        output_transform: turns ``engine.state.output`` into what is checked (as
            ``TerminateOnNan``'s argument).
        max_grad_norm: clip the gradients to this norm after the check, with
            ``torch.nn.utils.clip_grad_norm_`` (``None``: no clipping by the handler); use it
            instead of clipping in the update function.
        **session_options: any other :class:`~eventbus_debug.SyncSession` keyword argument
            (``level``, ``policy``, ``scheduler``, ``scaler``, ``recovery``, ``alerts``, ...).

    Raises:
        TypeError: if *model* is not a module, *optimizer* not an optimizer, *output_transform*
            not callable, or a session option names ``model``, ``optimizer`` or ``log_dir``.
        ValueError: if *max_grad_norm* is not a positive finite number.
    """

    _RUN_SCOPED = ("_engine", "_started_at", "_hook", "_pending", "_bad_output", "_window")

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        log_dir: str | Path | None = DEFAULT_LOG_DIR,
        *,
        output_transform: Callable[[Any], Any] = _identity,
        max_grad_norm: float | None = None,
        **session_options: Any,
    ) -> None:
        if not isinstance(model, nn.Module):
            msg = f"model must be a torch.nn.Module, got {type(model).__qualname__}"
            raise TypeError(msg)
        if not isinstance(optimizer, torch.optim.Optimizer):
            msg = f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__qualname__}"
            raise TypeError(msg)
        if not callable(output_transform):
            msg = f"output_transform must be callable, got {output_transform!r}"
            raise TypeError(msg)
        self.model = model
        self.optimizer = optimizer
        self.max_grad_norm = (
            None if max_grad_norm is None else positive_number("max_grad_norm", max_grad_norm)
        )
        self._output_transform = output_transform
        self._fit = FitSession("ignite", log_dir, session_options)
        self._loss = LossAccumulator()
        self._samples = SampleCounter()
        self._engine: Engine | None = None
        self._started_at: int | None = None  # the iteration the run started at, until it iterates
        self._hook: RemovableHandle | None = None
        self._pending: tuple[int, Verdict, float | None] | None = None
        self._bad_output: int | None = None  # the first non-finite output since the last step
        # a parameter and its gradient at the end of an iteration without a checked step
        self._window: tuple[torch.Tensor, weakref.ref[torch.Tensor]] | None = None

    # -- wiring -----------------------------------------------------------------------------------

    def attach(self, engine: Engine) -> None:
        """Run the session with every ``engine.run(...)``: ``handler.attach(trainer)``.

        Same as ``engine.add_event_handler(Events.STARTED, handler)``.

        Raises:
            TypeError: if *engine* is not an Ignite ``Engine``.
        """
        if not isinstance(engine, Engine):
            msg = f"engine must be an ignite.engine.Engine, got {type(engine).__qualname__}"
            raise TypeError(msg)
        if not engine.has_event_handler(self, Events.STARTED):
            engine.add_event_handler(Events.STARTED, self)

    def track_loss(self, loss_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """Wrap *loss_fn* so the step's check also sees the loss (before ``optimizer.step()``).

        ``create_supervised_trainer(model, optimizer, handler.track_loss(loss_fn))``: the
        training losses computed since the last optimizer step are averaged (gradient
        accumulation) and checked with the gradients, so a loss spike is detected (and acted
        on) before the step. Without it only the gradients are checked before the step;
        ``engine.state.output`` is checked after it for non-finite values only (as
        ``TerminateOnNan``) and recorded as the step's loss, but no loss spike is detected
        from it.

        Raises:
            TypeError: if *loss_fn* is not callable.
        """
        if not callable(loss_fn):
            msg = f"loss_fn must be callable, got {loss_fn!r}"
            raise TypeError(msg)

        def tracked(*args: Any, **kwargs: Any) -> torch.Tensor:
            loss = loss_fn(*args, **kwargs)
            if (
                self._fit.running
                and isinstance(loss, torch.Tensor)
                and loss.requires_grad
                and torch.is_grad_enabled()
            ):
                if self._window_ended():  # before this micro-batch's backward
                    self._drop_window()
                self._loss.add(loss)
            return loss

        return tracked

    def __call__(self, engine: Engine) -> None:
        """The ``Events.STARTED`` handler: open the session and install the step hook.

        Registered twice for the same engine's ``Events.STARTED``, the second call does nothing.

        Raises:
            ValueError: if called for another event than ``Events.STARTED``, or by a second
                engine while the run of the engine it follows goes on (an evaluator).
        """
        if engine.last_event_name != Events.STARTED:
            msg = (
                "EventBusDebugHandler runs from Events.STARTED: use handler.attach(engine) or "
                f"engine.add_event_handler(Events.STARTED, handler), not {engine.last_event_name}"
            )
            raise ValueError(msg)
        if self._engine is not None and self._fit.running:
            if engine is not self._engine:
                msg = (
                    "EventBusDebugHandler was started by a second engine while the run of the "
                    "engine it follows goes on: attach it to the training engine only, not to "
                    "an evaluator (one handler checks one training run)"
                )
                raise ValueError(msg)
            if self._started_at == engine.state.iteration:
                return  # the same Events.STARTED reached it twice: attach + add_event_handler
        if self._engine is not None:
            self._close(RuntimeError("the engine started a new run before the last one ended"))
        self._engine = engine
        self._started_at = engine.state.iteration
        self._loss.take()
        self._samples.take()
        self._pending = None
        self._window = None
        self._fit.open(self.model, self.optimizer)
        self._hook = self.optimizer.register_step_pre_hook(self._before_step)
        # Registered once per engine and left in place (inert between runs): removing a
        # handler while Ignite fires that event would make it skip the next handler.
        for event, handler in self._handlers():
            if not engine.has_event_handler(handler, event):
                engine.add_event_handler(event, handler)

    def _handlers(self) -> tuple[tuple[Events, Callable[..., None]], ...]:
        return (
            (Events.ITERATION_COMPLETED, self._iteration_completed),
            (Events.COMPLETED, self._completed),
            (Events.TERMINATE, self._completed),
            (Events.EXCEPTION_RAISED, self._exception_raised),
        )

    # -- the per-step handlers --------------------------------------------------------------------

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        engine = self._engine
        if engine is None or not self._fit.running:
            return
        self._started_at = None
        if self._window_ended():  # without track_loss: looked at before a skip resets them
            self._drop_window()
        step = max(engine.state.iteration - 1, 0)
        lr = learning_rate(optimizer)
        # the window's earlier iterations (accumulation) and this one's batch
        samples = self._samples.peek(batch_size(engine.state.batch))
        verdict = self._fit.check(step, self._loss.take(mean=True), samples)
        if verdict.should_step and self.max_grad_norm is not None:
            clip_gradients(self.model.parameters(), self.max_grad_norm)
        self._pending = (step, verdict, lr)

    def _iteration_completed(self, engine: Engine) -> None:
        if engine is not self._engine:
            return
        self._started_at = None
        if self._window_ended():  # without track_loss: seen after this iteration's backward
            self._drop_window()
        self._samples.add(batch_size(engine.state.batch))
        pending, self._pending = self._pending, None
        output = self._output_transform(engine.state.output)
        if not _finite(output) and self._bad_output is None:
            self._bad_output = max(engine.state.iteration - 1, 0)
        if pending is None:
            # No optimizer step this iteration: accumulation (wait for the step), or a step
            # that never reached the hook (a GradScaler overflow: scaler.step skips
            # optimizer.step). Which one shows when the gradients are next looked at.
            self._keep_window()
            return
        bad, self._bad_output = self._bad_output, None
        if bad is not None and pending[1].finite:  # not reported by the step's own check
            self._report_output(bad)
        step, verdict, lr = pending
        loss = verdict.loss
        if loss is None and isinstance(output, numbers.Real):
            loss = float(output)
        elif loss is None and isinstance(output, torch.Tensor) and output.numel() == 1:
            loss = float(output.detach())
        self._fit.completed(step, loss=loss, learning_rate=lr, samples=self._samples.take())

    # -- windows that end without a checked step ---------------------------------------------------
    #
    # An iteration without a step that reached the hook leaves its losses (track_loss), samples
    # and non-finite output for the step that closes its window. When the update function ends
    # the window anyway (a GradScaler overflow: scaler.step skips optimizer.step, and the next
    # window starts with zero_grad), they belong to no checked step and must not leak into the
    # next one: a NaN loss of the overflow step would make that healthy step a
    # NonFiniteDetected, and skip it. Within a window backward accumulates into the same
    # gradient tensors; zero_grad (set_to_none, torch's default) drops them. So the gradient
    # object of one parameter, kept at the end of such an iteration (a weak reference, no
    # device sync), tells at the next look whether the window went on.

    def _keep_window(self) -> None:
        """The end of an iteration without a checked step: keep one gradient to compare."""
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                grad = param.grad
                if grad is not None:
                    self._window = (param, weakref.ref(grad))
                    return
        self._window = None
        self._drop_window()  # the update function already set every gradient to None

    def _window_ended(self) -> bool:
        """Whether the gradients were reset since the last :meth:`_keep_window` (once)."""
        window, self._window = self._window, None
        if window is None:
            return False
        param, kept = window
        grad = kept()
        return grad is None or param.grad is not grad

    def _drop_window(self) -> None:
        """Forget the losses and samples of a window that ended without a checked step; its
        non-finite output is reported now."""
        self._loss.take()
        self._samples.take()
        bad, self._bad_output = self._bad_output, None
        if bad is not None:
            self._report_output(bad)

    def _report_output(self, step: int) -> None:
        session = self._fit.session if self._fit.running else None
        if session is not None:
            session.publish(
                NonFiniteDetected(
                    step=step,
                    source=f"{session.name}.ignite",
                    role=TensorRole.OUTPUT,
                    names=(OUTPUT_NAME,),
                )
            )

    def _completed(self, engine: Engine) -> None:
        if engine is self._engine:
            self._close(None)

    def _exception_raised(self, engine: Engine, exc: BaseException) -> None:
        if engine is self._engine:
            self._close(exc)
        # Ignite re-raises only when no EXCEPTION_RAISED handler is registered. Keep that: when
        # ours is the only one, re-raise; otherwise the user's own handlers decide.
        if len(engine._event_handlers.get(Events.EXCEPTION_RAISED, ())) <= 1:
            raise exc

    def _close(self, exc: BaseException | None) -> None:
        self._engine = None
        self._started_at = None
        self._samples.take()
        bad, self._bad_output = self._bad_output, None
        if bad is not None:  # the run ended inside an accumulation window
            self._report_output(bad)
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._pending = None
        self._window = None
        self._fit.close(exc)


def _finite(output: Any) -> bool:
    """``TerminateOnNan``'s test: every number and tensor in *output* is finite.

    Walks what ``TerminateOnNan`` walks (numbers, tensors, and tuples, lists, named tuples and
    mappings of them, nested) and more: numpy arrays and scalars, any tensor layout (sparse,
    nested), each in its own precision. It only reads *output*, never rebuilds its containers
    (``ignite.utils.apply_to_type`` calls ``type(x)(...)``, which fails for a ``defaultdict``
    or a ``range``). What holds nothing to check (``None``: an update function that returns
    nothing; strings; other objects) is left out rather than raised, and a structure that
    cannot be walked (one that contains itself) is not checked: the handler never ends a run
    over an output it cannot read (``TerminateOnNan`` raises ``TypeError`` on ``None`` or a
    numpy array).
    """
    if output is None:
        return True
    try:
        return non_finite_counts(output, name=OUTPUT_NAME, skip_unknown=True).finite
    except ValueError:  # contains itself, or nested deeper than the walk goes
        _log.warning("%s cannot be walked; it is not checked for NaN/Inf", OUTPUT_NAME)
        return True
