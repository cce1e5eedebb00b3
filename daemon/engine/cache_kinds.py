"""What each kind of mlx-lm cache allows a stage to do with a request's state.

mlx-lm gives every layer a cache of its architecture's kind (``mlx_lm.models.cache``):

* ``KVCache`` -- full attention: keys and values of every token, in order. The state
  at any shorter length ``n`` is its first ``n`` positions (attention is causal), so it
  can be cut, stored compactly, joined layer range to layer range and trimmed.
* ``RotatingKVCache(max_size, keep)`` -- a sliding window: once more than ``max_size``
  tokens went in, the oldest are overwritten (``_update_in_place``) or dropped
  (``_update_concat``); mlx-lm itself trims it only while ``offset < max_size``
  (``RotatingKVCache.is_trimmable``).
* ``ArraysCache(size)`` -- a recurrent state (linear attention, SSM, short convolution:
  qwen3_next.py ``GatedDeltaNet``, mamba2.py, lfm2.py): a constant-size summary of every
  token so far; it can never be cut back (``is_trimmable`` is False).
* ``ChunkedKVCache(chunk_size)`` -- chunked attention (llama4.py): drops whole chunks.
* ``QuantizedKVCache`` -- packed keys and values (``mx.quantize`` triples).
* ``CacheList`` -- several of the above for one layer.

So a stage whose layers are all plain ``KVCache`` (:func:`plain`) can reuse a stored
state at any prefix length; any other stage's state is reusable only at exactly the
length it was saved (:func:`freeze` / :func:`thaw` keep and restore it whole, through
each class's own ``state`` / ``from_state``, as ``mlx_lm.models.cache.save_prompt_cache``
and ``load_prompt_cache`` do). :func:`trimmable` says whether a request's caches can
drop their last ``n`` tokens (speculative decoding's rejected drafts), by mlx-lm's own
``can_trim_prompt_cache``; :func:`mergeable` whether requests' caches can decode as one
batch (mlx-lm's ``BatchKVCache``, ``BatchRotatingKVCache``, batched ``ArraysCache``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx_lm.models.cache as mlx_cache


def plain(cache: list) -> bool:
    """Whether every layer of a request's ``cache`` is a plain mlx-lm ``KVCache``: its
    state at any prefix length is a slice of it."""
    return bool(cache) and all(type(c) is mlx_cache.KVCache for c in cache)


def exact_only(cache: list) -> bool:
    """Whether a request's ``cache`` (non-empty) is reusable only at the length it holds:
    some layer is not a plain ``KVCache`` (a window, a recurrent state, ...)."""
    return bool(cache) and not plain(cache)


def trimmable(cache: list, n: int) -> bool:
    """Whether the last ``n`` tokens can be dropped from every layer of ``cache`` exactly,
    by mlx-lm's ``trim_prompt_cache``: every layer ``is_trimmable()`` (mlx-lm's
    ``can_trim_prompt_cache``; a ``RotatingKVCache`` only before it wraps, never a
    recurrent ``ArraysCache``) and holds at least ``n`` tokens."""
    if n <= 0:
        return True
    return bool(cache) and mlx_cache.can_trim_prompt_cache(cache) and all(
        getattr(c, "offset", 0) >= n for c in leaves(cache))


#: cache kinds whose batched form mlx-lm has (``merge`` into ``BatchKVCache``,
#: ``BatchRotatingKVCache``, a batched ``ArraysCache``; ``extract`` back per row)
MERGEABLE = ("KVCache", "RotatingKVCache", "ArraysCache")


def mergeable(caches: list[list]) -> bool:
    """Whether several requests' caches (one list per request, per layer) can join one
    batched forward through mlx-lm's own batch caches: every layer of the same kind in
    every request, a kind of :data:`MERGEABLE` (or a ``CacheList`` of them), and of the
    same size parameter (window, state arrays), a window keeping no first tokens
    (``keep=0``, as every mlx-lm model's). A ``QuantizedKVCache`` or a
    ``ChunkedKVCache`` has no batched form in mlx-lm: such requests run one at a time."""
    if not caches or not all(caches) or len({len(c) for c in caches}) != 1:
        return False
    from ringlet.daemon.engine.layer_pattern import cache_signature

    for layer in zip(*caches, strict=True):
        if len({cache_signature(c) for c in layer}) != 1 or len({type(c) for c in layer}) != 1:
            return False
        members = layer[0].caches if isinstance(layer[0], mlx_cache.CacheList) else (layer[0],)
        if not all(type(m).__name__ in MERGEABLE and not getattr(m, "keep", 0) for m in members):
            return False  # (BatchRotatingKVCache keeps no first tokens: extract gives keep=0)
    return True


def nbytes(cache: list) -> int:
    """Bytes a request's caches hold (an empty layer: 0, whatever its kind)."""
    return sum(0 if c.empty() else c.nbytes for c in cache)


def kinds(cache: list) -> list[str]:
    """The class name of each layer's cache (a ``CacheList`` with its members:
    ``CacheList(ArraysCache+KVCache)``)."""
    return [f"CacheList({'+'.join(type(m).__name__ for m in c.caches)})" if isinstance(c, mlx_cache.CacheList)
            else type(c).__name__ for c in cache]


@dataclass
class Frozen:
    """One layer's cache state, kept apart from the request that made it: the cache
    class's name (in ``mlx_lm.models.cache``) and a copy of its ``state`` (arrays
    evaluated, never mutated)."""

    kind: str
    state: Any
    nbytes: int


def freeze(cache: list) -> list[Frozen]:
    """Copies of every layer's state of ``cache`` (evaluated; the request may go on
    updating its caches). A ``KVCache`` layer keeps only its ``offset`` filled positions.

    Raises:
        ValueError: a layer whose class is not in ``mlx_lm.models.cache``.
    """
    out = []
    for c in cache:
        kind = type(c).__name__
        if getattr(mlx_cache, kind, None) is not type(c):
            raise ValueError(f"cache kind {kind} is not one of mlx_lm.models.cache's")
        if kind == "KVCache" and c.keys is not None:
            state = (mx.contiguous(c.keys[..., :c.offset, :]), mx.contiguous(c.values[..., :c.offset, :]), c.offset)
        else:
            state = _copy(c.state)
        arrays = _arrays(state)
        mx.eval(arrays)
        out.append(Frozen(kind, state, sum(a.nbytes for a in arrays)))
    return out


def thaw(layers: list) -> list:
    """Fresh mlx-lm caches holding the states ``layers`` keep (new array objects, so a
    request updating them never reaches the kept copies): a :class:`Frozen` state as its
    own kind, a ``(keys, values)`` pair (a plain layer joined to them) as a ``KVCache``
    of all its tokens."""
    out = []
    for f in layers:
        if isinstance(f, Frozen):
            out.append(getattr(mlx_cache, f.kind).from_state(_copy(f.state)))
        else:
            keys, values = f
            out.append(mlx_cache.KVCache.from_state((mx.array(keys), mx.array(values), keys.shape[2])))
    return out


def layers_nbytes(layers: list) -> int:
    """Bytes of stored layers: ``(keys, values)`` pairs or :class:`Frozen` states."""
    return sum(x.nbytes if isinstance(x, Frozen) else x[0].nbytes + x[1].nbytes for x in layers)


def frozen(layers: list) -> bool:
    """Whether stored layers hold any whole state (:class:`Frozen`): reusable only at
    exactly their length."""
    return any(isinstance(x, Frozen) for x in layers)


def _copy(state: Any) -> Any:
    """``state`` with every array a new array object (same data) and every list new."""
    if isinstance(state, mx.array):
        return mx.array(state)
    if isinstance(state, (list, tuple)):
        return type(state)(_copy(s) for s in state)
    return state


def _arrays(state: Any) -> list[mx.array]:
    if isinstance(state, mx.array):
        return [state]
    if isinstance(state, (list, tuple)):
        return [a for s in state for a in _arrays(s)]
    return []


def leaves(cache: list) -> list:
    """Every cache of ``cache``, a ``CacheList`` opened into its members."""
    return [m for c in cache for m in (c.caches if isinstance(c, mlx_cache.CacheList) else (c,))]
