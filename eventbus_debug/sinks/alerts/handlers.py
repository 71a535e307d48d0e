"""The built-in alert handlers: to :mod:`logging`, to stderr, to a JSON-lines file, to a webhook."""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import orjson

from eventbus_debug.diagnostics import get_logger
from eventbus_debug.events import (
    Severity,
)
from eventbus_debug.exceptions import ArgumentTypeError

from .._checks import brief, seconds
from .._terminal import resolve_stream, write_text
from ..lines import format_event, use_colors
from .alert import Alert, alert_to_dict

__all__ = ("FileAlert", "LogAlert", "StderrAlert", "WebhookAlert")


@dataclass(frozen=True, slots=True)
class LogAlert:
    """Log each alert through standard :mod:`logging` (sync: runs in a worker thread).

    The line goes to the stdlib logger *logger_name* (under ``eventbus_debug``): silent until
    the application configures logging, never on stdout. A session with a console view does
    not use it, so an incident is shown once.

    Args:
        logger_name: the logger name; names outside ``eventbus_debug`` are placed under it.
    """

    logger_name: str = "eventbus_debug.alerts"

    def __call__(self, alert: Alert, /) -> None:
        level = alert.event.severity
        logger = get_logger(self.logger_name)
        method = {
            Severity.DEBUG: logger.debug,
            Severity.INFO: logger.info,
            Severity.WARNING: logger.warning,
            Severity.ERROR: logger.error,
            Severity.CRITICAL: logger.critical,
        }[level]
        method(
            "alert",
            rule=alert.rule.name,
            kind=alert.event.kind,
            step=alert.event.step,
            rank=alert.event.rank,
            count=alert.count,
            suppressed=alert.suppressed,
            message=alert.message,
        )


class StderrAlert:
    """Write one line per alert to a stream (``sys.stderr`` at call time by default).

    The line is the console's line for the event (:func:`sinks.lines.format_event`) plus the
    repeats a summary stands for; it goes through an active tqdm or rich progress bar. Do not
    add it next to a console view that already shows incidents: each would print the incident.

    Args:
        stream: a text stream to write to instead of standard error.
        colors: ANSI colours; ``None`` uses them when the stream is a terminal.
    """

    def __init__(self, stream: IO[str] | None = None, *, colors: bool | None = None) -> None:
        self._stream = stream
        self._colors = colors
        self._lock = threading.Lock()

    def __call__(self, alert: Alert, /) -> None:
        stream = resolve_stream(self._stream)
        colors = use_colors(stream) if self._colors is None else self._colors
        line = format_event(alert.event, colors=colors) + alert.repeats + "\n"
        with self._lock:
            write_text(stream, line)


class FileAlert:
    """Append each alert as one JSON line (see :func:`alert_to_dict`) to *path*.

    The file is opened in append mode per alert, so external rotation is safe; lines are
    written whole under a lock.

    Args:
        path: the file to append to; its directory is created when missing.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()

    def __call__(self, alert: Alert, /) -> None:
        line = orjson.dumps(alert_to_dict(alert), option=orjson.OPT_APPEND_NEWLINE)
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "ab") as fh:
                fh.write(line)


class WebhookAlert:
    """POST each alert as JSON (see :func:`alert_to_dict`) to a URL, with a timeout.

    Needs the optional ``http`` extra (httpx): ``pip install 'eventbus-debug[http]'``. A
    non-2xx answer raises, so it is reported as an :class:`AlertHandlerFailed` incident.

    Args:
        url: the endpoint (Slack-compatible receivers, alertmanager bridges, your service).
        timeout: seconds for the whole request.
        headers: extra request headers (an ``Authorization`` token, for instance).

    Raises:
        ImportError: if httpx is not installed.
        ArgumentTypeError: if *url* is not a str or *timeout* not a number (a ``TypeError``,
            and the ``ValueError`` earlier releases raised).
        ValueError: if *url* is not an http(s) URL or *timeout* is not a finite number > 0.
    """

    def __init__(
        self, url: str, *, timeout: float = 5.0, headers: Mapping[str, str] | None = None
    ) -> None:
        try:
            import httpx
        except ImportError:
            msg = (
                "WebhookAlert needs httpx, the optional 'http' extra: "
                "pip install 'eventbus-debug[http]'"
            )
            raise ImportError(msg) from None
        if not isinstance(url, str):
            msg = f"url must be an http:// or https:// URL (a str), got {brief(url)}"
            raise ArgumentTypeError(msg)
        if not url.startswith(("http://", "https://")):
            msg = f"url must be an http:// or https:// URL, got {url!r}"
            raise ValueError(msg)
        self.timeout = seconds("timeout", timeout, rule="a finite number of seconds > 0")
        self.url = url
        self.headers = dict(headers or {})
        self._httpx = httpx

    async def __call__(self, alert: Alert, /) -> None:
        body = orjson.dumps(alert_to_dict(alert))
        headers = {"content-type": "application/json", **self.headers}
        async with self._httpx.AsyncClient(timeout=self.timeout) as client:
            response = await client.post(self.url, content=body, headers=headers)
            response.raise_for_status()
