"""Contiguous splits of ``L`` layers over a fixed ring order of ``k`` nodes.

Every function takes per-node ``(L+1) x (L+1)`` cost matrices (see
:mod:`costs`), where entry ``[s, e]`` is the cost of node j holding ``[s, e)``,
``inf`` when impossible (s > e, or the range does not fit in memory), and the
diagonal ``[s, s]`` means the node holds nothing and is left out of the ring.

* :func:`min_max` -- the smallest achievable largest stage cost (the bottleneck).
  Dynamic programme ``D_j(e) = min_s max(D_{j-1}(s), T_j[s, e])``,
  O(k L^2) time, O(L) memory (vectorised: one L x L numpy operation per node).
* :func:`lexicographic` -- among ranges allowed by a mask, the split minimising a
  tuple of *additive* costs lexicographically (e.g. bytes to load, then time, then
  number of stages). Addition preserves lexicographic order, so the principle of
  optimality holds and the same O(k L^2) DP is exact. Ties go to the smallest
  start index, so the answer is deterministic.
* :func:`with_hops` -- minimise the sum of stage costs plus a cost per hop between
  consecutive *used* nodes plus a return hop from the last used node to the first
  (the latency policy). State = (last used node, layers covered, first used node);
  the best predecessor of each state is folded over nodes before the min-plus step
  with the stage costs: O(k |F| L^2 + k^2 |F| L) for |F| candidate first nodes.
* :func:`proportional` -- exo's memory-proportional largest-remainder counts.

All are exact for the model they optimise; none allocates more than O(L^2).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

import numpy as np

INF = math.inf

Split = list[tuple[int, int]]  # one (start, end) per node of the order; start == end: node unused


def min_max(costs: Sequence[np.ndarray]) -> float:
    """The smallest possible value of the largest stage cost over all contiguous splits.

    Args:
        costs: one ``(L+1) x (L+1)`` matrix per node, in ring order.

    Returns:
        The optimum (seconds if the matrices are times), or ``inf`` when no split fits.

    Complexity: O(k L^2).
    """
    L1 = costs[0].shape[0]
    dp = np.full(L1, INF)
    dp[0] = 0.0
    for t in costs:
        dp = np.maximum(dp[:, None], t).min(axis=0)
    return float(dp[L1 - 1])


def lexicographic(keys: Sequence[Sequence[np.ndarray]], allowed: Sequence[np.ndarray]) -> Split | None:
    """The split minimising a tuple of additive costs, lexicographically.

    Args:
        keys: per node, a sequence of cost matrices (primary first). Values must be
            exact in float64 (integers below 2**53) for ties to be meaningful.
        allowed: per node, a boolean matrix of the ranges it may hold.

    Returns:
        ``[(start, end), ...]`` in ring order, or None if no allowed split covers every layer.

    Complexity: O(k m L^2) for m keys.
    """
    k = len(allowed)
    L1 = allowed[0].shape[0]
    m = len(keys[0])
    dp = [np.full(L1, INF) for _ in range(m)]
    for d in dp:
        d[0] = 0.0
    parents: list[np.ndarray] = []
    for j in range(k):
        ok = allowed[j] & np.isfinite(dp[0])[:, None]
        cand = np.where(ok, dp[0][:, None] + keys[j][0], INF)
        best = cand.min(axis=0)
        tie = ok & (cand == best[None, :])
        new = [best]
        for i in range(1, m):
            cand = np.where(tie, dp[i][:, None] + keys[j][i], INF)
            b = cand.min(axis=0)
            tie &= cand == b[None, :]
            new.append(b)
        parents.append(np.argmax(tie, axis=0))
        dp = new
    if not math.isfinite(dp[0][L1 - 1]):
        return None
    return _backtrack(parents, L1 - 1)


def _backtrack(parents: list[np.ndarray], end: int) -> Split:
    out: Split = []
    e = end
    for par in reversed(parents):
        s = int(par[e])
        out.append((s, e))
        e = s
    out.reverse()
    return out


def with_hops(
    costs: Sequence[np.ndarray],
    hop: np.ndarray,
    back: np.ndarray,
    first_candidates: Sequence[int],
) -> tuple[float, Split] | None:
    """Minimise sum(stage costs) + sum(hop[u, v] over consecutive used nodes) + back[last, first].

    Nodes may be skipped (left out); the hop then joins the used nodes on either
    side. A single used node pays no hop and no return.

    Args:
        costs: per node, ``(L+1) x (L+1)`` stage costs (inf where impossible).
        hop: ``k x k`` forward hop cost between used nodes (ring positions).
        back: ``k x k`` return cost from the last used node to the first.
        first_candidates: ring positions allowed to be the first used node.

    Returns:
        (optimal cost, split) or None when nothing fits.

    Complexity: O(k |F| L^2 + k^2 |F| L) time, O(k |F| L + |F| L^2) memory, F = first_candidates.
    """
    k = len(costs)
    L1 = costs[0].shape[0]
    F = list(first_candidates)
    nf = len(F)
    strict = []
    for t in costs:
        c = t.copy()
        np.fill_diagonal(c, INF)  # a used node holds at least one layer
        strict.append(c)
    # D[j][f, e]: best cost with node j the last used, first used F[f], layers [0, e) covered.
    D = [np.full((nf, L1), INF) for _ in range(k)]
    parent_node = [np.full((nf, L1), -1, dtype=np.int64) for _ in range(k)]
    parent_end = [np.full((nf, L1), -1, dtype=np.int64) for _ in range(k)]
    for i, f in enumerate(F):
        D[f][i, :] = strict[f][0, :]
    for j2 in range(1, k):
        # Best predecessor per (first, boundary e): min over j < j2 of D[j][f, e] + hop[j, j2]
        # (O(k |F| L)); then one min-plus product with j2's stage costs (O(|F| L^2)).
        via = np.stack([D[j] + hop[j, j2] for j in range(j2)])  # (j2, F, L+1)
        pj = via.argmin(axis=0)
        m = np.take_along_axis(via, pj[None], axis=0)[0]
        if not np.isfinite(m).any():
            continue
        cand = m[:, :, None] + strict[j2][None, :, :]  # cand[f, e, e2]
        arg = cand.argmin(axis=1)
        val = np.take_along_axis(cand, arg[:, None, :], axis=1)[:, 0, :]
        better = val < D[j2]
        if better.any():
            D[j2] = np.where(better, val, D[j2])
            parent_node[j2] = np.where(better, np.take_along_axis(pj, arg, axis=1), parent_node[j2])
            parent_end[j2] = np.where(better, arg, parent_end[j2])
    best = INF
    best_at = None
    for i, f in enumerate(F):
        for j in range(k):
            v = D[j][i, L1 - 1]
            if not math.isfinite(v):
                continue
            total = v + (0.0 if j == f else back[j, f])
            if total < best:
                best, best_at = total, (i, j)
    if best_at is None:
        return None
    i, j = best_at
    split: Split = [(0, 0)] * k
    e = L1 - 1
    while True:
        pj, pe = int(parent_node[j][i, e]), int(parent_end[j][i, e])
        if pj < 0:
            split[j] = (0, e)
            break
        split[j] = (pe, e)
        j, e = pj, pe
    # Unused nodes get an empty range at the boundary where they sit, so ranges stay ordered.
    pos = 0
    out: Split = []
    for s, e in split:
        if s == e:
            out.append((pos, pos))
        else:
            out.append((s, e))
            pos = e
    return best, out


def proportional(total: int, weights: Sequence[int]) -> list[int]:
    """exo's layer counts: proportional to ``weights``, largest remainder, at least 1 each.

    Floor each exact share ``total * w / sum(w)``, give the remaining layers to the
    largest fractional parts (ties to the earlier node), then give every node left
    at 0 one layer taken from the node with the most (the first such on ties).
    Exact rational arithmetic; the same counts as exo's
    ``allocate_layers_proportionally`` (exo-explore/exo, src/exo/master/placement_utils.py).

    Raises:
        ValueError: fewer layers than nodes, or non-positive total weight.
    """
    n = len(weights)
    if n == 0 or total < n:
        raise ValueError(f"cannot give {total} layers to {n} nodes at least one each")
    wsum = sum(weights)
    if wsum <= 0:
        raise ValueError("proportional split needs a positive total weight")
    raw = [Fraction(total * w, wsum) for w in weights]
    result = [math.floor(r) for r in raw]
    order = sorted(range(n), key=lambda i: raw[i] - result[i], reverse=True)  # stable: ties keep ring order
    for i in range(total - sum(result)):
        result[order[i]] += 1
    for i in range(n):
        if result[i] == 0:
            donor = max(range(n), key=lambda j: result[j])
            result[donor] -= 1
            result[i] = 1
    return result
