"""The former name of :mod:`eventbus_debug.diagnostics`, kept while modules move over to it."""

from __future__ import annotations

from .diagnostics import LOGGER_NAME as LOGGER_NAME, get_logger as get_logger

__all__ = ("LOGGER_NAME", "get_logger")
