"""Every ```python block in README.md and docs/*.md runs, so examples cannot rot.

Blocks of one file run in order in one namespace (a later block may use an earlier one's
names), in a temporary working directory. Fence a snippet as ```py to show it without running it.

They run twice: as written (``anyio.run`` on asyncio), and with the blocks' own ``anyio.run``
calls on trio, anyio's other backend. On trio, a block that serves a ``DebugServer`` (uvicorn,
asyncio only) must fail with the server's clear error instead.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_NAME = re.compile(r"^\S+\.md\[block \d+\]$")


def _blocks(path: Path) -> list[str]:
    return _BLOCK.findall(path.read_text(encoding="utf-8"))


def _run_blocks(path: Path, each: Callable[[str, Callable[[], None]], None]) -> None:
    namespace: dict[str, object] = {"__name__": f"doc_{path.stem}"}
    for i, block in enumerate(_blocks(path)):
        code = compile(block, f"{path.name}[block {i}]", "exec", dont_inherit=True)
        each(block, lambda code=code: exec(code, namespace))  # type: ignore[misc]


@pytest.mark.parametrize("path", [p for p in DOCS if p.exists()], ids=lambda p: p.name)
def test_doc_blocks_run(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each python block of the document executes without error."""
    monkeypatch.chdir(tmp_path)
    _run_blocks(path, lambda _block, run: run())


@pytest.mark.parametrize("path", [p for p in DOCS if p.exists()], ids=lambda p: p.name)
def test_doc_blocks_run_on_trio(
    path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same blocks with their ``anyio.run(main)`` on trio (the library's own threads keep
    their asyncio loops, as they do under a trio program)."""
    monkeypatch.chdir(tmp_path)
    run_as_written = anyio.run

    def on_trio(func: Callable[..., Any], *args: object, **kwargs: Any) -> Any:
        if _NAME.match(sys._getframe(1).f_code.co_filename):  # called by a block itself
            kwargs["backend"] = "trio"
        return run_as_written(func, *args, **kwargs)

    monkeypatch.setattr(anyio, "run", on_trio)

    def each(block: str, run: Callable[[], None]) -> None:
        if "DebugServer(" in block:
            with pytest.raises(RuntimeError, match="runs only on asyncio"):
                run()
        else:
            run()

    _run_blocks(path, each)
