"""docs/seed-mapping.md: every seed name maps to ours, and every name of ours imports."""

from __future__ import annotations

import importlib
import keyword
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAPPING = ROOT / "docs" / "seed-mapping.md"
HEADER = "| seed name | ours | import from |"

_CODE = re.compile(r"`([^`]+)`")
_CELL_SPLIT = re.compile(r"(?<!\\)\|")
# a name the reader would import: followed by a call or an attribute, not itself an attribute
_HEAD = re.compile(r"(?<![\w./])([A-Za-z_]\w*)(?=\s*[(.])")
_IDENTIFIER = re.compile(r"[A-Za-z_]\w*")


@dataclass(frozen=True, slots=True)
class Row:
    """One line of a mapping table."""

    line: int
    seed: str
    ours: str
    paths: tuple[str, ...]


def _rows(text: str) -> list[Row]:
    rows: list[Row] = []
    in_table = False
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip() == HEADER:
            in_table = True
            continue
        if not in_table or line.startswith("| ---"):
            continue
        if not line.startswith("|"):
            in_table = False
            continue
        cells = [c.strip() for c in _CELL_SPLIT.split(line.strip())[1:-1]]
        assert len(cells) == 3, f"line {number}: expected 3 cells, got {len(cells)}: {line}"
        rows.append(Row(number, cells[0], cells[1], tuple(_CODE.findall(cells[2]))))
    return rows


def _names_used(ours: str) -> set[str]:
    """The names a reader of the "ours" cell has to import."""
    names: set[str] = set()
    for span in _CODE.findall(ours.replace("\\|", "|")):
        if _IDENTIFIER.fullmatch(span):
            names.add(span)
        names.update(_HEAD.findall(span))
    return {n for n in names if not keyword.iskeyword(n)}


def _covered(path: str) -> set[str]:
    """The names one "import from" entry provides (every component of the dotted path)."""
    _, _, attribute = path.partition(":")
    if attribute:
        return {attribute}
    return set(path.split("."))


def _resolve(path: str) -> object:
    """Import *path* (a dotted name, a repository file, or ``file:Name``), or raise."""
    if "/" in path:
        file, _, name = path.partition(":")
        source = (ROOT / file).read_text(encoding="utf-8")
        if name and not re.search(rf"^(class|def|async def) {re.escape(name)}\b", source, re.M):
            msg = f"{file} defines no {name}"
            raise AttributeError(msg)
        return source
    parts = path.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[split:]:
            obj = getattr(obj, attribute)
        return obj
    msg = f"no module in {path!r}"
    raise ModuleNotFoundError(msg)


ROWS = _rows(MAPPING.read_text(encoding="utf-8"))


def test_mapping_has_every_seed() -> None:
    """The document keeps its four seed tables and their rows."""
    text = MAPPING.read_text(encoding="utf-8")
    for seed in ("000", "001", "002", "003"):
        assert f"## Seed {seed}:" in text, seed
    assert text.count(HEADER) == 4
    assert len(ROWS) >= 60, len(ROWS)


@pytest.mark.parametrize("row", ROWS, ids=lambda r: f"line{r.line}")
def test_every_name_of_ours_imports(row: Row) -> None:
    """Each row says where its names live, every such path imports, and it covers the row."""
    assert row.paths, f"line {row.line}: no import path for {row.seed}"
    for path in row.paths:
        assert path.startswith(("eventbus_debug.", "examples/", "benchmarks/")), path
        try:
            _resolve(path)
        except (ImportError, AttributeError, OSError) as exc:
            pytest.fail(f"line {row.line}: {path} does not resolve: {exc!r}")
    provided = set().union(*(_covered(p) for p in row.paths))
    missing = _names_used(row.ours) - provided
    assert not missing, f"line {row.line}: {sorted(missing)} used but not in the import column"


def test_names_used_reads_calls_attributes_and_bare_names() -> None:
    """Calls, attribute heads and bare names count; arguments, attributes and keywords do not."""
    ours = "`await report_error(engine, exc)`; `Session.check_step`; `DebugLevel`; `x = y`"
    assert _names_used(ours) == {"report_error", "Session", "DebugLevel"}
    assert _names_used("`python benchmarks/bench_x.py`; `on=A \\| B`") == set()


def test_a_row_with_a_wrong_or_missing_path_fails() -> None:
    """A path that does not import is an error; a used name missing from the paths is caught."""
    with pytest.raises(AttributeError):
        _resolve("eventbus_debug.events.NoSuchEvent")
    with pytest.raises(ModuleNotFoundError):
        _resolve("no_such_package.Thing")
    with pytest.raises(AttributeError, match="defines no Nope"):
        _resolve("examples/email_sequence_optimizer.py:Nope")
    (row,) = _rows(
        f"{HEADER}\n| --- | --- | --- |\n| `a()` | `Session(m)`; `read_events(p)` | `eventbus_debug.Session` |\n"
    )
    assert _names_used(row.ours) - _covered(row.paths[0]) == {"read_events"}
