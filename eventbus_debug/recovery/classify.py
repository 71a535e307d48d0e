"""Error classification: an exception (and what the caller said about it) → category + severity.

The classifier is an ordered list of rules; the first rule that matches wins. Users register
their own rules in front of the built-in ones::

    classifier = ErrorClassifier()
    classifier.register(ErrorCategory.DATA, exception=KeyError, severity=Severity.WARNING)
    classifier.register(ErrorCategory.SYSTEM, pattern="connection reset")
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, final

import torch

from ..events import ErrorCategory, Severity

__all__ = (
    "ErrorClassification",
    "ErrorClassifier",
    "ErrorRule",
    "exception_names",
    "is_out_of_memory",
)

_CPU_OOM: Final = re.compile(r"can't allocate memory|cannot allocate memory|out of memory", re.I)


def exception_names(exc_type: type[BaseException]) -> tuple[str, ...]:
    """The qualified names of *exc_type* and its bases, most derived first (``object`` left out).

    Events carry these so that a strategy registered for ``RuntimeError`` matches an
    ``OutOfMemoryError`` without the live exception object.
    """
    return tuple(
        _qualified(cls)
        for cls in exc_type.__mro__
        if cls is not object and cls is not BaseException
    )


def _qualified(cls: type) -> str:
    module = cls.__module__
    return cls.__qualname__ if module == "builtins" else f"{module}.{cls.__qualname__}"


def is_out_of_memory(exc: BaseException) -> bool:
    """True for ``torch.OutOfMemoryError``, ``MemoryError`` and the CPU allocator's failure.

    The CPU allocator raises a plain ``RuntimeError`` whose message says "can't allocate memory".
    """
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(exc, RuntimeError) and _CPU_OOM.search(str(exc)) is not None


@dataclass(frozen=True, slots=True, kw_only=True)
class ErrorClassification:
    """What a classifier decided about one error."""

    category: ErrorCategory
    severity: Severity
    rule: str


Predicate = Callable[[BaseException, Mapping[str, str]], bool]


@dataclass(frozen=True, slots=True, kw_only=True)
class ErrorRule:
    """One classification rule; every given condition must hold for it to match.

    Attributes:
        category: the category it assigns.
        severity: the severity it assigns.
        exception: match instances of these exception types.
        pattern: match when this regular expression is found in the message (case-insensitive).
        operation: match when the caller's context says ``operation=<this>``.
        predicate: any other test, called with the exception and the context.
        name: a name for the logs (defaults to a description of the conditions).
    """

    category: ErrorCategory
    severity: Severity = Severity.ERROR
    exception: tuple[type[BaseException], ...] = ()
    pattern: re.Pattern[str] | None = None
    operation: str | None = None
    predicate: Predicate | None = None
    name: str = ""

    def matches(self, exc: BaseException, context: Mapping[str, str]) -> bool:
        """Whether every condition of this rule holds for *exc* raised in *context*."""
        if self.exception and not isinstance(exc, self.exception):
            return False
        if self.pattern is not None and self.pattern.search(str(exc)) is None:
            return False
        if self.operation is not None and context.get("operation") != self.operation:
            return False
        return self.predicate is None or self.predicate(exc, context)


def _builtin_rules() -> list[ErrorRule]:
    return [
        # What the caller says it was doing decides first: an OOM while loading a model is
        # answered by the model-loading fallbacks (half precision, CPU), not by a smaller batch.
        ErrorRule(category=ErrorCategory.DATA, operation="data_loading", name="data_loading"),
        ErrorRule(category=ErrorCategory.MODEL, operation="model_loading", name="model_loading"),
        ErrorRule(
            category=ErrorCategory.MEMORY,
            severity=Severity.ERROR,
            predicate=lambda exc, _ctx: is_out_of_memory(exc),
            name="out_of_memory",
        ),
        ErrorRule(
            category=ErrorCategory.DATA,
            pattern=re.compile(r"DataLoader worker|corrupt|truncated|decod", re.I),
            name="data_message",
        ),
        ErrorRule(
            category=ErrorCategory.NUMERICAL,
            exception=(FloatingPointError, ZeroDivisionError, OverflowError),
            name="numerical_type",
        ),
        ErrorRule(
            category=ErrorCategory.NUMERICAL,
            pattern=re.compile(r"\bnan\b|\binf\b|non-finite|singular|not positive-definite", re.I),
            name="numerical_message",
        ),
        ErrorRule(
            category=ErrorCategory.MODEL,
            pattern=re.compile(
                r"state_dict|size mismatch|shape|mat1 and mat2|Expected .* dimension", re.I
            ),
            name="model_message",
        ),
        ErrorRule(
            category=ErrorCategory.SYSTEM,
            exception=(OSError, ConnectionError, TimeoutError),
            name="system_type",
        ),
        ErrorRule(
            category=ErrorCategory.CONFIGURATION,
            severity=Severity.ERROR,
            exception=(ValueError, TypeError, KeyError),
            name="configuration_type",
        ),
    ]


@final
class ErrorClassifier:
    """Derives an :class:`ErrorCategory` and a :class:`~eventbus_debug.Severity` for errors.

    Rules registered with :meth:`register` are tried before the built-in ones, most recent
    first. The built-ins recognise out-of-memory errors (CUDA and CPU allocator), the
    ``operation`` the caller named (``"data_loading"``, ``"model_loading"``), data, numerical,
    model-shape, system and configuration errors; anything else is ``UNKNOWN``/``ERROR``.

    Args:
        builtin_rules: keep the built-in rules (after the registered ones).
    """

    def __init__(self, *, builtin_rules: bool = True) -> None:
        self._user: list[ErrorRule] = []
        self._builtin: Sequence[ErrorRule] = _builtin_rules() if builtin_rules else ()

    def register(
        self,
        category: ErrorCategory,
        *,
        severity: Severity = Severity.ERROR,
        exception: type[BaseException] | tuple[type[BaseException], ...] = (),
        pattern: str | re.Pattern[str] | None = None,
        operation: str | None = None,
        predicate: Predicate | None = None,
        name: str = "",
    ) -> ErrorRule:
        """Add a rule in front of the others and return it.

        Raises:
            TypeError: if *category* is not an :class:`ErrorCategory`, *severity* not a
                ``Severity`` or *exception* not an exception type.
            ValueError: if no condition is given (the rule would match every error), or
                *pattern* is not a valid regular expression.
        """
        if not isinstance(category, ErrorCategory):
            msg = f"category must be an ErrorCategory, got {category!r}"
            raise TypeError(msg)
        if not isinstance(severity, Severity):
            msg = f"severity must be a Severity, got {severity!r}"
            raise TypeError(msg)
        types = exception if isinstance(exception, tuple) else (exception,)
        for t in types:
            if not (isinstance(t, type) and issubclass(t, BaseException)):
                msg = f"exception must be an exception type or a tuple of them, got {t!r}"
                raise TypeError(msg)
        compiled = _compile(pattern)
        if not types and compiled is None and operation is None and predicate is None:
            msg = (
                "register() needs at least one condition (exception=, pattern=, operation= "
                "or predicate=); a rule without one would classify every error"
            )
            raise ValueError(msg)
        rule = ErrorRule(
            category=category,
            severity=severity,
            exception=types,
            pattern=compiled,
            operation=operation,
            predicate=predicate,
            name=name or _describe(types, compiled, operation),
        )
        self._user.insert(0, rule)
        return rule

    @property
    def rules(self) -> tuple[ErrorRule, ...]:
        """Every rule, in the order they are tried."""
        return (*self._user, *self._builtin)

    def classify(
        self, exc: BaseException, context: Mapping[str, str] | None = None
    ) -> ErrorClassification:
        """The category and severity of *exc* raised in *context* (first matching rule)."""
        ctx = context or {}
        for rule in (*self._user, *self._builtin):
            if rule.matches(exc, ctx):
                return ErrorClassification(
                    category=rule.category, severity=rule.severity, rule=rule.name
                )
        return ErrorClassification(
            category=ErrorCategory.UNKNOWN, severity=Severity.ERROR, rule="default"
        )


def _compile(pattern: str | re.Pattern[str] | None) -> re.Pattern[str] | None:
    if pattern is None or isinstance(pattern, re.Pattern):
        return pattern
    if not isinstance(pattern, str) or not pattern:
        msg = f"pattern must be a non-empty string or a compiled re.Pattern, got {pattern!r}"
        raise TypeError(msg)
    try:
        return re.compile(pattern, re.IGNORECASE)
    except re.error as exc:
        msg = f"pattern {pattern!r} is not a valid regular expression: {exc}"
        raise ValueError(msg) from None


def _describe(
    types: tuple[type[BaseException], ...], pattern: re.Pattern[str] | None, operation: str | None
) -> str:
    parts = [t.__name__ for t in types]
    if pattern is not None:
        parts.append(f"/{pattern.pattern}/")
    if operation is not None:
        parts.append(f"operation={operation}")
    return " ".join(parts) or "predicate"
