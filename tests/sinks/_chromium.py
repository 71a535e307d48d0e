"""Drive Debian's headless Chromium from tests: dump the DOM after scripts ran, screenshot.

Tests that need it are skipped when Chromium is absent (``apt-get install -y chromium``).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or (
    "/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None
)

needs_chromium = pytest.mark.skipif(
    CHROMIUM is None,
    reason="needs Debian's chromium for a headless browser: apt-get update && apt-get install -y chromium",
)


def _base(profile: Path, extra: tuple[str, ...]) -> list[str]:
    assert CHROMIUM is not None
    return [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        *extra,
    ]


def dump_dom(url: str, profile: Path, *extra: str, budget_ms: int = 3000) -> str:
    """The DOM of *url* once its scripts (and the timers they set) had *budget_ms* of
    virtual time, as Chromium serializes it."""
    result = subprocess.run(
        [*_base(profile, extra), f"--virtual-time-budget={budget_ms}", "--dump-dom", url],
        capture_output=True,
        text=True,
        timeout=90,
        check=True,
    )
    return result.stdout


def screenshot(url: str, profile: Path, out: Path, *, size: str = "1200,2400") -> Path:
    """A PNG screenshot of *url* at *size* (width,height)."""
    subprocess.run(
        [
            *_base(profile, ()),
            "--hide-scrollbars",
            f"--window-size={size}",
            f"--screenshot={out}",
            url,
        ],
        capture_output=True,
        timeout=90,
        check=True,
    )
    return out
