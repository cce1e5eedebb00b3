"""The three policies, each choosing one (ring order, split) among candidate orders.

* ``balanced`` -- minimise the largest stage time per token (the pipeline's
  throughput bound), memory permitting; a stage's time is a decoded token's plus
  a prompt token's, weighed by ``Policy.prefill_share``
  (:meth:`.costs.CostModel.balance_time`). Phase 1 finds the optimum tau* exactly
  with :func:`.split.min_max` on every candidate order (O(k L^2) each). Phase 2,
  over ranges whose time is <= tau* (<= tau* (1 + tolerance) with a previous plan),
  picks lexicographically the fewest bytes to load (with a previous plan), then
  the smallest sum of stage times (one request's latency), then the fewest stages,
  then the smallest sum of memory fractions used (roomier nodes first), with
  :func:`.split.lexicographic` (O(k L^2)).
* ``memory`` -- exo parity: on the first candidate order where it fits, layer
  counts proportional to usable memory with largest-remainder rounding, at least
  one layer per node (:func:`.split.proportional`; with more nodes than layers,
  the L nodes with the most memory). If that split overflows some
  node (exo would fail), the memory-balanced split instead: minimise the largest
  fraction of a node's memory used (same min-max DP), noted in the plan.
* ``latency`` -- minimise one request's time per token: stage times + forward hops
  + the return hop, where leaving a node out saves its hop
  (:func:`.split.with_hops`, O(k |F| L^2 + k^2 |F| L); |F| = k up to the exact-ring limit,
  else the first 3 ring positions may start the pipeline).

A policy returns a :class:`Choice`, or None when nothing fits on any order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from . import split as splits
from .costs import CostModel
from .ring import Topology
from .spec import NodeSpec, Policy
from .stability import NOTHING, Holding

INF = math.inf


@dataclass(frozen=True)
class Choice:
    """A chosen order and split, with the policy's view of it."""

    order: tuple[str, ...]
    split: tuple[tuple[int, int], ...]
    objective: float  # the policy's objective for this plan (seconds, or fraction for the memory fallback)
    best: float  # the best objective over the candidate orders considered
    load: int  # bytes to load
    notes: tuple[str, ...] = ()


@dataclass
class Context:
    """Everything a policy needs besides the orders."""

    nodes: dict[str, NodeSpec]
    cost: CostModel
    topology: Topology
    policy: Policy
    previous: dict[str, Holding] | None  # None: no reusable previous plan

    def holding(self, node_id: str) -> Holding:
        """What ``node_id`` held under the previous plan (nothing if none)."""
        if self.previous is None:
            return NOTHING
        return self.previous.get(node_id, NOTHING)

    def load_matrix(self, node_id: str) -> np.ndarray:
        """Bytes ``node_id`` must load for each range ``[s, e)`` (see :meth:`.CostModel.load_matrix`)."""
        h = self.holding(node_id)
        return self.cost.load_matrix(h.layers, h.embedding, h.head)

    def load_of(self, order: Sequence[str], split: Sequence[tuple[int, int]]) -> int:
        """Bytes all nodes of ``order`` must load to hold ``split``."""
        total = 0
        for n, (s, e) in zip(order, split, strict=True):
            h = self.holding(n)
            total += self.cost.stage_load(h.layers, h.embedding, h.head, s, e)
        return total


def choose(ctx: Context, orders: Sequence[tuple[str, ...]]) -> Choice | None:
    """Run ``ctx.policy.name`` over ``orders`` (see module docstring)."""
    name = ctx.policy.name
    if name == "balanced":
        return _balanced(ctx, orders)
    if name == "memory":
        return _memory(ctx, orders)
    return _latency(ctx, orders)


def _balanced(ctx: Context, orders: Sequence[tuple[str, ...]]) -> Choice | None:
    cost = ctx.cost
    share, refs = ctx.policy.prefill_share, (1.0, 1.0)
    if share:  # the whole model's decode and prompt-token times on the fastest node: the blend's units
        whole = [(cost.time(node)[0, cost.L], cost.prefill_time(node)[0, cost.L]) for node in ctx.nodes.values()]
        refs = (min(d for d, _ in whole), min(p for _, p in whole))
        if not all(0 < r < INF for r in refs):  # no flops figures to weigh prefill by: decode alone
            share = 0.0
    times = [[cost.balance_time(ctx.nodes[n], share, *refs) for n in o] for o in orders]
    taus = [splits.min_max(t) for t in times]
    best = min(taus)
    if not math.isfinite(best):
        return None
    limit = best if ctx.previous is None else best * (1.0 + ctx.policy.tolerance)
    picked = None
    for idx, (order, tau) in enumerate(zip(orders, taus, strict=True)):
        if tau > limit:
            continue
        keys = []
        ns = [cost.feasible_time_ns(ctx.nodes[n]) for n in order]
        for n, t in zip(order, ns, strict=True):
            k = [t, cost.stages, cost.utilisation(ctx.nodes[n])]
            if ctx.previous is not None:
                k.insert(0, ctx.load_matrix(n))
            keys.append(k)
        allowed = [t <= limit for t in times[idx]]
        sp = splits.lexicographic(keys, allowed)
        if sp is None:  # pragma: no cover - tau <= limit guarantees a split
            continue
        load = ctx.load_of(order, sp)
        total_ns = sum(int(t[s, e]) for t, (s, e) in zip(ns, sp, strict=True))
        used = sum(1 for s, e in sp if s < e)
        rank = (load if ctx.previous is not None else 0, total_ns, used, idx)
        if picked is None or rank < picked[0]:
            objective = max(float(t[s, e]) for t, (s, e) in zip(times[idx], sp, strict=True) if s < e)
            picked = (rank, Choice(order, tuple(sp), objective, best, load))
    return None if picked is None else picked[1]


def _memory(ctx: Context, orders: Sequence[tuple[str, ...]]) -> Choice | None:
    cost = ctx.cost
    L = cost.L
    fitting = []
    for idx, order in enumerate(orders):
        nodes = [ctx.nodes[n] for n in order]
        # exo needs a layer per node: with more nodes than layers, the L with the most memory
        # take part (in ring order), the others hold nothing.
        ranked = sorted(nodes, key=lambda n: (-n.memory_bytes, -n.bandwidth_bytes_per_s, -n.flops, n.node_id))
        members = {n.node_id for n in ranked[:L]}
        used = [n for n in nodes if n.node_id in members]
        counts = iter(splits.proportional(L, [n.memory_bytes for n in used]))
        sp, s = [], 0
        for n in nodes:
            c = next(counts) if n.node_id in members else 0
            sp.append((s, s + c))
            s += c
        if all(cost.memory[a, b] <= n.memory_bytes for n, (a, b) in zip(nodes, sp, strict=True)):
            load = ctx.load_of(order, sp)
            objective = max(cost.stage_time(n, a, b) for n, (a, b) in zip(nodes, sp, strict=True) if a < b)
            rank = (load if ctx.previous is not None else 0, idx)
            fitting.append((rank, Choice(order, tuple(sp), objective, 0, load)))
            if ctx.previous is None:
                break  # exo parity: the first (best-linked) order where the proportional split fits
    if fitting:
        choice = min(fitting, key=lambda x: x[0])[1]
        return Choice(choice.order, choice.split, choice.objective, choice.objective, choice.load)
    # Fallback: minimise the largest fraction of memory used, then as balanced.
    for order in orders:
        nodes = [ctx.nodes[n] for n in order]
        with np.errstate(divide="ignore", invalid="ignore"):
            util = [np.where(cost.fits(n), cost.memory / n.memory_bytes, INF) for n in nodes]
        u = splits.min_max(util)
        if not math.isfinite(u):
            continue
        keys = []
        for n in nodes:
            k = [cost.feasible_time_ns(n), cost.stages, cost.utilisation(n)]
            if ctx.previous is not None:
                k.insert(0, ctx.load_matrix(n.node_id))
            keys.append(k)
        sp = splits.lexicographic(keys, [m <= u for m in util])
        if sp is None:  # pragma: no cover
            continue
        objective = max(cost.stage_time(n, a, b) for n, (a, b) in zip(nodes, sp, strict=True) if a < b)
        used = [n.node_id for n, (a, b) in zip(nodes, sp, strict=True) if a < b]
        note = (
            "the memory-proportional split (exo) overflows a node's memory; used the split that minimises "
            f"the largest fraction of memory used instead ({u:.0%} at most, nodes {', '.join(used)})"
        )
        return Choice(order, tuple(sp), objective, objective, ctx.load_of(order, sp), (note,))
    return None


def _latency(ctx: Context, orders: Sequence[tuple[str, ...]]) -> Choice | None:
    cost = ctx.cost
    topo = ctx.topology
    results = []
    for idx, order in enumerate(orders):
        k = len(order)
        times = [cost.feasible_time(ctx.nodes[n]) for n in order]
        pos = [topo.index[n] for n in order]
        hop = topo.fwd_ns[np.ix_(pos, pos)] / 1e9
        back = topo.route_ns[np.ix_(pos, pos)] / 1e9
        first = range(k) if k <= ctx.policy.exact_ring_max_nodes else range(min(3, k))
        res = splits.with_hops(times, hop, back, list(first))
        if res is None:
            continue
        value, sp = res
        results.append((value, idx, order, sp))
    if not results:
        return None
    best = min(r[0] for r in results)
    limit = best if ctx.previous is None else best * (1.0 + ctx.policy.tolerance)
    picked = None
    for value, idx, order, sp in results:
        if value > limit:
            continue
        load = ctx.load_of(order, sp)
        rank = (load if ctx.previous is not None else 0, value, idx)
        if picked is None or rank < picked[0]:
            picked = (rank, Choice(order, tuple(sp), value, best, load))
    return picked[1]
