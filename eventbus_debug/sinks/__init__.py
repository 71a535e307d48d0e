"""Built-in subscribers, written only against eventbus_debug's public API.

Each module owns its ``__all__``; this package re-exports them. The exporters to TensorBoard
and W&B (optional extras) are exported lazily: importing :mod:`sinks` imports neither
tensorboard nor wandb; ``sinks.TensorBoardSink`` imports its module on first access.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import alerts as _alerts, console as _console, report as _report, rotating_file as _rf
from .alerts import *  # noqa: F403
from .console import *  # noqa: F403
from .report import *  # noqa: F403
from .rotating_file import *  # noqa: F403

if TYPE_CHECKING:
    from .tensorboard import TensorBoardSink as TensorBoardSink
    from .wandb import WandbSink as WandbSink

_LAZY = {"TensorBoardSink": ".tensorboard", "WandbSink": ".wandb"}

__all__ = (
    *_rf.__all__,
    *_console.__all__,
    *_alerts.__all__,
    *_report.__all__,
    "TensorBoardSink",
    "WandbSink",
)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        msg = f"module {__name__!r} has no attribute {name!r}"
        raise AttributeError(msg)
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value
