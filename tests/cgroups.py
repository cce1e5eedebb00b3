"""Real memory cgroups for daemon tests (#43): this kernel's cgroup v1 memory controller
is writable by root; each test cgroup is a child of the test process's own memory cgroup
(so its daemons stay accounted where the test is) and is removed afterwards.

A daemon joins its cgroup before it starts: ``sh -c 'echo $$ > cgroup.procs; exec ringlet run ...'``,
so every byte it ever holds is charged there and its first memory probe sees the limit.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from pathlib import Path

import pytest

from ringlet.daemon.ops.demo import LocalCluster

PAGE = 4096
#: The random llama the memory-cgroup cluster tests share (tests/conftest.py's
#: ``cgroup_llama``): 10 layers of 48 MiB (float32: hidden 1024, MLP 3072, 8 query and 2
#: key/value heads) and the tests' 98-token vocabulary, 483 MB in all; and their prompt.
CGROUP_LLAMA = {
    "model_type": "llama", "hidden_size": 1024, "num_hidden_layers": 10, "intermediate_size": 3072,
    "num_attention_heads": 8, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": 98,
    "max_position_embeddings": 1024, "rope_theta": 10000.0, "tie_word_embeddings": False,
}
PROMPT = [5, 17, 42, 90, 8, 50, 3, 77]
TOKENS = 8


def own_memory_cgroup() -> Path | None:
    """The v1 memory cgroup directory of this process, or ``None`` (no v1 memory controller)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            d = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            return d if (d / "memory.limit_in_bytes").exists() else None
    return None


def require_cgroups() -> Path:
    """The parent for test cgroups; skips the test where they cannot be made."""
    parent = own_memory_cgroup()
    if parent is None or os.geteuid() != 0 or not os.access(parent, os.W_OK):
        pytest.skip("needs root and a writable cgroup v1 memory controller")
    return parent


class Cgroup:
    """One memory cgroup: ``limit(bytes)`` writes ``memory.limit_in_bytes`` and returns the
    value the kernel keeps (rounded down to a page); ``remove()`` once its processes ended."""

    def __init__(self, parent: Path, name: str, limit: int | None = None):
        self.path = parent / f"{name}-{os.getpid()}"
        self.path.mkdir(exist_ok=True)
        if limit is not None:
            self.limit(limit)

    def limit(self, nbytes: int) -> int:
        (self.path / "memory.limit_in_bytes").write_text(str(nbytes))
        kept = int((self.path / "memory.limit_in_bytes").read_text())
        assert kept == nbytes // PAGE * PAGE, (nbytes, kept)
        return kept

    def read(self, name: str) -> str:
        return (self.path / name).read_text()

    def usage(self) -> int:
        return int(self.read("memory.usage_in_bytes"))

    def peak(self) -> int:
        return int(self.read("memory.max_usage_in_bytes"))

    def reset_peak(self) -> None:
        """Start the peak anew from what the cgroup holds now (v1: writing 0 to
        ``memory.max_usage_in_bytes``)."""
        (self.path / "memory.max_usage_in_bytes").write_text("0")

    def oom_kills(self) -> int:
        m = re.search(r"^oom_kill (\d+)$", self.read("memory.oom_control"), re.M)
        return int(m.group(1)) if m else 0

    def remove(self) -> None:
        """rmdir (its memory goes to the parent); retried while the last process exits."""
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)
        self.path.rmdir()


@contextlib.contextmanager
def cgroups(parent: Path, limits: dict[str, int | None]):
    """``{name: Cgroup}`` made for the block, removed after it (even on a failure)."""
    made: dict[str, Cgroup] = {}
    try:
        for name, limit in limits.items():
            made[name] = Cgroup(parent, name, limit)
        yield made
    finally:
        for cg in made.values():
            with contextlib.suppress(OSError):
                cg.remove()


class CgroupCluster(LocalCluster):
    """A :class:`LocalCluster` whose node ``i`` starts inside ``cgroups[i]`` (``None``: where
    the test runs)."""

    def __init__(self, *args, cgroups: list[Cgroup | None], **kwargs):
        super().__init__(*args, **kwargs)
        self.cgroups = list(cgroups)

    def _command(self, i: int) -> list[str]:
        cmd = super()._command(i)
        cg = self.cgroups[i] if i < len(self.cgroups) else None
        if cg is None:
            return cmd
        return ["sh", "-c", f'echo $$ > {cg.path}/cgroup.procs && exec "$@"', "sh", *cmd]


@contextlib.contextmanager
def cgroup_ring(log_dir: Path, model: Path, limits: dict[str, int], ids: dict[str, str], extra_args: list[str]):
    """A dynamic :class:`CgroupCluster` of ``model`` whose node ``i`` runs in a cgroup of
    ``limits``' ``i``-th limit with the ``i``-th of ``ids`` (``{name: node id}``; on loopback
    the planner orders nodes of equal speed by id). Yields ``(cluster, {name: Cgroup})``;
    everything is stopped and removed afterwards. Skips where cgroups cannot be made."""
    parent = require_cgroups()
    fix_node_ids(log_dir, list(ids.values()))
    with cgroups(parent, limits) as cg, CgroupCluster(
            len(ids), model=str(model), dynamic=True, cgroups=[cg[k] for k in ids], log_dir=str(log_dir),
            extra_args=extra_args) as c:
        yield c, cg


def fix_node_ids(log_dir: Path, ids: list[str]) -> None:
    """Give node ``i`` of a :class:`LocalCluster` on ``log_dir`` the id ``ids[i]`` (16 hex
    chars): on loopback the planner orders equal nodes by id, so a test can say which node
    is the first stage and which the last."""
    import json

    for i, node_id in enumerate(ids):
        d = log_dir / f"data{i}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "node.json").write_text(json.dumps({"node_id": node_id, "created_at": time.time(), "history": []}))


def expected_usable(limit: int, source: str) -> int:
    """What a node in a cgroup of ``limit`` bytes offers the planner, by hand: 80 % of the
    limit, less the daemon's runtime and the cgroup's other processes (as its
    ``usable_memory_source`` names them, rounded: 85.3 MiB, 195 MiB), less the boundary
    budget (a sixteenth), the work space and the tokenizer the source names (one step's
    activations and 8 MiB at least: tests/engine/test_work_space.py checks them by hand)."""
    held = 0.0
    for pattern in (r"less ([\d.]+) ([KMG]iB) the daemon's runtime",
                    r"and ([\d.]+) ([KMG]iB) its other processes hold"):
        if m := re.search(pattern, source):
            held += _size(m)
    offered = int(limit * 0.8 - held)
    work = _size(m) if (m := re.search(r"and ([\d.]+) ([KMG]iB) for one step's activations", source)) else 0
    tokenizer = _size(m) if (m := re.search(r"and ([\d.]+) ([KMG]iB) for the tokenizer", source)) else 0
    return int(offered - offered // 16 - work - tokenizer)


def _size(m: re.Match) -> float:
    return float(m.group(1)) * {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}[m.group(2)]
