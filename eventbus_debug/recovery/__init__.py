"""Recovery: turn incidents into typed decisions, applied by the loop at safe points."""

from __future__ import annotations

__all__: tuple[str, ...] = ()
