"""The layout of daemon/ and partitioning/ (issue: daemon/ by concern), checked on every run.

* no module over 500 lines (the generated protobuf code aside), so each stays one idea;
* import-linter's contracts in pyproject.toml hold: the layers, no cycles, a pure
  partitioning package (``lint-imports`` is the tool; its verdict is the expected value).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 500
GENERATED = {"ringlet_pb2.py", "ringlet_pb2_grpc.py"}


def test_no_module_over_500_lines():
    long = []
    for pkg in ("daemon", "partitioning"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if path.name in GENERATED:
                continue
            n = len(path.read_text().splitlines())
            if n > MAX_LINES:
                long.append(f"{path.relative_to(ROOT)}: {n} lines")
    assert not long, "modules over 500 lines (split them by idea):\n" + "\n".join(long)


def test_import_contracts_hold():
    exe = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    if not Path(exe).exists():
        pytest.skip("import-linter is not installed (make install brings it)")
    r = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def test_every_package_is_installed():
    """pyproject.toml lists packages one by one (the design card fixes the layout under
    ``ringlet.daemon``): every folder with an ``__init__.py`` must be listed, or a plain
    ``pip install`` leaves it out."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set()
    for top, name in (("daemon", "ringlet.daemon"), ("partitioning", "ringlet.partitioning")):
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / top).parts
            found.add(".".join((name, *rel)))
    assert found - listed == set(), f"packages missing from pyproject.toml: {sorted(found - listed)}"
