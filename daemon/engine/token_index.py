"""The index both prefix cache tiers keep: entries keyed by (scope, token ids) in
mlx-lm's token trie (:class:`mlx_lm.models.cache.PromptTrie`), least recently used
first, with their total bytes.

:class:`~ringlet.daemon.engine.prefix_store.PrefixStore` (memory) and
:class:`~ringlet.daemon.engine.prefix_disk.PrefixDisk` (files) differ only in what an
entry holds, what forgetting one frees (:meth:`TokenIndex._discard`) and what evicting
one does first (:meth:`TokenIndex._evict`).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Any

from mlx_lm.models.cache import PromptTrie


class TokenIndex:
    """Entries with ``id``, ``scope``, ``tokens`` (list of token ids) and ``nbytes``,
    held within ``budget_bytes``."""

    def __init__(self, budget_bytes: int = 0) -> None:
        self._trie = PromptTrie()
        self._entries: OrderedDict[int, Any] = OrderedDict()  # least recently used first
        self._ids = itertools.count(1)
        self.nbytes = 0
        #: the most bytes of entries held (0: none)
        self.budget_bytes = max(0, int(budget_bytes))

    def set_budget(self, budget_bytes: int) -> None:
        """A new budget (bytes); entries beyond it are evicted now."""
        self.budget_bytes = max(0, int(budget_bytes))
        self._evict_to(self.budget_bytes)

    def make_room(self, nbytes: int) -> None:
        """Evict least recently used entries until ``nbytes`` fewer bytes are held (or none
        is left); the budget stays."""
        self._evict_to(max(0, self.nbytes - max(0, int(nbytes))))

    def clear(self) -> None:
        """Forget every entry."""
        for entry in list(self._entries.values()):
            self._forget(entry)

    def __len__(self) -> int:
        return len(self._entries)

    def _add(self, entry: Any) -> None:
        """Index ``entry`` as the most recently used; an entry with the same tokens goes."""
        prev = self._trie.add(entry.scope, entry.tokens, entry.id)
        if prev is not None:
            self._forget(self._entries[prev], in_trie=False)
        self._entries[entry.id] = entry
        self.nbytes += entry.nbytes

    def _forget(self, entry: Any, in_trie: bool = True) -> None:
        if in_trie:
            self._trie.pop(entry.scope, entry.tokens)
        self._entries.pop(entry.id, None)
        self.nbytes -= entry.nbytes
        self._discard(entry)

    def _discard(self, entry: Any) -> None:
        """Free what ``entry`` holds outside the index (nothing, by default)."""

    def _evict(self, entry: Any) -> None:
        """Evict one entry for room (by default, just forget it)."""
        self._forget(entry)

    def _evict_to(self, budget: int) -> None:
        """Evict least recently used entries until at most ``budget`` bytes are held."""
        while self.nbytes > budget and self._entries:
            _, oldest = next(iter(self._entries.items()))
            self._evict(oldest)

    def _longest_match(self, scope: str, tokens: list[int]) -> tuple[Any | None, int]:
        """The entry sharing the longest prefix with ``tokens`` and that prefix's length
        (``(None, 0)``: none shares any)."""
        return max(self._candidates(scope, tokens), key=lambda c: c[1], default=(None, 0))

    def _forget_prefixes_of(self, scope: str, tokens: list[int]) -> None:
        """Forget the entries whose tokens are ``tokens`` or a prefix of them (an entry for
        ``tokens`` serves every lookup they did)."""
        while True:
            found = self._trie.search(scope, tokens)
            prefix = found.exact if found.exact is not None else found.shorter
            if prefix is None and len(tokens) > 1 and self._trie.search(scope, tokens[:1]).exact is not None:
                prefix = tokens[:1]  # PromptTrie.search never reports a one-token prefix as ``shorter``
            if prefix is None:
                return
            self._forget(self._entries[self._trie.get(scope, prefix)])

    def _candidates(self, scope: str, tokens: list[int]) -> list[tuple[Any, int]]:
        """The entries that share a prefix with ``tokens``, each with that prefix's
        length (> 0): the one holding exactly ``tokens``, then the longest holding a
        prefix of them, then one holding a longer sequence."""
        if not tokens or not self._entries:
            return []
        found = self._trie.search(scope, tokens)
        out = []
        if found.exact is not None:
            out.append((self._entries[self._trie.get(scope, found.exact)], len(tokens)))
        if found.shorter is not None:
            out.append((self._entries[self._trie.get(scope, found.shorter)], len(found.shorter)))
        if found.longer is not None and found.common_prefix > 0:
            out.append((self._entries[self._trie.get(scope, found.longer)], found.common_prefix))
        return out
