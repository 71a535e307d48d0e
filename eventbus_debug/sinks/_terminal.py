"""Write human-readable lines to a terminal without breaking a progress bar on it.

Training scripts keep a tqdm or rich progress bar on screen; a plain ``write`` in the middle of
it tears the bar apart. :func:`write_text` goes through the bar when one is active:

- **rich** (``Progress``, ``Live``) replaces ``sys.stderr`` / ``sys.stdout`` by a proxy that
  prints above the live display; a line meant for the proxied stream goes through the proxy;
- **tqdm**: when the application imported tqdm, lines go through ``tqdm.write``, which clears
  the bars on that stream, writes, and redraws them.

Neither library is imported here: only one the application already uses is looked up.
"""

from __future__ import annotations

import sys
from typing import IO

__all__ = ("resolve_stream", "write_text")


def resolve_stream(stream: IO[str] | None) -> IO[str]:
    """The stream to write to now: *stream* (``sys.stderr`` when None) or rich's proxy of it."""
    target: IO[str] = stream if stream is not None else sys.stderr
    for current in (sys.stderr, sys.stdout):
        if current is not target and getattr(current, "rich_proxied_file", None) is target:
            return current
    return target


def write_text(stream: IO[str] | None, text: str) -> None:
    """Write *text* (whole lines, ending in a newline) and flush, through an active progress bar.

    Raises:
        OSError: if the stream cannot be written (a closed pipe, a full disk).
        ValueError: if the stream is closed.
    """
    target = resolve_stream(stream)
    tqdm_module = sys.modules.get("tqdm")
    tqdm_class = getattr(tqdm_module, "tqdm", None)
    if tqdm_class is not None and getattr(tqdm_class, "_instances", None):
        # One call per batch of lines: tqdm clears its bars on *target*, writes, redraws them.
        tqdm_class.write(text.rstrip("\n"), file=target)
        target.flush()
        return
    target.write(text)
    target.flush()
