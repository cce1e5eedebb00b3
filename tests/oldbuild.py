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

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from conftest import REFERENCE
from streaming import Streamed, completion_body, read_events

from ringlet.daemon.node.config import SPEC_ALWAYS_ENV
from ringlet.daemon.ops.demo import LocalCluster

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
    ``tree``'s, compiled once here (its daemons run with PYTHONDONTWRITEBYTECODE, as on CI,
    and would each compile it again, ~0.6 CPU-s a process); the environment that puts it
    first on the path."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", str(tree)], check=True,
                   stdout=subprocess.DEVNULL)
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
    out = subprocess.run([sys.executable, "-c", "import os, ringlet.daemon as d; print(os.path.realpath(d.__file__))"],
                         capture_output=True, text=True, env={**os.environ, **build.env}, check=True)
    return str(Path(out.stdout.strip()).parent)


# --- rings of several builds, and what the tests ask them ------------------------------

RAW = next(c for c in REFERENCE if "raw" in c)
CHAT = next(c for c in REFERENCE if "messages" in c)
TOKENS = 16  # of the reference's continuation (float32 on both sides: equal)


def ring(log_dir: Path, builds: list[Build | None], ids: list[str]) -> LocalCluster:
    """A dynamic ring (mDNS on loopback, negotiated plans) of one node per build (``None``:
    the current one), float32, node i with the id ``ids[i]`` (its data dir's identity file:
    the lowest id is stage 0), stage 0 drafting whenever it may (``RINGLET_TEST_SPEC_ALWAYS``,
    so a draft that reached a node that cannot verify it would show)."""
    for i, node_id in enumerate(ids):
        data = log_dir / f"data{i}"
        data.mkdir(parents=True, exist_ok=True)
        (data / "node.json").write_text(json.dumps({"node_id": node_id, "created_at": time.time()}))
    return LocalCluster(len(builds), dtype="float32", dynamic=True, log_dir=str(log_dir), env={SPEC_ALWAYS_ENV: "1"},
                        per_node_env=[dict(b.env) if b is not None else {} for b in builds])


def complete(url: str, stream: bool, timeout_s: float = 120) -> Streamed:
    """The reference's raw prompt, greedy, :data:`TOKENS` tokens, streamed or not: the
    token ids (with their arrival times when streamed). Fails the test on an error."""
    body = {**completion_body(RAW["raw"], TOKENS), "stream": stream}
    if not stream:
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=timeout_s)
        assert r.status_code == 200, r.text
        return Streamed(ids=r.json()["choices"][0]["token_ids"])
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout_s) as r:
        assert r.status_code == 200, r.read()
        got = read_events(r.iter_lines(), Streamed())
    assert got.error is None, got.error
    return got


def chat(url: str, prediction: bool) -> dict:
    """The reference's chat question, greedy (with its answer as the ``prediction``): the
    response body. Fails the test on an error."""
    body = {"messages": CHAT["messages"], "max_tokens": CHAT["max_tokens"], "temperature": 0,
            "return_token_ids": True}
    if prediction:
        body["prediction"] = {"type": "content", "content": CHAT["completion_text"]}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()
