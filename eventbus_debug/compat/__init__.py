"""The seed documents' names, kept importable for code written against them.

Nothing here is re-exported from :mod:`eventbus_debug`: new code uses the library's own API
(``docs/seed-mapping.md`` maps every seed name to ours). Each name is a thin layer over the
public API: the one-call checks (:mod:`.checks`) over :class:`~eventbus_debug.StepProbe`, the
error handler (:mod:`.recovery`) over :class:`~eventbus_debug.Retrying`, the factories
(:mod:`.session`) over :class:`~eventbus_debug.Session`.
"""

from __future__ import annotations

from .checks import (
    GradientReport as GradientReport,
    ParameterStats as ParameterStats,
    analyze_gradients as analyze_gradients,
    analyze_model_parameters as analyze_model_parameters,
    check_gradient_explosion as check_gradient_explosion,
    check_gradient_vanishing as check_gradient_vanishing,
    check_gradients as check_gradients,
    check_model_parameters as check_model_parameters,
    monitor_training_step as monitor_training_step,
)
from .recovery import (
    DebugDecorator as DebugDecorator,
    ErrorHandler as ErrorHandler,
    HandledError as HandledError,
)
from .session import (
    AsyncTrainingLogger as AsyncTrainingLogger,
    create_pytorch_debugger as create_pytorch_debugger,
    debug_training_session as debug_training_session,
    debug_training_step as debug_training_step,
)

__all__ = (
    "AsyncTrainingLogger",
    "DebugDecorator",
    "ErrorHandler",
    "GradientReport",
    "HandledError",
    "ParameterStats",
    "analyze_gradients",
    "analyze_model_parameters",
    "check_gradient_explosion",
    "check_gradient_vanishing",
    "check_gradients",
    "check_model_parameters",
    "create_pytorch_debugger",
    "debug_training_session",
    "debug_training_step",
    "monitor_training_step",
)
