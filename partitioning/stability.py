"""Re-sharding stability: what each node already holds, and the orders that keep the old ring.

After a membership change the planner prefers plans that reuse loaded weights:

* :func:`holdings` reads, from the previous plan, the layer range and the
  embedding/head each node holds (nothing, when the model changed);
* :func:`insertion_orders` lists the previous ring order with departed nodes
  removed and every way of inserting the new nodes, so a joining node can land
  *between* two old ones instead of at the end (which would shift every range).

Among plans whose objective is within ``Policy.tolerance`` of the best, the
planner then minimises the bytes to load, exactly (see :func:`.split.lexicographic`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from math import prod

from .plan import Plan


@dataclass(frozen=True)
class Holding:
    """What a node held under the previous plan."""

    layers: tuple[int, int] | None  # [start, end) or None
    embedding: bool
    head: bool


NOTHING = Holding(None, False, False)


def holdings(previous: Plan | None, fingerprint: str) -> dict[str, Holding] | None:
    """Node id -> :class:`Holding` from ``previous``; None when there is no previous plan
    or it was for another model (different fingerprint: nothing is reusable)."""
    if previous is None or previous.model_fingerprint != fingerprint:
        return None
    return {s.node_id: Holding((s.start, s.end), s.embeds, s.heads) for s in previous.stages}


def insertion_orders(previous_ring: Iterable[str], usable: Iterable[str], cap: int) -> list[tuple[str, ...]] | None:
    """Orders that keep the surviving nodes of ``previous_ring`` in their order and insert
    the other ``usable`` nodes.

    Every interleaving is listed when there are at most ``cap`` of them
    (``(k+1)(k+2)...(k+m)`` for k kept and m new nodes); beyond that, the new nodes are
    inserted as one block (in id order) at each of the k+1 positions.

    Returns:
        The orders (the kept order with new nodes first at the front), or None when no
        node of the old ring survives.
    """
    usable_set = set(usable)
    kept = tuple(n for n in previous_ring if n in usable_set)
    if not kept:
        return None
    joiners = tuple(sorted(usable_set - set(kept)))
    k, m = len(kept), len(joiners)
    if prod(range(k + 1, k + m + 1)) > cap:
        return [kept[:i] + joiners + kept[i:] for i in range(k + 1)]
    orders = [kept]
    for j in joiners:
        orders = [o[:i] + (j,) + o[i:] for o in orders for i in range(len(o) + 1)]
    return orders
