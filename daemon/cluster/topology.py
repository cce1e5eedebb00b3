"""Topology: the cluster as a networkx graph, built the same way on every member.

Nodes are members (with their capabilities from their records); edges are links
with their kind, measured bandwidth and RTT. Each node measures its own outgoing
links and publishes them in its record, so every member holding the same records
builds the same graph. A link measured from both ends takes the slower bandwidth,
the larger RTT and the slower kind. The graph is also what the planner is fed
(:func:`planner_inputs`).
"""

from __future__ import annotations

import networkx as nx

from ringlet.daemon.cluster.linkprobe import combine_kinds
from ringlet.partitioning import LinkSpec, NodeSpec

# Fallbacks when a record lacks a measured figure (a node that just joined):
# a conservative 100 GB/s memory bandwidth and 1 TFLOP/s compute keep it plannable.
DEFAULT_BANDWIDTH = 100e9
DEFAULT_FLOPS = 1e12
#: A link whose measured throughput is below this fraction of the median link is "slow".
SLOW_FRACTION = 0.25


def build_graph(records: dict[str, dict]) -> nx.Graph:
    """The topology graph from ``{node_id: record}``.

    Node attributes: ``memory_bytes`` (usable), ``bandwidth_bytes_per_s``, ``flops``,
    ``name``, ``chip``. Edge attributes: ``kind``, ``bandwidth_bytes_per_s``,
    ``rtt_s``, ``slow`` (bool: under :data:`SLOW_FRACTION` of the median edge).
    """
    g = nx.Graph()
    for node_id in sorted(records):
        rec = records[node_id] or {}
        g.add_node(node_id, memory_bytes=int(rec.get("usable_memory_bytes") or 0),
                   bandwidth_bytes_per_s=float(rec.get("memory_bandwidth_bytes_per_s") or DEFAULT_BANDWIDTH),
                   flops=float(rec.get("flops") or DEFAULT_FLOPS), name=rec.get("name", node_id),
                   chip=rec.get("chip", ""))
    for a in sorted(records):
        for b, link in sorted(((records[a] or {}).get("links") or {}).items()):
            if b not in records or b == a:
                continue
            bw, rtt = float(link.get("bandwidth_bytes_per_s") or 0), float(link.get("rtt_s") or 0)
            if g.has_edge(a, b):
                e = g.edges[a, b]
                e["bandwidth_bytes_per_s"] = min(e["bandwidth_bytes_per_s"], bw) if bw else e["bandwidth_bytes_per_s"]
                e["rtt_s"] = max(e["rtt_s"], rtt)
                e["kind"] = combine_kinds(e["kind"], link.get("kind", "ethernet"))
            else:
                g.add_edge(a, b, kind=link.get("kind", "ethernet"), bandwidth_bytes_per_s=bw, rtt_s=rtt)
    bws = sorted(d["bandwidth_bytes_per_s"] for _, _, d in g.edges(data=True) if d["bandwidth_bytes_per_s"] > 0)
    median = bws[len(bws) // 2] if bws else 0.0
    for _, _, d in g.edges(data=True):
        d["slow"] = bool(median and d["bandwidth_bytes_per_s"] < SLOW_FRACTION * median)
    return g


def planner_inputs(g: nx.Graph) -> tuple[list[NodeSpec], list[LinkSpec]]:
    """Node and link specs for :func:`ringlet.partitioning.make_plan`. A link's latency
    is half its RTT (one way)."""
    nodes = [NodeSpec(node_id=n, memory_bytes=d["memory_bytes"], bandwidth_bytes_per_s=d["bandwidth_bytes_per_s"],
                      flops=d["flops"]) for n, d in sorted(g.nodes(data=True))]
    links = [LinkSpec(a=a, b=b, bandwidth_bytes_per_s=d["bandwidth_bytes_per_s"], latency_s=d["rtt_s"] / 2,
                      kind=d.get("kind", "direct"))
             for a, b, d in sorted(g.edges(data=True)) if d["bandwidth_bytes_per_s"] > 0]
    return nodes, links


def to_json(g: nx.Graph) -> dict:
    """Nodes and links of the graph, JSON-safe (for ``/v1/cluster``)."""
    return {
        "nodes": [{"node_id": n, **d} for n, d in sorted(g.nodes(data=True))],
        "links": [{"a": a, "b": b, **d} for a, b, d in sorted(g.edges(data=True))],
    }
