"""The canonical log: one JSON object per line, its encoding and its files.

Reading a log needs neither torch nor a bus: ``read_events(path)`` yields the same typed
events that were published (NaN and infinities preserved).
"""

from __future__ import annotations

from .encoding import (
    decode_event as decode_event,
    encode_event as encode_event,
    encode_events as encode_events,
)
from .files import (
    LOG_STEM as LOG_STEM,
    LOG_SUFFIX as LOG_SUFFIX,
    ReadStatistics as ReadStatistics,
    log_file_name as log_file_name,
    log_files as log_files,
    read_events as read_events,
)

__all__ = (
    "LOG_STEM",
    "LOG_SUFFIX",
    "ReadStatistics",
    "decode_event",
    "encode_event",
    "encode_events",
    "log_file_name",
    "log_files",
    "read_events",
)
