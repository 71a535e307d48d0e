"""Autograd anomaly mode, captured as an incident, and armed only to replay a failed step."""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from eventbus_debug.diagnostics import get_logger

from .._validate import publisher
from ..events import AutogradAnomalyDetected
from ..typing import Publisher

__all__ = ("AnomalyCapture", "capture_autograd_anomaly", "replay_with_anomaly_detection")

_log = get_logger(__name__)
_FN_NAME = re.compile(r"Function '(\w+)' returned nan")
_ERROR_FN = re.compile(r"Error detected in (\w+)\.")


@dataclass(slots=True)
class AnomalyCapture:
    """Filled in by :func:`capture_autograd_anomaly` when autograd reported an anomaly."""

    event: AutogradAnomalyDetected | None = None
    warnings: list[str] = field(default_factory=list)


@contextmanager
def capture_autograd_anomaly(
    bus: Publisher | None = None,
    *,
    check_nan: bool = True,
    reraise: bool = True,
    step: int | None = None,
    source: str = "autograd",
) -> Iterator[AnomalyCapture]:
    """Run the block under ``torch.autograd.detect_anomaly`` and turn its error into an incident.

    PyTorch reports the forward stack of the failing operation only as a warning; it is
    captured into :attr:`AutogradAnomalyDetected.forward_stack`, with the backward function's
    name (e.g. ``"SqrtBackward0"``). Anomaly mode costs 1.3-1.9x per step (5-6x on models of
    many small layers); prefer :func:`replay_with_anomaly_detection` for one failed step.

    Args:
        bus: where the incident goes (``None``: only into the yielded capture).
        check_nan: also fail on backward functions that return NaN (else only on errors).
        reraise: re-raise the ``RuntimeError`` after publishing (else swallow it; the caller
            reads :attr:`AnomalyCapture.event` and lets recovery decide).
        step: the step stamped on the event.
        source: the ``source`` stamped on the event.

    Raises:
        RuntimeError: autograd's own error, when *reraise*.
    """
    target = publisher("bus", bus)
    capture = AnomalyCapture()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with torch.autograd.detect_anomaly(check_nan=check_nan):
                yield capture
        except RuntimeError as exc:
            capture.warnings = [str(w.message) for w in caught]
            stack = next((s for s in capture.warnings if "Traceback of forward call" in s), "")
            message = str(exc)
            match = _FN_NAME.search(message) or _ERROR_FN.search(stack)
            capture.event = AutogradAnomalyDetected(
                step=step,
                source=source,
                backward_fn=match.group(1) if match else "",
                forward_stack=stack,
                message=message,
            )
            if target is not None:
                target.publish_nowait(capture.event)
            _log.warning("autograd_anomaly", backward_fn=capture.event.backward_fn, step=step)
            if reraise:
                raise


def replay_with_anomaly_detection(
    step_fn: Callable[[], object],
    bus: Publisher | None = None,
    *,
    check_nan: bool = True,
    step: int | None = None,
) -> AutogradAnomalyDetected | None:
    """Re-run one failed step (forward and backward) in anomaly mode; pay its cost once.

    Call it after a step probe reported non-finite gradients, with a function that replays the
    same batch. The replay's error is captured and published, never raised.

    Returns:
        the published incident, or ``None`` when the replay raised nothing.
    """
    with capture_autograd_anomaly(bus, check_nan=check_nan, reraise=False, step=step) as cap:
        step_fn()
    return cap.event
