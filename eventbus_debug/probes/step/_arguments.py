"""What the step probe takes from its caller: the loss as a number, the optimizer's learning
rate, and the errors for a loss it cannot check."""

from __future__ import annotations

from typing import Final

import numpy as np
import torch

from ..._validate import real_number

__all__ = ("loss_value", "optimizer_lr", "refuse_tensor")

_STRIDED: Final = torch.strided


def optimizer_lr(optimizer: torch.optim.Optimizer) -> float | None:
    """The largest learning rate of *optimizer*'s parameter groups (``None``: none readable).

    An LR held in a tensor is read only on the CPU (a device tensor would synchronize)."""
    groups = optimizer.param_groups
    if len(groups) == 1:
        lr = groups[0].get("lr")
        if lr.__class__ is float:
            return lr  # the usual case, on every check
    best: float | None = None
    for group in groups:
        lr = group.get("lr")
        if isinstance(lr, torch.Tensor):
            if lr.device.type != "cpu" or lr.numel() != 1:
                continue
            lr = lr.item()
        if isinstance(lr, (int, float)) and not isinstance(lr, bool):
            value = float(lr)
            if best is None or value > best:
                best = value
    return best


def loss_value(loss: object) -> float | None:
    """*loss*, a number that is not a float (an int, ``numpy.float32(0.5)``, a 0-d NumPy
    array, a ``Fraction``), as a float; None as None.

    Raises:
        TypeError: if *loss* is not a real number (a bool, a complex, a string, a list...).
        ValueError: if *loss* is too large for a float (``10**400``).
    """
    if loss is None:
        return None
    if isinstance(loss, np.ndarray) and loss.shape == ():
        loss = loss[()]  # a 0-d array (np.mean of a batch's losses) as its NumPy scalar
    return real_number("loss", loss, expected="a one-element tensor or a number")


def refuse_tensor(loss: torch.Tensor) -> None:
    """Raise the error for a loss tensor that is not dense or not of one element."""
    if loss.layout is not _STRIDED:
        msg = (
            f"loss must be a dense tensor, got a {loss.layout} one; pass loss.to_dense() "
            "(a loss is a one-element real tensor)"
        )
        raise TypeError(msg)
    msg = (
        f"loss must be a scalar tensor (one element), got shape {tuple(loss.shape)}; "
        "reduce it first, e.g. loss.mean()"
    )
    raise ValueError(msg)
