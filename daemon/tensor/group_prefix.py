"""The prefix store of a hybrid plan's tensor-group stage: the index here, the KV in the ranks.

A pipeline stage's engine asks its prefix store how much of a prompt it can serve
(:meth:`GroupPrefixStore.longest`), for fresh caches holding a prefix (:meth:`take`) and
to keep a finished request's cache (:meth:`insert`) -- the interface of
:class:`~ringlet.daemon.engine.prefix_store.PrefixStore`. When the stage is a tensor group
(:class:`~ringlet.daemon.tensor.group_stage.GroupStage`) a request's cache is a *slot*
whose KV lives in the rank processes, each holding its shard of the heads. So this store
keeps only the index (token ids by scope, LRU order, bytes), and has the ranks keep, load
and drop their shards of an entry (:mod:`ringlet.daemon.tensor.rank_prefix`; rank 0 passes
each on over the side channel).

Entries belong to the group epoch that made them: a group restart starts new rank
processes without them, and a lookup then finds nothing (a miss costs only a prefill;
the ring's fallback keeps every answer exact). All methods run on the engine's worker
thread, like the engine's own store (they block on the group's answers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ringlet.daemon.engine.prefix_store import StoreStats
from ringlet.daemon.engine.token_index import TokenIndex

if TYPE_CHECKING:
    from ringlet.daemon.tensor.group_stage import GroupStage


@dataclass
class GroupEntry:
    """One entry: its scope, token ids, rank 0's shard bytes and the group epoch holding it."""

    id: int
    scope: str
    tokens: list[int]
    nbytes: int
    epoch: int


class GroupPrefixStore(TokenIndex):
    """The prefix store of a tensor-group stage holding layers ``[start, end)``.

    Args:
        stage: the group stage whose ranks hold the entries' KV.
        budget_bytes: the most bytes of KV each rank holds (0: none).
    """

    disk = None  # no disk tier: the KV lives in other processes

    def __init__(self, stage: GroupStage, budget_bytes: int):
        super().__init__(budget_bytes)
        self.stage = stage
        self.stats = StoreStats()

    def _live(self) -> None:
        """Forget the entries of group epochs that are gone (their ranks exited)."""
        epoch = self.stage.group_epoch()
        for entry in [e for e in self._entries.values() if e.epoch != epoch]:
            self._forget(entry)

    def longest(self, scope: str, tokens: list[int], limit: int | None = None) -> int:
        """How many leading tokens of ``tokens`` (at most ``limit``) the ranks can serve."""
        self._live()
        limit = len(tokens) if limit is None else min(limit, len(tokens))
        return max((n for _, n in self._candidates(scope, tokens[:limit])), default=0)

    def take(self, scope: str, tokens: list[int]) -> list | None:
        """A fresh slot whose caches (in every rank) hold exactly ``tokens``, or ``None``
        (a miss) when no entry holds them or the ranks could not load it."""
        self._live()
        entry = next((e for e, n in self._candidates(scope, tokens) if n == len(tokens)), None)
        cache = self.stage.load_prefix(entry.id, entry.epoch, len(tokens)) if entry is not None else None
        if cache is None:
            self.stats.misses += 1
            return None
        self._entries.move_to_end(entry.id)
        self.stats.hits += 1
        self.stats.hit_tokens += len(tokens)
        return cache

    def miss(self) -> None:
        self.stats.misses += 1

    def insert(self, scope: str, tokens: list[int], cache: list) -> bool:
        """Have the ranks keep a finished request's slot (``cache``) for ``tokens`` (as many
        as it holds). Entries it extends and the least recently used beyond the budget
        are dropped. Returns whether it was kept."""
        if self.budget_bytes <= 0 or not tokens:
            return False
        self._live()
        entry_id = next(self._ids)
        kept = self.stage.save_prefix(cache, entry_id, len(tokens))
        if kept is None:
            return False
        epoch, nbytes = kept
        if nbytes <= 0 or nbytes > self.budget_bytes:
            self.stage.drop_prefix(entry_id, epoch)
            return False
        while covered := [e for e, n in self._candidates(scope, tokens) if n == len(e.tokens)]:
            self._forget(covered[0])  # it holds a prefix of these tokens: the new entry serves it
        self._add(GroupEntry(entry_id, scope, list(tokens), nbytes, epoch))
        self.stats.inserted += 1
        self._evict_to(self.budget_bytes)
        return True

    def _evict(self, entry: GroupEntry) -> None:
        self._forget(entry)
        self.stats.evictions += 1

    def _discard(self, entry: GroupEntry) -> None:
        self.stage.drop_prefix(entry.id, entry.epoch)

    def retain(self, start: int, end: int) -> None:
        """A group holds one layer range for its whole life: another range drops everything."""
        if (start, end) != (self.stage.start, self.stage.end):
            self.clear()

    def save_to_disk(self) -> int:
        return 0

    def entries(self) -> list[GroupEntry]:
        return list(self._entries.values())

    def info(self) -> dict:
        """JSON-safe figures for ``/v1/cluster``'s ``prefix_cache`` (``bytes`` per rank)."""
        s = self.stats
        return {"disk": None, "budget_bytes": self.budget_bytes, "bytes": self.nbytes,
                "entries": len(self._entries), "tokens": sum(len(e.tokens) for e in self._entries.values()),
                "hits": s.hits, "misses": s.misses, "hit_tokens": s.hit_tokens, "evictions": s.evictions,
                "inserted": s.inserted, "dropped_on_replan": s.dropped_on_replan,
                "layer_range": [self.stage.start, self.stage.end], "ranks": self.stage.group_size()}
