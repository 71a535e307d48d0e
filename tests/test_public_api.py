"""The public surface: tuple ``__all__`` everywhere, complete and accurate; sinks use it only."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import eventbus_debug

ROOT = Path(__file__).resolve().parent.parent


def _public_modules() -> list[str]:
    names = ["eventbus_debug"]
    for info in pkgutil.walk_packages(eventbus_debug.__path__, prefix="eventbus_debug."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            names.append(info.name)
    return sorted(names)


PUBLIC_MODULES = _public_modules()


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_all_is_a_complete_accurate_tuple(name: str) -> None:
    """``__all__`` is a tuple without duplicates; every name exists; nothing public is missing."""
    module = importlib.import_module(name)
    exported = getattr(module, "__all__", None)
    assert isinstance(exported, tuple), f"{name}.__all__ must be a tuple, got {type(exported)}"
    assert len(set(exported)) == len(exported), f"{name}.__all__ has duplicates"
    missing = [n for n in exported if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ lists names it does not define: {missing}"
    unlisted = [
        attr
        for attr, obj in vars(module).items()
        if not attr.startswith("_")
        and (inspect.isclass(obj) or inspect.isfunction(obj))
        and getattr(obj, "__module__", None) == name
        and attr not in exported
    ]
    assert not unlisted, f"{name} defines public names missing from __all__: {unlisted}"


def test_front_door_is_small_and_explicit() -> None:
    """The top level names about 35 things, each importable and listed in ``__all__``."""
    names = [n for n in eventbus_debug.__all__ if n != "__version__"]
    assert 30 <= len(names) <= 40, len(names)
    for name in names:
        value = getattr(eventbus_debug, name)
        assert value is not None, name
    assert sorted(dir(eventbus_debug)) == dir(eventbus_debug)
    assert set(names) <= set(dir(eventbus_debug))


def _front_door_tables() -> tuple[dict[str, str], dict[str, str]]:
    """The top level's ``TYPE_CHECKING`` imports and its ``_HOMES`` table, each name -> module."""
    tree = ast.parse((ROOT / "eventbus_debug" / "__init__.py").read_text(encoding="utf-8"))
    typed: dict[str, str] = {}
    homes: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom) and imp.level == 1, ast.unparse(imp)
                for alias in imp.names:
                    assert alias.asname == alias.name, f"{alias.name} is not `import X as X`"
                    typed[alias.name] = "." + (imp.module or "")
        elif (
            isinstance(node, ast.AnnAssign)
            and ast.unparse(node.target) == "_HOMES"
            and node.value is not None
        ):
            homes = ast.literal_eval(node.value)
    return typed, homes


def test_front_door_type_checking_imports_match_homes() -> None:
    """The imports type checkers read and the lazy table name the same things from the same homes."""
    typed, homes = _front_door_tables()
    assert homes, "eventbus_debug/__init__.py has no _HOMES table"
    assert set(typed) == set(homes), {
        "only in TYPE_CHECKING": sorted(set(typed) - set(homes)),
        "only in _HOMES": sorted(set(homes) - set(typed)),
    }
    moved = {n: (typed[n], homes[n]) for n in homes if typed[n] != homes[n]}
    assert not moved, f"TYPE_CHECKING and _HOMES disagree on the home of: {moved}"
    assert set(eventbus_debug.__all__) == {"__version__", *homes}
    assert set(homes) <= set(dir(eventbus_debug))


@pytest.mark.parametrize("name", sorted(_front_door_tables()[1]))
def test_front_door_name_is_its_homes_object(name: str) -> None:
    """Each top-level name is the very object its package front exports (no copies, no stubs)."""
    home = importlib.import_module(_front_door_tables()[1][name], "eventbus_debug")
    assert name in home.__all__, f"{home.__name__}.__all__ does not export {name}"
    assert getattr(eventbus_debug, name) is getattr(home, name)


def test_front_door_refuses_unknown_names() -> None:
    """A name that is not at the top level raises AttributeError naming it."""
    with pytest.raises(AttributeError, match="no attribute 'NonFiniteDetected'"):
        eventbus_debug.NonFiniteDetected  # type: ignore[attr-defined]  # noqa: B018  (in .events)


@pytest.mark.parametrize("name", ["read_events", "Event", "encode_event", "decode_event"])
def test_reading_a_log_needs_no_torch(name: str) -> None:
    """``import eventbus_debug`` and the log's names import neither torch nor the sinks."""
    code = (
        "import sys, eventbus_debug\n"
        f"eventbus_debug.{name}\n"
        "import eventbus_debug.events, eventbus_debug.log\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('eventbus_debug.sinks'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_extras_events_decode_without_the_extras() -> None:
    """A log line of an opt-in feature's event decodes with neither torch nor the extras loaded."""
    code = (
        "import sys\n"
        "from eventbus_debug.events import LatentAnomalyDetected, OperationCompleted\n"
        "from eventbus_debug.log import decode_event, encode_event\n"
        "for event in (OperationCompleted(name='fwd', duration_s=0.5, step=3),\n"
        "              LatentAnomalyDetected(denoising_step=2, rule='norm_drift', message='m')):\n"
        "    assert decode_event(encode_event(event)) == event, event\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('eventbus_debug.extras'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def _violations(source: str, filename: str) -> list[str]:
    """Imports of *source* that reach past eventbus_debug's public API."""
    problems = []
    imports: list[tuple[str, tuple[str, ...]]]
    for node in ast.walk(ast.parse(source, filename=filename)):
        if isinstance(node, ast.Import):
            imports = [(alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            imports = [(node.module, tuple(a.name for a in node.names))]
        else:
            continue
        for module, names in imports:
            if not (module == "eventbus_debug" or module.startswith("eventbus_debug.")):
                continue
            where = f"{filename}:{node.lineno}"
            if any(part.startswith("_") for part in module.split(".")):
                problems.append(f"{where} imports private module {module}")
                continue
            target = importlib.import_module(module)
            exported = set(getattr(target, "__all__", ()))
            for n in names:
                if n == "*":
                    continue
                is_submodule = inspect.ismodule(getattr(target, n, None))
                if n not in exported and not (is_submodule and not n.startswith("_")):
                    problems.append(f"{where} imports {n!r}, not in {module}.__all__")
    return problems


def test_sinks_use_only_the_public_api() -> None:
    """sinks/ imports only names exported by eventbus_debug or its public submodules."""
    problems = []
    for path in sorted((ROOT / "eventbus_debug" / "sinks").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        problems += _violations(path.read_text(encoding="utf-8"), rel)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from eventbus_debug._bus import EventBus", "private module eventbus_debug._bus"),
        ("import eventbus_debug._sync", "private module eventbus_debug._sync"),
        ("from eventbus_debug import _bus", "imports '_bus', not in eventbus_debug.__all__"),
        ("from eventbus_debug.events import _REGISTRY", "imports '_REGISTRY', not in"),
        ("from eventbus_debug import EventBus, testing", None),
        ("from eventbus_debug.testing import RecordingSink", None),
        ("import orjson", None),
    ],
)
def test_import_checker(source: str, expected: str | None) -> None:
    """The checker flags private modules and unexported names, and nothing else."""
    problems = _violations(source, "x.py")
    if expected is None:
        assert problems == []
    else:
        assert len(problems) == 1 and expected in problems[0], problems


def test_documented_import_paths_of_the_distributed_names() -> None:
    """README and docs write ``distributed=RankAgreement(...)`` and ``current_rank()``: both import
    from the top level (and ``RankAgreement`` from ``eventbus_debug.recovery``) as one object."""
    from eventbus_debug import RankAgreement, current_rank
    from eventbus_debug.events import current_rank as events_current_rank
    from eventbus_debug.recovery import RankAgreement as RecoveryRankAgreement
    from eventbus_debug.recovery.agreement import RankAgreement as Home

    assert RankAgreement is RecoveryRankAgreement is Home
    assert current_rank is events_current_rank
    assert current_rank() == 0  # no process group in the tests' main process


def test_every_error_the_library_defines_derives_from_eventbuserror() -> None:
    """The exceptions module's promise: ``except EventBusError`` catches whatever the library
    raises of its own (``NoGoodStateError`` and ``CorruptDataError`` were plain
    ``RuntimeError`` subclasses)."""
    import importlib
    import inspect
    import pkgutil

    import eventbus_debug
    from eventbus_debug.exceptions import EventBusError

    outside: list[str] = []
    for info in pkgutil.walk_packages(eventbus_debug.__path__, "eventbus_debug."):
        try:
            module = importlib.import_module(info.name)
        except ImportError:  # an optional extra that is not installed
            continue
        for name, value in vars(module).items():
            if (
                inspect.isclass(value)
                and issubclass(value, BaseException)
                and value.__module__ == module.__name__
                and not name.startswith("_")
                and not issubclass(value, EventBusError)
            ):
                outside.append(f"{module.__name__}.{name}")
    assert outside == []
