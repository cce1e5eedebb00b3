"""What ``/v1/cluster`` shows of the cluster side: members, the measured links, unreachable
routes, the mode and the negotiation's state."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ringlet.daemon.cluster.proposal import routes_report
from ringlet.daemon.cluster.topology import build_graph, to_json

if TYPE_CHECKING:
    from ringlet.daemon.cluster.negotiation import Negotiator

__all__ = ["cluster_view"]


def cluster_view(negotiator: Negotiator) -> dict:
    """Members, topology and negotiation state of ``negotiator``'s node, JSON-safe.

    ``negotiation.refusals`` counts the refusals this node gave (``given: <reason>``) and
    its proposals received (``received: <reason>``) since it started, by reason up to its
    first colon (the log says each once, then with a count: :class:`.refusals.CountedLog`)."""
    ids = negotiator.membership.alive_ids()
    records = {i: negotiator.membership.record_of(i) or {} for i in ids}
    graph = to_json(build_graph(records))
    members = []
    for m in negotiator.membership.info():
        rec = m.get("record") or {}
        members.append({
            "node_id": m["node_id"], "state": m["state"], "grpc_address": m["grpc_address"],
            "api_url": rec.get("api_url"), "name": rec.get("name"), "chip": rec.get("chip"),
            "memory_total_bytes": rec.get("memory_total_bytes"),
            "memory_usable_bytes": rec.get("usable_memory_bytes"),
            "memory_usable_source": rec.get("usable_memory_source"),  # which rule set it, in words
            "silent_s": m.get("silent_s"), "record_version": m["record_version"],
            "release": m["release"], "protocol_version": m["protocol_version"], "capabilities": m["capabilities"],
        })
    tp = negotiator.tp.info() if negotiator.tp is not None else {"mode": "pipeline", "backend": "none", "ranks": []}
    return {
        "mode": tp["mode"],
        "tp": tp,
        "policy": negotiator.policy.name,
        "members": members,
        "links": graph["links"],
        "routes": routes_report(records, negotiator.node.plan),  # every address a member could not reach
        # nodes of another wire protocol version, kept out: {node_id, address, release, protocol_version, reason}
        "incompatible": negotiator.membership.incompatible.info(),
        # this node's own addresses (cluster/netwatch.py, set by the runner): what it advertises, or why none
        "network": network.info() if (network := getattr(negotiator, "network", None)) is not None else None,
        "negotiation": {"state": negotiator.state, **negotiator.agreement.info(negotiator.membership),
                        "membership_digest": negotiator.membership.digest(), "last_result": negotiator.last_result,
                        "refusals": dict(negotiator.said.totals)},
    }
