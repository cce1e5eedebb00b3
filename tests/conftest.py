"""Shared fixtures: the default model, tiny random mlx-lm models, local clusters."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from ringlet.daemon.probes import blas

# In-process tests run MLX as ringlet's own processes do: on the optimized BLAS,
# loaded before anything imports mlx.core (daemons and ranks load it themselves).
blas.load()

TESTS = Path(__file__).parent
REFERENCE = json.loads((TESTS / "smollm2_135m_instruct_greedy.json").read_text())


def pytest_configure(config):
    """The processes the tests start (daemons, their tensor ranks, CLI runs) make their
    temporary files in one directory per pytest process, removed when it ends: a daemon
    makes its ranks' work dir (``ringlet-tp-ranks-*``) as it starts and removes it only when
    it stops cleanly, so every daemon a test kills with SIGKILL, and every supervisor of
    ranks, left one in /tmp (~150 after a run). This process keeps the system's temporary
    directory (pytest's ``tmp_path`` directories stay where they are kept for a look
    after a failure)."""
    tempfile.gettempdir()  # this process's own choice, fixed before TMPDIR changes
    config._ringlet_tmp = tempfile.mkdtemp(prefix="ringlet-tests-")  # noqa: SLF001 - our own attribute
    os.environ["TMPDIR"] = config._ringlet_tmp  # noqa: SLF001


def pytest_unconfigure(config):
    shutil.rmtree(getattr(config, "_ringlet_tmp", ""), ignore_errors=True)


def ringlet(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the real ``ringlet`` CLI in a subprocess."""
    return subprocess.run([sys.executable, "-m", "ringlet.daemon.ops.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def greedy_ids(prompt: str, tokens: int) -> list[int]:
    """The ids ``ringlet generate`` (one process, no network) gives ``prompt``, greedy."""
    proc = ringlet("generate", "--json", "--max-tokens", str(tokens), prompt)
    assert proc.returncode == 0, proc.stderr
    ids = json.loads(proc.stdout)["completion_ids"]
    assert len(ids) == tokens
    return ids


def index_of(cluster, node_id: str) -> int:
    """The index in ``cluster`` (a ``LocalCluster``) of the running node with ``node_id``."""
    for i in cluster.alive():
        if cluster.cluster_info(i)["node_id"] == node_id:
            return i
    raise AssertionError(f"no running node has id {node_id}")


def keyed_cluster(directory: Path, key: str, nodes: int = 1, dynamic: bool = False, **kwargs):
    """A float32 :class:`LocalCluster` whose nodes want API key ``key`` (written to an
    ``api-keys`` file in ``directory``, mode 600) and whose own calls send it."""
    from ringlet.daemon.ops.demo import LocalCluster

    keys = directory / "api-keys"
    keys.write_text(key + "\n")
    keys.chmod(0o600)
    cluster = LocalCluster(nodes, dtype="float32", dynamic=dynamic, extra_args=["--api-key-file", str(keys)], **kwargs)
    cluster.api_headers = {"Authorization": f"Bearer {key}"}
    return cluster


@pytest.fixture(scope="session")
def reference() -> list[dict]:
    """Greedy continuations of SmolLM2-135M-Instruct computed by transformers (fp32)."""
    return REFERENCE


@pytest.fixture(scope="session")
def cgroup_llama(tmp_path_factory) -> tuple:
    """``(model directory, mlx-lm's greedy ids of the whole model)`` of the memory-cgroup
    tests' llama (tests/cgroups.py ``CGROUP_LLAMA``, ``PROMPT``, ``TOKENS``), written once
    per test process: its page cache is charged to the test's own cgroup, not a daemon's."""
    from cgroups import CGROUP_LLAMA, PROMPT, TOKENS
    from tiny_models import make_chat_model, whole_model_greedy

    model = make_chat_model("llama", tmp_path_factory.mktemp("cgroup-llama") / "model", CGROUP_LLAMA)
    return model, whole_model_greedy(model, PROMPT, TOKENS)


@pytest.fixture(scope="session")
def default_location():
    from ringlet.daemon.engine.sources import resolve

    return resolve(None)


#: Test files that must not share the machine with another test file's processes: the
#: tensor-parallel tests start rank processes that busy-wait in MLX's ring collectives
#: and time hangs, stalled collectives and idle ranks' CPU (the planning-only tensor
#: tests, test_tp_config and test_tp_serving, run in the parallel phase); the
#: network-namespace tests time links they shape; the live dashboard runs in tmux; the
#: speed probe times matmuls. They carry the ``serial`` mark.
SERIAL = ("tensor/test_tp_cluster.py", "tensor/test_tp_group.py", "tensor/test_tp_hybrid.py",
          "tensor/test_tp_hybrid_cluster.py", "cluster/test_netns.py", "ops/test_dashboard_cluster.py",
          "probes/test_probe_speed_local.py")

#: Test files that mostly wait (heartbeats, mDNS rounds, handshake retries, systemd's
#: verifier, a memory-pressure calm period) and compute little: they carry the ``waiting``
#: mark and run in a third pytest process beside the parallel phase's two workers, which
#: keep both cores busy but leave these their few milliseconds of CPU (in the serial phase
#: they made its second lane ~60 s longer than the tensor lane beside it).
WAITING = ("cluster/test_membership.py", "cluster/test_discovery_loopback.py", "ops/test_service.py",
           "cluster/test_reconcile.py", "cluster/test_lookup_retry.py", "cluster/test_boot_netns.py",
           "probes/test_pressure_cluster.py")


#: The parallel phase's longest files (25-100 s each on this 2-core machine), longest
#: first: pytest-xdist hands each worker the next whole file in collection order, so
#: running these first leaves short files, not a long one, for the end, where the other
#: worker would otherwise wait idle for the last file.
SLOW_FIRST = ("node/test_resharding.py", "agents/test_agents.py", "engine/test_prefix_cache.py",
              "engine/test_speculation.py", "engine/test_concurrency.py", "engine/test_zoo.py",
              "node/test_hub_cluster.py", "node/test_node_loss.py", "node/test_rolling_upgrade.py",
              "cluster/test_several_models.py",
              "node/test_cache_kinds_cluster.py", "api/test_openai_agents.py", "api/test_long_prefill.py",
              "ops/test_service_upgrade.py", "ops/test_service_models.py", "node/test_cluster.py",
              "cluster/test_heal_netns.py",
              "api/test_tool_streaming.py", "cluster/test_incompatible_version.py", "agents/test_agents_models.py",
              "probes/test_cgroup_cluster.py")


#: Serial files that measure links or time work (shaped veths, the speed probe's matmuls, the
#: dashboard's tokens per second): last in their lane, so they run once the tensor lane
#: beside them, whose ranks busy-wait in collectives, is done or nearly so. Beside it they
#: were CPU-starved: test_netns.py took 135 s there against ~75 s alone (its shaped-link
#: test waited out a whole 30 s link refresh for an unstarved measurement).
SERIAL_LAST = ("cluster/test_netns.py", "ops/test_dashboard_cluster.py", "probes/test_probe_speed_local.py")


def pytest_collection_modifyitems(config, items):
    """Mark the files in :data:`SERIAL` ``serial`` and those in :data:`WAITING` ``waiting``,
    put the files of :data:`SLOW_FIRST` first (in its order) and those of :data:`SERIAL_LAST`
    last (the others keep their order). ``make test`` runs the unmarked files on 2
    pytest-xdist workers (``-n 2 --dist loadfile --no-loadscope-reorder``: each file whole on
    one worker, so its module fixtures start once and its tests run in order; files handed
    out in this order, where xdist would by default hand out the files with the most tests
    first and leave the long one-test files for the end) with the ``waiting`` ones beside
    them in a third process, then the ``serial`` ones in two pytest processes side by side:
    the tensor files one after the other in one, the rest (links, tmux) in the other."""
    def rel(item) -> str:
        return Path(str(item.fspath)).relative_to(TESTS).as_posix()

    for item in items:
        if rel(item).startswith(SERIAL):
            item.add_marker(pytest.mark.serial)
        elif rel(item).startswith(WAITING):
            item.add_marker(pytest.mark.waiting)
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    rank.update({name: len(SLOW_FIRST) + 1 + i for i, name in enumerate(SERIAL_LAST)})
    items.sort(key=lambda item: rank.get(rel(item), len(SLOW_FIRST)))  # stable: a file's tests keep their order
