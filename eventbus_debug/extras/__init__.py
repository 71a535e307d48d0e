"""Opt-in features beside the debugging core: AMP/compile/checkpointing recipes, input and
output validation, diffusion latents, and timing a block of code.

Each lives in its own module (:mod:`.optimization`, :mod:`.validation`, :mod:`.diffusion`,
:mod:`.debug_context`); this package re-exports their names. Their events are in
:mod:`eventbus_debug.events` with the rest of the vocabulary.
"""

from __future__ import annotations

from .debug_context import (
    DebugContext as DebugContext,
    debug_context as debug_context,
)
from .diffusion import (
    LatentMonitor as LatentMonitor,
    analyze_pipeline as analyze_pipeline,
)
from .optimization import (
    OptimizationMode as OptimizationMode,
    OptimizedStep as OptimizedStep,
    StepOutcome as StepOutcome,
    default_amp_dtype as default_amp_dtype,
    disable_gradient_checkpointing as disable_gradient_checkpointing,
    enable_gradient_checkpointing as enable_gradient_checkpointing,
    is_gradient_checkpointing as is_gradient_checkpointing,
    optimize_model as optimize_model,
)
from .validation import (
    InputSpec as InputSpec,
    InputValidationError as InputValidationError,
    InputValidator as InputValidator,
    OutputChecker as OutputChecker,
    ValidationPolicy as ValidationPolicy,
    Violation as Violation,
    validate_input as validate_input,
)

__all__ = (
    "DebugContext",
    "InputSpec",
    "InputValidationError",
    "InputValidator",
    "LatentMonitor",
    "OptimizationMode",
    "OptimizedStep",
    "OutputChecker",
    "StepOutcome",
    "ValidationPolicy",
    "Violation",
    "analyze_pipeline",
    "debug_context",
    "default_amp_dtype",
    "disable_gradient_checkpointing",
    "enable_gradient_checkpointing",
    "is_gradient_checkpointing",
    "optimize_model",
    "validate_input",
)
