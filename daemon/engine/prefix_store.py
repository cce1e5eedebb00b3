"""The prefix store of one stage: KV caches of finished requests for this stage's layers,
keyed by token ids, bounded in bytes, least recently used evicted first.

Why: chat apps and coding agents send the whole conversation again every turn. A turn
that starts with a cached prefix prefills only its new tokens.

Design (issue "Conversations stay in the ring"):

* **Keyed by token ids, per scope.** The index is mlx-lm's token trie
  (:class:`mlx_lm.models.cache.PromptTrie`, the one behind ``mlx_lm.server``'s
  ``LRUPromptCache``), one trie per scope (an API key's digest, or the cluster). Every
  stage learns the token ids: stage 0 sends the reused prefix's ids with a request's
  first prefill chunk and all of a request's ids with its release.
* **Copy on extend, not shared blocks.** An entry is one conversation's KV for exactly
  its tokens, stored compact (``mx.contiguous`` slices: no 256-token padding), so a
  cached token costs the model's KV bytes per token for these layers. A request that
  reuses an entry gets fresh arrays (:meth:`take`), so an entry is never mutated by
  the request that reuses it, and two requests may extend one prefix at once. When a
  finished request extends an entry (its tokens start with the entry's), the entry is
  dropped: the new one answers every lookup the old one did. Conversations that share
  a system prompt keep one entry each (the shared part is held once per
  conversation); a block trie would hold it once, but every hit would then have to
  concatenate blocks into a contiguous cache anyway, and conversations rarely share
  more than their system prompt.
* **Exact lengths.** :meth:`longest` says how many leading tokens of a prompt this stage
  can serve; :meth:`take` builds caches of exactly that many, trimming a longer entry.
  Stage 0 decides one length for the ring and every stage must take exactly it, or
  the request falls back to a shorter one (never to wrong output).
* **Layer ranges.** Entries carry their layer range ``[start, end)``; after a re-plan a
  stage keeps the entries covering its new range (sliced to it) and drops the others
  (:meth:`retain`). :meth:`export_entry` / :meth:`import_entry` give an entry as plain
  tensors (for moving KV with its layers).

* **Other cache kinds at exact lengths.** A stage whose layers are all plain ``KVCache``
  stores compact keys and values, reusable at any prefix length. A stage with any other
  kind (a sliding window's ``RotatingKVCache``, a recurrent ``ArraysCache``, ...:
  :mod:`.cache_kinds`) can reuse a state only at exactly the length it was saved: its
  entry keeps every layer's state whole (:func:`.cache_kinds.freeze`), is *exact*, and
  serves a prompt only when its tokens are all a prefix of it, at exactly their number
  (:meth:`longest` says that many, or a shorter plain answer, never a cut). A release
  keeps the state at the turn's end (prompt and output), which the next turn of a chat
  starts with. Such entries stay in memory (the disk tier takes plain ones only: one
  evicted is dropped, counted in ``exact_dropped``); on a re-plan they stay on their
  node, never crossing the wire (:mod:`.kv_handoff` counts them).

A tensor group's stage has a store of its own (:mod:`ringlet.daemon.tensor.group_prefix`).
All methods run on the engine's MLX worker thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from ringlet.daemon.engine import cache_kinds
from ringlet.daemon.engine.prefix_disk import PrefixDisk
from ringlet.daemon.engine.token_index import TokenIndex


@dataclass
class Entry:
    """One cached sequence: ``tokens`` and, per layer of ``[start, end)``, its keys and
    values, each ``(1, kv_heads, len(tokens), head_dim)`` in the cache dtype; or, when
    ``exact``, each layer's whole state (:class:`.cache_kinds.Frozen`), reusable only at
    exactly ``len(tokens)``."""

    scope: str
    tokens: list[int]
    start: int
    end: int
    layers: list[tuple[mx.array, mx.array]]
    nbytes: int = 0
    id: int = 0
    exact: bool = False


@dataclass
class StoreStats:
    """Counters of one store, for ``/v1/cluster``: lookups that found a prefix (hits) and
    found none (misses), tokens served from it, entries and bytes held, evictions."""

    hits: int = 0
    misses: int = 0
    hit_tokens: int = 0
    evictions: int = 0
    inserted: int = 0
    dropped_on_replan: int = 0
    #: exact entries (:mod:`.cache_kinds`) evicted with no disk tier to take them
    exact_dropped: int = 0
    extra: dict = field(default_factory=dict)


def storable(cache: list) -> bool:
    """Whether a request's cache is made of plain mlx-lm ``KVCache`` layers only (its KV
    can be cut to any prefix, joined and moved: :func:`.cache_kinds.plain`)."""
    return cache_kinds.plain(cache)


layers_nbytes = cache_kinds.layers_nbytes


class PrefixStore(TokenIndex):
    """The prefix store of one stage holding layers ``[start, end)``.

    Args:
        budget_bytes: the most bytes of KV it holds (0: it holds nothing).
        start, end: the stage's layer range.
        disk: the disk tier (:class:`~ringlet.daemon.engine.prefix_disk.PrefixDisk`), if any.
    """

    def __init__(self, budget_bytes: int, start: int = 0, end: int = 0, disk: PrefixDisk | None = None):
        #: the disk tier: entries evicted for room go there, and come back on a hit
        self.disk = disk
        self.start, self.end = start, end
        super().__init__(budget_bytes)
        self.stats = StoreStats()
        #: ids of entries the budget never evicts: requests in flight across a re-plan
        #: (:mod:`ringlet.daemon.engine.kv_handoff`), until taken or the next re-plan
        self.pinned: set[int] = set()

    # --- lookup -------------------------------------------------------------------------

    def longest(self, scope: str, tokens: list[int], limit: int | None = None) -> int:
        """How many leading tokens of ``tokens`` (at most ``limit``) this stage can serve,
        from memory or from the disk tier."""
        limit = len(tokens) if limit is None else min(limit, len(tokens))
        n = 0
        if self._entries:
            entry, found = self._usable_match(scope, tokens[:limit])
            n = found if entry is not None else 0
        if self.disk is not None and len(self.disk) and n < limit:
            n = max(n, self.disk.longest(scope, tokens[:limit], self.start, self.end))
        return n

    def take(self, scope: str, tokens: list[int]) -> list[KVCache] | None:
        """Fresh caches holding exactly ``tokens`` (all of them) for this stage's layers,
        or ``None`` when neither memory nor the disk tier can serve that many (counted as
        a miss). The entry is moved to the most recently used end (an entry on disk is
        loaded back into memory first); its arrays are never handed out."""
        entry, n = self._usable_match(scope, tokens) if self._entries else (None, 0)
        if (entry is None or n < len(tokens)) and self.disk is not None:
            loaded = self.disk.take(scope, tokens, self.start, self.end)
            if loaded is not None:
                if not self.import_entry(*loaded):  # larger than the memory budget: serve it once
                    self.stats.hits += 1
                    self.stats.hit_tokens += len(tokens)
                    return caches_from(_layers_of(*loaded, self.start, self.end), len(tokens))
                entry, n = self._usable_match(scope, tokens)
        if entry is None or n < len(tokens):
            self.stats.misses += 1
            return None
        self._entries.move_to_end(entry.id)
        offset = self.start - entry.start
        self.stats.hits += 1
        self.stats.hit_tokens += len(tokens)
        layers = entry.layers[offset:offset + (self.end - self.start)]
        caches = cache_kinds.thaw(layers) if entry.exact else caches_from(layers, len(tokens))
        if entry.id in self.pinned:  # a resumed request took its KV: an entry like any other now
            self.pinned.discard(entry.id)
            self._evict_to(self.budget_bytes)
        return caches

    def miss(self) -> None:
        """Count a lookup that found nothing to reuse."""
        self.stats.misses += 1

    def _covers(self, entry: Entry) -> bool:
        return entry.start <= self.start and entry.end >= self.end

    def _usable_match(self, scope: str, tokens: list[int]) -> tuple[Entry | None, int]:
        """The entry serving the longest prefix of ``tokens`` and that prefix's length:
        it covers this stage's layers and, if exact, all its tokens start ``tokens``
        (``(None, 0)``: none)."""
        usable = [(e, n) for e, n in self._candidates(scope, tokens)
                  if self._covers(e) and (not e.exact or n == len(e.tokens))]
        return max(usable, key=lambda c: c[1], default=(None, 0))

    # --- insert, evict ------------------------------------------------------------------

    def insert(self, scope: str, tokens: list[int], cache: list) -> bool:
        """Keep a finished request's ``cache`` (one mlx-lm cache per layer of this stage)
        for ``tokens`` (its ids, as many as the cache holds): plain ``KVCache`` layers as
        compact keys and values, any other kind whole, as an exact entry. Entries it
        extends are dropped; the least recently used go until the budget holds. Returns
        whether it was kept (not when the budget is 0, a layer holds another number of
        tokens, or it alone is over the budget)."""
        n = len(tokens)
        if self.budget_bytes <= 0 or n == 0 or not cache or any(
                getattr(c, "offset", n) != n for c in cache_kinds.leaves(cache)):
            return False
        exact = not storable(cache)
        layers = cache_kinds.freeze(cache) if exact else snapshot(cache, n)
        nbytes = layers_nbytes(layers)
        if nbytes > self.budget_bytes:
            return False
        self._forget_prefixes_of(scope, tokens)
        # room first, then the entry: the figures another thread reads (/v1/cluster) never
        # show more than the budget, even while an evicted entry is written to disk
        self._evict_to(self.budget_bytes - nbytes)
        entry = Entry(scope, list(tokens), self.start, self.end, layers, nbytes, next(self._ids), exact)
        self._add(entry)
        self.stats.inserted += 1
        return True

    def adopt(self, scope: str, tokens: list[int], start: int, end: int, layers: list,
              pinned: bool = False) -> bool:
        """Keep KV that came with a re-plan: ``layers`` of ``[start, end)`` (this stage's
        range) for ``tokens``, keys and values or whole states (an exact entry).
        ``pinned``: a request in flight, kept whatever the budget until it is taken.
        Returns whether it was kept."""
        nbytes = layers_nbytes(layers)
        if (start, end) != (self.start, self.end) or not tokens or (not pinned and nbytes > self.budget_bytes):
            return False
        self._forget_prefixes_of(scope, tokens)
        entry = Entry(scope, list(tokens), start, end, layers, nbytes, next(self._ids), cache_kinds.frozen(layers))
        self._add(entry)
        if pinned:
            self.pinned.add(entry.id)
        self._evict_to(self.budget_bytes)
        return entry.id in self._entries

    def _evict_to(self, budget: int) -> None:
        """Evict least recently used unpinned entries until at most ``budget`` bytes of
        unpinned entries are held."""
        held = self.nbytes - sum(self._entries[i].nbytes for i in self.pinned if i in self._entries)
        for entry in [e for e in self._entries.values() if e.id not in self.pinned]:
            if held <= budget:
                return
            held -= entry.nbytes
            self._evict(entry)

    def _forget(self, entry: Entry, in_trie: bool = True) -> None:
        self.pinned.discard(entry.id)
        super()._forget(entry, in_trie)

    def _evict(self, entry: Entry) -> None:
        """Evict one entry for room, spilling it to the disk tier when there is one (a
        plain one: an exact entry is dropped, counted)."""
        if entry.exact:
            self.stats.exact_dropped += 1
        elif self.disk is not None:
            self.disk.put(*self.export_entry(entry))
        self._forget(entry)
        self.stats.evictions += 1

    def save_to_disk(self) -> int:
        """Write every entry to the disk tier, most recently used last (so it is the last
        the tier evicts), e.g. before the process exits. Returns how many it kept."""
        if self.disk is None:
            return 0
        return sum(self.disk.put(*self.export_entry(entry)) for entry in self.entries() if not entry.exact)

    # --- re-plans, export ---------------------------------------------------------------

    def retain(self, start: int, end: int) -> None:
        """The stage now holds ``[start, end)``: entries covering it are sliced to it, the
        others are dropped (they lack layers this stage needs)."""
        for entry in list(self._entries.values()):
            if entry.start <= start and entry.end >= end:
                lo = start - entry.start
                kept = entry.layers[lo:lo + (end - start)]
                self.nbytes -= entry.nbytes - layers_nbytes(kept)
                entry.layers, entry.start, entry.end = kept, start, end
                entry.nbytes = layers_nbytes(kept)
            else:
                self._forget(entry)
                self.stats.dropped_on_replan += 1
        self.start, self.end = start, end

    def entries(self) -> list[Entry]:
        """Entries, least recently used first."""
        return list(self._entries.values())

    @staticmethod
    def export_entry(entry: Entry) -> tuple[dict[str, mx.array], dict[str, str]]:
        """A plain entry as tensors (``layer.<i>.keys`` / ``.values``, ``i`` absolute) and
        string metadata (scope, layer range, token ids), e.g. for ``mx.save_safetensors``.

        Raises:
            ValueError: an exact entry (its states are not keys and values).
        """
        if entry.exact:
            raise ValueError("an exact prefix entry (whole cache states) has no keys-and-values form")
        arrays = {"tokens": mx.array(entry.tokens, dtype=mx.int32)}
        for i, (k, v) in enumerate(entry.layers, start=entry.start):
            arrays[f"layer.{i}.keys"], arrays[f"layer.{i}.values"] = k, v
        return arrays, {"scope": entry.scope, "start": str(entry.start), "end": str(entry.end)}

    def import_entry(self, arrays: dict[str, Any], meta: dict[str, str]) -> bool:
        """Add an entry given as :meth:`export_entry` made it, if it covers this stage's
        layers (it is sliced to them) and its shapes agree. Returns whether it was kept.

        Raises:
            ValueError: the tensors do not form an entry (missing layers, shapes disagree).
        """
        start, end = int(meta["start"]), int(meta["end"])
        tokens = [int(t) for t in arrays["tokens"].tolist()]
        _layers_of(arrays, meta, start, end)  # checks every layer
        if not (start <= self.start and end >= self.end) or self.budget_bytes <= 0:
            return False
        layers = _layers_of(arrays, meta, self.start, self.end)
        entry = Entry(meta.get("scope", ""), tokens, self.start, self.end, layers,
                      sum(k.nbytes + v.nbytes for k, v in layers), next(self._ids))
        if entry.nbytes > self.budget_bytes:
            return False
        self._forget_prefixes_of(entry.scope, tokens)
        self._add(entry)
        self._evict_to(self.budget_bytes)
        return True

    def info(self) -> dict:
        """JSON-safe figures for ``/v1/cluster``'s ``prefix_cache`` (``disk``: the disk
        tier's, or ``None``)."""
        s = self.stats
        return {"disk": self.disk.info() if self.disk is not None else None,
                "budget_bytes": self.budget_bytes, "bytes": self.nbytes, "entries": len(self._entries),
                "tokens": sum(len(e.tokens) for e in self._entries.values()), "hits": s.hits, "misses": s.misses,
                "hit_tokens": s.hit_tokens, "evictions": s.evictions, "inserted": s.inserted,
                "dropped_on_replan": s.dropped_on_replan, "exact_dropped": s.exact_dropped,
                "exact_entries": sum(e.exact for e in self._entries.values()), "layer_range": [self.start, self.end],
                "pinned": len(self.pinned)}


def _layers_of(arrays: dict[str, Any], meta: dict[str, str], start: int, end: int) -> list[tuple[mx.array, mx.array]]:
    """Layers ``[start, end)`` of an exported entry, each ``(keys, values)``.

    Raises:
        ValueError: a layer is missing or does not hold the entry's token count.
    """
    n = len(arrays["tokens"].tolist()) if "tokens" in arrays else -1
    layers = []
    for i in range(start, end):
        k, v = arrays.get(f"layer.{i}.keys"), arrays.get(f"layer.{i}.values")
        if k is None or v is None or k.ndim != 4 or v.ndim != 4 or k.shape[2] != n or v.shape[2] != n:
            raise ValueError(f"prefix entry: layer {i} is missing or does not hold {n} tokens")
        layers.append((k, v))
    return layers


def snapshot(cache: list, n: int) -> list[tuple[mx.array, mx.array]]:
    """Compact copies of the first ``n`` tokens of a request's ``KVCache`` layers: per
    layer ``(keys, values)``, each ``(1, kv_heads, n, head_dim)`` in the cache dtype,
    evaluated (the request may go on updating its cache)."""
    layers = [(mx.contiguous(c.keys[..., :n, :]), mx.contiguous(c.values[..., :n, :])) for c in cache]
    mx.eval(layers)
    return layers


def caches_from(layers: list[tuple[mx.array, mx.array]], n: int) -> list[KVCache]:
    """Fresh mlx-lm caches holding the first ``n`` tokens of ``layers``: new array
    objects (slices), so a request's updates never reach the stored arrays."""
    caches = []
    for keys, values in layers:
        c = KVCache()
        c.keys, c.values, c.offset = keys[..., :n, :], values[..., :n, :], n
        caches.append(c)
    return caches
