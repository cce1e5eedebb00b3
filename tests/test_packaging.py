"""The wheel ``pip install ringlet`` gets carries every module the daemon runs: each package
directory of ``daemon/`` and ``partitioning/`` is in pyproject.toml's package list (under the
``ringlet`` namespace), and each file that is not Python source is package data. Fast, on
every run; ``make wheel-check`` (CI) builds the wheel, installs and runs it."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _package(directory: Path) -> str:
    return "ringlet." + ".".join(directory.relative_to(ROOT).parts)


def _source_dirs():
    for top in ("daemon", "partitioning"):
        for d in [ROOT / top, *sorted((ROOT / top).rglob("*"))]:
            if d.is_dir() and "__pycache__" not in d.parts and any(d.glob("*.py")):
                yield d


def test_every_package_directory_is_listed():
    listed = set(SETUPTOOLS["packages"])
    found = {_package(d) for d in _source_dirs()}
    assert found - listed == set(), f"add to pyproject.toml's [tool.setuptools] packages: {sorted(found - listed)}"
    assert listed - found == set(), f"pyproject.toml lists packages that do not exist: {sorted(listed - found)}"
    assert not [d for d in _source_dirs() if not (d / "__init__.py").exists()], "a package without __init__.py"


def test_every_data_file_is_package_data():
    data = SETUPTOOLS.get("package-data", {})
    missing = []
    for d in _source_dirs():
        for f in d.iterdir():
            if f.is_file() and f.suffix not in (".py", ".pyc") and not any(
                    fnmatch.fnmatch(f.name, pat) for pat in data.get(_package(d), [])):
                missing.append(str(f.relative_to(ROOT)))
    assert not missing, f"not in pyproject.toml's package-data, so not in the wheel: {missing}"
