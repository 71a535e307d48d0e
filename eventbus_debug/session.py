"""The session: one object wiring the bus, probes, sinks, sampler and recovery together."""

from __future__ import annotations

__all__: tuple[str, ...] = ()
