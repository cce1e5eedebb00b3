"""Layers that take their mask from their own cache, for forwards that pick a layer's
kind by its *local* loop index.

``gemma3_text.py`` ``Gemma3Model.__call__`` and ``cohere2.py`` ``CohereModel.__call__``
build two masks before the loop -- the global one from ``cache[P - 1]``, the sliding one
from ``cache[0]`` with ``window_size`` -- and give layer ``i`` the global mask when
``i % P == P - 1`` (``P``: ``sliding_window_pattern``). ``i`` is the position in the
stage's layer list, not in the model, so a stage starting at a layer that is not a
multiple of ``P`` would give its layers the wrong masks, and a stage of fewer than ``P``
layers would index past its caches.

:func:`own_masks` makes this exact for any split: the inner model's pattern becomes 1 (one
mask, from ``cache[0]``, which every layer then ignores), and each layer's class becomes
a subclass whose ``__call__`` builds the mask of its *global* kind from its own cache
before running: ``create_attention_mask(x, cache)`` for a global layer,
``create_attention_mask(x, cache, window_size=window)`` for a sliding one -- the calls
the whole model makes, on a cache of the same kind (:mod:`layer_pattern` gives each
layer the whole model's cache for its global position) in the same state (no layer has
updated its cache when the forward builds its masks, nor when a layer starts). The
layers' parameters and names are unchanged.

``llama4.py`` ``LlamaModel.__call__`` reads its loop index ``idx`` three ways: it trims
the caches with ``(idx + 1) % 4 != 0`` (``ChunkedKVCache.maybe_trim_front``), gives those
layers the chunked mask and the others the global mask built from ``cache[3]``, and takes
``start_position`` and ``offset`` from ``cache[0]``. :func:`own_masks` makes the local index
equal the global one modulo 4 (:class:`_Period4`): before each forward the stage's layers
get ``p = first global layer % 4`` pass-through layers in front and its caches ``p``
chunked caches in front -- the stage's first chunked cache itself (``maybe_trim_front`` is
idempotent; every chunked cache of a model holds the same positions, so ``cache[0]`` gives
the whole model's ``start_position`` and ``offset``), or a fresh one when the stage has
none (its chunked mask then goes to no layer) -- and fresh caches of the whole model's
kinds behind, up to 4 (so ``cache[3]`` exists; it is the stage's first global layer's own
cache whenever the stage has one). The pass-through layers return their input; ``zip``
stops at the last real layer, so no layer reads a stand-in.
"""

from __future__ import annotations

import copy
from typing import Any

from ringlet.daemon.engine.mixins import mixed

#: model_type -> where the inner model keeps ``(P, window)``: the attribute holding P
#: (dotted: a field of ``args``) and the one holding the window.
LOCAL_INDEX: dict[str, tuple[str, str]] = {
    "gemma3_text": ("sliding_window_pattern", "window_size"),  # gemma3_text.py Gemma3Model.__init__
    "cohere2": ("args.sliding_window_pattern", "window_size"),  # cohere2.py CohereModel.__call__
    "gemma3": ("sliding_window_pattern", "window_size"),  # gemma3.py: gemma3_text.Model under language_model
}

#: model_type -> the period of a forward that reads its loop index modulo it (llama4.py, above).
PERIOD4 = frozenset({"llama4"})


class _OwnMask:
    """Mixed into a decoder layer's class: the mask comes from the layer's own cache."""

    _ringlet_window: int | None = None

    def __call__(self, x, mask=None, cache=None, *args, **kwargs):
        from mlx_lm.models.base import create_attention_mask

        if self._ringlet_window is None:
            own = create_attention_mask(x, cache)
        else:
            own = create_attention_mask(x, cache, window_size=self._ringlet_window)
        return super().__call__(x, own, cache, *args, **kwargs)


class _PassThrough:
    """A layer that returns its input (:class:`_Period4` puts them in front)."""

    def __call__(self, x, *args, **kwargs):
        return x


class _Period4:
    """Mixed into llama4.py ``LlamaModel``: pads the layers and caches in front so the loop
    index is the global one modulo 4 (module docstring)."""

    def __call__(self, inputs, cache=None, *args, **kwargs):
        from mlx_lm.models.cache import ChunkedKVCache, KVCache

        layers = self.layers
        if cache is None or not layers:
            return super().__call__(inputs, cache, *args, **kwargs)
        first = layers[0].__dict__["_ringlet_global"]
        pad = first % 4
        chunked = [c for i, c in enumerate(cache) if (first + i + 1) % 4 != 0]
        size = self.attention_chunk_size
        front = [chunked[0] if chunked else ChunkedKVCache(size) for _ in range(pad)]
        padded = [*front, *cache]
        padded += [ChunkedKVCache(size) if (i + 1) % 4 else KVCache() for i in range(len(padded), 4)]
        try:
            self.layers = [*([_PassThrough()] * pad), *layers]
            return super().__call__(inputs, padded, *args, **kwargs)
        finally:
            self.layers = layers


def own_masks(inner: Any, model_type: str, start: int, layers: list) -> None:
    """Make ``inner`` (its ``layers`` already the stage's, from global layer ``start``) give
    each layer the mask of its global kind (module docstring). Other architectures: no-op."""
    if model_type in PERIOD4:
        for i, layer in enumerate(layers):
            layer.__dict__["_ringlet_global"] = start + i  # an attribute, not a child or parameter
        inner.__class__ = mixed(_Period4, type(inner))
        return
    if model_type not in LOCAL_INDEX:
        return
    pattern_attr, window_attr = LOCAL_INDEX[model_type]
    owner, name = (inner, pattern_attr)
    if "." in pattern_attr:
        head, name = pattern_attr.split(".")
        owner = copy.copy(getattr(inner, head))
        setattr(inner, head, owner)
    period, window = getattr(owner, name), getattr(inner, window_attr)
    if period <= 1:
        return
    for i, layer in enumerate(layers):
        is_global = (start + i) % period == period - 1
        layer.__class__ = mixed(_OwnMask, type(layer), f"OwnMask{type(layer).__name__}")
        layer._ringlet_window = None if is_global else window
    setattr(owner, name, 1)
