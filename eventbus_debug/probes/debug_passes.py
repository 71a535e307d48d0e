"""Debug passes (the seeds' vocabulary): one forward pass reported layer by layer, one backward
pass's gradient norms."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .._modules import named_root
from ._flags import float_tensors, made_here, nonfinite_flags

__all__ = (
    "BackwardReport",
    "ForwardReport",
    "LayerRecord",
    "debug_backward_pass",
    "debug_forward_pass",
)


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerRecord:
    """One module's output in a debugged forward pass.

    Attributes:
        module: the qualified module name (``""`` for the root).
        type: the module's class name.
        shapes: the shapes of its floating-point outputs.
        mean, std, min, max: statistics over its (first) output's finite values.
        nan_count, inf_count: non-finite elements over all its outputs.
        duration_s: host time from the module's start to its end (on GPU: launch time only).
        inputs_finite: False when its (positional) inputs held NaN or Inf.
    """

    module: str
    type: str
    shapes: tuple[tuple[int, ...], ...]
    mean: float
    std: float
    min: float
    max: float
    nan_count: int
    inf_count: int
    duration_s: float
    inputs_finite: bool = True


@dataclass(frozen=True, slots=True, kw_only=True)
class ForwardReport:
    """What :func:`debug_forward_pass` saw, layer by layer, in completion order.

    Attributes:
        layers: every module's record, in completion order.
        duration_s: host time of the whole forward pass.
        first_non_finite: the module where a NaN/Inf was made: the first (in completion order)
            whose inputs were finite and whose output is not — a parent whose own code made it
            is named, not the child that passed it on; ``None`` when everything was finite.
    """

    layers: tuple[LayerRecord, ...]
    duration_s: float
    first_non_finite: str | None

    @property
    def finite(self) -> bool:
        """True when no layer produced NaN or Inf."""
        return self.first_non_finite is None


def debug_forward_pass(
    model: nn.Module, inputs: object, *, layer_hooks: bool = True
) -> tuple[Any, ForwardReport]:
    r"""Run ``model(inputs)`` once and report per-layer shapes, statistics and timing.

    Every statistic stays on the device until the end; one transfer moves them all. A
    ``torch.compile``\ d model runs eager here (the model it wraps), so that every layer's hooks
    run and the layers are named as in the model.

    Args:
        model: the module to run.
        inputs: a tensor, or a tuple/list of positional arguments.
        layer_hooks: record every submodule (else only the whole model).

    Returns:
        the model's output and the :class:`ForwardReport`.

    Raises:
        TypeError: if *model* is not an ``nn.Module``.
    """
    if not isinstance(model, nn.Module):
        msg = f"model must be a torch.nn.Module, got {type(model).__qualname__}"
        raise TypeError(msg)
    starts: dict[int, float] = {}
    in_flags: dict[int, torch.Tensor] = {}
    rows: list[tuple[str, str, tuple[tuple[int, ...], ...], torch.Tensor, float]] = []

    def pre(name: str) -> Callable[[nn.Module, object], None]:
        def hook(module: nn.Module, args: object) -> None:
            with torch.no_grad():
                in_flags[id(module)] = nonfinite_flags(float_tensors(args))
            starts[id(module)] = time.perf_counter()

        return hook

    def post(name: str) -> Callable[[nn.Module, object, object], None]:
        def hook(module: nn.Module, args: object, output: object) -> None:
            outs = [o for o in float_tensors(output) if not o.is_complex()]
            if not outs:
                return
            elapsed = time.perf_counter() - starts.pop(id(module), time.perf_counter())
            with torch.no_grad():
                o = outs[0].detach().float()
                fin = o[torch.isfinite(o)]
                nan = sum(x.isnan().sum() for x in outs)
                inf = sum(x.isinf().sum() for x in outs)
                if fin.numel():
                    std = fin.std() if fin.numel() > 1 else torch.zeros((), device=o.device)
                    stats = torch.stack([fin.mean(), std, fin.min(), fin.max()])
                else:
                    stats = torch.full((4,), float("nan"), device=o.device)
                flags = in_flags.pop(id(module), torch.zeros(2, dtype=torch.uint8))
                row = torch.cat(
                    [
                        stats,
                        torch.stack([torch.as_tensor(nan), torch.as_tensor(inf)]).to(stats),
                        flags.to(stats),
                    ]
                )
            rows.append(
                (name, type(module).__name__, tuple(tuple(x.shape) for x in outs), row, elapsed)
            )

        return hook

    model = named_root(model)  # a compiled model runs eager here: every layer's hooks fire
    modules = list(model.named_modules()) if layer_hooks else [("", model)]
    handles = []
    for name, module in modules:
        handles.append(module.register_forward_pre_hook(pre(name)))
        handles.append(module.register_forward_hook(post(name)))
    args = inputs if isinstance(inputs, tuple | list) else (inputs,)
    start = time.perf_counter()
    try:
        with torch.compiler.set_stance("force_eager"):  # a model compiled in place too
            output = model(*args)
    finally:
        for h in handles:
            h.remove()
    duration = time.perf_counter() - start
    values = torch.stack([r[3].cpu() for r in rows]).tolist() if rows else []
    layers = tuple(
        LayerRecord(
            module=name,
            type=type_name,
            shapes=shapes,
            mean=v[0],
            std=v[1],
            min=v[2],
            max=v[3],
            nan_count=int(v[4]),
            inf_count=int(v[5]),
            duration_s=elapsed,
            inputs_finite=not v[7],
        )
        for (name, type_name, shapes, _, elapsed), v in zip(rows, values, strict=True)
    )
    made = [
        r
        for r, v in zip(layers, values, strict=True)
        if made_here([int(v[6]), int(v[7]), int(v[4] > 0), int(v[4] + v[5] > 0)])
    ]
    bad = [r for r in layers if r.nan_count or r.inf_count]
    first = made[0] if made else bad[0] if bad else None
    return output, ForwardReport(
        layers=layers,
        duration_s=duration,
        first_non_finite=first.module if first is not None else None,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class BackwardReport:
    """What :func:`debug_backward_pass` saw.

    Attributes:
        duration_s: host time of ``loss.backward()``.
        grad_norms: per-parameter gradient 2-norm (when a model was given).
        non_finite: the parameters whose gradient holds NaN or Inf.
        total_norm: the total gradient 2-norm.
    """

    duration_s: float
    grad_norms: dict[str, float]
    non_finite: tuple[str, ...]
    total_norm: float | None


def debug_backward_pass(
    loss: torch.Tensor, model: nn.Module | None = None, *, retain_graph: bool = False
) -> BackwardReport:
    """Run ``loss.backward()`` and report its duration and the resulting gradient norms.

    Raises:
        TypeError: if *loss* is not a tensor.
        ValueError: if *loss* has more than one element or does not require grad.
    """
    if not isinstance(loss, torch.Tensor):
        msg = f"loss must be a tensor, got {type(loss).__qualname__}"
        raise TypeError(msg)
    if loss.numel() != 1 or not loss.requires_grad:
        msg = f"loss must be a one-element tensor that requires grad, got shape {tuple(loss.shape)} requires_grad={loss.requires_grad}"
        raise ValueError(msg)
    start = time.perf_counter()
    loss.backward(retain_graph=retain_graph)  # type: ignore[no-untyped-call]
    duration = time.perf_counter() - start
    if model is None:
        return BackwardReport(duration_s=duration, grad_norms={}, non_finite=(), total_norm=None)
    named = [(n, p.grad) for n, p in named_root(model).named_parameters() if p.grad is not None]
    if not named:
        return BackwardReport(duration_s=duration, grad_norms={}, non_finite=(), total_norm=0.0)
    grads = [g.coalesce().values() if g.is_sparse else g for _, g in named]
    # float64: a finite float32 gradient whose float32 norm would overflow is still finite
    norms = torch.stack(
        [n.cpu() for n in torch._foreach_norm(grads, 2, dtype=torch.float64)]
    ).tolist()
    by_name = {n: v for (n, _), v in zip(named, norms, strict=True)}
    total = sum(v * v for v in norms) ** 0.5
    bad = tuple(n for n, v in by_name.items() if v != v or v in (float("inf"), -float("inf")))
    return BackwardReport(duration_s=duration, grad_norms=by_name, non_finite=bad, total_norm=total)
