"""Tensor-parallel topology: the best link per pair of members, and ring finding.

The MLX ring backend only talks to its left and right neighbours, so a ring group
needs a Hamiltonian cycle through its members (:func:`find_ring`). Ranks are
ordered along the ring, the leader (the node that takes API requests and drives
the group) is rank 0. Among several cycles the one with the best bottleneck
bandwidth, then the lowest total latency, then the lexicographically smallest
order wins.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

from ringlet.daemon.tensor.planning.inputs import TPLink

#: Largest group searched exhaustively for the best ring order.
EXACT_RING_LIMIT = 9


class LinkGraph:
    """Best link per pair of members."""

    def __init__(self, members: Sequence[str], links: Iterable[TPLink]):
        self.nodes = tuple(sorted(members))
        self.best: dict[frozenset[str], TPLink] = {}
        self.all: dict[frozenset[str], list[TPLink]] = {}
        known = set(self.nodes)
        for link in links:
            if link.a == link.b or link.a not in known or link.b not in known:
                continue
            key = frozenset((link.a, link.b))
            self.all.setdefault(key, []).append(link)
        for key, ls in self.all.items():
            ls.sort(key=_link_order)
            self.best[key] = ls[0]

    def link(self, a: str, b: str, *, rdma: bool = False) -> TPLink | None:
        if rdma:
            ls = [x for x in self.all.get(frozenset((a, b)), ()) if x.rdma]
            return ls[0] if ls else None
        return self.best.get(frozenset((a, b)))

    def rdma_links(self, a: str, b: str) -> list[TPLink]:
        return [x for x in self.all.get(frozenset((a, b)), ()) if x.rdma]

    def full_rdma_mesh(self, nodes: Sequence[str]) -> bool:
        return all(self.link(a, b, rdma=True) for a, b in itertools.combinations(nodes, 2))


def _link_order(link: TPLink) -> tuple:
    ends = tuple(sorted((link.a, link.b)))
    return (
        not link.rdma,
        -link.eff_bandwidth(),
        link.eff_latency(),
        link.kind,
        ends,
        str(link.iface_a if link.a == ends[0] else link.iface_b),
        str(link.iface_b if link.a == ends[0] else link.iface_a),
    )


def find_ring(
    nodes: Sequence[str], links: Iterable[TPLink], *, start: str | None = None, rdma: bool = False
) -> tuple[str, ...] | None:
    """The best Hamiltonian cycle through ``nodes`` as a rank order starting at ``start``
    (default: the smallest id), or ``None`` when the links contain none.

    Two nodes need one link (MLX's ring then opens two sockets to the same peer);
    one node is a ring by itself. Best = highest bottleneck bandwidth, then lowest
    total latency, then lexicographically smallest order (the two directions of a
    cycle are the same ring; the one whose second rank is smaller is returned).
    With ``rdma`` only RDMA links count.
    """
    graph = links if isinstance(links, LinkGraph) else LinkGraph(nodes, links)
    order = sorted(nodes)
    if not order:
        return None
    start = start if start is not None else order[0]
    if start not in order:
        raise ValueError(f"ring start {start!r} is not among the nodes")
    if len(order) == 1:
        return (start,)
    rest = [n for n in order if n != start]
    best: tuple | None = None
    best_ring: tuple[str, ...] | None = None

    def score(ring: tuple[str, ...]) -> tuple | None:
        edges = []
        for i in range(len(ring)):
            link = graph.link(ring[i], ring[(i + 1) % len(ring)], rdma=rdma)
            if link is None:
                return None
            edges.append(link)
        if len(ring) == 2:
            edges = edges[:1]
        return (-min(e.eff_bandwidth() for e in edges), sum(e.eff_latency() for e in edges), ring)

    if len(order) <= EXACT_RING_LIMIT:
        for perm in itertools.permutations(rest):
            if len(perm) > 1 and perm[0] > perm[-1]:
                continue  # the reverse direction of a ring already seen
            ring = (start, *perm)
            s = score(ring)
            if s is not None and (best is None or s < best):
                best, best_ring = s, ring
        return best_ring

    # Large groups: depth-first search, neighbours in best-link order, first cycle wins.
    def dfs(path: list[str], seen: set[str]) -> tuple[str, ...] | None:
        if len(path) == len(order):
            return tuple(path) if graph.link(path[-1], start, rdma=rdma) else None
        cands = [n for n in order if n not in seen and graph.link(path[-1], n, rdma=rdma)]
        cands.sort(key=lambda n: _link_order(graph.link(path[-1], n, rdma=rdma)))
        for n in cands:
            seen.add(n)
            path.append(n)
            found = dfs(path, seen)
            if found:
                return found
            path.pop()
            seen.discard(n)
        return None

    return dfs([start], {start})
