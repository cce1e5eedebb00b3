"""MLX's host configuration of a tensor group (:func:`host_config`), formats checked against MLX's source.

* ring (``mlx/distributed/ring/ring.cpp``): ``MLX_RANK`` and ``MLX_HOSTFILE`` =
  path of a JSON list, one entry per rank, each a list of ``"ip:port"``. Rank i
  binds and accepts on its own entry and connects to rank i+1's, so rank i's
  address is its IP on the link from rank i-1 (as in
  ``mlx/_distributed_utils/config.py`` ``configure_ring``).
* jaccl (``mlx/distributed/jaccl/*.cpp``): ``MLX_RANK``, ``MLX_IBV_DEVICES`` =
  path of a JSON matrix ``devices[i][j]`` = the RDMA device of rank i towards
  rank j (``"rdma_<interface>"``; a list when there are several cables; ``null``
  on the diagonal), ``MLX_JACCL_COORDINATOR`` = ``"ip:port"`` where rank 0
  listens for the side channel (``launch_jaccl``: rank 0's first IP).
* :attr:`HostConfig.launch_hostfile`: the same group in ``mlx.launch
  --hostfile`` form (``{"backend", "envs", "hosts": [{"ssh", "ips", "rdma"}]}``)
  for running MLX's own tools by hand.

The only I/O of tensor planning is :meth:`HostConfig.write`.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ringlet.daemon.tensor.planning.decision import TPDecision
from ringlet.daemon.tensor.planning.inputs import TPLink, TPMember
from ringlet.daemon.tensor.planning.topology import LinkGraph

HOSTFILE_NAME = "mlx_hostfile.json"
IBV_DEVICES_NAME = "mlx_ibv_devices.json"


@dataclass(frozen=True)
class HostConfig:
    """MLX's configuration for one tensor group.

    Attributes:
        backend: "ring" or "jaccl".
        ranks: node ids in rank order.
        files: file name -> JSON text every rank needs (written into a directory on
            each machine, see :meth:`write`).
        common_env: variables every rank gets; ``{dir}`` stands for the directory
            the files were written to (:meth:`env` fills it in).
        launch_hostfile: the group in ``mlx.launch --hostfile`` form.
    """

    backend: str
    ranks: tuple[str, ...]
    files: Mapping[str, str]
    common_env: Mapping[str, str]
    launch_hostfile: Mapping[str, Any]

    @property
    def size(self) -> int:
        return len(self.ranks)

    def env(self, rank: int, directory: str | Path) -> dict[str, str]:
        """The environment of rank ``rank`` with the files in ``directory``."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} out of range for a group of {self.size}")
        d = str(directory)
        env = {k: v.replace("{dir}", d) for k, v in self.common_env.items()}
        env["MLX_RANK"] = str(rank)
        return env

    def write(self, directory: str | Path) -> list[Path]:
        """Write :attr:`files` into ``directory`` (created); returns their paths."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        out = []
        for name, text in self.files.items():
            p = d / name
            tmp = p.with_suffix(p.suffix + ".tmp")
            tmp.write_text(text)
            tmp.replace(p)
            out.append(p)
        return out


def host_config(
    ranks: Sequence[str],
    backend: str,
    members: Sequence[TPMember],
    links: Iterable[TPLink],
    *,
    base_port: int = 32323,
    envs: Sequence[str] = (),
) -> HostConfig:
    """MLX host configuration for one tensor group, ranks in the given order.

    ring: rank i listens on ``<its IP on the link from rank i-1>:<base_port + i>``
    (the member's host when the link has no IP; distinct ports let ranks share a
    host). jaccl: ``devices[i][j] = "rdma_<i's interface on the i-j cable>"`` (a list
    when every pair has several RDMA cables, as many as the least cabled pair),
    coordinator ``<rank 0's host>:<base_port>``.

    Raises:
        ValueError: unknown backend or member, a missing link, an RDMA link without
            an interface name.
    """
    by_id = {m.node_id: m for m in members}
    ranks = tuple(ranks)
    for r in ranks:
        if r not in by_id:
            raise ValueError(f"rank {r!r} is not a member")
    n = len(ranks)
    graph = LinkGraph(list(ranks), links)
    if backend == "ring":
        hosts = []
        for i, node in enumerate(ranks):
            ip = by_id[node].host
            if n > 1:
                link = graph.link(ranks[i - 1], node)
                if link is None:
                    raise ValueError(f"no link between {ranks[i - 1]} and {node} for the ring")
                ip = link.ip(node) or ip
            hosts.append([f"{ip}:{base_port + i}"])
        files = {HOSTFILE_NAME: json.dumps(hosts)}
        env = {"MLX_HOSTFILE": "{dir}/" + HOSTFILE_NAME}
        launch = {
            "backend": "ring",
            "envs": list(envs),
            "hosts": [
                {"ssh": by_id[r].host, "ips": [h[0].rsplit(":", 1)[0]], "rdma": []}
                for r, h in zip(ranks, hosts, strict=True)
            ],
        }
        return HostConfig("ring", ranks, files, env, launch)
    if backend == "jaccl":
        pairs = {(a, b): graph.rdma_links(a, b) for a, b in itertools.permutations(ranks, 2)}
        missing = [f"{a}-{b}" for (a, b), ls in pairs.items() if not ls and a < b]
        if missing:
            raise ValueError(f"jaccl needs an RDMA link between every pair; missing: {', '.join(missing)}")
        count = min((len(ls) for ls in pairs.values()), default=1)
        matrix: list[list[Any]] = []
        for a in ranks:
            row: list[Any] = []
            for b in ranks:
                if a == b:
                    row.append(None)
                    continue
                devs = []
                for link in pairs[a, b][:count]:
                    iface = link.iface(a)
                    if not iface:
                        raise ValueError(f"RDMA link {a}-{b} has no interface name on {a}")
                    devs.append(f"rdma_{iface}")
                row.append(devs[0] if count == 1 else devs)
            matrix.append(row)
        coordinator = f"{by_id[ranks[0]].host}:{base_port}"
        files = {IBV_DEVICES_NAME: json.dumps(matrix)}
        env = {"MLX_IBV_DEVICES": "{dir}/" + IBV_DEVICES_NAME, "MLX_JACCL_COORDINATOR": coordinator}
        launch = {
            "backend": "jaccl",
            "envs": list(envs),
            "hosts": [
                {"ssh": by_id[r].host, "ips": [by_id[r].host], "rdma": row}
                for r, row in zip(ranks, matrix, strict=True)
            ],
        }
        return HostConfig("jaccl", ranks, files, env, launch)
    raise ValueError(f"no MLX host configuration for backend {backend!r}")


def decision_host_configs(
    decision: TPDecision, members: Sequence[TPMember], links: Iterable[TPLink], *, base_port: int = 32323
) -> tuple[HostConfig, ...]:
    """One :class:`HostConfig` per tensor group of ``decision`` (none for pipeline).
    Groups get disjoint port ranges (``base_port + 64 * group``)."""
    links = list(links)
    return tuple(
        host_config(g, b, members, links, base_port=base_port + 64 * i)
        for i, (g, b) in enumerate(zip(decision.groups, decision.group_backends, strict=True))
    )
