"""Tensor-parallel planning: pick a mode and an MLX backend, and write MLX's host configuration.

Pure: no I/O (except :meth:`HostConfig.write`), no asyncio, no MLX import,
deterministic for the same inputs in any order.

Inputs
------
* members: :class:`TPMember` (node id, the address peers reach it on, usable
  memory, optionally its memory bandwidth);
* links: :class:`TPLink` between two members (kind, RDMA, bandwidth, latency
  and, for Thunderbolt, the interface and IP at each end). :func:`loopback_links`,
  :func:`lan_links` and :func:`links_from_thunderbolt` (from
  ``ringlet.daemon.probes.match_links``) build them;
* the model: :class:`TPModelSpec` (head counts, bytes).

Decision (:func:`decide`)
-------------------------
* ``tensor`` needs every member to hold every layer, split by mlx-lm's
  ``model.shard(group)``: attention heads *and* key/value heads (and the MLP
  width) must divide by the group size -- mlx-lm divides ``n_heads`` and
  ``n_kv_heads`` by N and slices q/k/v/o and gate/up/down evenly
  (``mlx.nn.layers.distributed.shard_linear`` raises when a width does not
  divide). SmolLM2-135M (9 heads, 3 kv heads) therefore runs on 3 ranks, not 2.
* backend: **jaccl** when every pair of members has an RDMA-enabled Thunderbolt
  link (a full mesh, like ``mlx.distributed_config`` ``check_valid_mesh`` plus
  ``check_rdma``); **ring** when the links contain a Hamiltonian cycle (the MLX
  ring backend only talks to its left and right neighbours); otherwise **none**
  and the gRPC pipeline.
* ranks are ordered along the ring, the leader (the node that takes API
  requests and drives the group) is rank 0. Among several cycles the one with
  the best bottleneck bandwidth, then the lowest total latency, then the
  lexicographically smallest order wins.
* ``auto`` compares predicted decode time per token of the feasible modes
  (:func:`predict_token_seconds`) and says why in ``reason``; ``--mode``
  overrides, and a tensor/hybrid override that cannot work raises
  :class:`TPRefused` with the reason.
* ``hybrid``: equal tensor-parallel groups (each with its own backend), chained
  as pipeline stages; chosen when the whole cluster cannot form one group but
  groups can (heads divide the group size, each group has a ring or mesh).

Host configuration (:func:`host_config`), formats checked against MLX's source
-------------------------------------------------------------------------------
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
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MODES = ("pipeline", "tensor", "hybrid")
BACKENDS = ("jaccl", "ring", "none")

#: Per link kind: (latency s, bandwidth bytes/s) assumed when a link does not say.
#: Loopback and TCP figures are this machine's (bench/bench_tp.py: a 2-rank
#: all_sum of one hidden vector over 127.0.0.1 takes ~70 us, i.e. ~35 us a hop).
LINK_DEFAULTS: dict[str, tuple[float, float]] = {
    "loopback": (35e-6, 5e9),
    "thunderbolt": (60e-6, 5e9),  # TCP over Thunderbolt (bridge / thunderbolt-net)
    "thunderbolt-rdma": (10e-6, 10e9),
    "ethernet": (200e-6, 125e6),
    "wifi": (3e-3, 30e6),
}
#: Memory bandwidth assumed for a member that did not measure it (bytes/s).
DEFAULT_MEMORY_BANDWIDTH = 100e9
#: Share of usable memory kept free for KV cache and activations.
MEMORY_HEADROOM = 0.10
#: Largest group searched exhaustively for the best ring order.
EXACT_RING_LIMIT = 9


class TPRefused(ValueError):
    """A requested tensor/hybrid plan cannot run; the message says why (one line)."""


@dataclass(frozen=True)
class TPMember:
    """One machine that may hold a rank.

    Attributes:
        node_id: ringlet node id.
        host: the address peers reach this member on (ring fallback IP, JACCL coordinator).
        usable_memory: bytes it may fill with weights and caches.
        memory_bandwidth: measured bytes/s (probes' speed result), ``None`` = unknown.
    """

    node_id: str
    host: str
    usable_memory: int
    memory_bandwidth: float | None = None


@dataclass(frozen=True)
class TPLink:
    """A direct link between members ``a`` and ``b`` (either order).

    ``kind``: "loopback", "thunderbolt", "ethernet", "wifi" (other names use the
    ethernet defaults). ``rdma``: RDMA works both ways over it (Thunderbolt 5 with
    ``rdma_ctl`` enabled; ``ThunderboltLink.rdma_both``). ``iface_*``: the network
    interface at each end (JACCL device ``rdma_<iface>``); ``ip_*``: each end's IP
    on this link (ring addresses over Thunderbolt); ``None`` = use the member's host.
    """

    a: str
    b: str
    kind: str = "ethernet"
    rdma: bool = False
    bandwidth: float | None = None
    latency: float | None = None
    iface_a: str | None = None
    iface_b: str | None = None
    ip_a: str | None = None
    ip_b: str | None = None

    def other(self, node: str) -> str:
        return self.b if node == self.a else self.a

    def iface(self, node: str) -> str | None:
        return self.iface_a if node == self.a else self.iface_b

    def ip(self, node: str) -> str | None:
        return self.ip_a if node == self.a else self.ip_b

    def eff_latency(self) -> float:
        if self.latency is not None:
            return float(self.latency)
        return _kind_defaults(self)[0]

    def eff_bandwidth(self) -> float:
        if self.bandwidth is not None:
            return float(self.bandwidth)
        return _kind_defaults(self)[1]


def _kind_defaults(link: TPLink) -> tuple[float, float]:
    if link.kind == "thunderbolt" and link.rdma:
        return LINK_DEFAULTS["thunderbolt-rdma"]
    return LINK_DEFAULTS.get(link.kind, LINK_DEFAULTS["ethernet"])


@dataclass(frozen=True)
class TPModelSpec:
    """What tensor planning needs to know about a model.

    Attributes:
        num_heads, num_kv_heads: attention (query) heads and key/value heads.
        num_layers: decoder layers.
        total_bytes: all weight bytes.
        replicated_bytes: weights every rank holds whole (embedding, head, norms).
        hidden_size: width of the vector all-reduced twice per layer per token.
        intermediate_size: MLP width (sliced by N too); ``None`` = not checked.
        activation_itemsize: bytes per element of the all-reduced vector.
        shardable: the mlx-lm architecture has ``model.shard(group)``.
        quant_group_size: quantization group of the weights (``None`` = float):
            a sliced input dimension must stay a multiple of it.
        head_dim: per-head width (for the quantized o_proj input check).
        name: for messages.
        vocab_size: embedding entries (token ids are below it); ``None`` = unknown.
    """

    num_heads: int
    num_kv_heads: int
    num_layers: int
    total_bytes: int
    replicated_bytes: int = 0
    hidden_size: int = 0
    intermediate_size: int | None = None
    activation_itemsize: int = 4
    shardable: bool = True
    quant_group_size: int | None = None
    head_dim: int | None = None
    name: str = "model"
    vocab_size: int | None = None

    def sharded_bytes(self) -> int:
        return max(0, self.total_bytes - self.replicated_bytes)

    def bytes_per_rank(self, n: int) -> int:
        """Weight bytes one rank of an ``n``-way tensor group holds."""
        return self.replicated_bytes + math.ceil(self.sharded_bytes() / n)


def tp_spec_from_config(
    config: Mapping[str, Any],
    total_bytes: int,
    replicated_bytes: int = 0,
    *,
    shardable: bool = True,
    activation_itemsize: int = 4,
    name: str | None = None,
) -> TPModelSpec:
    """A :class:`TPModelSpec` from an mlx-lm ``config.json`` dict and byte counts."""
    text = config.get("text_config") if isinstance(config.get("text_config"), Mapping) else {}

    def get(key: str, default: Any = None) -> Any:
        return config.get(key, text.get(key, default))

    heads = int(get("num_attention_heads"))
    kv = int(get("num_key_value_heads") or heads)
    hidden = int(get("hidden_size") or 0)
    head_dim = get("head_dim")
    quant = get("quantization")
    return TPModelSpec(
        num_heads=heads,
        num_kv_heads=kv,
        num_layers=int(get("num_hidden_layers")),
        total_bytes=int(total_bytes),
        replicated_bytes=int(replicated_bytes),
        hidden_size=hidden,
        intermediate_size=int(get("intermediate_size")) if get("intermediate_size") else None,
        activation_itemsize=activation_itemsize,
        shardable=shardable,
        quant_group_size=int(quant["group_size"]) if isinstance(quant, Mapping) and "group_size" in quant else None,
        head_dim=int(head_dim) if head_dim else (hidden // heads if hidden and heads else None),
        name=str(name or config.get("_name_or_path") or config.get("model_type") or "model"),
        vocab_size=int(get("vocab_size")) if get("vocab_size") else None,
    )


def tensor_refusal(spec: TPModelSpec, n: int) -> str | None:
    """Why ``spec`` cannot be split ``n`` ways by ``model.shard`` (``None`` = it can)."""
    if n < 2:
        return f"tensor parallelism needs at least 2 ranks, got {n}"
    if not spec.shardable:
        return f"{spec.name}: mlx-lm has no model.shard() for this architecture"
    bad = []
    if spec.num_heads % n:
        bad.append(f"{spec.num_heads} attention heads")
    if spec.num_kv_heads % n:
        bad.append(f"{spec.num_kv_heads} key/value heads")
    if spec.intermediate_size is not None and spec.intermediate_size % n:
        bad.append(f"MLP width {spec.intermediate_size}")
    if bad:
        ok = [d for d in range(2, max(spec.num_heads, 2) + 1) if _divides(spec, d)]
        hint = f"; group sizes that work: {', '.join(map(str, ok))}" if ok else "; no group size works"
        return f"{spec.name}: {' and '.join(bad)} do not divide by {n} ranks{hint}"
    g = spec.quant_group_size
    if g:
        widths = [("MLP width", spec.intermediate_size)]
        if spec.head_dim:
            widths.append(("attention width", spec.num_heads * spec.head_dim))
        for what, w in widths:
            if w and (w // n) % g:
                return f"{spec.name}: quantized {what} {w}/{n} = {w // n} is not a multiple of the group size {g}"
    return None


def _divides(spec: TPModelSpec, n: int) -> bool:
    return (
        spec.num_heads % n == 0
        and spec.num_kv_heads % n == 0
        and (spec.intermediate_size is None or spec.intermediate_size % n == 0)
    )


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


# ---------------------------------------------------------------------------------------- topology


class _Graph:
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
    graph = links if isinstance(links, _Graph) else _Graph(nodes, links)
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


# ---------------------------------------------------------------------------------------- prediction


def allreduce_seconds(n: int, nbytes: int, ring: Sequence[str], graph: _Graph, *, rdma: bool = False) -> float:
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
    graph: _Graph,
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


# ---------------------------------------------------------------------------------------- decision


def _backend_for(nodes: Sequence[str], graph: _Graph, leader: str) -> tuple[str, tuple[str, ...] | None, str]:
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
    ids: Sequence[str], graph: _Graph, spec: TPModelSpec, leader: str, members: Mapping[str, TPMember]
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
    graph = _Graph(ids, links)
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


# ---------------------------------------------------------------------------------------- links


def loopback_links(node_ids: Sequence[str]) -> tuple[TPLink, ...]:
    """A full mesh of loopback links (ranks simulated on one machine)."""
    ids = sorted(node_ids)
    return tuple(TPLink(a, b, "loopback") for a, b in itertools.combinations(ids, 2))


def lan_links(
    node_ids: Sequence[str], *, latency: float | None = None, bandwidth: float | None = None, kind: str = "ethernet"
) -> tuple[TPLink, ...]:
    """Every pair on one switched network (a full mesh of ``kind`` links)."""
    ids = sorted(node_ids)
    return tuple(TPLink(a, b, kind, latency=latency, bandwidth=bandwidth) for a, b in itertools.combinations(ids, 2))


def links_from_thunderbolt(
    tb_links: Iterable[Any], ips: Mapping[tuple[str, str], str] | None = None, latency: float | None = None
) -> tuple[TPLink, ...]:
    """Convert ``probes.match_links`` results (``ThunderboltLink``) into :class:`TPLink`.

    ``ips`` maps ``(node_id, interface)`` to that interface's IPv4 address when
    known (the ring backend then runs over the cable itself).
    """
    ips = ips or {}
    out = []
    for t in tb_links:
        out.append(
            TPLink(
                a=t.node_a,
                b=t.node_b,
                kind="thunderbolt",
                rdma=bool(t.rdma_both),
                bandwidth=float(t.speed_bytes_per_s) if t.speed_bytes_per_s else None,
                latency=latency,
                iface_a=t.iface_a,
                iface_b=t.iface_b,
                ip_a=ips.get((t.node_a, t.iface_a or "")),
                ip_b=ips.get((t.node_b, t.iface_b or "")),
            )
        )
    return tuple(out)


# ---------------------------------------------------------------------------------------- host configuration

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
    graph = _Graph(list(ranks), links)
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
