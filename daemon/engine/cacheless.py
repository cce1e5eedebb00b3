"""Layers that cache nothing, given a cache that holds nothing but their length.

Everything a stage does with a request's state -- the prefix store, a re-plan's KV
handoff, a rebuild from boundary states, decode groups, speculative decoding's trim --
works on one mlx-lm cache per layer, ``[start, end)``. Some architectures have layers that
cache nothing:

* nemotron_h.py: only its mamba (``M``) and attention (``*``) blocks have caches;
  ``Model.make_cache`` makes one per such block and ``NemotronHModel.__call__`` hands
  them out with a counter (``cache_counter``), ``None`` to MLP (``-``) and MoE (``E``)
  blocks, so the cache list is not one per layer;
* nemotron-nas.py: ``Model.make_cache`` makes a ``KVCache`` per layer whose
  ``self_attn is not None`` and ``NemotronNASModel.__call__`` counts them (``cache_idx``),
  so a layer whose attention is a no-op has none; a layer whose attention is replaced by
  a linear map (``LinearSubblockReplacement``, which takes the cache and ignores it) has
  one that is never written.

Each such layer here gets a *length cache*: a plain mlx-lm ``KVCache`` that the stage
advances after every forward by the forward's tokens with keys and values of width 0
(``(batch, 1, tokens, 0)``): it holds 0 bytes and its ``offset`` is the layer's token
count, so it is cut, stored, joined, trimmed, merged into a ``BatchKVCache`` and split
back exactly as a real layer's is (an always-empty cache would not be: mlx-lm's
``trim_prompt_cache`` reports the first layer's count, and ``extract`` of a merged empty
cache fails). The forward never sees the length caches of layers the model gives no
cache (:func:`model_caches` leaves them out, so its counter finds its own), and the one
a layer is handed and ignores is advanced all the same.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

#: model_type -> (whether a decoder layer has an entry in the model's cache list,
#: whether the layer ever writes it); sources in the module docstring.
RULES: dict[str, tuple[Callable[[Any], bool], Callable[[Any], bool]]] = {
    "nemotron_h": (lambda layer: layer.block_type in ("M", "*"), lambda layer: True),
    "nemotron-nas": (lambda layer: layer.self_attn is not None,
                     lambda layer: type(layer.self_attn).__name__ != "LinearSubblockReplacement"),
}


def positions(model_type: str, layers: list) -> tuple[frozenset[int], frozenset[int]]:
    """``(missing, unwritten)``: the positions of ``layers`` (a whole model's decoder
    layers) that have no entry in its cache list, and those whose entry is never written
    (the missing ones included); both empty for an architecture not in :data:`RULES`."""
    if model_type not in RULES:
        return frozenset(), frozenset()
    has_entry, writes = RULES[model_type]
    missing = frozenset(i for i, layer in enumerate(layers) if not has_entry(layer))
    return missing, missing | frozenset(i for i, layer in enumerate(layers) if i not in missing and not writes(layer))


def one_per_layer(caches: list, missing: frozenset[int], n: int) -> list:
    """The whole model's cache list (``make_prompt_cache``: an entry per layer not in
    ``missing``, in order) as one cache per layer of ``n``, a fresh ``KVCache`` at each
    position of ``missing``.

    Raises:
        ValueError: the list does not have ``n - len(missing)`` entries.
    """
    if not missing:
        return caches
    if len(caches) != n - len(missing):
        raise ValueError(f"{len(caches)} caches for {n - len(missing)} layers that have one")
    entries = iter(caches)
    return [KVCache() if i in missing else next(entries) for i in range(n)]


def model_caches(caches: list, missing_local: frozenset[int]) -> list:
    """What the model's own forward takes: a stage's caches (one per layer) less those of
    the layers the model gives none (positions ``missing_local`` in the stage); a stage
    of such layers alone gives its first length cache, as ``cache[0]`` for the mask the
    forward builds (nemotron-nas.py ``NemotronNASModel.__call__``), which no layer reads."""
    if not missing_local:
        return caches
    kept = [c for i, c in enumerate(caches) if i not in missing_local]
    return kept or caches[:1]  # a forward reads cache[0] for its mask (nemotron-nas.py): a length cache then


def advance(caches: list, unwritten_local: frozenset[int], x: mx.array) -> None:
    """After a forward over ``x`` (``(batch, tokens)`` ids or ``(batch, tokens, hidden)``
    states), add its tokens to the length caches at ``unwritten_local`` (positions in
    the stage's one-per-layer ``caches``; a ``KVCache``, or a ``BatchKVCache`` in a
    decode group)."""
    if not unwritten_local:
        return
    empty = mx.zeros((x.shape[0], 1, x.shape[1], 0), dtype=mx.float32)
    for i in unwritten_local:
        caches[i].update_and_fetch(empty, empty)
