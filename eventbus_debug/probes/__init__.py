"""Probes: what training loops await to check gradients, parameters, loss, memory and more."""

from __future__ import annotations

__all__: tuple[str, ...] = ()
