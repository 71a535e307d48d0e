"""The step probe: loss, gradient, parameter, update and activation checks after ``backward()``.

:class:`StepProbe` (``probe.py``) validates, schedules, offloads and reads; ``_launch.py`` puts
every number of a step in one device vector; ``_judge.py`` turns that vector into a
:class:`StepVerdict` and its events; ``_spikes.py`` and ``_explosions.py`` hold the loss-spike
and explosion detectors, ``_windows.py`` the robust windows they share; ``activations.py`` the EXTREME-level forward hooks.
"""

from __future__ import annotations

from .probe import StepProbe
from .verdict import StepVerdict

__all__: tuple[str, ...] = ("StepProbe", "StepVerdict")
