"""Ring order from the link graph (networkx).

Vocabulary: a ring order ``(v0, ..., v_{k-1})`` sends hidden states forward over
the k-1 *forward hops* ``v_i -> v_{i+1}`` and the sampled token back over the
*return hop* ``v_{k-1} -> v0``.

Each pair of nodes talks over its best option for the hidden-state payload:
a direct link (:class:`~.spec.LinkSpec`) or the default network
(``Policy.fallback_*``). The return hop carries only a token, so it is *routed*:
the cheapest store-and-forward path through the graph of direct links and the
default network (Dijkstra/Floyd-Warshall, weight = latency + token_bytes /
bandwidth per edge), which for a daisy chain is the chain itself walked back.

An order is ranked by, in this order:

1. the slowest forward hop's bandwidth (larger is better) -- the cable that caps
   throughput; a Hamiltonian *cycle* over direct links is simply an order whose
   return hop is also direct, and a daisy chain yields a Hamiltonian *path*;
2. the ring's total time, forward hops plus return route (smaller is better),
   counted in integer nanoseconds so ties are exact;
3. the node-id sequence, lexicographically (deterministic tie-break).

Up to ``Policy.exact_ring_max_nodes`` (10) nodes this is solved exactly: a
bitmask search for the largest bandwidth threshold that still admits a
Hamiltonian path (O(2^n n) per threshold, binary search over thresholds), then
Held-Karp over that graph with the return cost depending on the start node
(O(2^n n^2) per start, vectorised over starts). Beyond that it uses networkx's
``greedy_tsp`` on the complete graph (hops below the maximum-spanning-tree
bottleneck penalised) polished by deterministic 2-opt, cut at the best edge.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .spec import LinkSpec, Policy

_PENALTY_NS = 10**13  # larger than any plausible ring time in ns: "avoid this pair"


@dataclass(frozen=True)
class PairLink:
    """How two nodes exchange hidden states: a direct link or the default network."""

    bandwidth_bytes_per_s: float
    latency_s: float
    kind: str
    direct: bool


@dataclass(frozen=True)
class Route:
    """A (possibly multi-hop) path and its cost for a given payload."""

    path: tuple[str, ...]
    bandwidth_bytes_per_s: float  # slowest edge on the path
    latency_s: float  # sum over edges
    time_s: float  # sum over edges of latency + payload / bandwidth (store and forward)
    kind: str  # "direct", "fallback" or "routed"


@dataclass(frozen=True)
class OrderKey:
    """The topological rank of a ring order (see module docstring)."""

    bottleneck_bytes_per_s: float
    total_ns: int


def _ns(seconds: float) -> int:
    return int(round(seconds * 1e9))


class Topology:
    """The link graph of the usable nodes and the costs derived from it.

    Args:
        node_ids: usable node ids (any order; kept sorted).
        links: measured links; links naming other nodes are ignored. Several links
            between one pair keep the best for the hidden-state payload.
        policy: fallback network, token size, exactness limit.
        activation_bytes: hidden-state bytes per token sent on forward hops.
    """

    def __init__(
        self, node_ids: Sequence[str], links: Sequence[LinkSpec], policy: Policy, activation_bytes: int
    ) -> None:
        self.ids = tuple(sorted(node_ids))
        self.index = {n: i for i, n in enumerate(self.ids)}
        self.policy = policy
        self.activation_bytes = activation_bytes
        fb = PairLink(policy.fallback_bandwidth_bytes_per_s, policy.fallback_latency_s, "fallback", False)
        n = len(self.ids)
        best: dict[tuple[str, str], LinkSpec] = {}
        for link in sorted(links, key=lambda x: (x.pair, -x.bandwidth_bytes_per_s, x.latency_s, x.kind)):
            if link.a not in self.index or link.b not in self.index:
                continue
            cur = best.get(link.pair)
            if cur is None or self._payload_time(link.bandwidth_bytes_per_s, link.latency_s) < self._payload_time(
                cur.bandwidth_bytes_per_s, cur.latency_s
            ):
                best[link.pair] = link
        self.direct = best
        # Forward pair options (hidden-state payload): direct link if it is not slower than the fallback.
        self.pairs: dict[tuple[str, str], PairLink] = {}
        self.fwd_bw = np.full((n, n), math.inf)
        self.fwd_ns = np.zeros((n, n))
        for i, a in enumerate(self.ids):
            for j in range(i + 1, n):
                b = self.ids[j]
                link = best.get((a, b))
                choice = fb
                if link is not None:
                    d = PairLink(link.bandwidth_bytes_per_s, link.latency_s, link.kind, True)
                    if self._payload_time(d.bandwidth_bytes_per_s, d.latency_s) <= self._payload_time(
                        fb.bandwidth_bytes_per_s, fb.latency_s
                    ):
                        choice = d
                self.pairs[(a, b)] = choice
                t = _ns(self._payload_time(choice.bandwidth_bytes_per_s, choice.latency_s))
                self.fwd_bw[i, j] = self.fwd_bw[j, i] = choice.bandwidth_bytes_per_s
                self.fwd_ns[i, j] = self.fwd_ns[j, i] = t
        self.route_ns, self._next = self._all_pairs_routes()
        # Plain lists for the scalar-heavy loops (numpy scalar indexing is ~10x slower).
        self._bw = self.fwd_bw.tolist()
        self._fns = [[int(x) for x in row] for row in self.fwd_ns.tolist()]
        self._rns = [[int(x) for x in row] for row in self.route_ns.tolist()]

    # --- costs ----------------------------------------------------------------------

    def _payload_time(self, bandwidth: float, latency: float) -> float:
        return latency + self.activation_bytes / bandwidth

    def pair(self, a: str, b: str) -> PairLink:
        """How ``a`` and ``b`` exchange hidden states."""
        return self.pairs[(a, b) if a < b else (b, a)]

    def forward(self, a: str, b: str) -> Route:
        """The forward hop ``a -> b`` carrying one token's hidden state."""
        p = self.pair(a, b)
        return Route(
            (a, b),
            p.bandwidth_bytes_per_s,
            p.latency_s,
            p.latency_s + self.activation_bytes / p.bandwidth_bytes_per_s,
            "direct" if p.direct else "fallback",
        )

    def _edge_options(self, a: str, b: str) -> tuple[float, float, str]:
        """(bandwidth, latency, kind) of the cheapest single edge a-b for the token payload."""
        tb = self.policy.token_bytes
        fb = (self.policy.fallback_bandwidth_bytes_per_s, self.policy.fallback_latency_s, "fallback")
        link = self.direct.get((a, b) if a < b else (b, a))
        if link is None:
            return fb
        d = (link.bandwidth_bytes_per_s, link.latency_s, "direct")
        return d if d[1] + tb / d[0] <= fb[1] + tb / fb[0] else fb

    def _all_pairs_routes(self) -> tuple[np.ndarray, np.ndarray]:
        """Floyd-Warshall over single-edge token costs (ns); ties keep the direct edge."""
        n = len(self.ids)
        tb = self.policy.token_bytes
        dist = np.zeros((n, n))
        for i in range(n):
            for j in range(i + 1, n):
                bw, lat, _ = self._edge_options(self.ids[i], self.ids[j])
                dist[i, j] = dist[j, i] = _ns(lat + tb / bw)
        nxt = np.tile(np.arange(n), (n, 1))
        for m in range(n):
            via = dist[:, m : m + 1] + dist[m : m + 1, :]
            better = via < dist
            if better.any():
                dist = np.where(better, via, dist)
                nxt = np.where(better, nxt[:, m : m + 1], nxt)
        return dist, nxt

    def back(self, a: str, b: str) -> Route:
        """The return hop ``a -> b`` carrying the sampled token, routed (see module docstring)."""
        i, j = self.index[a], self.index[b]
        path = [a]
        while i != j:
            i = int(self._next[i, j])
            path.append(self.ids[i])
        tb = self.policy.token_bytes
        bws, lats, kinds = [], [], []
        for u, v in zip(path, path[1:], strict=False):
            bw, lat, kind = self._edge_options(u, v)
            bws.append(bw)
            lats.append(lat)
            kinds.append(kind)
        if len(path) > 2:
            kind = "routed"
        else:
            kind = kinds[0] if kinds else "direct"
        return Route(
            tuple(path),
            min(bws) if bws else math.inf,
            sum(lats),
            sum(lat + tb / bw for bw, lat in zip(bws, lats, strict=True)),
            kind,
        )

    def key(self, order: Sequence[str]) -> OrderKey:
        """The topological rank of ``order``."""
        return self._key_idx([self.index[v] for v in order])

    def _key_idx(self, idx: Sequence[int]) -> OrderKey:
        if len(idx) < 2:
            return OrderKey(math.inf, 0)
        bw, fns = self._bw, self._fns
        pairs = list(zip(idx, idx[1:], strict=False))
        return OrderKey(
            float(min(bw[a][b] for a, b in pairs)),
            sum(fns[a][b] for a, b in pairs) + self._rns[idx[-1]][idx[0]],
        )

    # --- choosing the order -----------------------------------------------------------

    def best_order(self) -> tuple[str, ...]:
        """The best ring order over all usable nodes (exact up to ``exact_ring_max_nodes``)."""
        n = len(self.ids)
        if n <= 2:
            return self.ids
        if n <= self.policy.exact_ring_max_nodes:
            return tuple(self.ids[i] for i in self._exact())
        return tuple(self.ids[i] for i in self._approximate())

    def candidate_orders(self, signature) -> list[tuple[str, ...]]:
        """The best order, then its reversal and (up to the exact-ring limit) the rotations
        that tie with it on :meth:`key`,
        without two orders whose node signatures coincide position by position
        (interchangeable for the split), at most ``Policy.max_candidate_orders``.

        Args:
            signature: node id -> hashable description of the machine.
        """
        best = self.best_order()
        k = self.key(best)
        out = [best]
        seen = {tuple(signature(v) for v in best)}
        n = len(best)
        variants = [tuple(reversed(best))]
        # Rotations only while the exact search is cheap; beyond, the best order and its reversal.
        for r in range(1, n if n <= self.policy.exact_ring_max_nodes else 1):
            rot = best[r:] + best[:r]
            variants += [rot, tuple(reversed(rot))]
        for v in variants:
            if len(out) >= self.policy.max_candidate_orders:
                break
            sig = tuple(signature(x) for x in v)
            if sig in seen or self.key(v) != k:
                continue
            seen.add(sig)
            out.append(v)
        return out

    def _exact(self) -> list[int]:
        n = len(self.ids)
        thresholds = sorted({float(self.fwd_bw[i, j]) for i in range(n) for j in range(i + 1, n)}, reverse=True)
        # The largest threshold admitting a Hamiltonian path; monotone, so binary search.
        lo, hi = 0, len(thresholds) - 1  # thresholds[hi] (the smallest) always admits one: complete graph
        while lo < hi:
            mid = (lo + hi) // 2
            if _has_hamiltonian_path(n, self._adjacency(thresholds[mid])):
                hi = mid
            else:
                lo = mid + 1
        tau = thresholds[lo]
        w = np.where(self.fwd_bw >= tau, self.fwd_ns, math.inf)
        np.fill_diagonal(w, math.inf)
        return _held_karp_path(w, self.route_ns)

    def _adjacency(self, tau: float) -> list[int]:
        n = len(self.ids)
        adj = []
        for i in range(n):
            bits = 0
            for j in range(n):
                if i != j and self.fwd_bw[i, j] >= tau:
                    bits |= 1 << j
            adj.append(bits)
        return adj

    def _approximate(self) -> list[int]:
        n = len(self.ids)
        off = ~np.eye(n, dtype=bool)
        if np.all(self.fwd_bw[off] == self.fwd_bw[0, 1]) and np.all(self.fwd_ns[off] == self.fwd_ns[0, 1]):
            if np.all(self.route_ns[off] == self.route_ns[0, 1]):
                return list(range(n))  # every order ties; the id order is the smallest
            # Every pair is alike for hidden states: only the return route can differ.
            return self._best_cut(list(range(n)))
        import networkx as nx  # beyond the exact limit only: importing it costs a process ~0.2 s

        full = nx.Graph()
        for i in range(n):
            for j in range(i + 1, n):
                full.add_edge(i, j, bw=float(self.fwd_bw[i, j]))
        tree = nx.maximum_spanning_tree(full, weight="bw")
        tau = min(d["bw"] for _, _, d in tree.edges(data=True))
        w = self.fwd_ns + np.where(self.fwd_bw >= tau, 0, _PENALTY_NS)
        for i, j in full.edges:
            full[i][j]["w"] = float(w[i, j])
        cycle = nx.approximation.greedy_tsp(full, weight="w", source=0)[:-1]
        cycle = _two_opt(cycle, w.tolist())
        return self._best_cut(cycle)

    def _best_cut(self, cycle: list[int]) -> list[int]:
        """Open a cycle into the path whose key is best (the cut edge becomes the return hop)."""
        best_path, best_key = None, None
        n = len(cycle)
        for r in range(n):
            for path in (cycle[r:] + cycle[:r], list(reversed(cycle[r:] + cycle[:r]))):
                k = self._key_idx(path)
                rank = (-k.bottleneck_bytes_per_s, k.total_ns, path)
                if best_key is None or rank < best_key:
                    best_key, best_path = rank, path
        return best_path


def _has_hamiltonian_path(n: int, adj: list[int]) -> bool:
    """Bitmask DP: reach[mask] = set of nodes where a simple path covering ``mask`` can end."""
    full = (1 << n) - 1
    reach = [0] * (1 << n)
    for v in range(n):
        reach[1 << v] = 1 << v
    for mask in range(1, full + 1):
        r = reach[mask]
        if not r:
            continue
        if mask == full:
            return True
        nb = 0
        while r:
            low = r & -r
            nb |= adj[low.bit_length() - 1]
            r ^= low
        nb &= ~mask
        while nb:
            low = nb & -nb
            reach[mask | low] |= low
            nb ^= low
    return reach[full] != 0


def _held_karp_path(w: np.ndarray, back: np.ndarray) -> list[int]:
    """The lexicographically smallest path minimising sum(w over path) + back[last, first].

    Backward Held-Karp, vectorised over the start node: ``B[s, mask, v]`` is the
    least cost to finish from ``v`` having visited ``mask``, then return to ``s``.
    O(2^n n^2) per start; costs are integers held exactly in float64.
    """
    n = w.shape[0]
    full = (1 << n) - 1
    B = np.full((n, 1 << n, n), math.inf)
    B[:, full, :] = back.T  # B[s, full, v] = back[v, s]
    for mask in range(full - 1, 0, -1):
        us = [u for u in range(n) if not (mask >> u) & 1]
        nxt = np.array([mask | (1 << u) for u in us])
        sub = B[:, nxt, us]  # (s, |us|)
        cand = w[:, us][None, :, :] + sub[:, None, :]  # (s, v, |us|)
        B[:, mask, :] = cand.min(axis=2)
    starts = [B[s, 1 << s, s] for s in range(n)]
    opt = min(starts)
    for s in range(n):
        if starts[s] != opt:
            continue
        path, mask, v = [s], 1 << s, s
        while mask != full:
            for u in range(n):
                if (mask >> u) & 1:
                    continue
                if w[v, u] + B[s, mask | (1 << u), u] == B[s, mask, v]:
                    path.append(u)
                    mask |= 1 << u
                    v = u
                    break
            else:  # pragma: no cover - cannot happen: B[s, mask, v] is attained by some u
                raise AssertionError("Held-Karp reconstruction failed")
        return path
    raise AssertionError("no start attains the optimum")  # pragma: no cover


def _two_opt(cycle: list[int], w: list[list[float]], max_passes: int = 8) -> list[int]:
    """Deterministic first-improvement 2-opt on a symmetric cycle (bounded passes)."""
    n = len(cycle)
    if n < 4:
        return cycle
    c = list(cycle)
    for _ in range(max_passes):
        improved = False
        for i in range(n - 1):
            a, b = c[i], c[i + 1]
            for j in range(i + 2, n if i > 0 else n - 1):
                d, e = c[j], c[(j + 1) % n]
                if w[a][d] + w[b][e] < w[a][b] + w[d][e]:
                    c[i + 1 : j + 1] = reversed(c[i + 1 : j + 1])
                    a, b = c[i], c[i + 1]
                    improved = True
        if not improved:
            break
    return c
