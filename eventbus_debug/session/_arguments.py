"""The arguments of the step entries (``check_step``, ``step_completed``, ``training_step``):
checked and converted, with the error a wrong one gets."""

from __future__ import annotations

from typing import Any

import torch

from .._validate import real_number, sample_count
from ..exceptions import ArgumentTypeError
from ..probes import StepProbe
from ..probes.step._arguments import loss_value

__all__ = ("checked_loss", "completed_values", "loss_argument", "sample_count")


def completed_values(
    step: object, loss: object, learning_rate: object, samples: object
) -> tuple[float | None, float | None, int | None]:
    """``step_completed``'s values, checked: the loss and the learning rate as floats (or None),
    *samples* as an int (or None). NaN and Infinity are facts worth logging: kept (the log
    writes them as ``"NaN"``/``"Infinity"``).

    Raises:
        TypeError: if *step* is not an int, *loss* not a dense one-element real tensor or a
            real number (``check_step``'s rule; a numpy real scalar is one), *learning_rate*
            not a real number or a one-element tensor, or *samples* not an int.
        ValueError: if *step* or *samples* is negative, *loss* a tensor of several elements or
            a meta tensor, *learning_rate* negative, or *loss* / *learning_rate* a number too
            large for a float (``10**400``).
    """
    loss = StepProbe._validate(step, loss)  # check_step's rules for the step and the loss
    if isinstance(loss, torch.Tensor):
        loss = float(loss.detach())
    lr: float | None = None
    if learning_rate is not None:
        lr = _number("learning_rate", learning_rate)
        if lr < 0:
            msg = f"learning_rate must be >= 0, got {learning_rate!r}"
            raise ValueError(msg)
    return (
        None if loss is None else float(loss),
        lr,
        None if samples is None else sample_count(samples),
    )


def loss_argument(loss: object) -> Any:
    """*loss* (not a float, not None) for the probe: a tensor as it is (the probe checks it),
    another real number (``numpy.float32(0.5)``, an int) as a float.

    Raises:
        TypeError: if *loss* is neither a tensor nor a real number (a bool, a complex, a str).
        ValueError: if *loss* is a number too large for a float (``10**400``).
    """
    if isinstance(loss, torch.Tensor):
        return loss
    return loss_value(loss)


def _number(name: str, value: object) -> float:
    """*value* (a real number or a dense one-element real tensor) as a float."""
    if isinstance(value, torch.Tensor):
        if value.is_complex() or value.dtype is torch.bool:
            # as a complex or bool number is: the wrong type (also a ValueError, as before)
            msg = (
                f"{name} must be a real number or a one-element real tensor, got a "
                f"{value.dtype} tensor"
            )
            raise ArgumentTypeError(msg)
        if value.numel() != 1 or value.layout is not torch.strided or value.is_meta:
            msg = (
                f"{name} must be a number or a one-element real tensor (dense), got shape "
                f"{tuple(value.shape)} {value.dtype} {value.layout}"
            )
            raise ValueError(msg)
        return float(value.detach())
    return real_number(name, value)


def checked_loss(loss: object, loss_fn: object) -> torch.Tensor:
    """What *loss_fn* returned, if it is a loss ``backward`` can start from.

    Raises:
        TypeError: if it is not a tensor.
        ValueError: if it has several elements or does not require grad.
    """
    if loss.__class__ is not torch.Tensor and not isinstance(loss, torch.Tensor):
        msg = (
            f"loss_fn {_name(loss_fn)} must return the loss as a tensor, got "
            f"{type(loss).__qualname__} {loss!r}"
        )
        raise TypeError(msg)
    if loss.numel() != 1:
        msg = (
            f"loss_fn {_name(loss_fn)} must return a scalar loss (one element), got shape "
            f"{tuple(loss.shape)}; reduce it, e.g. with reduction='mean' or .mean()"
        )
        raise ValueError(msg)
    if not loss.requires_grad:
        msg = (
            f"loss_fn {_name(loss_fn)} returned a loss that does not require grad (computed "
            "under torch.no_grad(), detached, or not from the model's outputs?)"
        )
        raise ValueError(msg)
    return loss


def _name(fn: object) -> str:
    return repr(getattr(fn, "__qualname__", None) or type(fn).__qualname__)
