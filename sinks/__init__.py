"""Built-in subscribers, written only against eventbus_debug's public API.

Each module owns its ``__all__``; this package re-exports them.
"""

from __future__ import annotations

from . import alerts as _alerts, console as _console, report as _report, rotating_file as _rf
from .alerts import *  # noqa: F403
from .console import *  # noqa: F403
from .report import *  # noqa: F403
from .rotating_file import *  # noqa: F403

__all__ = (*_rf.__all__, *_console.__all__, *_alerts.__all__, *_report.__all__)
