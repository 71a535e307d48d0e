"""The house rules, read from the imports: arrows point down the layers, and no circles."""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "eventbus_debug"

# Bottom to top. A module may import its own layer and the layers below it, never above.
LAYERS: tuple[tuple[str, ...], ...] = (
    # 1: the vocabulary and the small leaves everything may use
    (
        "events",
        "exceptions",
        "typing",
        "_validate",
        "_saved",
        "_records",
        "_tensors",
        "_memory",
        "_modules",
        "diagnostics",
        "threads",
        "step_context",
    ),
    # 2: the canonical log and the bus
    ("log", "_bus"),
    # 3: what watches training and what acts on it
    ("probes", "recovery"),
    # 4: the built-in subscribers (through the public API only)
    ("sinks",),
    # 5: the application layer
    ("session", "extras", "compat", "integrations", "testing", "cli", "demo"),
)

# Known edges that break the rules, each to be removed by the restructuring (issue #11).
ALLOWED: frozenset[tuple[str, str]] = frozenset()


def _layer_of(module: str) -> int:
    top = module.split(".")[1] if module.count(".") else ""
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    msg = f"{module} is in no layer: add its top-level name to LAYERS"
    raise AssertionError(msg)


def _front_door() -> dict[str, str]:
    """The top level's lazy names and the modules they come from (its ``_HOMES`` table)."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if (
            isinstance(node, ast.AnnAssign)
            and getattr(node.target, "id", "") == "_HOMES"
            and node.value is not None
        ):
            table = ast.literal_eval(node.value)
            return {name: "eventbus_debug" + home for name, home in table.items()}
    msg = "eventbus_debug/__init__.py has no _HOMES table"
    raise AssertionError(msg)


_FRONT_DOOR = _front_door()


def _module_name(path: Path) -> str:
    parts = ["eventbus_debug", *path.relative_to(PACKAGE).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(module: str, path: Path, known: set[str]) -> Iterator[tuple[str, int]]:
    """(imported module, line) for every import of *module*, type-checking-only ones too."""
    is_package = path.name == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("eventbus_debug"):
                    yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            elif node.module and node.module.startswith("eventbus_debug"):
                target = node.module
            else:
                continue
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                sub = f"{target}.{alias.name}"
                if sub in known:
                    yield sub, node.lineno
                elif target == "eventbus_debug" and alias.name in _FRONT_DOOR:
                    yield _FRONT_DOOR[alias.name], node.lineno  # where the lazy name lives
                else:
                    yield target, node.lineno


def _edges() -> dict[tuple[str, str], int]:
    modules = _modules()
    known = set(modules)
    edges: dict[tuple[str, str], int] = {}
    for module, path in modules.items():
        for target, line in _imports(module, path, known):
            # the top-level front door is lazy and sits above every layer
            if module != "eventbus_debug" and target not in (module, "eventbus_debug"):
                edges.setdefault((module, target), line)
    return edges


def test_every_module_has_a_layer() -> None:
    """Each module of the package belongs to one layer of the house."""
    for module in _modules():
        if module != "eventbus_debug":
            _layer_of(module)


def test_arrows_point_down() -> None:
    """No module imports a module of a higher layer (sinks and the session sit on top)."""
    upward = [
        f"{src} (layer {_layer_of(src) + 1}) imports {dst} (layer {_layer_of(dst) + 1}), line {line}"
        for (src, dst), line in sorted(_edges().items())
        if _layer_of(dst) > _layer_of(src) and (src, dst) not in ALLOWED
    ]
    assert not upward, "\n".join(upward)


def test_nothing_below_the_session_imports_sinks() -> None:
    """The core (layers 1-3) never imports the built-in sinks, not even lazily."""
    core = [
        f"{src} imports {dst}"
        for (src, dst) in _edges()
        if dst.startswith("eventbus_debug.sinks") and _layer_of(src) < _layer_of(dst)
    ]
    assert not core, "\n".join(core)


# typing's backport, imported on Python 3.10 only (events/_base.py's dataclass_transform)
_STDLIB_BACKPORTS: frozenset[str] = frozenset({"typing_extensions"})


def _foreign_imports(path: Path) -> list[str]:
    """The imports of *path* that are neither the standard library nor relative."""
    foreign = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        foreign += [
            f"{n}, line {node.lineno}"
            for n in names
            if n.partition(".")[0] not in {*sys.stdlib_module_names, *_STDLIB_BACKPORTS}
        ]
    return foreign


def test_events_import_only_the_standard_library() -> None:
    """The vocabulary (every module of events/) needs nothing but Python: no torch, no anyio."""
    paths = sorted((PACKAGE / "events").rglob("*.py"))
    assert len(paths) > 5
    foreign = [f"{p.relative_to(PACKAGE)}: {imp}" for p in paths for imp in _foreign_imports(p)]
    assert not foreign, "\n".join(foreign)


def test_foreign_import_finder(tmp_path: Path) -> None:
    """The finder flags third-party and absolute package imports, not stdlib or relative ones."""
    module = tmp_path / "m.py"
    module.write_text(
        "import os, torch\nfrom anyio import run\nfrom . import x\nfrom eventbus_debug import y\n"
    )
    assert _foreign_imports(module) == [
        "torch, line 1",
        "anyio, line 2",
        "eventbus_debug, line 4",
    ]


def test_compat_is_a_leaf() -> None:
    """The seeds' names are importable, never re-exported: nothing outside compat imports it."""
    users = [
        f"{src} imports {dst}, line {line}"
        for (src, dst), line in sorted(_edges().items())
        if dst.startswith("eventbus_debug.compat") and not src.startswith("eventbus_debug.compat")
    ]
    assert not users, "\n".join(users)
    assert not [n for n, home in _FRONT_DOOR.items() if home.startswith("eventbus_debug.compat")]


def _cycles(edges: set[tuple[str, str]]) -> list[list[str]]:
    graph: dict[str, list[str]] = {}
    for src, dst in edges:
        graph.setdefault(src, []).append(dst)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_circles() -> None:
    """No group of modules imports itself round a circle (package fronts excepted)."""
    # A package's __init__ re-exporting its children is not a circle of concerns: leave the
    # fronts out, and check the modules that hold the code.
    modules = _modules()
    fronts = {m for m, p in modules.items() if p.name == "__init__.py"}
    edges = {(s, d) for (s, d) in _edges() if s not in fronts and d not in fronts}
    assert _cycles(edges) == []


@pytest.mark.parametrize(
    ("edges", "expected"),
    [
        ({("a", "b"), ("b", "c")}, []),
        ({("a", "b"), ("b", "a")}, [["a", "b"]]),
        ({("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")}, [["a", "b", "c"]]),
    ],
)
def test_cycle_finder(edges: set[tuple[str, str]], expected: list[list[str]]) -> None:
    """The circle finder reports exactly the strongly connected groups of two or more."""
    assert _cycles(edges) == expected
