"""The position of a stage whose recurrent layers take their RoPE offset from an
attention layer's cache it does not hold.

Some mlx-lm architectures read one position for every layer from one attention cache,
before any layer runs, and rotate their linear-attention queries and keys by it:

* bailing_moe_linear.py ``LanguageModel.__call__``: ``offset = cache[self.attn_idx].offset``,
  then ``h = layer(h, mask, c, offset=offset)``; ``LinearAttention.__call__``:
  ``queries = self.rope(queries, offset=offset)`` before ``recurrent_gla``;
* bailing_hybrid.py ``LanguageModel.__call__``: ``attn_cache = cache[self._attn_idx]``,
  ``offset = attn_cache.offset if attn_cache is not None else 0``, then the same (its own
  ``LanguageModel.pipeline`` refuses a rank without an MLA layer: "Every rank needs an
  MLA layer for the position offset").

A stage holding an attention layer reads that layer's own cache
(:meth:`~ringlet.daemon.engine.layer_pattern.LayerPattern.apply` points the index at it):
its ``offset`` is the position at prefill, at every decode step, after a prefix-cache
reuse, after ``trim_prompt_cache`` (``KVCache.trim``) and, in a decode group, per row
(``BatchKVCache.offset``). A stage of linear-attention layers alone holds only
``ArraysCache`` states, which count no tokens. So for these architectures every
recurrent cache carries its own count: one more array after its states (:func:`carry`,
on the whole model's caches, so every stage's caches have it wherever a layer's cache
later goes), ``(batch,)`` int32, the tokens its state has absorbed, advanced right after
the forward that advanced the state (:func:`advance`). Being part of the cache's
``state``, the count goes wherever its state goes: kept and restored with it by the
prefix store and a re-plan's handoff (``cache_kinds.freeze``/``thaw``), merged and
split with it in a decode group (``ArraysCache.merge``/``extract``, one row per
request). A recurrent state is never trimmed (``ArraysCache`` is not ``is_trimmable``, so
mlx-lm's ``trim_prompt_cache`` leaves a stage holding one alone, and speculative decoding
is off for a model with one: ``head._may_speculate`` asks ``speculation.trimmable`` of the
whole model's caches), so neither is its count. Where the forward reads the position,
such a stage gives it a :class:`Position` whose ``offset`` is that count
(:func:`position`): an ``int`` for one request, as the whole model's ``KVCache.offset``;
one per row for a decode group, as mlx-lm's ``BatchKVCache.offset``. Its layers are no
attention layers, so the attention mask the forward builds from it goes to no layer: it
builds none.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

#: model_type -> the index attribute of the inner model naming the cache it reads the
#: position from (sources in the module docstring).
POSITION_INDEX: dict[str, str] = {"bailing_moe_linear": "attn_idx", "bailing_hybrid": "_attn_idx"}


def carry(caches: list, model_type: str) -> None:
    """Give every recurrent cache of ``caches`` (the whole model's, empty) its token count,
    for the architectures of :data:`POSITION_INDEX`; others: no-op."""
    if model_type in POSITION_INDEX:
        for c in caches:
            if isinstance(c, ArraysCache):
                c.cache.append(None)


def counted(caches: list, model_type: str) -> int:
    """Entries of the recurrent caches among the whole model's ``caches`` (after
    :func:`carry`), the count included; 0: this architecture's caches count nothing."""
    if model_type not in POSITION_INDEX:
        return 0
    return next((len(c.cache) for c in caches if isinstance(c, ArraysCache)), 0)


def position(caches: list, size: int) -> int | mx.array:
    """The tokens a stage's recurrent ``caches`` have absorbed (each of ``size`` entries,
    the count last): ``int`` for one request, ``(batch,)`` int32 for a decode group.

    Raises:
        ValueError: a recurrent state without its count (one this module did not make).
    """
    for c in caches:
        if isinstance(c, ArraysCache):
            if len(c.cache) != size or (c.cache[-1] is None and c.cache[0] is not None):
                raise ValueError("a recurrent state without its token count: its position is unknown")
            count = c.cache[-1]
            if count is None:
                return 0
            return int(count.item()) if count.size == 1 else count
    raise ValueError("no recurrent state to read the position from")


def advance(caches: list, inputs: Any, size: int) -> None:
    """Count the tokens of ``inputs`` (``(batch, tokens, ...)``: ids or hidden states) in every
    recurrent cache of ``caches`` (each of ``size`` entries, the count last), after the
    forward that gave them to the states."""
    batch, tokens = inputs.shape[0], inputs.shape[1]
    for c in caches:
        if isinstance(c, ArraysCache) and len(c.cache) == size:
            count = c.cache[-1]
            c.cache[-1] = (mx.zeros((batch,), mx.int32) if count is None else count) + tokens


class Position:
    """Stands in, on a stage of recurrent layers alone, for the attention cache the forward
    reads the position from (:data:`POSITION_INDEX`): :meth:`bind` gives one whose
    ``offset`` is the stage's position (:func:`position`); no attention layer here takes
    the mask it would make (``make_mask`` gives ``None``).

    Args:
        size: entries of the model's recurrent caches, the count included.
        offset: the position (``int``, or ``(batch,)`` for a decode group).
    """

    def __init__(self, size: int, offset: int | mx.array = 0):
        self.size, self.offset = size, offset

    def bind(self, caches: list) -> Position:
        """The stand-in for one forward over the stage's own ``caches``."""
        return Position(self.size, position(caches, self.size))

    def make_mask(self, *args, **kwargs) -> None:
        return None
