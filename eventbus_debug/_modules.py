"""The module whose names users know: a ``torch.compile``\\ d model is named as the model.

``torch.compile(model)`` returns an ``OptimizedModule`` that holds the model as ``_orig_mod``:
its parameters and submodules are the model's own objects, named ``_orig_mod.<name>``. The
probes, the localizer and the repairs name what they report after :func:`named_root`, so a
compiled model's incidents, report rows and layer names read ``0.weight``, as the model's own
``state_dict`` and the user's code name them, not ``_orig_mod.0.weight``. Only names change:
the tensors and modules are the same objects, and the model is still called as it was given.
"""

from __future__ import annotations

from torch import nn

__all__ = ("float_parameters", "named_root")


def named_root(model: nn.Module) -> nn.Module:
    """The module to name *model*'s parameters, buffers and submodules after: the model a
    ``torch.compile`` wrapper (``OptimizedModule``, nested too) holds, else *model* itself.

    Recognized without importing ``torch._dynamo`` (which costs seconds): by the class name
    and an ``_orig_mod`` that is a module.
    """
    while type(model).__name__ == "OptimizedModule":
        inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            break
        model = inner
    return model


def float_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """*model*'s floating-point and complex parameters (the ones that hold values to check),
    named after :func:`named_root`; a tied weight once."""
    return [
        (n, p)
        for n, p in named_root(model).named_parameters()  # remove_duplicate: tied weights once
        if p.is_floating_point() or p.is_complex()
    ]
