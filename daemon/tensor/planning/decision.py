"""Tensor-parallel mode decision (:func:`decide`): pipeline, tensor or hybrid, and the backend.

* ``tensor`` needs every member to hold every layer, split by mlx-lm's
  ``model.shard(group)`` (heads and key/value heads must divide by the group size:
  :func:`~ringlet.daemon.tensor.planning.inputs.tensor_refusal`).
* backend: **jaccl** when every pair of members has an RDMA-enabled Thunderbolt
  link (a full mesh, like ``mlx.distributed_config`` ``check_valid_mesh`` plus
  ``check_rdma``); **ring** when the links contain a Hamiltonian cycle (the MLX
  ring backend only talks to its left and right neighbours); otherwise **none**
  and the gRPC pipeline.
* ranks are ordered along the ring, the leader (the node that takes API
  requests and drives the group) is rank 0
  (:func:`~ringlet.daemon.tensor.planning.topology.find_ring`).
* ``auto`` compares predicted decode time per token of the feasible modes
  (:func:`~ringlet.daemon.tensor.planning.prediction.predict_token_seconds`) and says
  why in ``reason``; ``--mode`` overrides, and a tensor/hybrid override that cannot
  work raises :class:`TPRefused` with the reason.
* ``hybrid``: equal tensor-parallel groups (each with its own backend), chained
  as pipeline stages; chosen when the whole cluster cannot form one group but
  groups can (heads divide the group size, each group has a ring or mesh).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ringlet.daemon.tensor.planning.inputs import TPLink, TPMember, TPModelSpec, tensor_refusal
from ringlet.daemon.tensor.planning.prediction import predict_token_seconds
from ringlet.daemon.tensor.planning.topology import LinkGraph, find_ring

MODES = ("pipeline", "tensor", "hybrid")
BACKENDS = ("jaccl", "ring", "none")
#: Share of usable memory kept free for KV cache and activations.
MEMORY_HEADROOM = 0.10


class TPRefused(ValueError):
    """A requested tensor/hybrid plan cannot run; the message says why (one line)."""


@dataclass(frozen=True)
class TPDecision:
    """The mode, backend and rank order for a set of members.

    ``ranks``: node ids in rank order along the ring (rank 0 = the leader); in
    ``pipeline`` mode the members in the order given (the pipeline planner orders
    stages). ``groups``: the tensor groups (one for ``tensor``, several for
    ``hybrid``, chained as pipeline stages in this order; empty for ``pipeline``),
    ``group_backends`` their backends. ``predicted``: seconds per decoded token
    of each mode considered.
    """

    mode: str
    backend: str
    ranks: tuple[str, ...]
    reason: str
    groups: tuple[tuple[str, ...], ...] = ()
    group_backends: tuple[str, ...] = ()
    predicted: Mapping[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "backend": self.backend,
            "ranks": list(self.ranks),
            "reason": self.reason,
            "groups": [list(g) for g in self.groups],
            "group_backends": list(self.group_backends),
            "predicted_s_per_token": dict(self.predicted),
        }


def _backend_for(nodes: Sequence[str], graph: LinkGraph, leader: str) -> tuple[str, tuple[str, ...] | None, str]:
    """(backend, rank order, why) for one tensor group."""
    if len(nodes) >= 2 and graph.full_rdma_mesh(nodes):
        ring = find_ring(nodes, graph, start=leader, rdma=True)
        return "jaccl", ring, "every pair has an RDMA Thunderbolt link"
    ring = find_ring(nodes, graph, start=leader)
    if ring is not None and len(ring) == 1:
        return "none", ring, "one member"
    if ring is not None:
        kinds = sorted({graph.link(ring[i], ring[(i + 1) % len(ring)]).kind for i in range(len(ring))})
        return "ring", ring, f"{'/'.join(kinds)} links form a ring {' -> '.join(ring)} -> {ring[0]}"
    return "none", None, "the links form no ring (no Hamiltonian cycle) and not every pair has RDMA"


def _fits(spec: TPModelSpec, group: Sequence[str], members: Mapping[str, TPMember], layer_frac: float = 1.0) -> bool:
    need = spec.replicated_bytes + spec.sharded_bytes() * layer_frac / len(group)
    return all(members[m].usable_memory * (1 - MEMORY_HEADROOM) >= need for m in group)


def _pipeline_fits(spec: TPModelSpec, members: Mapping[str, TPMember]) -> bool:
    return sum(m.usable_memory for m in members.values()) * (1 - MEMORY_HEADROOM) >= spec.total_bytes


def _hybrid_groups(
    ids: Sequence[str], graph: LinkGraph, spec: TPModelSpec, leader: str, members: Mapping[str, TPMember]
) -> tuple[tuple[tuple[str, ...], ...], tuple[str, ...], str] | None:
    """Equal groups of the largest size g (2 <= g < N, g divides N and the heads), each
    with a backend; memory for an even share of the layers; groups ordered leader first.
    Partitions are searched in a fixed order; the one with the most JACCL groups, then the
    best bottleneck bandwidth wins."""
    n = len(ids)
    for g in sorted((d for d in range(2, n) if n % d == 0 and tensor_refusal(spec, d) is None), reverse=True):
        best = None
        for part in _partitions(sorted(ids), g, leader):
            info = []
            for grp in part:
                lead = leader if leader in grp else min(grp)
                backend, ring, _ = _backend_for(grp, graph, lead)
                if ring is None or not _fits(spec, grp, members, 1 / len(part)):
                    break
                info.append((backend, ring))
            else:
                jaccl = sum(b == "jaccl" for b, _ in info)
                bott = min(
                    graph.link(r[i], r[(i + 1) % len(r)], rdma=b == "jaccl").eff_bandwidth()
                    for b, r in info
                    for i in range(len(r))
                )
                key = (-jaccl, -bott)
                if best is None or key < best[0]:
                    best = (key, tuple(r for _, r in info), tuple(b for b, _ in info))
        if best is not None:
            return best[1], best[2], f"{n // g} groups of {g}"
    return None


def _partitions(ids: list[str], g: int, leader: str):
    """All partitions of ``ids`` into groups of size g; the leader's group first, then by smallest id."""
    if not ids:
        yield []
        return
    first = leader if leader in ids else ids[0]
    others = [i for i in ids if i != first]
    for combo in itertools.combinations(others, g - 1):
        grp = tuple(sorted((first, *combo)))
        rest = [i for i in others if i not in combo]
        for tail in _partitions(rest, g, rest[0] if rest else ""):
            yield [grp, *tail]


def decide(
    members: Sequence[TPMember],
    links: Iterable[TPLink],
    spec: TPModelSpec,
    mode: str | None = None,
    *,
    leader: str | None = None,
) -> TPDecision:
    """Choose pipeline / tensor / hybrid and the backend for ``members``.

    Args:
        members: the cluster (any order).
        links: direct links between members (any order; unknown nodes ignored).
        spec: the model.
        mode: ``None``/``"auto"`` decides; ``"pipeline"``, ``"tensor"``, ``"hybrid"``
            override (``--mode``).
        leader: the node that drives the group (rank 0); default: the smallest id.

    Raises:
        TPRefused: an overridden tensor/hybrid mode cannot run (heads do not divide,
            no ring or mesh, not enough memory); the message says why.
        ValueError: unknown mode, no members, duplicate ids, unknown leader.
    """
    if mode in (None, "", "auto"):
        mode = None
    elif mode not in MODES:
        raise ValueError(f"--mode must be one of auto, {', '.join(MODES)}; got {mode!r}")
    by_id = {m.node_id: m for m in members}
    if not by_id:
        raise ValueError("no members")
    if len(by_id) != len(members):
        raise ValueError("duplicate member ids")
    ids = sorted(by_id)
    leader = leader if leader is not None else ids[0]
    if leader not in by_id:
        raise ValueError(f"leader {leader!r} is not a member")
    links = list(links)
    graph = LinkGraph(ids, links)
    n = len(ids)
    pipe_order = (leader, *[i for i in ids if i != leader])

    def pipeline(reason: str, predicted: dict | None = None) -> TPDecision:
        return TPDecision("pipeline", "none", pipe_order, reason, predicted=predicted or {})

    if mode == "pipeline":
        return pipeline("--mode pipeline")
    if n == 1 and mode is None:
        return pipeline("one member: nothing to split")

    # tensor over every member
    refusal = tensor_refusal(spec, n)
    backend, ring, why = _backend_for(ids, graph, leader)
    t_refusal = refusal
    if t_refusal is None and ring is None:
        t_refusal = f"no backend for {n} members: {why}"
    if t_refusal is None and not _fits(spec, ids, by_id):
        t_refusal = (
            f"each rank needs {spec.bytes_per_rank(n) / 2**30:.2f} GiB of weights, more than "
            f"{1 - MEMORY_HEADROOM:.0%} of the smallest member's usable memory"
        )
    predicted: dict[str, float] = {}
    if t_refusal is None:
        predicted["tensor"] = predict_token_seconds("tensor", spec, by_id, [ring], graph, [backend])

    hybrid = _hybrid_groups(ids, graph, spec, leader, by_id) if n >= 4 else None
    if hybrid is not None:
        predicted["hybrid"] = predict_token_seconds("hybrid", spec, by_id, hybrid[0], graph, hybrid[1])
    pipe_ok = _pipeline_fits(spec, by_id)
    if pipe_ok:
        predicted["pipeline"] = predict_token_seconds("pipeline", spec, {i: by_id[i] for i in pipe_order}, [], graph)

    def tensor_decision(reason: str) -> TPDecision:
        return TPDecision("tensor", backend, ring, reason, (ring,), (backend,), predicted)

    def hybrid_decision(reason: str) -> TPDecision:
        groups, backends, _ = hybrid
        ranks = tuple(x for grp in groups for x in grp)
        weakest = "ring" if "ring" in backends else "jaccl"
        return TPDecision("hybrid", weakest, ranks, reason, groups, backends, predicted)

    ms = {k: f"{v * 1e3:.2f} ms" for k, v in predicted.items()}
    if mode == "tensor":
        if t_refusal is not None:
            raise TPRefused(f"tensor mode refused: {t_refusal}")
        return tensor_decision(f"--mode tensor: {n} ranks over {backend}: {why}")
    if mode == "hybrid":
        if hybrid is None:
            raise TPRefused(
                f"hybrid mode refused: no split of {n} members into equal tensor groups (of a size the heads "
                f"divide by) where every group has a ring or RDMA mesh and memory for its share of the layers"
            )
        return hybrid_decision(f"--mode hybrid: {hybrid[2]} over {'/'.join(hybrid[1])}")

    # auto
    options = {k: v for k, v in predicted.items()}
    if not options:
        # nothing fits by the numbers; keep the default data plane and let the planner say why
        return pipeline(f"pipeline: {t_refusal or 'tensor not possible'}; the model may not fit", predicted)
    choice = min(options, key=lambda k: (options[k], MODES.index(k)))
    compare = ", ".join(f"{k} {ms[k]}" for k in sorted(ms))
    if choice == "tensor":
        return tensor_decision(f"tensor: {n} ranks over {backend} ({why}); predicted per token: {compare}")
    if choice == "hybrid":
        return hybrid_decision(f"hybrid: {hybrid[2]} over {'/'.join(hybrid[1])}; predicted per token: {compare}")
    if t_refusal is not None:
        return pipeline(f"pipeline: tensor not possible ({t_refusal})", predicted)
    return pipeline(f"pipeline: predicted faster ({compare})", predicted)
