"""Every ```python block in README.md and docs/*.md runs, so examples cannot rot.

Blocks of one file run in order in one namespace (a later block may use an earlier one's
names), in a temporary working directory. Fence a snippet as ```py to show it without running it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _blocks(path: Path) -> list[str]:
    return _BLOCK.findall(path.read_text(encoding="utf-8"))


@pytest.mark.parametrize("path", [p for p in DOCS if p.exists()], ids=lambda p: p.name)
def test_doc_blocks_run(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each python block of the document executes without error."""
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": f"doc_{path.stem}"}
    for i, block in enumerate(_blocks(path)):
        code = compile(block, f"{path.name}[block {i}]", "exec", dont_inherit=True)
        exec(code, namespace)
