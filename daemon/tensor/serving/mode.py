"""The mode decision of a negotiated plan: made by the proposer from membership records
(:func:`decide_mode`), read by the members (:func:`group_of`) and checked in a proposal
(:func:`check_tp_dict`).

* **Decision** (proposer, :func:`decide_mode`): :func:`~ringlet.daemon.tensor.planning.decision.decide`
  over the members (memory and addresses from their records, :func:`cluster_inputs`) and one
  link per pair (the measured link's kind and bandwidth when there is one). The decision
  travels in the proposal (``Proposal.tp_json``, :func:`tp_json`) and becomes ``ServingPlan.tp``.
* **Modes.** ``auto`` keeps the pipeline when members share a machine (loopback links);
  ``--mode tensor`` (or ``hybrid``) runs that mode whenever the members can, else the
  pipeline with ``refused`` saying why.
* **Hybrid**: the decision lists the groups (``groups``, each in rank order, its leader
  first) and each group's layer range (``layer_ranges``: an even split,
  :func:`hybrid_layer_ranges`).
* **Releases**: members that run several releases (a rolling upgrade) keep the pipeline: a
  group's ranks run lockstep collectives and a side channel whose protocol is their
  release's, which no capability describes.

See :mod:`ringlet.daemon.tensor.serving` for how a tensor plan is served.
"""

from __future__ import annotations

import ipaddress
import itertools
import json
from collections.abc import Mapping, Sequence
from typing import Any

from ringlet.daemon.tensor.planning.decision import TPDecision, TPRefused, decide
from ringlet.daemon.tensor.planning.inputs import TPLink, TPMember, TPModelSpec
from ringlet.daemon.tensor.planning.links import links_from_thunderbolt
from ringlet.daemon.tensor.serving.thunderbolt import record_ports
from ringlet.daemon.wire import versions

#: ``--mode`` values.
REQUESTED_MODES = ("auto", "pipeline", "tensor", "hybrid")
#: Modes whose plans run tensor groups.
GROUP_MODES = ("tensor", "hybrid")


def address_host(address: str) -> str:
    """The host part of a ``host:port`` address (brackets of an IPv6 host removed)."""
    return address.rsplit(":", 1)[0].strip("[]")


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _links_of(records: Mapping[str, dict], node_id: str) -> dict:
    return (records.get(node_id) or {}).get("links") or {}


def cluster_inputs(
    ids: Sequence[str], records: Mapping[str, dict], addresses: Mapping[str, str]
) -> tuple[list[TPMember], list[TPLink]]:
    """TPMembers and one TPLink per pair of members, from membership records, plus one
    per Thunderbolt cable both ends published (``record["thunderbolt"]``, with RDMA).

    Link kind and bandwidth come from either end's measured link (``record["links"]``);
    a pair not measured yet is ``loopback`` when both addresses are loopback or equal,
    else ``ethernet``. Latency is left to the kind's default: the measured round trip
    is ringlet's gRPC stack (~1 ms on loopback), not MLX's ring socket (~35 us).
    """
    members = []
    for i in ids:
        rec = records.get(i) or {}
        members.append(
            TPMember(
                node_id=i,
                host=address_host(addresses.get(i, "")),
                usable_memory=int(rec.get("usable_memory_bytes") or 0),
                memory_bandwidth=rec.get("memory_bandwidth_bytes_per_s") or None,
            )
        )
    links = []
    for a, b in itertools.combinations(sorted(ids), 2):
        measured = _links_of(records, a).get(b) or _links_of(records, b).get(a)
        ha, hb = address_host(addresses.get(a, "")), address_host(addresses.get(b, ""))
        if measured and measured.get("kind"):
            kind = str(measured["kind"])
            bandwidth = measured.get("bandwidth_bytes_per_s") or None
        else:
            kind = "loopback" if (_is_loopback(ha) and _is_loopback(hb)) or ha == hb else "ethernet"
            bandwidth = None
        links.append(TPLink(a, b, kind, bandwidth=bandwidth))
    # Thunderbolt cables both ends published (RDMA on both ends makes JACCL possible)
    from ringlet.daemon.probes.links import match_links

    cables = match_links({i: record_ports(records.get(i) or {}) for i in ids})
    links.extend(links_from_thunderbolt(cables))
    return members, links


def pipeline_decision(requested: str, reason: str, refused: str | None = None) -> dict[str, Any]:
    """The mode decision of a pipeline plan: ``reason`` and, when ``requested`` was refused, why."""
    out = {"mode": "pipeline", "backend": "none", "ranks": [], "reason": reason, "requested": requested}
    if refused:
        out["refused"] = refused
    return out


def decide_mode(
    requested: str,
    ids: Sequence[str],
    records: Mapping[str, dict],
    addresses: Mapping[str, str],
    spec: TPModelSpec,
    leader: str,
) -> dict[str, Any]:
    """The mode decision of a proposal (``TPDecision.to_dict()`` plus ``requested`` and,
    when tensor was asked for but cannot run, ``refused``): see the module docstring.

    Never raises for a cluster that cannot run tensor parallel: the answer is then the
    pipeline, with the reason.
    """
    if requested == "pipeline":
        return pipeline_decision(requested, "--mode pipeline")
    partial = [i for i in ids if (records.get(i) or {}).get("whole_model") is False]
    if partial and len(ids) > 1:
        why = (f"tensor mode refused: {', '.join(i[:16] for i in partial)} hold(s) only part of the model "
               "(--fetch-model); every rank needs all of it")
        return pipeline_decision(requested, f"{why}; serving the pipeline",
                                 refused=why if requested == "tensor" else None)
    releases = {i: versions.release_of(records.get(i)) for i in ids}
    if len(set(releases.values())) > 1:  # ranks run lockstep collectives over a protocol of their release
        why = ("tensor mode refused: the members run several releases (" + ", ".join(
            f"{i[:16]} {r}" for i, r in sorted(releases.items())) + "); a tensor group's ranks must run one: "
               "finish the upgrade")
        return pipeline_decision(requested, f"{why}; serving the pipeline",
                                 refused=why if requested == "tensor" else None)
    members, links = cluster_inputs(ids, records, addresses)
    try:
        decision = decide(members, links, spec, None if requested == "auto" else requested, leader=leader)
    except TPRefused as exc:
        return pipeline_decision(requested, f"{exc}; serving the pipeline", refused=str(exc))
    except ValueError as exc:  # no members, unknown leader: nothing to decide
        return pipeline_decision(requested, f"pipeline: {exc}")
    if decision.mode == "pipeline":
        return {**pipeline_decision(requested, decision.reason), "predicted_s_per_token": dict(decision.predicted)}
    out = {**decision.to_dict(), "requested": requested}
    if decision.mode == "hybrid":
        try:
            out["layer_ranges"] = [list(r) for r in hybrid_layer_ranges(spec.num_layers, len(decision.groups))]
        except ValueError as exc:  # more groups than layers
            why = f"hybrid mode refused: {exc}"
            return pipeline_decision(requested, f"{why}; serving the pipeline", refused=why)
    if decision.mode in GROUP_MODES and requested == "auto":
        shared = [f"{x.a[:8]}-{x.b[:8]}" for x in links if x.kind == "loopback"]
        if shared:
            return pipeline_decision(
                requested,
                f"pipeline: members share a machine ({', '.join(shared)} over loopback), where tensor "
                f"ranks would split one memory bus and gain nothing (would have been: {decision.reason}); "
                f"--mode {decision.mode} forces it",
            )
    return out


def hybrid_layer_ranges(num_layers: int, groups: int) -> list[tuple[int, int]]:
    """Half-open layer ranges of ``groups`` chained tensor groups: an even split, the
    earlier groups taking one more layer when it does not divide (the last group also
    runs the output head). E.g. 30 layers, 4 groups: [0, 8), [8, 16), [16, 23), [23, 30).

    Raises:
        ValueError: fewer layers than groups, or no group.
    """
    if groups < 1 or num_layers < groups:
        raise ValueError(f"cannot split {num_layers} layers into {groups} groups")
    base, extra = divmod(num_layers, groups)
    out, start = [], 0
    for i in range(groups):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


def group_of(tp: Mapping[str, Any] | None, node_id: str) -> tuple[int, list[str], str, tuple[int, int] | None] | None:
    """The tensor group of a plan's mode decision that ``node_id`` belongs to:
    ``(index, ranks, backend, layer range or None for every layer)``; ``None`` when the
    plan runs no group or the node is in none."""
    if not tp or tp.get("mode") not in GROUP_MODES:
        return None
    if tp["mode"] == "tensor":
        ranks = [str(r) for r in tp["ranks"]]
        return (0, ranks, str(tp["backend"]), None) if node_id in ranks else None
    for i, grp in enumerate(tp["groups"]):
        if node_id in grp:
            a, b = tp["layer_ranges"][i]
            return i, [str(r) for r in grp], str(tp["group_backends"][i]), (int(a), int(b))
    return None


def group_decision(ranks: Sequence[str], backend: str, reason: str) -> TPDecision:
    """The :class:`TPDecision` of one committed group (rank 0 first)."""
    ranks = tuple(str(r) for r in ranks)
    return TPDecision("tensor", backend, ranks, reason, (ranks,), (backend,))


def check_tp_dict(d: Any, member_ids: Sequence[str], proposer: str, num_layers: int | None = None) -> str | None:
    """Why a proposal's mode decision is malformed (``None`` = fine)."""
    if not isinstance(d, dict) or d.get("mode") not in ("pipeline", *GROUP_MODES):
        return "mode decision is not pipeline, tensor or hybrid"
    if d["mode"] == "pipeline":
        return None
    ranks = d.get("ranks")
    if not isinstance(ranks, list) or sorted(map(str, ranks)) != sorted(member_ids):
        return "tensor ranks are not exactly the members"
    if ranks[0] != proposer:
        return "rank 0 of a tensor plan must be its proposer"
    if d["mode"] == "tensor":
        if d.get("backend") not in ("ring", "jaccl"):
            return f"unknown tensor backend {str(d.get('backend'))[:16]!r}"
        return None
    groups, backends, layer_ranges = d.get("groups"), d.get("group_backends"), d.get("layer_ranges")
    if (not isinstance(groups, list) or len(groups) < 2 or not all(isinstance(g, list) and len(g) >= 2 for g in groups)
            or [str(r) for g in groups for r in g] != [str(r) for r in ranks]):
        return "hybrid groups are not the ranks in order, in groups of 2 or more"
    if not isinstance(backends, list) or len(backends) != len(groups) or any(b not in ("ring", "jaccl")
                                                                             for b in backends):
        return "unknown hybrid group backend"
    try:
        bounds = [(int(a), int(b)) for a, b in layer_ranges]
    except (TypeError, ValueError):
        return "hybrid layer ranges are not pairs of integers"
    edges = [0] + [b for _, b in bounds]
    if (len(bounds) != len(groups) or any(a != edges[i] or b <= a for i, (a, b) in enumerate(bounds))
            or (num_layers is not None and edges[-1] != num_layers)):
        return "hybrid layer ranges do not cover every layer exactly once, in order"
    return None


def tp_json(d: Mapping[str, Any] | None) -> str:
    """The wire form of a mode decision."""
    return json.dumps(dict(d), sort_keys=True) if d else ""
