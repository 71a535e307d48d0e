"""The installed package: what the wheel holds, and a user project with its own ``sinks``.

The wheel is built from a copy of the sources (offline, with the setuptools build backend,
never through the network) and unpacked into a private target directory, so these tests see
what ``pip install eventbus-debug`` puts in site-packages.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "eventbus_debug"

# Runs in the user's project: its own ``sinks`` first, then the installed library beside it.
USER_SCRIPT = """
import sys

import anyio

import sinks  # the user's package, not ours

import eventbus_debug
from eventbus_debug import EventBus, read_events
from eventbus_debug.events import StepCompleted
from eventbus_debug.sinks import RotatingFileSink


async def main(log_dir: str) -> None:
    async with EventBus() as bus:
        bus.subscribe(RotatingFileSink(log_dir))
        for step in range(3):
            bus.publish_nowait(StepCompleted(step=step, loss=0.5))
    steps = [e.step for e in read_events(log_dir) if isinstance(e, StepCompleted)]
    assert steps == [0, 1, 2], steps


anyio.run(main, sys.argv[1])
assert sinks.OWNER == "user project", sinks.__file__
assert sys.modules["sinks"] is sinks
print("LIBRARY", eventbus_debug.__file__)
print("USER_SINKS", sinks.__file__)
print("TORCH", "torch" in sys.modules)
"""


def _wheel_names(wheel: Path) -> list[PurePosixPath]:
    with zipfile.ZipFile(wheel) as archive:
        return [PurePosixPath(name) for name in archive.namelist()]


def _packages_of(files: list[PurePosixPath]) -> set[str]:
    """The dotted package names of every ``__init__.py`` in *files*."""
    return {".".join(f.parent.parts) for f in files if f.name == "__init__.py"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel built from a clean copy of the sources (no build/, caches or the sinks link)."""
    pytest.importorskip("setuptools.build_meta", reason="building the wheel needs setuptools")
    src = tmp_path_factory.mktemp("src")
    shutil.copytree(PACKAGE, src / "eventbus_debug", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, src / name)
    dist = tmp_path_factory.mktemp("dist")
    build = f"import setuptools.build_meta as b; print(b.build_wheel({str(dist)!r}))"
    done = subprocess.run(
        [sys.executable, "-c", build], cwd=src, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return dist / done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel installed into a private target directory, as site-packages would hold it.

    A pure-Python wheel installs by unpacking it (pip adds only the console script and the
    RECORD's bookkeeping), so unpacking keeps this test fast and offline.
    """
    target = tmp_path_factory.mktemp("site")
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(target)
    return target


def test_wheel_installs_sinks_inside_the_package(wheel: Path) -> None:
    """No top-level ``sinks``; the sinks, ``py.typed`` and the console script are in the wheel."""
    names = _wheel_names(wheel)
    tops = {n.parts[0] for n in names if not n.parts[0].endswith(".dist-info")}
    assert tops == {"eventbus_debug"}, tops
    assert PurePosixPath("eventbus_debug/sinks/__init__.py") in names
    assert PurePosixPath("eventbus_debug/sinks/rotating_file.py") in names
    assert PurePosixPath("eventbus_debug/py.typed") in names
    with zipfile.ZipFile(wheel) as archive:
        (entry_points,) = [n for n in archive.namelist() if n.endswith("entry_points.txt")]
        scripts = archive.read(entry_points).decode()
    assert "eventbus-debug = eventbus_debug.cli:main" in scripts


def test_wheel_holds_every_package_of_the_tree(wheel: Path) -> None:
    """Package discovery finds every directory with an ``__init__.py``, and nothing else."""
    tree = {
        ".".join(p.relative_to(ROOT).parent.parts)
        for p in PACKAGE.rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    shipped = _packages_of(_wheel_names(wheel))
    assert shipped == tree, {
        "missing from the wheel": sorted(tree - shipped),
        "not in the tree": sorted(shipped - tree),
    }


def test_wheel_holds_every_module_of_the_tree(wheel: Path) -> None:
    """Every ``.py`` file of the package is shipped (a module outside a package would not be)."""
    tree = {
        PurePosixPath(*p.relative_to(ROOT).parts)
        for p in PACKAGE.rglob("*.py")
        if "__pycache__" not in p.parts
    }
    shipped = {n for n in _wheel_names(wheel) if n.suffix == ".py"}
    assert tree == shipped, sorted(tree ^ shipped)


def test_package_check_notices_a_missing_package() -> None:
    """The comparison the discovery test relies on sees a package without its ``__init__``."""
    files = [PurePosixPath("eventbus_debug/__init__.py"), PurePosixPath("eventbus_debug/x/a.py")]
    assert _packages_of(files) == {"eventbus_debug"}
    files.append(PurePosixPath("eventbus_debug/x/__init__.py"))
    assert _packages_of(files) == {"eventbus_debug", "eventbus_debug.x"}


def test_user_project_with_its_own_sinks_package(installed: Path, tmp_path: Path) -> None:
    """A project's own ``sinks/`` and the installed library work side by side, without torch."""
    project = tmp_path / "project"
    (project / "sinks").mkdir(parents=True)
    (project / "sinks" / "__init__.py").write_text('OWNER = "user project"\n', encoding="utf-8")
    (project / "train.py").write_text(textwrap.dedent(USER_SCRIPT), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(installed)}
    env.pop("PYTHONSAFEPATH", None)  # the script's directory (the project) comes first
    done = subprocess.run(
        [sys.executable, "train.py", str(tmp_path / "logs")],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert Path(lines["LIBRARY"]).is_relative_to(installed), lines
    assert Path(lines["USER_SINKS"]).is_relative_to(project), lines
    assert lines["TORCH"] == "False", "writing and reading a log imported torch"
