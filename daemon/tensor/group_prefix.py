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

from typing import TYPE_CHECKING

from ringlet.daemon.tensor.rank_prefix import ShardEntry, ShardIndex

if TYPE_CHECKING:
    from ringlet.daemon.tensor.group_stage import GroupStage


class GroupPrefixStore(ShardIndex):
    """The prefix store of a tensor-group stage holding layers ``[start, end)``: a
    :class:`~ringlet.daemon.tensor.rank_prefix.ShardIndex` whose entries name the group
    epoch holding them, behind the engine's prefix store interface.

    Args:
        stage: the group stage whose ranks hold the entries' KV.
        budget_bytes: the most bytes of KV each rank holds (0: none).
    """

    disk = None  # no disk tier: the KV lives in other processes

    def __init__(self, stage: GroupStage, budget_bytes: int):
        super().__init__(budget_bytes, lambda entry: stage.drop_prefix(entry.id, entry.epoch))
        self.stage = stage

    def _live(self) -> None:
        """Forget the entries of group epochs that are gone (their ranks exited)."""
        epoch = self.stage.group_epoch()
        for entry in [e for e in self._entries.values() if e.epoch != epoch]:
            self._forget(entry)

    def longest(self, scope: str, tokens: list[int], limit: int | None = None) -> int:
        """How many leading tokens of ``tokens`` (at most ``limit``) the ranks can serve."""
        self._live()
        limit = len(tokens) if limit is None else min(limit, len(tokens))
        return self._longest_match(scope, tokens[:limit])[1]

    def take(self, scope: str, tokens: list[int]) -> list | None:
        """A fresh slot whose caches (in every rank) hold exactly ``tokens``, or ``None``
        (a miss) when no entry holds them or the ranks could not load it."""
        self._live()
        entry, n = self._longest_match(scope, tokens)
        ok = entry is not None and n == len(tokens)
        cache = self.stage.load_prefix(entry.id, entry.epoch, n) if ok else None
        if cache is not None:
            self._entries.move_to_end(entry.id)
        self.count(len(tokens) if cache is not None else 0)
        return cache

    def miss(self) -> None:
        self.count(0)

    def insert(self, scope: str, tokens: list[int], cache: list) -> bool:
        """Have the ranks keep a finished request's slot (``cache``) for ``tokens`` (as many
        as it holds). Entries it extends and the least recently used beyond the budget
        are dropped. Returns whether it was kept."""
        if self.budget_bytes <= 0 or not tokens:
            return False
        self._live()
        entry_id = self.next_id()
        kept = self.stage.save_prefix(cache, entry_id, len(tokens))
        return kept is not None and self.add(entry_id, scope, tokens, kept[1], epoch=kept[0])

    def retain(self, start: int, end: int) -> None:
        """A group holds one layer range for its whole life: another range drops everything."""
        if (start, end) != (self.stage.start, self.stage.end):
            self.clear()

    def save_to_disk(self) -> int:
        return 0

    def entries(self) -> list[ShardEntry]:
        return list(self._entries.values())

    def info(self) -> dict:
        """JSON-safe figures for ``/v1/cluster``'s ``prefix_cache`` (``bytes`` per rank)."""
        return {**super().info(self.stage.group_size()), "dropped_on_replan": self.stats.dropped_on_replan,
                "layer_range": [self.stage.start, self.stage.end]}
