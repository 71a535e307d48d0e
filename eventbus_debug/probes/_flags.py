"""On-device NaN/Inf flags of what a module call takes and returns, for the localizer and the
debug passes: the flags stay on the device until one transfer reads them all."""

from __future__ import annotations

import torch

from .finite import stored_values

__all__ = ("float_tensors", "made_here", "nonfinite_flags", "tensors_in")


def tensors_in(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, tuple | list):
        return [t for v in value for t in tensors_in(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_in(v)]
    return []


def float_tensors(value: object) -> list[torch.Tensor]:
    return [
        t for t in tensors_in(value) if (t.is_floating_point() or t.is_complex()) and not t.is_meta
    ]


def nonfinite_flags(
    tensors: list[torch.Tensor], device: torch.device | None = None
) -> torch.Tensor:
    """``[any NaN, any NaN or Inf]`` over *tensors*, as a uint8 pair on their device."""
    parts: list[torch.Tensor] = []
    for t in tensors:
        try:
            v = stored_values(t)
        except (TypeError, ValueError):
            continue
        if v.numel() == 0:
            continue
        parts.append(torch.stack([torch.isnan(v).any(), (~torch.isfinite(v)).any()]))
    if not parts:
        return torch.zeros(2, dtype=torch.uint8, device=device)
    home = parts[0].device
    return torch.stack([p.to(home) for p in parts]).any(dim=0).to(torch.uint8)


def made_here(flags: list[int]) -> bool:
    """A call made the NaN/Inf of its output: no NaN came in for a NaN out; nothing for an Inf.

    An input holding ``-inf`` (an additive attention mask) does not excuse a NaN output: the
    module turned it into NaN (a softmax over a fully masked row).
    """
    in_nan, in_bad, out_nan, out_bad = flags
    if not out_bad:
        return False
    return not in_nan if out_nan else not in_bad
