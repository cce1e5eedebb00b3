"""Residual streams a stage boundary carries beside the hidden states.

A stage boundary carries one tensor per token, ``(batch, tokens, width)``. Most mlx-lm
architectures pass their layers nothing else, so ``width`` is ``hidden_size``. A few pass
every layer a second stream made once, before or at the first layer:

* rwkv7.py ``Rwkv7Model.__call__``: ``x, v_first = layer(x, v_first, c)`` -- layer 0's
  attention value (``Rwkv7TimeMixing.__call__``: ``if self.layer_idx == 0: v_first = value``,
  else ``value = addcmul(value, v_first - value, vv)``), ``(batch, tokens, hidden_size)``;
* talkie.py ``TalkieModel.__call__``: ``e_x = h`` (the normalized embedding output), then
  ``h = block(e_x, h, mask, c)`` -- every block adds it back with a learned gain.

For these a stage boundary carries ``[hidden states, stream]`` concatenated on the last
axis (:func:`width`: ``2 * hidden_size``). A stage runs the model's own forward; while it is
not the whole model, its layers are seen through wrappers (:class:`_Streams`, mixed into
the inner model's class): on a stage that is not first, its layers take the hidden states
and the stream from the stage's input instead of what the forward made of it (a
pass-through embedding's output, which then goes to no layer and is never evaluated); on a
stage that is not last, the forward returns its last layer's output and the stream it
ran with, packed, instead of the final norm's output. So every layer computes what it
computes in the whole model, from the same inputs, split anywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ringlet.daemon.engine.mixins import mixed

# (MLX is imported where a forward runs: the planner reads :func:`width` without it)


def _rwkv7(layer: Callable, args: tuple, kwargs: dict, hidden: Any,
           stream: Any) -> tuple[Any, Any, Any]:
    """rwkv7.py ``Rwkv7Layer.__call__(x, v_first, cache) -> (out, v_first)``, ``v_first``
    ``(batch, tokens, heads, head_dim)`` (``Rwkv7TimeMixing.__call__``: ``value =
    self.v_proj(xv).reshape(B, L, self.num_heads, self.head_dim)``)."""
    x, v_first, *rest = args
    if stream is not None:
        stream = stream.reshape(*stream.shape[:2], layer.attn.num_heads, layer.attn.head_dim)
    out = layer(x if hidden is None else hidden, v_first if stream is None else stream, *rest, **kwargs)
    return out, out[0], out[1]


def _talkie(layer: Callable, args: tuple, kwargs: dict, hidden: Any,
            stream: Any) -> tuple[Any, Any, Any]:
    """talkie.py ``TransformerBlock.__call__(e_x, x, mask, cache) -> x``."""
    e_x, x, *rest = args
    e_x = e_x if stream is None else stream
    out = layer(e_x, x if hidden is None else hidden, *rest, **kwargs)
    return out, out, e_x


#: model_type -> (the inner model's layer list attribute, whether every layer takes the
#: stream from the forward (else the first only, the layers passing it on), the adapter of
#: one layer call: ``(layer, args, kwargs, hidden states, stream) -> (what the call returns,
#: its hidden states out, the stream)``, a given ``None`` meaning the forward's own);
#: sources in the module docstring.
STREAMS: dict[str, tuple[str, bool, Callable]] = {"rwkv7": ("layers", False, _rwkv7),
                                                  "talkie": ("blocks", True, _talkie)}


def width(config: dict) -> int:
    """Width of the tensor a stage boundary of this model carries per token: ``hidden_size``,
    twice that for an architecture of :data:`STREAMS`."""
    hidden = int(config.get("hidden_size") or (config.get("text_config") or {}).get("hidden_size") or 0)
    return 2 * hidden if config.get("model_type") in STREAMS else hidden


class _Layer:
    """One layer seen through its architecture's adapter, given the carried hidden states
    and stream (each ``None``: the forward's own); records what it returned (:attr:`out`,
    :attr:`stream`)."""

    def __init__(self, layer: Callable, adapt: Callable, hidden: Any, stream: Any):
        self.layer, self.adapt, self.hidden, self.given = layer, adapt, hidden, stream
        self.out: Any = None
        self.stream: Any = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.layer, name)

    def __call__(self, *args, **kwargs) -> Any:
        result, self.out, self.stream = self.adapt(self.layer, args, kwargs, self.hidden, self.given)
        return result


class _Streams:
    """Mixed into an inner model's class (:data:`STREAMS`): while ``_ringlet_streams`` says
    the stage is not first or not last, its layers take the carried hidden states and
    stream from the input, and its output is the last layer's hidden states and stream,
    packed (module docstring)."""

    def __call__(self, inputs: Any, *args, **kwargs) -> Any:
        import mlx.core as mx

        carried_in, packed_out = self.__dict__.get("_ringlet_streams", (False, False))
        name, every, adapt = STREAMS[self.__dict__["_ringlet_streams_type"]]
        layers = getattr(self, name)
        if not (carried_in or packed_out) or not layers:
            return super().__call__(inputs, *args, **kwargs)
        hidden, stream = mx.split(inputs, 2, axis=-1) if carried_in else (None, None)
        seen = [_Layer(layer, adapt, hidden if i == 0 else None, stream if i == 0 or every else None)
                for i, layer in enumerate(layers)]
        setattr(self, name, seen)
        try:
            out = super().__call__(inputs, *args, **kwargs)
        finally:
            setattr(self, name, layers)
        if not packed_out:
            return out
        last = seen[-1]
        return mx.concatenate([last.out, last.stream.reshape(*last.out.shape[:2], -1)], axis=-1)


def carry(inner: Any, model_type: str, carried_in: bool, packed_out: bool) -> Callable[[], None] | None:
    """Make ``inner`` (an inner model of :data:`STREAMS`) take a stage boundary's carried
    streams (``carried_in``: the stage is not first) and give them (``packed_out``: not
    last). Returns a function restoring what it was set to, or ``None`` for another
    architecture."""
    if model_type not in STREAMS:
        return None
    inner.__class__ = mixed(_Streams, type(inner))
    saved = inner.__dict__.get("_ringlet_streams", (False, False))
    inner.__dict__["_ringlet_streams_type"] = model_type  # attributes, not children or parameters
    inner.__dict__["_ringlet_streams"] = (carried_in, packed_out)
    return lambda: inner.__dict__.__setitem__("_ringlet_streams", saved)
