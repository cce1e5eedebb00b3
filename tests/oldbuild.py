"""Other builds of ringlet run as real daemons beside the current one: an earlier release
materialized from this repository's own history, or a copy of the current tree with one
change (a raised protocol version).

A build is a source tree (its ``daemon/`` and ``partitioning/``) and a ``PYTHONPATH`` entry
holding a ``ringlet/`` package whose two subpackages are symlinks into that tree; put first
on the path, it wins over the editable install's finder (which ``site`` appends after the
path finder), so ``python -m ringlet.daemon.ops.cli run`` in that environment runs the
build's code on the current virtual environment's dependencies. :func:`imported_from`
checks which tree a process really imports.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

#: Release 0.1.0 (2026-12-02): the last release before member records carried versions and
#: capabilities. Its wire already had no drafts, prefill progress events, second residual
#: streams, KV pieces of every cache kind or tensor-group trims.
RELEASE_0_1_0 = "d45620d9a425933c5e239accfbfb9b188ea281df"


@dataclass(frozen=True)
class Build:
    """A build to run: ``tree`` holds its ``daemon/`` and ``partitioning/``; ``env`` is the
    environment (``PYTHONPATH``) that makes ``ringlet`` import it."""

    name: str
    tree: Path
    env: dict[str, str]


def _shim(tree: Path, where: Path) -> dict[str, str]:
    """A ``ringlet/`` package under ``where`` whose ``daemon`` and ``partitioning`` are
    ``tree``'s; the environment that puts it first on the path."""
    pkg = where / "ringlet"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    for sub in ("daemon", "partitioning"):
        (pkg / sub).symlink_to(tree / sub, target_is_directory=True)
    return {"PYTHONPATH": str(where), "PYTHONDONTWRITEBYTECODE": "1"}


def release(commit: str, where: Path, name: str = "") -> Build:
    """The tree of ``commit`` (``git archive`` of this repository) under ``where``.

    Fails the test (not a skip) when the commit is not in the clone, e.g. a shallow one:
    the mixed-version tests need the release itself."""
    have = subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{commit}^{{commit}}"],  # noqa: S607
                          capture_output=True)
    if have.returncode != 0:
        pytest.fail(f"commit {commit} (release {name or '?'}) is not in this clone of {REPO}: the mixed-version "
                    "tests build it from the repository's history; fetch it (git fetch --unshallow) and run again",
                    pytrace=False)
    tree = where / "tree"
    tree.mkdir(parents=True)
    archive = subprocess.Popen(["git", "-C", str(REPO), "archive", commit, "daemon", "partitioning"],  # noqa: S607
                               stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(tree)], stdin=archive.stdout, check=True)  # noqa: S607
    assert archive.wait() == 0, f"git archive {commit} failed"
    return Build(name or commit[:7], tree, _shim(tree, where / "path"))


def patched_current(where: Path, name: str, edits: dict[str, tuple[str, str]]) -> Build:
    """A copy of the current working tree with ``edits`` (path → (old, new), each ``old``
    present exactly once) applied."""
    tree = where / "tree"
    for sub in ("daemon", "partitioning"):
        shutil.copytree(REPO / sub, tree / sub, ignore=shutil.ignore_patterns("__pycache__"))
    for rel, (old, new) in edits.items():
        path = tree / rel
        text = path.read_text()
        assert text.count(old) == 1, f"{rel}: {old!r} is not there exactly once"
        path.write_text(text.replace(old, new))
    return Build(name, tree, _shim(tree, where / "path"))


def imported_from(build: Build) -> str:
    """The directory ``ringlet.daemon`` is imported from in ``build``'s environment (the
    check that the build, not the editable install, runs)."""
    import os

    out = subprocess.run([sys.executable, "-c", "import os, ringlet.daemon as d; print(os.path.realpath(d.__file__))"],
                         capture_output=True, text=True, env={**os.environ, **build.env}, check=True)
    return str(Path(out.stdout.strip()).parent)
