"""The seeds' session entry points (``create_pytorch_debugger``, ``debug_training_session``,
``debug_training_step``, ``AsyncTrainingLogger``), as thin layers over
:class:`~eventbus_debug.Session`."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..events import TensorRole
from ..session import DebugMode, Session, TrainingStepResult, Verdict
from ..session.options import DEFAULT_LOG_DIR

__all__ = (
    "AsyncTrainingLogger",
    "create_pytorch_debugger",
    "debug_training_session",
    "debug_training_step",
)


def create_pytorch_debugger(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    enable_anomaly_detection: bool = True,
    enable_profiling: bool = False,
    enable_memory_tracking: bool = False,
    enable_gradient_checking: bool = True,
    log_dir: str | os.PathLike[str] | None = DEFAULT_LOG_DIR,
    **options: Any,
) -> Session:
    """Seed 001's factory: a :class:`~eventbus_debug.Session` (not yet started) with the seed's
    switches.

    The ``enable_*`` switches become :class:`~eventbus_debug.DebugMode` values; everything
    else is passed to the session. Start it with ``async with``.
    """
    modes: list[DebugMode] = []
    if enable_anomaly_detection:
        modes.append(DebugMode.ANOMALY_DETECTION)
    if enable_profiling:
        modes.append(DebugMode.PROFILING)
    if enable_memory_tracking:
        modes.append(DebugMode.MEMORY_PROFILING)
    if enable_gradient_checking:
        modes.append(DebugMode.GRADIENT_CHECKING)
    return Session(model, optimizer, mode=modes or DebugMode.NONE, log_dir=log_dir, **options)


def debug_training_session(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None, **options: Any
) -> Session:
    """Seed 001's ``debug_training_session``: ``async with debug_training_session(model) as s``.

    Takes the arguments of :func:`create_pytorch_debugger`.
    """
    return create_pytorch_debugger(model, optimizer, **options)


async def debug_training_step(
    model: nn.Module,
    inputs: Any,
    targets: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    *,
    session: Session | None = None,
    step: int | None = None,
) -> TrainingStepResult:
    """Seed 001's ``debug_training_step``: one fully checked step.

    With *session*, the step runs in it (its probes, sinks and recovery). Without, a
    short-lived session with no log is used: the verdict says what the checks found.

    Raises:
        ValueError: if *session* was built for another model or optimizer.
    """
    if session is not None:
        if session.model is not model or session.optimizer is not optimizer:
            msg = "session was built for another model/optimizer; pass the session's own"
            raise ValueError(msg)
        return await session.training_step(inputs, targets, loss_fn, step=step)
    async with Session(model, optimizer, log_dir=None, alerts=False, report=False) as s:
        return await s.training_step(inputs, targets, loss_fn, step=step)


class AsyncTrainingLogger:
    """Seed 002's ``AsyncTrainingLogger`` calls over a running :class:`~eventbus_debug.Session`.

    Each ``*_async`` method is the session's own call under the seed's name:
    ``check_tensor_anomalies_async`` is :meth:`Session.check_tensor`,
    ``check_gradient_anomalies_async`` is :meth:`Session.check_step`, and
    ``update_progress_async`` is :meth:`Session.step_completed`.

    Raises:
        TypeError: if *session* is not a :class:`~eventbus_debug.Session`.
    """

    __slots__ = ("session",)

    def __init__(self, session: Session) -> None:
        if not isinstance(session, Session):
            msg = f"session must be an eventbus_debug.Session, got {session!r}"
            raise TypeError(msg)
        self.session = session

    async def check_tensor_anomalies_async(
        self, tensor: object, name: str, *, role: TensorRole = TensorRole.ACTIVATION
    ) -> bool:
        """True when every value of *tensor* is finite (see :meth:`Session.check_tensor`)."""
        return await self.session.check_tensor(tensor, name, role=role)

    async def check_gradient_anomalies_async(self, step: int | None = None) -> Verdict:
        """Check the model's gradients now: the session's safe point at *step* (or the next)."""
        return await self.session.check_step(self.session.next_step(step))

    async def update_progress_async(
        self,
        *,
        step: int,
        loss: float | torch.Tensor | None = None,
        learning_rate: float | None = None,
        epoch: int | None = None,
    ) -> None:
        """Record the step (*epoch* is accepted for compatibility; steps are numbered globally)."""
        del epoch
        await self.session.step_completed(step, loss=loss, learning_rate=learning_rate)
