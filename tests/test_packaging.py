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


def test_the_web_console_ships_its_page_and_vendored_libraries():
    """The console's page, script, style and vendored libraries with their licences are package
    data (in subdirectories of the package, which the test above does not walk), and the page
    loads nothing from another host: a cluster is often offline."""
    console = ROOT / "daemon" / "api" / "console"
    patterns = SETUPTOOLS["package-data"][_package(console)]
    static = [f for f in sorted((console / "static").rglob("*")) if f.is_file()]
    names = {f.relative_to(console).as_posix() for f in static}
    for needed in ("static/index.html", "static/console.js", "static/console.css", "static/vendor/marked.min.js",
                   "static/vendor/marked.LICENSE.txt", "static/vendor/dompurify.min.js",
                   "static/vendor/dompurify.LICENSE.txt"):
        assert needed in names, f"the console needs {needed} (make console-assets vendors the libraries)"
    unshipped = [n for n in names if not any(fnmatch.fnmatch(n, p) for p in patterns)]
    assert not unshipped, f"not in pyproject.toml's package-data, so not in the wheel: {unshipped}"
    page = (console / "static" / "index.html").read_text()
    assert "//" not in page.replace("<!doctype html>", ""), "the page must load every asset from this node"
