"""Scales an architecture applies around the layers happen once: on the first stage
(the embedding's) and on the last (the head's).

Some mlx-lm architectures scale the embedding output inside the inner model's forward,
right after ``embed_tokens``, or scale the head's input or output in the outer model's
forward, beside ``lm_head``. A stage that is not first gets hidden states through
:class:`~ringlet.daemon.engine.prune.StageEmbedding` (a pass-through) and a stage that
is not last has an identity head, so those forwards would scale hidden states that
must pass unchanged. :func:`neutralize` sets each such factor to exactly 1 (or switches
it off) on a stage that must not apply it (``h * 1.0`` and ``h / 1.0`` are ``h``, bit for bit, in every
float dtype). Each rule, from mlx-lm:

Embedding (stage not first):

* ``gemma.py`` ``GemmaModel.__call__``: ``h = h * (self.args.hidden_size**0.5)`` -- the
  inner model's own ``args`` becomes a copy with ``hidden_size = 1`` (``1**0.5 == 1.0``);
  the layers keep theirs, and the inner forward reads ``self.args`` for nothing else.
* ``granite.py`` ``GraniteModel.__call__``, ``granitemoe.py`` ``GraniteMoEModel.__call__``,
  ``granitemoehybrid.py`` ``GraniteMoeHybridModel.__call__``:
  ``self.embed_tokens(inputs) * self.embedding_multiplier`` -- set to ``1.0``.
* ``minicpm.py`` ``MiniCPMModel.__call__``, ``minicpm3.py`` ``MiniCPM3Model.__call__``:
  ``self.embed_tokens(inputs) * self.args.scale_emb`` -- a copy of ``args`` with
  ``scale_emb = 1.0``.

* ``afmoe.py`` ``AfmoeModel.__call__``: ``if self.mup_enabled: h = h * math.sqrt(...)`` --
  set to ``False``; ``gear.py`` ``GearModel.__call__``: ``* self.embed_scale`` -- set to ``1.0``.
* ``gpt2.py`` ``GPT2Model.__call__``, ``gpt_bigcode.py`` ``GPTBigCodeModel.__call__``:
  ``hidden_states += self.wpe(position_ids)`` -- learned positions, added once: ``wpe``
  becomes :class:`NoPositions` (``-0.0``, the exact identity of addition).

* gemma2.py ``GemmaModel.__call__``: ``h * (self.args.hidden_size**0.5)`` -- as gemma;
  recurrent_gemma.py ``Griffin.__call__``: ``if self.scale_by_sqrt_dim`` -- set to ``False``;
  phi3small.py ``Phi3Model.__call__``: ``if self.mup_embedding_multiplier`` -- set to ``None``.

Head (stage not last):

* granite.py, granitemoe.py, granitemoehybrid.py ``Model.__call__``:
  ``return out / self.logits_scaling`` -- set to ``1.0``.
* minicpm.py, minicpm3.py ``Model.__call__`` (untied head):
  ``self.lm_head(out / (self.args.hidden_size / self.args.dim_model_base))`` -- a copy of
  the outer ``args`` with ``dim_model_base = hidden_size`` (the quotient is ``1.0``).
* cohere.py and cohere2.py ``Model.__call__``: ``out = out * self.model.args.logit_scale`` -- the inner
  model's ``args`` becomes a copy with ``logit_scale = 1.0`` (``CohereModel`` reads its
  ``args`` only when built).
* gear.py ``Model.__call__``: ``if self.args.final_logit_softcapping: out = tanh(out / cap) * cap``
  -- a copy of ``args`` with ``final_logit_softcapping = None``; recurrent_gemma.py the same
  with ``logits_soft_cap``.
* phi3small.py ``Model.__call__``: ``if self.mup_width_multiplier: out = out / ...`` -- ``None``;
  ``out[..., self._dummy_tokenizer_ids] = -inf`` -- no ids.
* gemma2.py ``Model.__call__`` soft-caps unconditionally: a stage that is not last runs the
  inner model alone (:data:`~ringlet.daemon.engine.prune.HEADLESS`); so do nanochat.py
  (``logits = softcap(logits)``) and muse_glimmer.py (``out * self.args.output_multiplier``, then
  ``mx.tanh(out / cap) * cap``: no value of ``cap`` leaves ``out`` unchanged).

Functions, around the layers (:data:`AROUND_LAYERS`): some inner forwards apply a
parameter-free function that no value switches off -- a norm has no neutral setting --
to the embedding output or to the last layer's output:

* nanochat.py ``NanoChatModel.__call__``: ``h = rms_norm(h)`` right after ``self.wte(inputs)``,
  and again after the layers (``# Critical: final norm before lm_head``);
* muse_glimmer.py ``MuseGlimmerModel.__call__``: ``h = mx.fast.rms_norm(h, None, self.embed_eps)``
  right after ``self.embed_tokens(inputs)`` (its final norm is the module ``self.norm``).

On such a stage the forward runs unchanged, with its first layer given the hidden states
the stage was given (stage not first) and the inner model returning its last layer's
output (stage not last) (:class:`_LayerEnds`): the function's result goes to no layer and
is never evaluated (MLX is lazy), and every layer computes what it computes in the whole
model, from the same input.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ringlet.daemon.engine import streams
from ringlet.daemon.engine.mixins import mixed

#: (attribute (dotted: of a sub-module), field of it or None, neutral value or a function of the attribute's value).
Rule = tuple[str, str | None, Any]

#: no token ids: ``out[..., _NO_IDS] = -inf`` changes nothing
_NO_IDS = mx.array([], dtype=mx.int32)


class NoPositions(nn.Module):
    """Stands in for learned position embeddings on a stage that is not first: gives
    ``-0.0``, which added to any float is that float, bit for bit (``+0.0`` and ``-0.0``
    included), in its own dtype (a Python float is weakly typed in MLX)."""

    def __call__(self, positions: mx.array) -> float:
        return -0.0


#: model_type -> rule (or rules) on the inner model, for a stage that is not first.
EMBED_SCALE: dict[str, Rule | tuple[Rule, ...]] = {
    # gpt2.py GPT2Model.__call__ / gpt_bigcode.py GPTBigCodeModel.__call__: ``hidden_states += self.wpe(position_ids)``
    # right after the token embedding: the first stage adds the learned positions, no other.
    "gpt2": ("wpe", None, NoPositions()),
    "gpt_bigcode": ("wpe", None, NoPositions()),
    "gemma": ("args", "hidden_size", 1),
    "gemma3_text": ("args", "hidden_size", 1),
    "gemma3": ("args", "hidden_size", 1),  # gemma3.py serves text through gemma3_text.Model
    "gemma2": ("args", "hidden_size", 1),  # gemma2.py GemmaModel.__call__: h * (self.args.hidden_size**0.5)
    # recurrent_gemma.py Griffin.__call__: ``if self.scale_by_sqrt_dim: x = x * math.sqrt(x.shape[-1])``
    "recurrent_gemma": ("scale_by_sqrt_dim", None, False),
    # phi3small.py Phi3Model.__call__: ``if self.mup_embedding_multiplier: h = self.mup_embedding_multiplier * h``
    "phi3small": ("mup_embedding_multiplier", None, None),
    # afmoe.py AfmoeModel.__call__: ``if self.mup_enabled: h = h * math.sqrt(self.hidden_size)``
    "afmoe": ("mup_enabled", None, False),
    # gear.py GearModel.__call__: ``h = self.embed_tokens(inputs) * self.embed_scale``
    "gear": ("embed_scale", None, 1.0),
    "granite": ("embedding_multiplier", None, 1.0),
    "granitemoe": ("embedding_multiplier", None, 1.0),
    "granitemoehybrid": ("embedding_multiplier", None, 1.0),
    "minicpm": ("args", "scale_emb", 1.0),
    "minicpm3": ("args", "scale_emb", 1.0),
}

#: model_type -> rule (or rules) on the outer model, for a stage that is not last.
HEAD_SCALE: dict[str, Rule | tuple[Rule, ...]] = {
    "granite": ("logits_scaling", None, 1.0),
    "granitemoe": ("logits_scaling", None, 1.0),
    "granitemoehybrid": ("logits_scaling", None, 1.0),
    "minicpm": ("args", "dim_model_base", lambda args: args.hidden_size),
    "minicpm3": ("args", "dim_model_base", lambda args: args.hidden_size),
    "cohere": ("model.args", "logit_scale", 1.0),
    "cohere2": ("model.args", "logit_scale", 1.0),
    # gear.py Model.__call__: ``if self.args.final_logit_softcapping: out = mx.tanh(out / cap) * cap``
    "gear": ("args", "final_logit_softcapping", None),
    # recurrent_gemma.py Model.__call__: ``if c: logits = mx.tanh(logits / c) * c`` (c = args.logits_soft_cap)
    "recurrent_gemma": ("args", "logits_soft_cap", None),
    # phi3small.py Model.__call__: ``if self.mup_width_multiplier: out = out / self.mup_width_multiplier`` and
    # ``out[..., self._dummy_tokenizer_ids] = -inf``: no division, no ids to overwrite in hidden states
    "phi3small": (("mup_width_multiplier", None, None), ("_dummy_tokenizer_ids", None, _NO_IDS)),
}


#: model_type -> (the inner model's layer list, whether its forward applies a function to
#: the embedding output, whether to the last layer's output), sources in the module docstring.
AROUND_LAYERS: dict[str, tuple[str, bool, bool]] = {
    "nanochat": ("h", True, True),  # nanochat.py NanoChatModel.__call__: h = rms_norm(h), both ends
    "muse_glimmer": ("layers", True, False),  # muse_glimmer.py MuseGlimmerModel.__call__: mx.fast.rms_norm(h, ...)
}


class _End:
    """A layer seen through: its attributes are the layer's (muse_glimmer.py
    ``MuseGlimmerModel._masks`` reads ``layer.self_attn.layer_type``)."""

    def __init__(self, layer: Callable):
        self.layer = layer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.layer, name)


class _Entry(_End):
    """The stage's first layer, run on the stage's input instead of what the forward made of it."""

    def __init__(self, layer: Callable, hidden: mx.array):
        super().__init__(layer)
        self.hidden = hidden

    def __call__(self, x: mx.array, *args, **kwargs) -> Any:
        return self.layer(self.hidden, *args, **kwargs)


class _Exit(_End):
    """The stage's last layer, its output kept (:attr:`out`) for the inner model to return."""

    def __init__(self, layer: Callable):
        super().__init__(layer)
        self.out = None

    def __call__(self, *args, **kwargs) -> Any:
        self.out = self.layer(*args, **kwargs)
        return self.out


class _LayerEnds:
    """Mixed into an inner model's class (:data:`AROUND_LAYERS`): while ``_ringlet_ends`` says
    so, the first layer takes the forward's input (hidden states ``(batch, tokens, hidden)``)
    and the forward returns the last layer's output, whatever it does before and after them."""

    def __call__(self, inputs: Any, *args, **kwargs) -> Any:
        raw_in, raw_out = self.__dict__.get("_ringlet_ends", (False, False))
        name = AROUND_LAYERS[self.__dict__["_ringlet_ends_type"]][0]
        layers = getattr(self, name)
        if not (raw_in or raw_out) or not layers:
            return super().__call__(inputs, *args, **kwargs)
        ends = list(layers)
        if raw_in:
            ends[0] = _Entry(ends[0], inputs)
        exit_ = ends[-1] = _Exit(ends[-1]) if raw_out else ends[-1]
        setattr(self, name, ends)
        try:
            out = super().__call__(inputs, *args, **kwargs)
        finally:
            setattr(self, name, layers)
        return exit_.out if raw_out else out


def _layer_ends(inner: Any, model_type: str, raw_in: bool, raw_out: bool) -> Callable[[], None]:
    inner.__class__ = mixed(_LayerEnds, type(inner))
    saved = inner.__dict__.get("_ringlet_ends", (False, False))
    inner.__dict__["_ringlet_ends_type"] = model_type  # attributes, not children or parameters
    inner.__dict__["_ringlet_ends"] = (raw_in, raw_out)
    return lambda: inner.__dict__.__setitem__("_ringlet_ends", saved)


def _apply(module: Any, rule: Rule) -> Callable[[], None]:
    attribute, name, neutral = rule
    *path, attribute = attribute.split(".")
    for step in path:
        module = getattr(module, step)
    saved = getattr(module, attribute)
    if name is None:
        setattr(module, attribute, neutral)
    else:
        replaced = copy.copy(saved)
        setattr(replaced, name, neutral(saved) if callable(neutral) else neutral)
        setattr(module, attribute, replaced)
    return lambda: setattr(module, attribute, saved)


def _rules(entry: Rule | tuple[Rule, ...]) -> tuple[Rule, ...]:
    return entry if isinstance(entry[0], tuple) else (entry,)  # type: ignore[return-value]


def neutralize(model: Any, inner: Any, model_type: str, *, embed: bool, head: bool) -> Callable[[], None]:
    """Make the forward leave hidden states unscaled (and unnormalized, :data:`AROUND_LAYERS`)
    where the stage has no embedding (``embed`` false) or no head (``head`` false).
    Returns a function restoring it."""
    undo = []
    if not embed and model_type in EMBED_SCALE:
        undo += [_apply(inner, rule) for rule in _rules(EMBED_SCALE[model_type])]
    if not head and model_type in HEAD_SCALE:
        undo += [_apply(model, rule) for rule in _rules(HEAD_SCALE[model_type])]
    if model_type in AROUND_LAYERS:
        _, at_embed, at_head = AROUND_LAYERS[model_type]
        undo.append(_layer_ends(inner, model_type, at_embed and not embed, at_head and not head))
    if (carried := streams.carry(inner, model_type, not embed, not head)) is not None:
        undo.append(carried)

    def restore() -> None:
        for step in reversed(undo):
            step()
    return restore


def refusal(model: Any, model_type: str) -> str | None:
    """Why this model's head cannot run on a pruned stage, if it cannot: a tied minicpm or
    llama4_text head reads ``self.model.embed_tokens.weight`` directly (minicpm.py ``Model.__call__``:
    ``out @ self.model.embed_tokens.weight.T``), not through ``as_linear``."""
    args = getattr(model, "args", None)
    if model_type == "minicpm" and getattr(args, "tie_word_embeddings", False):
        return ("its tied head reads embed_tokens.weight directly (minicpm.py Model.__call__: "
                "out @ self.model.embed_tokens.weight.T), not through as_linear")
    if model_type == "llama4_text" and getattr(model, "tie_word_embeddings", False):
        return ("its tied head reads embed_tokens.weight directly (llama4_text.py Model.__call__: "
                "h @ self.model.embed_tokens.weight.T), not through as_linear")
    return None
