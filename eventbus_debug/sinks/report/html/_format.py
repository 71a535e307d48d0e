"""The page's text: every value from a summary goes through these (escaped, or formatted as a
number by code here), and identifiers are reduced to ``[A-Za-z0-9_-]`` before they reach an
``id`` or ``href`` attribute."""

from __future__ import annotations

import datetime as _dt
import html
import math
import re
from typing import Final

_SLUG_RE: Final = re.compile(r"[^A-Za-z0-9_-]")


def _e(text: object) -> str:
    """*text* as HTML text or a quoted attribute value: ``& < > " '`` escaped."""
    return html.escape(str(text), quote=True)


def _slug(value: object) -> str:
    """*value* reduced to ``[A-Za-z0-9_-]``: safe in ``id`` and ``href="#..."``."""
    return _SLUG_RE.sub("_", str(value))[:80]


def _anchor(rank: object, seq: object) -> str:
    return f"ev-{_slug(rank)}-{_slug(seq)}"


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _num(value: float | None, digits: int = 4) -> str:
    if value is None:
        return "–"
    if not _is_number(value):
        return _e(value)  # a crafted log can put anything in a numeric field
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return f"{value:.{digits}g}"


def _int(value: object) -> str:
    """An integer field as text (escaped when a crafted log put something else there)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return "–" if value is None else _e(value)


def _bytes(value: float | None) -> str:
    if value is None:
        return "–"
    if not _is_number(value):
        return _e(value)
    v = float(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(v) < 1024 or unit == "TiB":
            return f"{v:.1f} {unit}" if unit != "B" else f"{int(v)} B"
        v /= 1024
    return f"{v:.1f} TiB"  # pragma: no cover


def _pct(value: float) -> str:
    return f"{value * 100:.2f} %"


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, sec = divmod(seconds, 60)
    if minutes < 60:
        return f"{int(minutes)} min {sec:.0f} s"
    hours, minutes = divmod(minutes, 60)
    return f"{int(hours)} h {int(minutes)} min"


def _time(ns: int | None) -> str:
    if ns is None:
        return "–"
    return _dt.datetime.fromtimestamp(ns / 1e9, tz=_dt.timezone.utc).strftime(
        "%Y-%m-%d %H:%M:%S UTC"
    )
