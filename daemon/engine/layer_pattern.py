"""A stage keeps the *global* layer pattern of its layers ``[start, end)``.

Some mlx-lm architectures mix layer kinds -- full and sliding-window attention, linear
attention or short convolutions beside attention, chunked attention -- and their code
finds a layer's kind by its position in the *whole* model. A stage holds only
``[start, end)`` and renumbers those layers from 0, so each such rule must be given the
stage's layers' global positions, or the stage silently runs a layer with the wrong
mask or cache. Two things carry the pattern, captured from the whole (unpruned, never
evaluated) model by :func:`capture`:

* **caches** -- the whole model's ``make_cache()`` (``mlx_lm.models.cache.make_prompt_cache``)
  gives one cache per global layer; a stage's caches are fresh copies of entries
  ``[start, end)`` (:meth:`LayerPattern.make_cache`), so every layer gets the cache type
  (``KVCache``, ``RotatingKVCache(max_size)``, ``ChunkedKVCache``, ``ArraysCache(size)``,
  ``MambaCache``...) the whole model gives its global position, whatever rule the
  architecture's ``make_cache`` uses (``layer_types`` in gpt_oss.py/olmo3.py,
  ``i % sliding_window_pattern`` in gemma3_text.py/cohere2.py, ``(i + 1) % 4`` in
  llama4.py, per-layer flags elsewhere).
* **the forward's index attributes** -- the inner model's forward computes each kind's
  mask once, from the cache of one representative layer, then hands it to every layer
  of that kind: ``fa_idx``/``swa_idx`` (llama.py, ministral3.py ``LlamaModel.__init__``),
  ``ga_idx``/``swa_idx`` (gpt_oss.py ``GptOssMoeModel.__init__``, olmo3.py
  ``Olmo3Model.__init__``), ``fa_idx``/``conv_idx`` (lfm2.py ``Lfm2Model.__init__``),
  ``fa_idx``/``ssm_idx`` (qwen3_next.py ``Qwen3NextModel.__init__``,
  granitemoehybrid.py), ``full_idx``/``swa_idx`` (exaone4.py), ``fa_idx``/``swa_idx``
  (laguna.py ``LagunaModel.__init__``). Each is re-pointed at
  the stage's first layer of the same kind (same cache signature, so the same offset
  and the same mask); the per-position list ``layer_types`` the forward zips with the
  layers (gpt_oss.py, olmo3.py ``__call__``) is sliced to ``[start, end)``.

Architectures whose forward decides a layer's kind by its local loop position
(``enumerate(self.layers)`` with ``i % sliding_window_pattern``: gemma3_text.py,
cohere2.py) have their layers build their own masks (:mod:`local_index`); ``(idx + 1) % 4``
and ``cache[3]`` (llama4.py) are not handled yet.
:data:`REFUSED` names what cannot be split and why, and :func:`check_split` refuses any other
architecture whose layers are of more than one kind unless it is in
:data:`PATTERN_VERIFIED` (verified split by split against mlx-lm's whole model by
``tests/engine/test_zoo.py``), so an unverified mixed architecture is refused up front
instead of giving wrong logits.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from typing import Any

from ringlet.daemon.errors import PlanError

#: Index attributes of an inner model that name one representative layer per kind
#: (sources in the module docstring).
INDEX_ATTRS = ("fa_idx", "swa_idx", "ga_idx", "full_idx", "ssm_idx", "conv_idx")

#: Per-position lists the forward zips with ``self.layers`` (gpt_oss.py, olmo3.py).
POSITION_LISTS = ("layer_types",)

#: Index attributes a forward skips when ``None`` (no layer of that kind here), as
#: mlx-lm's own pipeline split sets them: qwen3_next.py ``Qwen3NextModel.pipeline`` and
#: ``__call__`` (``if self.fa_idx is not None``); ministral3.py ``LlamaModel.__call__``
#: and qwen3_5.py ``Qwen3_5TextModel.__call__`` skip theirs the same way.
NULLABLE: dict[str, frozenset[str]] = {"qwen3_next": frozenset({"fa_idx", "ssm_idx"}),
                                        "ministral3": frozenset({"fa_idx", "swa_idx"}),
                                        "qwen3_5": frozenset({"fa_idx", "ssm_idx"}),
                                        "qwen3_5_moe": frozenset({"fa_idx", "ssm_idx"})}

#: Mixed-kind architectures whose stages are verified exact by tests/engine/test_zoo.py.
PATTERN_VERIFIED = frozenset({"gpt_oss", "olmo3", "qwen3_next", "exaone4", "llama", "exaone_moe",
                              "gemma3_text", "cohere2", "ministral3", "laguna", "qwen3_5",
                              "qwen3_5_moe"})

#: Architectures that cannot be split, and why (shown in the PlanError).
#: Architectures (mlx-lm ``model_type``) whose every split the zoo (tests/engine/test_zoo.py)
#: shows equal to mlx-lm's whole model; the test fails when this set and the zoo disagree.
#: A split of any other architecture is refused: "not yet in the zoo" is not safe
#: (deepseek_v41, untested, gave wrong logits on every split while its layers all looked
#: alike). ``RINGLET_SPLIT_UNVERIFIED=1`` lets such a split run, at the user's risk.
SPLIT_VERIFIED = frozenset((
    "Klear apertus bailing_moe cohere cohere2 deepseek deepseek_v2 deepseek_v3 deepseek_v32 dots1 ernie4_5 "
    "ernie4_5_moe exaone4 exaone_moe falcon_h1 gemma gemma3_text glm glm4 glm4_moe glm4_moe_lite glm_moe_dsa "
    "gpt_oss granite granitemoe helium hunyuan hunyuan_v1_dense internlm2 internlm3 laguna llama llama4_text "
    "mamba2 mimo minicpm minicpm3 minimax ministral3 mistral mistral4 mixtral nanbeige nemotron olmo2 olmo3 "
    "olmoe openelm phi phi3 phimoe qwen2 qwen2_moe qwen3 qwen3_5 qwen3_5_moe qwen3_moe qwen3_next seed_oss "
    "smollm3 solar_open stablelm starcoder2 telechat3 youtu_llm").split())
#: the environment variable that lets a split of an unverified architecture run
UNVERIFIED_ENV = "RINGLET_SPLIT_UNVERIFIED"

REFUSED: dict[str, str] = {
    "gemma2": "its head soft-caps the output after ``embed_tokens.as_linear`` in Model.__call__ "
              "(gemma2.py: tanh(out / final_logit_softcapping) * final_logit_softcapping), which a stage "
              "that is not last would apply to its hidden states",
    "gemma3": "its forward scales the embedding output (gemma3_text.py Gemma3Model.__call__) and picks "
              "sliding or global attention by the local loop index i % sliding_window_pattern",
    "gemma3n": "its forward scales the embedding and shares KV across layers by global position (gemma3n.py)",
    "recurrent_gemma": "its forward scales the embedding output and picks attention or recurrence by "
                       "global position (recurrent_gemma.py)",
    "exaone": "its modules are ``transformer.wte``/``transformer.h``/``transformer.ln_f`` (exaone.py), not the "
              "``layers``/``embed_tokens``/``norm`` a stage prunes",
    "lfm2": "its forward builds the attention mask from cache[fa_idx] and the conv mask from cache[conv_idx] "
            "unconditionally (lfm2.py Lfm2Model.__call__): a stage without an attention layer or without a "
            "conv layer has no cache of that kind to build it from (splits whose every stage has both kinds "
            "were checked exact)",
    "phi3small": "its forward scales the embedding output by mup_embedding_multiplier (phi3small.py), which a "
                 "later stage would apply again",
    "afmoe": "its forward scales the embedding output by sqrt(hidden_size) when mup_enabled (afmoe.py), "
             "which a later stage would apply again",
    "gear": "its forward scales the embedding output by embed_scale (gear.py), which a later stage would "
            "apply again",
    "gemma4_text": "its forward scales the embedding output by embed_scale (gemma4_text.py), which a later "
                   "stage would apply again",
    "gpt2": "its modules are ``wte``/``wpe``/``h``/``ln_f`` (gpt2.py GPT2Model) and it adds learned position "
            "embeddings after the token embedding, not the ``layers``/``embed_tokens``/``norm`` a stage prunes",
    "gpt_bigcode": "its modules are ``transformer.wte``/``wpe``/``h``/``ln_f`` (gpt_bigcode.py) and it adds learned "
                   "position embeddings, not the ``layers``/``embed_tokens``/``norm`` a stage prunes",
    "gpt_neox": "its modules are ``embed_in``/``h``/``final_layer_norm`` (gpt_neox.py GPTNeoXModel), not the "
                "``layers``/``embed_tokens``/``norm`` a stage prunes",
    "gptj": "its modules are ``wte``/``h``/``ln_f`` (gptj.py GPTJModel), not the ``layers``/``embed_tokens``/"
            "``norm`` a stage prunes",
    "dbrx": "its modules are ``transformer.wte``/``blocks``/``norm_f`` (dbrx.py DBRX), not the "
            "``layers``/``embed_tokens``/``norm`` a stage prunes",
    "qwen": "its modules are ``transformer.wte``/``h``/``ln_f`` (qwen.py QwenModel), not the "
            "``layers``/``embed_tokens``/``norm`` a stage prunes",
    "nemotron_h": "only its mamba and attention layers have caches, counted apart from the MLP layers "
                  "(nemotron_h.py NemotronHModel.__call__ cache_counter), so caches are not one per layer",
    "mamba": "its forward unpacks ``B, T = inputs.shape`` (mamba.py Model.__call__), so a stage that is not "
             "first cannot take hidden states",
    "deepseek_v41": "its layers pass hc_mult residual streams, a pre_mix and shared state to each other "
                    "(deepseek_v41.py HyperConnection, TextModel.__call__), not the one hidden state a stage "
                    "boundary carries",
    "nanochat": "its modules are ``transformer.wte``/``h`` (nanochat.py NanoChatModel), not the "
                "``layers``/``embed_tokens`` a stage prunes",
    "talkie": "its modules are ``embed``/``blocks`` (talkie.py TalkieModel), not the ``layers``/``embed_tokens`` a "
              "stage prunes",
    "plamo": "its decoder layers are nested in ``model.layers.layers`` (plamo.py PlamoDecoder), apart from the "
             "embedding and final norm a stage prunes",
    "llama4": "its forward picks chunked or global attention by the local loop index (idx + 1) % 4 and takes "
              "the global mask from cache[3] (llama4.py LlamaModel.__call__)",
}


def cache_signature(cache: Any) -> tuple:
    """What makes two layers' caches interchangeable for building a mask: the cache type
    and its size parameter (``RotatingKVCache.max_size``, ``ChunkedKVCache.chunk_size``,
    ``ArraysCache`` length); a ``CacheList`` by its members."""
    kind = type(cache).__name__
    if hasattr(cache, "caches") and isinstance(cache.caches, (list, tuple)):
        return (kind, tuple(cache_signature(c) for c in cache.caches))
    for name in ("max_size", "chunk_size"):
        if isinstance(getattr(cache, name, None), int):
            return (kind, getattr(cache, name))
    if isinstance(getattr(cache, "cache", None), list):
        return (kind, len(cache.cache))
    return (kind,)


@dataclass
class LayerPattern:
    """The whole model's per-layer pattern, captured before pruning.

    Attributes:
        caches: the whole model's empty caches, one per global layer (never filled).
        indices: the inner model's index attributes (:data:`INDEX_ATTRS`) as the whole
            model set them (global positions; ``None`` kept as ``None``).
        lists: the inner model's per-position lists (:data:`POSITION_LISTS`), whole.
    """

    caches: list
    model_type: str = ""
    indices: dict[str, int | None] = field(default_factory=dict)
    lists: dict[str, list] = field(default_factory=dict)

    @property
    def signatures(self) -> list[tuple]:
        """:func:`cache_signature` of every global layer."""
        return [cache_signature(c) for c in self.caches]

    @property
    def mixed(self) -> bool:
        """Whether the layers are of more than one kind."""
        return len(set(self.signatures)) > 1

    def make_cache(self, start: int, end: int) -> list:
        """Fresh caches for global layers ``[start, end)``: copies of the whole model's."""
        return copy.deepcopy(self.caches[start:end])

    def apply(self, inner: Any, start: int, end: int) -> None:
        """Point ``inner``'s index attributes and per-position lists at the layers
        ``[start, end)`` it now holds (``inner.layers`` already sliced to them).

        An index whose kind the stage lacks points at the stage's first layer of the
        same mask family (attention caches take ``window_size``, state caches do not),
        else is ``None`` where the forward skips ``None`` (:data:`NULLABLE`), else 0: the
        mask it builds is then given to no layer.
        """
        sigs = self.signatures
        local = sigs[start:end]
        for name, value in self.indices.items():
            if value is None:
                continue
            want = sigs[value]
            same = [i for i, s in enumerate(local) if s == want]
            family = [i for i, s in enumerate(local) if _attention(s) == _attention(want)]
            absent = None if name in NULLABLE.get(self.model_type, ()) else 0
            setattr(inner, name, (same or family or [absent])[0])
        for name, whole in self.lists.items():
            setattr(inner, name, whole[start:end])


def _attention(signature: tuple) -> bool:
    return "KVCache" in signature[0]


def capture(model: Any, inner: Any, model_type: str) -> LayerPattern:
    """The :class:`LayerPattern` of a whole mlx-lm model (built, not pruned; nothing is
    evaluated: empty caches hold no arrays)."""
    from mlx_lm.models.cache import make_prompt_cache

    n = len(inner.layers)
    indices = {name: getattr(inner, name) for name in INDEX_ATTRS
               if hasattr(inner, name) and (getattr(inner, name) is None or isinstance(getattr(inner, name), int))}
    lists = {name: list(getattr(inner, name)) for name in POSITION_LISTS
             if isinstance(getattr(inner, name, None), list) and len(getattr(inner, name)) == n}
    return LayerPattern(caches=make_prompt_cache(model), model_type=model_type, indices=indices, lists=lists)


def verified(model_type: str, module: str = "") -> bool:
    """Whether splits of ``model_type``, or of the mlx-lm model module that runs it
    (``module``: ``kimi_k2`` runs as ``deepseek_v3``, ``mistral`` as ``llama``...), are
    zoo-verified. (The module comes from the built model: importing ``mlx_lm.utils`` for
    its remapping table would import transformers, which a GGUF stage never needs.)"""
    return model_type in SPLIT_VERIFIED or module in SPLIT_VERIFIED


def check_split(model_type: str, pattern: LayerPattern | None, module: str = "") -> None:
    """Refuse, before any weight is read, a split the stage could not run exactly.

    Raises:
        PlanError: ``model_type`` is in :data:`REFUSED`, not in :data:`SPLIT_VERIFIED`
            (unless ``RINGLET_SPLIT_UNVERIFIED=1``), or its layers are of more than one
            kind (by their caches) and it is not in :data:`PATTERN_VERIFIED`.
    """
    if model_type in REFUSED:
        raise PlanError(f"architecture {model_type!r} cannot be split into stages: {REFUSED[model_type]}; "
                        "run it on one node")
    if not verified(model_type, module) and os.environ.get(UNVERIFIED_ENV) != "1":
        raise PlanError(f"architecture {model_type!r} cannot be split into stages: splitting it is not yet "
                        "verified to give exactly the whole model's logits (ringlet refuses rather than risk "
                        f"wrong output); run it on one node, or set {UNVERIFIED_ENV}=1 to split it anyway")
    if pattern is not None and pattern.mixed and model_type not in PATTERN_VERIFIED:
        kinds = sorted({s[0] for s in pattern.signatures})
        raise PlanError(f"architecture {model_type!r} cannot be split into stages: its layers are of "
                        f"different kinds ({', '.join(kinds)}) and splitting it by its layer pattern is not "
                        "verified; run it on one node")
