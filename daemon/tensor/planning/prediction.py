"""Tensor-parallel prediction: rough decode seconds per token of each mode.

``auto`` (:func:`ringlet.daemon.tensor.planning.decision.decide`) compares the
predicted decode time per token of the feasible modes (:func:`predict_token_seconds`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence

from ringlet.daemon.tensor.planning.inputs import LINK_DEFAULTS, TPMember, TPModelSpec
from ringlet.daemon.tensor.planning.topology import LinkGraph

#: Memory bandwidth assumed for a member that did not measure it (bytes/s).
DEFAULT_MEMORY_BANDWIDTH = 100e9


def allreduce_seconds(n: int, nbytes: int, ring: Sequence[str], graph: LinkGraph, *, rdma: bool = False) -> float:
    """Ring all-reduce of ``nbytes`` over ``ring``: 2(n-1) steps, each one link latency
    plus ``nbytes/n`` over the slowest link."""
    if n < 2:
        return 0.0
    links = [graph.link(ring[i], ring[(i + 1) % n], rdma=rdma) for i in range(n)]
    links = [x for x in links if x is not None]
    lat = max(x.eff_latency() for x in links)
    bw = min(x.eff_bandwidth() for x in links)
    return 2 * (n - 1) * (lat + nbytes / n / bw)


def predict_token_seconds(
    mode: str,
    spec: TPModelSpec,
    members: Mapping[str, TPMember],
    groups: Sequence[Sequence[str]],
    graph: LinkGraph,
    backends: Sequence[str] = (),
) -> float:
    """Rough decode seconds per token: weights read at the slowest member's memory
    bandwidth (decode is bandwidth bound), split N ways in a tensor group, plus
    2 all-reduces per layer and one for the next token ids; pipeline adds one hop
    per stage boundary and the return to stage 0."""

    def bw(ids: Iterable[str]) -> float:
        return min(members[i].memory_bandwidth or DEFAULT_MEMORY_BANDWIDTH for i in ids)

    if mode == "pipeline":
        ids = list(members)
        t = spec.total_bytes / bw(ids)
        if len(ids) > 1:
            # hidden state per hop over the best links, one hop per member
            lat = [graph.link(a, b).eff_latency() for a, b in itertools.pairwise(ids) if graph.link(a, b)]
            t += len(ids) * (max(lat) if lat else LINK_DEFAULTS["ethernet"][0])
        return t
    total = 0.0
    layers_left = spec.num_layers
    for gi, group in enumerate(groups):
        n = len(group)
        share = layers_left if gi == len(groups) - 1 else round(spec.num_layers / len(groups))
        layers_left -= share
        frac = share / spec.num_layers
        total += (spec.replicated_bytes / len(groups) + spec.sharded_bytes() * frac / n) / bw(group)
        rdma = bool(backends) and backends[gi] == "jaccl"
        ar = allreduce_seconds(n, spec.hidden_size * spec.activation_itemsize, group, graph, rdma=rdma)
        total += (2 * share + 1) * ar
    if len(groups) > 1:
        total += len(groups) * LINK_DEFAULTS["ethernet"][0]
    return total
