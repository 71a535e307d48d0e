"""Diffusion-model debugging: component analysis and per-denoising-step latent checks.

A *pipeline* is anything that holds modules: a Mapping of names to modules, an object whose
attributes are modules (a ``diffusers`` pipeline's ``unet``, ``vae``, ``text_encoder``...), or a
single module (its children are the components).

Example::

    analysis = analyze_pipeline({"unet": unet, "text_encoder": encoder})
    monitor = LatentMonitor(max_norm_ratio=4.0)
    for i, t in enumerate(timesteps):
        latents = scheduler_step(unet(latents, t), t, latents)
        await monitor.check(latents, denoising_step=i, timestep=int(t), publish=bus.publish_nowait)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import anyio.lowlevel
import torch
from torch import nn

from .._validate import positive_number
from ..events import (
    ComponentInfo,
    Event,
    LatentAnomalyDetected,
    LatentChecked,
    PipelineAnalyzed,
    Severity,
)

__all__ = ("LatentMonitor", "analyze_pipeline")

Publish = Callable[[Event], object]


def _components(pipeline: object) -> dict[str, nn.Module]:
    if isinstance(pipeline, Mapping):
        items = {str(k): v for k, v in pipeline.items() if isinstance(v, nn.Module)}
    elif isinstance(pipeline, nn.Module):
        items = dict(pipeline.named_children()) or {type(pipeline).__name__: pipeline}
    else:
        attrs: dict[str, object] = {}
        for cls in type(pipeline).__mro__:
            attrs.update({k: getattr(pipeline, k, None) for k in getattr(cls, "__slots__", ())})
        attrs.update(getattr(pipeline, "__dict__", {}))
        items = {
            k: v for k, v in attrs.items() if isinstance(v, nn.Module) and not k.startswith("_")
        }
    if not items:
        msg = (
            f"pipeline must be a module, a mapping of names to modules, or an object with module "
            f"attributes; {type(pipeline).__name__} holds no nn.Module"
        )
        raise TypeError(msg)
    return items


def analyze_pipeline(pipeline: object, *, step: int | None = None) -> PipelineAnalyzed:
    """Describe each component of *pipeline*: parameter counts, dtypes, devices, memory.

    Publish the returned event to record it (``bus.publish_nowait(analyze_pipeline(p))``).

    Raises:
        TypeError: if *pipeline* holds no ``nn.Module``.
    """
    components = _components(pipeline)
    infos: list[ComponentInfo] = []
    seen: set[int] = set()
    total = 0
    for name, module in components.items():
        params = list(module.parameters())
        count = sum(p.numel() for p in params)
        for p in params:
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
        size = sum(p.numel() * p.element_size() for p in params) + sum(
            b.numel() * b.element_size() for b in module.buffers()
        )
        infos.append(
            ComponentInfo(
                name=name,
                module_type=type(module).__name__,
                parameters=count,
                trainable=sum(p.numel() for p in params if p.requires_grad),
                size_bytes=size,
                dtypes=tuple(sorted({str(p.dtype).removeprefix("torch.") for p in params})),
                devices=tuple(sorted({str(p.device) for p in params})),
                training=module.training,
            )
        )
    all_dtypes = {d for i in infos for d in i.dtypes}
    all_devices = {d for i in infos for d in i.devices}
    return PipelineAnalyzed(
        step=step,
        source="diffusion",
        components=tuple(infos),
        total_parameters=total,
        mixed_dtypes=len(all_dtypes) > 1,
        mixed_devices=len(all_devices) > 1,
    )


@dataclass(slots=True)
class _Window:
    previous_norm: float | None = None
    first_norm: float | None = None
    history: list[float] = field(default_factory=list)


class LatentMonitor:
    """Checks each denoising step's latents: non-finite values and norm drift.

    Norm drift compares each step's RMS with the previous step's: a ratio above
    *max_norm_ratio* (or below its inverse) is an incident. Call :meth:`reset` between samples.

    Args:
        max_norm_ratio: the largest step-to-step change of the RMS that is normal (> 1).
        max_norm: an absolute ceiling on the RMS (``None``: none).
    """

    def __init__(self, *, max_norm_ratio: float = 4.0, max_norm: float | None = None) -> None:
        if not max_norm_ratio > 1.0:
            msg = f"max_norm_ratio must be > 1, got {max_norm_ratio!r}"
            raise ValueError(msg)
        self.max_norm_ratio = max_norm_ratio
        self.max_norm = None if max_norm is None else positive_number("max_norm", max_norm)
        self._w = _Window()

    @property
    def norms(self) -> tuple[float, ...]:
        """The RMS of every step checked since the last :meth:`reset`."""
        return tuple(self._w.history)

    def reset(self) -> None:
        """Forget the previous steps (call it before sampling a new image)."""
        self._w = _Window()

    def check_sync(
        self,
        latents: torch.Tensor,
        *,
        denoising_step: int,
        timestep: int | None = None,
        publish: Publish | None = None,
        step: int | None = None,
    ) -> tuple[Event, ...]:
        """Check *latents* (one device-to-host transfer); publish the telemetry and any incident.

        Returns:
            The :class:`LatentChecked` event followed by any :class:`LatentAnomalyDetected`.
        """
        x = latents.detach().float()
        finite = torch.isfinite(x)
        safe = torch.where(finite, x, torch.zeros_like(x))
        n = max(1, x.numel())
        stats = torch.stack(
            [
                (~finite).sum().float(),
                torch.linalg.vector_norm(safe) / math.sqrt(n),
                safe.mean(),
                safe.std() if n > 1 else torch.zeros((), device=x.device),
            ]
        ).tolist()
        bad, norm, mean, std = int(stats[0]), stats[1], stats[2], stats[3]
        prev = self._w.previous_norm
        ratio = norm / prev if prev is not None and prev > 0 else None
        out: list[Event] = [
            LatentChecked(
                step=step,
                source="latent_monitor",
                denoising_step=denoising_step,
                timestep=timestep,
                norm=norm,
                mean=mean,
                std=std,
                finite=bad == 0,
                norm_ratio=ratio,
            )
        ]
        incident = functools.partial(
            LatentAnomalyDetected,
            step=step,
            source="latent_monitor",
            denoising_step=denoising_step,
            timestep=timestep,
            norm=norm,
            reference_norm=prev,
        )
        if bad:
            out.append(
                incident(
                    severity=Severity.ERROR,
                    rule="non_finite",
                    message=f"latents at denoising step {denoising_step} hold {bad} NaN/Inf values",
                    nonfinite_count=bad,
                )
            )
        else:
            drift = ratio is not None and (
                ratio > self.max_norm_ratio or ratio < 1.0 / self.max_norm_ratio
            )
            ceiling = self.max_norm is not None and norm > self.max_norm
            if drift or ceiling:
                reason = (
                    f"latent RMS changed {ratio:.3g}x in one step (limit {self.max_norm_ratio:g}x)"
                    if drift and ratio is not None
                    else f"latent RMS {norm:.3g} exceeds {self.max_norm:g}"
                )
                out.append(
                    incident(
                        rule="norm_drift", message=f"denoising step {denoising_step}: {reason}"
                    )
                )
            self._w.previous_norm = norm
            if self._w.first_norm is None:
                self._w.first_norm = norm
        self._w.history.append(norm)
        if publish is not None:
            for ev in out:
                publish(ev)
        return tuple(out)

    async def check(
        self,
        latents: torch.Tensor,
        *,
        denoising_step: int,
        timestep: int | None = None,
        publish: Publish | None = None,
        step: int | None = None,
    ) -> tuple[Event, ...]:
        """:meth:`check_sync`, then a checkpoint so subscribers run (async sampling loops)."""
        events = self.check_sync(
            latents, denoising_step=denoising_step, timestep=timestep, publish=publish, step=step
        )
        await anyio.lowlevel.checkpoint()
        return events
