"""Forwards that unpack the token ids' shape, run on a stage that takes hidden states.

A stage that is not first is given hidden states ``(batch, tokens, hidden_size)`` where
the architecture's forward takes token ids ``(batch, tokens)``; the embedding is a
pass-through (:class:`~ringlet.daemon.engine.prune.StageEmbedding`). Most forwards only
hand their input to the embedding, but some first unpack its shape into two names, which
fails on three dimensions:

* gpt2.py ``GPT2Model.__call__``: ``_, L = inputs.shape``;
* gpt_bigcode.py ``GPTBigCodeModel.__call__``: ``B, L = inputs.shape``;
* gpt_neox.py ``GPTNeoXModel.__call__``: ``_, L = inputs.shape``;
* gptj.py ``GPTJModel.__call__``: ``batch_size, input_length = inputs.shape``;
* plamo2.py ``PlamoModel.__call__``: ``batch_size, seq_length = inputs.shape``;
* mamba.py ``Model.__call__``: ``B, T = inputs.shape``.

Each of these forwards uses its input for nothing else than that shape and the
embedding. :func:`accept_hidden` makes the outer model wrap hidden states in
:class:`TokenShaped` -- an object whose ``shape`` is ``(batch, tokens)``, the shape of the
token ids the whole model was given at that point -- and the stage's embedding unwraps
it, so the forward runs unchanged on the hidden states.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ringlet.daemon.engine.mixins import mixed

#: model_type of the architectures above.
TOKEN_SHAPED = frozenset({"gpt2", "gpt_bigcode", "gpt_neox", "gptj", "plamo2", "mamba"})


class TokenShaped:
    """Hidden states ``(batch, tokens, hidden_size)`` showing the token ids' ``shape``
    ``(batch, tokens)``; :attr:`hidden` holds them."""

    def __init__(self, hidden: mx.array):
        self.hidden = hidden
        self.shape = tuple(hidden.shape[:2])


class _AcceptsHidden:
    """Mixed into an outer model's class: 3-D input is hidden states, passed as :class:`TokenShaped`."""

    def __call__(self, inputs: Any, *args, **kwargs):
        if isinstance(inputs, mx.array) and inputs.ndim == 3:
            inputs = TokenShaped(inputs)
        return super().__call__(inputs, *args, **kwargs)


def accept_hidden(model: Any, model_type: str) -> None:
    """Let ``model`` (an mlx-lm outer model of :data:`TOKEN_SHAPED`) take hidden states;
    other architectures: no-op. The class keeps its name and module."""
    if model_type in TOKEN_SHAPED:
        model.__class__ = mixed(_AcceptsHidden, type(model))


def unwrap(x: Any) -> Any:
    """The hidden states of a :class:`TokenShaped`, else ``x``."""
    return x.hidden if isinstance(x, TokenShaped) else x
