"""The prefix cache of a tensor group: rank 0 keeps the index, every rank its own shards.

A tensor group's ranks each hold ``1/size`` of every KV head, so no single process can
keep a finished request's KV. The split follows the split of the work:

* **Every rank** keeps, per entry id, compact copies of *its* shard of a request's KV
  caches (:class:`ShardEntries`). Rank 0 tells the others over the side channel when to
  keep a slot's cache as an entry (``OP_SAVE``), start a slot from an entry
  (``OP_LOAD``) and forget an entry (``OP_DROP``); none of these runs a collective, and
  all ranks apply them in the same order, so the ranks' entries stay the same set.
* **One index** -- token ids by scope, LRU order, bytes -- decides which entry a request
  reuses and which are evicted (:class:`ShardIndex`, the same trie and LRU as a pipeline
  stage's :class:`~ringlet.daemon.engine.prefix_store.PrefixStore`). In tensor mode rank
  0's process owns it (:mod:`ringlet.daemon.tensor.rank_lead`); for a hybrid plan's group
  the daemon's engine does (:mod:`ringlet.daemon.tensor.group_prefix`).

An entry's bytes are rank 0's shard bytes: every rank holds as many (heads are split
evenly), and the budget (``--prefix-cache-bytes``) is per node, i.e. per rank. A group
restart starts new rank processes with no entries; the index of the old epoch goes with
them (a lookup then misses, which only costs a prefill).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ringlet.daemon.engine.prefix_store import StoreStats, caches_from, snapshot, storable
from ringlet.daemon.engine.token_index import TokenIndex


class ShardEntries:
    """One rank's shards of the group's prefix entries: entry id -> per layer ``(keys,
    values)``, each ``(1, kv_heads / size, tokens, head_dim)`` in the cache dtype."""

    def __init__(self) -> None:
        self.layers: dict[int, list[tuple[Any, Any]]] = {}

    def save(self, entry_id: int, cache: list | None, n: int) -> int:
        """Keep the first ``n`` tokens of ``cache`` (a slot's mlx-lm ``KVCache`` layers) as
        ``entry_id``. Returns the bytes kept (0: nothing kept, the cache is of another kind
        or holds fewer than ``n`` tokens)."""
        if cache is None or n <= 0 or not storable(cache) or any(c.offset < n for c in cache):
            return 0
        layers = snapshot(cache, n)
        self.layers[entry_id] = layers
        return sum(k.nbytes + v.nbytes for k, v in layers)

    def load(self, entry_id: int, n: int) -> list | None:
        """Fresh caches holding the first ``n`` tokens of entry ``entry_id`` (new arrays: the
        request never writes into the entry), or ``None`` when this rank lacks it."""
        layers = self.layers.get(entry_id)
        if layers is None or any(k.shape[2] < n for k, _ in layers):
            return None
        return caches_from(layers, n)

    def drop(self, entry_id: int) -> None:
        self.layers.pop(entry_id, None)


@dataclass
class ShardEntry:
    """What the index knows of one entry: its scope, token ids, rank 0's shard bytes and
    the group epoch whose ranks hold it (0 in rank 0's own index: its group is its epoch)."""

    id: int
    scope: str
    tokens: list[int]
    nbytes: int
    epoch: int = 0


class ShardIndex(TokenIndex):
    """The index of a tensor group's prefix entries, bounded in bytes (per rank).

    Args:
        budget_bytes: the most bytes of KV each rank holds (0: none).
        drop: called with a :class:`ShardEntry` whenever an entry is forgotten (evicted,
            replaced by one that extends it, cleared, or refused), so that the ranks drop
            their shards.
    """

    def __init__(self, budget_bytes: int, drop):
        super().__init__(budget_bytes)
        self._drop_shards = drop
        self.stats = StoreStats()

    def next_id(self) -> int:
        """A fresh entry id (to name an entry to the ranks before it is indexed)."""
        return next(self._ids)

    def longest(self, scope: str, tokens: list[int]) -> tuple[int, int]:
        """``(entry id, n)``: the entry sharing the longest prefix with ``tokens`` and that
        prefix's length, ``(0, 0)`` when none does. The entry becomes the most recently used."""
        entry, n = self._longest_match(scope, tokens)
        if entry is None:
            return 0, 0
        self._entries.move_to_end(entry.id)
        return entry.id, n

    def count(self, n: int) -> None:
        """Count one lookup that served ``n`` tokens (0: a miss)."""
        if n > 0:
            self.stats.hits += 1
            self.stats.hit_tokens += n
        else:
            self.stats.misses += 1

    def add(self, entry_id: int, scope: str, tokens: list[int], nbytes: int, epoch: int = 0) -> bool:
        """Index an entry the ranks kept (``nbytes``: rank 0's). Entries it extends and the
        least recently used beyond the budget are forgotten. Returns whether it was kept
        (not when it alone is over the budget: the ranks are told to drop it)."""
        entry = ShardEntry(entry_id, scope, list(tokens), nbytes, epoch)
        if nbytes <= 0 or nbytes > self.budget_bytes or not tokens:
            self._drop_shards(entry)
            return False
        self._forget_prefixes_of(scope, entry.tokens)
        self._add(entry)
        self.stats.inserted += 1
        self._evict_to(self.budget_bytes)
        return True

    def _evict(self, entry: ShardEntry) -> None:
        self._forget(entry)
        self.stats.evictions += 1

    def _discard(self, entry: ShardEntry) -> None:
        self._drop_shards(entry)

    def info(self, ranks: int) -> dict:
        """JSON-safe figures for ``/v1/cluster``'s ``prefix_cache`` (``bytes`` per rank)."""
        s = self.stats
        return {"budget_bytes": self.budget_bytes, "bytes": self.nbytes, "entries": len(self._entries),
                "tokens": sum(len(e.tokens) for e in self._entries.values()), "hits": s.hits,
                "misses": s.misses, "hit_tokens": s.hit_tokens, "evictions": s.evictions,
                "inserted": s.inserted, "ranks": ranks, "disk": None}
