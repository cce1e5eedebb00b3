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
  inner model alone (:data:`~ringlet.daemon.engine.prune.HEADLESS`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

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
    """Make the forward leave hidden states unscaled where the stage has no embedding
    (``embed`` false) or no head (``head`` false). Returns a function restoring it."""
    undo = []
    if not embed and model_type in EMBED_SCALE:
        undo += [_apply(inner, rule) for rule in _rules(EMBED_SCALE[model_type])]
    if not head and model_type in HEAD_SCALE:
        undo += [_apply(model, rule) for rule in _rules(HEAD_SCALE[model_type])]

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
