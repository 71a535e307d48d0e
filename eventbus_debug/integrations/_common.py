"""What the framework integrations share: one :class:`SyncSession` per fit, opened and closed
by the framework's hooks, and the step-level plumbing around it."""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Final, final

import torch
from torch import nn

from .._tensors import batch_size
from .._validate import log_dir as check_log_dir
from ..session import SyncSession, Verdict
from ..session._state import read_state, session_state
from ..session.options import DEFAULT_LOG_DIR

__all__ = (
    "DEFAULT_LOG_DIR",
    "FitSession",
    "LossAccumulator",
    "SampleCounter",
    "batch_size",
    "clip_gradients",
    "learning_rate",
    "require",
)

_log = logging.getLogger("eventbus_debug.integrations")

_RESERVED: Final = frozenset({"model", "optimizer", "log_dir"})


def require(module: str, extra: str) -> None:
    """Raise a clear ImportError when *module* (a framework) is not installed.

    Raises:
        ImportError: naming the extra that installs it.
    """
    import importlib.util

    if importlib.util.find_spec(module) is None:
        msg = (
            f"eventbus_debug.integrations.{extra} needs {module!r}: "
            f'pip install "eventbus-debug[{extra}]"'
        )
        raise ImportError(msg)


@final
class LossAccumulator:
    """Sums the detached losses of the micro-batches of one optimizer step (no host sync).

    Frameworks that divide the loss by the accumulation steps before backward (Lightning) make
    the sum the step's mean loss; :meth:`take` with ``mean=True`` averages raw per-batch losses.
    """

    __slots__ = ("_count", "_total")

    def __init__(self) -> None:
        self._total: torch.Tensor | None = None
        self._count = 0

    def add(self, loss: torch.Tensor) -> None:
        """Add one micro-batch's loss (a scalar tensor; detached here)."""
        value = loss.detach()
        if value.numel() != 1:
            value = value.mean()
        value = value.reshape(()).float()
        self._total = value if self._total is None else self._total + value
        self._count += 1

    @property
    def count(self) -> int:
        """How many losses were added since the last :meth:`take`."""
        return self._count

    def take(self, *, mean: bool = False) -> torch.Tensor | None:
        """The sum (or mean) of the losses added since the last call; None when none was."""
        total, count = self._total, self._count
        self._total, self._count = None, 0
        if total is None:
            return None
        return total / count if mean and count > 1 else total


@final
class SampleCounter:
    """Adds up the samples of the micro-batches of one optimizer step.

    A micro-batch whose size is unknown makes the step's count unknown (``None``), rather than
    a count that silently leaves it out.
    """

    __slots__ = ("_known", "_total")

    def __init__(self) -> None:
        self._total = 0
        self._known = True

    def add(self, size: int | None) -> None:
        """Add one micro-batch of *size* samples (``None``: unknown)."""
        if size is None:
            self._known = False
        else:
            self._total += size

    def take(self) -> int | None:
        """The samples added since the last call (``None`` when none was, or one was unknown)."""
        total = self.peek()
        self._total, self._known = 0, True
        return total

    def peek(self, more: int | None = 0) -> int | None:
        """What :meth:`take` would return with *more* samples added, leaving the count as it
        is (``None`` when *more* is)."""
        if more is None or not self._known:
            return None
        total = self._total + more
        return total if total > 0 else None


class FitViews:
    """What a user (or a test) can look at on an integration: its session and its counts.

    Mixed into each framework's callback or handler, which sets ``self._fit``. A copy
    (``copy.deepcopy``, ``pickle``) taken while a run goes on is the object idle: its options
    and counts, no session, and none of the run's references (:attr:`_RUN_SCOPED`) — a
    session's threads, files and event loop cannot be copied, and a copy must not drag the
    framework's trainer or model along.
    """

    _fit: FitSession
    #: Attributes that belong to the run going on: ``None`` in a copy.
    _RUN_SCOPED: ClassVar[tuple[str, ...]] = ()

    def __getstate__(self) -> dict[str, Any]:
        """The state a copy gets: this object's, idle (see the class docstring)."""
        state = dict(vars(self))
        for name in self._RUN_SCOPED:
            if name in state:
                state[name] = None
        if isinstance(state.get("_loss"), LossAccumulator):
            state["_loss"] = LossAccumulator()
        for name, value in state.items():
            if isinstance(value, SampleCounter):
                state[name] = SampleCounter()
        return state

    @property
    def session(self) -> SyncSession | None:
        """The running session (None outside a run)."""
        return self._fit.session

    @property
    def last_verdict(self) -> Verdict | None:
        """The verdict of the last checked step."""
        return self._fit.last_verdict

    @property
    def steps_checked(self) -> int:
        """Optimizer steps checked in the current (or last) run."""
        return self._fit.steps_checked

    @property
    def steps_skipped(self) -> int:
        """Optimizer steps skipped in the current (or last) run."""
        return self._fit.steps_skipped

    def state_dict(self) -> dict[str, Any]:
        """What the detectors learned of the run, to save in a checkpoint (a session's
        :meth:`~eventbus_debug.SyncSession.state_dict`: plain Python values).

        During a run, the running session's; between runs, the state loaded for the next run
        if one was, else the last run's at its end, else an empty state (nothing learned yet).
        """
        return self._fit.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a :meth:`state_dict` saved with a checkpoint: during a run, at once
        (between steps); outside a run, at the start of the next one.

        Raises:
            ValueError: if *state* is not a session's state dict (the message names the field);
                nothing changes then.
        """
        self._fit.load_state_dict(state)


@final
class FitSession:
    """A :class:`SyncSession` whose life follows a framework's fit (open at start, close at end).

    Args:
        framework: the framework's name (the session's default name, and for messages).
        log_dir: the session's log directory (``None``: no log, no report).
        options: the other :class:`SyncSession` keyword arguments.

    Raises:
        TypeError: if *options* is not a mapping of keyword arguments, or names model,
            optimizer or log_dir (those come from the framework or are arguments already).
    """

    def __init__(
        self, framework: str, log_dir: str | Path | None, options: Mapping[str, Any]
    ) -> None:
        if not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options):
            msg = f"session options must be keyword arguments, got {options!r}"
            raise TypeError(msg)
        reserved = sorted(_RESERVED & set(options))
        if reserved:
            msg = (
                f"{', '.join(reserved)} cannot be passed as session options: the {framework} "
                "integration takes the model and optimizer from the framework, and log_dir is "
                "its own argument"
            )
            raise TypeError(msg)
        check_log_dir(log_dir)
        self.framework = framework
        self.log_dir = log_dir
        self.options: dict[str, Any] = dict(options)
        self.session: SyncSession | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.steps_checked = 0
        self.steps_skipped = 0
        self.last_verdict: Verdict | None = None
        self.pending_state: dict[str, Any] | None = None
        """A state loaded while no session ran, handed to the next session at its start."""
        self.last_state: dict[str, Any] | None = None
        """The last session's state, taken when it ended."""

    @property
    def running(self) -> bool:
        """Whether the session is open.

        A session that your code ended during the fit (``callback.session.__exit__(...)``) is
        let go here, with a warning: the fit goes on unchecked, as without the integration,
        rather than failing at its next step.
        """
        session = self.session
        if session is None:
            return False
        try:
            session.bus  # noqa: B018 -- raises RuntimeError once the session has ended
        except RuntimeError:
            self.session = None
            self.optimizer = None
            self.last_state = self._state_of(session)
            _log.warning(
                "the %s debug session was ended during the fit (not by the framework): the "
                "rest of the fit is not checked",
                self.framework,
            )
            return False
        return True

    def __getstate__(self) -> dict[str, Any]:
        """A copy (``copy.deepcopy``, ``pickle``) keeps the options and counts, not the open
        session (its threads, files and event loop cannot be copied) nor the optimizer."""
        state = dict(vars(self))
        state["session"] = None
        state["optimizer"] = None
        return state

    def state_dict(self) -> dict[str, Any]:
        """The running session's ``state_dict()``; outside a run, the state waiting for the
        next session, else the last session's (taken at its end), else an empty state."""
        session = self.session if self.running else None
        if session is not None:
            return session.state_dict()
        if self.pending_state is not None:
            return copy.deepcopy(self.pending_state)
        if self.last_state is not None:
            return copy.deepcopy(self.last_state)
        return session_state(None, None)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load *state* into the running session, or keep it for the next session's start.

        Raises:
            ValueError: if *state* is not a session's state dict (checked at once, also when
                kept for later); nothing changes then.
        """
        session = self.session if self.running else None
        if session is not None:
            session.load_state_dict(state)
            return
        read_state(state)
        self.pending_state = copy.deepcopy(dict(state))

    def _state_of(self, session: SyncSession) -> dict[str, Any] | None:
        """*session*'s state at its end (None, logged, if it cannot be read)."""
        try:
            return session.state_dict()
        except Exception:  # never let the bookkeeping of a resume break the end of a fit
            _log.exception("reading the %s debug session's state failed", self.framework)
            return None

    def open(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        schedulers: Sequence[Any] = (),
        scaler: Any = None,
    ) -> SyncSession:
        """Start the session for *model* / *optimizer*, with the framework's schedulers/scaler.

        A session still open from an earlier fit that ended without telling us (an exception
        the framework has no hook for) is closed first, its end recorded as interrupted.
        ``scheduler=`` / ``scaler=`` given by the user as options win over the framework's.
        A state loaded before (:meth:`load_state_dict`) is handed to the session at its start.
        """
        if self.session is not None:
            self.close(RuntimeError(f"{self.framework} started a new fit before this one ended"))
        options = dict(self.options)
        options.setdefault("name", self.framework)
        if schedulers and "scheduler" not in options:
            options["scheduler"] = list(schedulers)
        if scaler is not None and "scaler" not in options:
            options["scaler"] = scaler
        session = SyncSession(model, optimizer, log_dir=self.log_dir, **options)
        if self.pending_state is not None:
            session.load_state_dict(self.pending_state)  # applied at the start
        session.__enter__()
        self.pending_state = None
        self.session = session
        self.optimizer = optimizer
        self.steps_checked = self.steps_skipped = 0
        self.last_verdict = None
        return session

    def check(
        self, step: int, loss: torch.Tensor | float | None, samples: int | None = None
    ) -> Verdict:
        """The safe point: check the gradients (and *loss*) of *step*, which averaged *samples*
        samples (``None``: unknown); enforce a skip.

        On a skipped step the optimizer's gradients are set to ``None``, so the framework's
        ``optimizer.step()`` leaves the parameters and the optimizer state as they are.

        Raises:
            RuntimeError: if the session is not open.
            TrainingStopped: if recovery decided to stop (the session is closed first).
        """
        session = self.session if self.running else None
        if session is None or self.optimizer is None:
            msg = f"the {self.framework} debug session is not running (the fit has not started)"
            raise RuntimeError(msg)
        try:
            verdict = session.check_step(step, loss=loss, samples=samples)
        except BaseException as exc:
            self.close(exc)
            raise
        self.steps_checked += 1
        self.last_verdict = verdict
        if not verdict.should_step:
            self.optimizer.zero_grad(set_to_none=True)
            self.steps_skipped += 1
        return verdict

    def completed(
        self,
        step: int,
        *,
        loss: float | torch.Tensor | None,
        learning_rate: float | None = None,
        samples: int | None = None,
    ) -> None:
        """Record that *step* finished (a ``StepCompleted``) and hand its events to the bus."""
        if self.running and self.session is not None:
            self.session.step_completed(
                step, loss=loss, learning_rate=learning_rate, samples=samples
            )

    def close(self, exc: BaseException | None = None) -> None:
        """End the session (``SessionEnded`` says why); idempotent."""
        session, self.session = self.session, None
        self.optimizer = None
        if session is None:
            return
        self.last_state = self._state_of(session)
        try:
            session.__exit__(type(exc) if exc is not None else None, exc, None)
        except Exception:  # closing must never mask the framework's own error
            if exc is None:
                raise
            _log.exception("closing the %s debug session failed", self.framework)


def learning_rate(optimizer: torch.optim.Optimizer) -> float | None:
    """The first parameter group's learning rate (None when it is not a number)."""
    lr = optimizer.param_groups[0].get("lr") if optimizer.param_groups else None
    if isinstance(lr, torch.Tensor):
        return float(lr)
    return float(lr) if isinstance(lr, int | float) else None


def clip_gradients(parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip the gradients of *parameters* to *max_norm* exactly as the frameworks do.

    ``torch.nn.utils.clip_grad_norm_`` with its defaults (2-norm, ``foreach=None``,
    ``error_if_nonfinite=False``): the call accelerate makes for Hugging Face ``Trainer``, and
    the one an Ignite update function writes. The probe's norm is not reused: it is summed in
    float64 on the host, torch's total norm in the gradients' dtype, and the ulp between them on
    some steps changes the clipped gradients, and every step after. Returns torch's total norm.
    """
    return torch.nn.utils.clip_grad_norm_(list(parameters), max_norm)
