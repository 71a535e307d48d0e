"""Where a state snapshot's copies live: the device's memory, the host's, or nowhere.

A snapshot is one copy of the parameters, buffers and optimizer state: 16 bytes a parameter for
fp32 AdamW. Kept beside the model on an accelerator it takes the memory training needs (a model
that fills half of its GPU would run out of memory at the first capture, under the default
policy). So the ``"auto"`` location keeps it on the device only while it is small there, moves
it to host memory otherwise, and keeps none when the host cannot hold it either: a debugger must
never make a healthy run fail for a copy it may never use. The choice is a pure function of the
byte counts and the memory figures, so it is tested without an accelerator.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Final, Literal, cast, final, get_args

import torch

from ..._memory import DEVICE_SHARE, device_total, host_available, local_processes, nbytes

__all__ = (
    "DEVICE_SHARE",
    "HOST_SHARE",
    "LOCATIONS",
    "Location",
    "Placement",
    "choose",
    "device_total",
    "host_available",
    "local_processes",
    "location_of",
    "plain",
    "sizes",
)

Location = Literal["auto", "device", "host"]
LOCATIONS: Final[tuple[str, ...]] = get_args(Location)

HOST_SHARE: Final = 0.5
"""The largest share of the host's available memory the snapshots of this machine's training
processes may take together (auto and host): each process gets its part."""


@final
@dataclass(frozen=True, slots=True)
class Placement:
    """Where a snapshot's copies live, and why.

    Attributes:
        where: ``"device"`` (beside the live tensors), ``"host"`` (CPU memory; pinned for
            accelerator tensors; where a CPU model's copy always is) or ``"none"`` (no snapshot:
            it would not fit).
        nbytes: the bytes one snapshot takes.
        reason: the figures behind the choice, in words.
    """

    where: Literal["device", "host", "none"]
    nbytes: int
    reason: str


def location_of(value: object) -> Location:
    """*value* as a snapshot location.

    Raises:
        TypeError: if *value* is not a str.
        ValueError: if it is not one of ``"auto"``, ``"device"``, ``"host"``.
    """
    if not isinstance(value, str):
        msg = f"location must be one of {', '.join(map(repr, LOCATIONS))}, got {value!r}"
        raise TypeError(msg)
    if value in LOCATIONS:
        return cast(Location, value)
    msg = f"location must be one of {', '.join(map(repr, LOCATIONS))}, got {value!r}"
    raise ValueError(msg)


def plain(t: torch.Tensor) -> bool:
    """Whether *t* is a plain tensor (a copy of it can move to the host); a tensor subclass
    (an FSDP2 DTensor shard) is copied where it is."""
    return t.__class__ is torch.Tensor


def sizes(tensors: Iterable[torch.Tensor]) -> tuple[dict[torch.device, int], int]:
    """The bytes a copy of *tensors* takes on each device that holds them, and the part of
    them that cannot move to the host (tensor subclasses, counted at their local shard)."""
    by_device: dict[torch.device, int] = {}
    pinned_to_device = 0
    for t in tensors:
        n = nbytes(t)
        by_device[t.device] = by_device.get(t.device, 0) + n
        if not plain(t):
            pinned_to_device += n
    return by_device, pinned_to_device


def choose(
    location: Location,
    by_device: Mapping[torch.device, int],
    *,
    stuck: int = 0,
    host: Callable[[], int] | None = None,
    total: Callable[[torch.device], int | None] | None = None,
    processes: Callable[[], int] | None = None,
) -> Placement:
    """Where a snapshot of ``by_device`` bytes (per device of the live tensors) goes.

    ``"device"``: beside the live tensors, always. ``"host"``: in host memory when this
    process's share of it holds the copy (``HOST_SHARE`` of the available memory over the
    machine's training processes), else none. ``"auto"``: beside the live tensors when they
    are all on the host (CPU training: within the same host share) or when the copy takes at
    most ``DEVICE_SHARE`` of each accelerator's total memory; otherwise as ``"host"``. The
    *stuck* bytes (tensor subclasses) stay on their device whatever the choice. *host*,
    *total* and *processes* read the memory figures (default: :func:`host_available`,
    :func:`device_total`, :func:`local_processes`).
    """
    host = host if host is not None else host_available
    total = total if total is not None else device_total
    processes = processes if processes is not None else local_processes
    nbytes = sum(by_device.values())
    accelerators = {d: n for d, n in by_device.items() if d.type not in ("cpu", "meta")}
    if location == "device":
        return Placement("device" if accelerators else "host", nbytes, "location='device'")
    if location == "auto" and accelerators:
        over = []
        for device, n in accelerators.items():
            capacity = total(device)
            if capacity is None or n > DEVICE_SHARE * capacity:
                shown = "unknown" if capacity is None else _size(capacity)
                over.append(f"{_size(n)} of {device}'s {shown}")
        if not over:
            return Placement(
                "device", nbytes, f"{_size(nbytes)}: within {DEVICE_SHARE:.0%} of device memory"
            )
        why = f"over {DEVICE_SHARE:.0%} of device memory ({'; '.join(over)})"
    else:
        why = f"location={location!r}" if location == "host" else "CPU tensors"
    to_host = nbytes - stuck
    local = processes()
    share = HOST_SHARE * host() / local
    if to_host > share:
        return Placement(
            "none",
            nbytes,
            f"{why}; the host cannot hold it either: {_size(to_host)} > {_size(share)} "
            f"({HOST_SHARE:.0%} of the available host memory over {local} "
            "local process(es))",
        )
    return Placement("host", nbytes, f"{why}; {_size(to_host)} in host memory")


def _size(n: float) -> str:
    """*n* bytes in words: ``512 B``, ``1.5 KiB`` ... ``20.3 GiB``."""
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
