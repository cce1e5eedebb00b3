"""Thunderbolt links between nodes, matched by domain UUID.

Rule (as in mlx ``_distributed_utils/config.py`` and exo ``apply.py``,
SOURCES.md "Link graph"): every port reports its own bus UUID and the UUID of
the host at the other end of its cable. A link between node A port a and
node B port b exists only when ``a.own == b.peer`` **and** ``b.own == a.peer``.
A one-sided claim (one capture is stale, or the other node is not a member)
is no link. Ports without an own or peer UUID (docks, SSDs, idle ports,
trimmed captures) never form links. Same-node loops (a cable between two
ports of one machine) are ignored.

The matching is pure and order-independent: the same ports give the same links
whichever node runs it and in whatever order the nodes are given.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from .common import ThunderboltPort

log = logging.getLogger("ringlet.daemon.probes")


@dataclass(frozen=True)
class ThunderboltLink:
    """One cable between two nodes; ``node_a < node_b``.

    ``speed_bytes_per_s``: the live link speed both ends report (the lower one
    if they differ; the one known if only one reports it; ``None`` if neither).
    ``rdma_both``: each end sees the other advertise the RDMA service.
    """

    node_a: str
    port_a: str | None
    iface_a: str | None
    node_b: str
    port_b: str | None
    iface_b: str | None
    speed_bytes_per_s: int | None
    rdma_both: bool
    uuid_a: str = ""  # node_a's own domain UUID of this port
    uuid_b: str = ""


def match_links(ports_by_node: Mapping[str, Sequence[ThunderboltPort]]) -> tuple[ThunderboltLink, ...]:
    """All reciprocal Thunderbolt links among the given nodes, sorted."""
    index: dict[str, tuple[str, ThunderboltPort]] = {}
    dup: set[str] = set()
    for node in sorted(ports_by_node):
        for p in ports_by_node[node]:
            if p.own_domain_uuid is None:
                continue
            if p.own_domain_uuid in index:
                dup.add(p.own_domain_uuid)
            index[p.own_domain_uuid] = (node, p)
    for u in sorted(dup):  # a UUID claimed twice cannot be trusted either way
        log.warning("thunderbolt links: domain UUID %s is reported by more than one port; ignored", u)
        del index[u]

    links: dict[tuple[str, str], ThunderboltLink] = {}
    for uuid, (node, p) in index.items():
        if p.peer_domain_uuid is None or p.peer_domain_uuid not in index:
            continue
        other_node, q = index[p.peer_domain_uuid]
        if other_node == node or q.peer_domain_uuid != uuid:
            continue
        (na, pa), (nb, pb) = sorted(((node, p), (other_node, q)), key=lambda t: (t[0], t[1].own_domain_uuid))
        key = (pa.own_domain_uuid or "", pb.own_domain_uuid or "")
        if key in links:
            continue
        speeds = [s for s in (pa.link_speed_bytes_per_s, pb.link_speed_bytes_per_s) if s is not None]
        links[key] = ThunderboltLink(
            node_a=na,
            port_a=pa.port_id,
            iface_a=pa.interface,
            node_b=nb,
            port_b=pb.port_id,
            iface_b=pb.interface,
            speed_bytes_per_s=min(speeds) if speeds else None,
            rdma_both=pa.peer_rdma and pb.peer_rdma,
            uuid_a=key[0],
            uuid_b=key[1],
        )
    return tuple(sorted(links.values(), key=lambda link: (link.node_a, link.node_b, link.uuid_a, link.uuid_b)))


def machines_cabled(links: Iterable[ThunderboltLink], node: str) -> int:
    """How many machines are joined to ``node`` through Thunderbolt, ``node`` included (1 if none).

    Feed it to :func:`macos_thunderbolt.bridge_loop_warning`.
    """
    adj: dict[str, set[str]] = {}
    for link in links:
        adj.setdefault(link.node_a, set()).add(link.node_b)
        adj.setdefault(link.node_b, set()).add(link.node_a)
    seen, stack = {node}, [node]
    while stack:
        for nxt in adj.get(stack.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return len(seen)
