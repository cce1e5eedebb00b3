"""Decode groups: the KV caches of requests that keep decoding together stay merged.

A batched decode step runs mlx-lm's left-padded ``BatchKVCache`` (for sliding windows
its ``BatchRotatingKVCache``, for recurrent states a batched ``ArraysCache``: each kind's
own ``merge`` and ``extract``; kinds without one run alone, counted in ``unmerged``). Building one
(``BatchKVCache.merge``) copies every member's whole KV cache into a padded buffer,
and splitting it back (``extract``) copies it again: work that grows with the
context, on every step, for every member. Measured by ``bench/bench_groups.py``
(SmolLM2-135M, float32, 18 layers, one thread): a step of 4 requests at 60 tokens of
context took 57 ms merged and split against 42 ms on a kept group; at 1,000 tokens
120 ms against 57 ms, and 8 requests 432 ms against 89 ms (one request alone: 24 and
30 ms).

So a group is kept while the same requests step together: the first step merges
their caches once, later steps of exactly those requests run on the group's caches,
and the rows go back into the members' own caches (one copy) only when something
needs one alone: a step with other company, a release, a re-plan. While a request is
in a group its own cache list is empty (the group holds its KV); :meth:`dissolve`
fills it again. Everything here runs on the engine's single MLX worker thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

import mlx.core as mx

from ringlet.daemon.engine import cache_kinds

log = logging.getLogger(__name__)


@dataclass
class _Group:
    keys: tuple  # the members, in row order
    owners: list[list]  # each member's own cache list, emptied while grouped (row order)
    caches: list  # one batched cache per layer (BatchKVCache, BatchRotatingKVCache, ArraysCache...)


class DecodeGroups:
    """The merged KV caches of the request groups that decode together on one stage."""

    def __init__(self) -> None:
        self._of: dict[Hashable, _Group] = {}
        #: batched steps run one request at a time instead: caches mlx-lm cannot merge
        #: (quantized, chunked), since start
        self.unmerged = 0

    def members(self, key: Hashable) -> tuple | None:
        """The members of ``key``'s group, in row order (``None``: not grouped)."""
        group = self._of.get(key)
        return group.keys if group is not None else None

    def __len__(self) -> int:
        """Groups held."""
        return len({id(g) for g in self._of.values()})

    def nbytes(self) -> int:
        """Bytes of the KV the groups hold (may be read from any thread)."""
        groups = {id(g): g for g in list(self._of.values())}
        return sum(c.nbytes for g in groups.values() for c in g.caches)

    def forward(self, forward: Callable[[mx.array, list], mx.array], keys: list[Hashable], x: mx.array,
                caches: list[list], mergeable: Callable[[list[list]], bool]) -> mx.array | None:
        """One batched decode step of ``keys`` (distinct, two or more).

        Args:
            forward: the stage, called as ``forward(x, merged_caches)``.
            keys: the requests, in the order of ``x``'s rows.
            x: their inputs ``(len(keys), 1, ...)``.
            caches: their own cache lists (per layer), in the same order; an empty list
                for a member of a group.
            mergeable: whether plain caches can be merged (``stage.mergeable``).

        Returns:
            The evaluated output ``(len(keys), 1, ...)`` in ``keys``' order, or ``None``
            when the caches cannot be merged (quantized, chunked: counted in
            :attr:`unmerged`): the members' own caches are then whole again and the caller
            runs them one by one.
        """
        group = self._of.get(keys[0])
        if group is None or len(group.keys) != len(keys) or set(group.keys) != set(keys):
            self.dissolve(keys)
            if not mergeable(caches):
                if not self.unmerged:
                    log.info("decode steps of caches mlx-lm cannot merge (%s) run one request at a time",
                             ", ".join(sorted({k for c in caches for k in cache_kinds.kinds(c)})))
                self.unmerged += 1
                return None
            group = self._form(tuple(keys), caches)
        row = {k: i for i, k in enumerate(group.keys)}
        order = [row[k] for k in keys]
        if order != sorted(order):  # x's rows into the group's row order, and the output back
            inverse = [0] * len(order)
            for i, r in enumerate(order):
                inverse[r] = i
            out = forward(x[mx.array(inverse)], group.caches)[mx.array(order)]
        else:
            out = forward(x, group.caches)
        mx.eval(out)
        return out

    def _form(self, keys: tuple, caches: list[list]) -> _Group:
        # each kind's own batched form: BatchKVCache, BatchRotatingKVCache, ArraysCache, CacheList
        merged = [type(caches[0][layer]).merge([cache[layer] for cache in caches]) for layer in range(len(caches[0]))]
        group = _Group(keys, list(caches), merged)
        for owner in caches:
            owner.clear()  # the group holds their KV now
        for key in keys:
            self._of[key] = group
        return group

    def dissolve(self, keys: Iterable[Hashable]) -> None:
        """Give every group holding any of ``keys`` back to its members: each member's
        own cache list gets its row (one copy of its KV), and the group goes."""
        for key in list(keys):
            group = self._of.get(key)
            if group is None:
                continue
            for row, (member, owner) in enumerate(zip(group.keys, group.owners, strict=True)):
                owner[:] = [c.extract(row) for c in group.caches]
                self._of.pop(member, None)
            mx.eval([c.state for owner in group.owners for c in owner])

    def dissolve_all(self) -> None:
        """Every member's own cache whole again; no groups left."""
        self.dissolve(list(self._of))
