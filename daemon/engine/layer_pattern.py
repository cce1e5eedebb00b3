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
cohere2.py) have their layers build their own masks (:mod:`local_index`), and llama4.py's
``(idx + 1) % 4``, ``cache[0].start_position`` and ``cache[3]`` see the global index modulo 4
(:mod:`local_index`, padded in front).
A forward that builds a kind's mask from ``cache[idx]`` unconditionally gets, on a stage
without that kind, a stand-in cache after its own (:meth:`LayerPattern.apply`); one that
also reads every layer's position from it gets the stage's own position
(:mod:`recurrent_position`).
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

from ringlet.daemon.engine import cacheless, recurrent_position
from ringlet.daemon.engine.mixins import mixed
from ringlet.daemon.errors import PlanError

#: Index attributes of an inner model that name one representative layer per kind
#: (sources in the module docstring).
INDEX_ATTRS = ("fa_idx", "swa_idx", "ga_idx", "full_idx", "ssm_idx", "conv_idx", "attn_idx", "gla_idx",
               "_attn_idx", "_gla_idx", "first_swa_idx", "first_global_idx", "attention_index", "linear_index",
               "_first_full", "_first_sliding", "_swa_idx", "_full_idx", "_fa_idx", "_lin_idx")

#: Per-position lists the forward zips with ``self.layers`` (gpt_oss.py, olmo3.py; mellum.py
#: ``MellumModel.__call__`` zips ``self.args.layer_types``: dotted, a copy of ``args`` gets the slice).
POSITION_LISTS = ("layer_types", "args.layer_types")

#: Sets of global layer positions the forward tests its loop index against: baichuan_m1.py
#: ``BaichuanModel.__call__`` (``mask = swa_mask if l in self.swa_layers else global_mask``,
#: ``l`` from ``enumerate(zip(self.layers, cache))``).
POSITION_SETS = ("swa_layers",)

#: Index attributes a forward skips when ``None`` (no layer of that kind here), as
#: mlx-lm's own pipeline split sets them: qwen3_next.py ``Qwen3NextModel.pipeline`` and
#: ``__call__`` (``if self.fa_idx is not None``); ministral3.py ``LlamaModel.__call__``
#: and qwen3_5.py ``Qwen3_5TextModel.__call__`` skip theirs the same way.
NULLABLE: dict[str, frozenset[str]] = {"qwen3_next": frozenset({"fa_idx", "ssm_idx"}),
                                        "ministral3": frozenset({"fa_idx", "swa_idx"}),
                                        "qwen3_5": frozenset({"fa_idx", "ssm_idx"}),
                                        "qwen3_5_moe": frozenset({"fa_idx", "ssm_idx"}),
                                        # baichuan_m1.py BaichuanModel.__call__: ``if self.first_global_idx is None``
                                        "baichuan_m1": frozenset({"first_swa_idx", "first_global_idx"}),
                                        # bailing_moe_v3.py: ``if self.attention_index is not None``
                                        "bailing_moe_v3": frozenset({"attention_index", "linear_index"}),
                                        # spark2_5.py Spark2_5Model.__call__: ``if self._first_full is not None``
                                        "spark2_5": frozenset({"_first_full", "_first_sliding"}),
                                        # plamo3.py Plamo3Decoder.__call__: ``if self.swa_idx is not None``
                                        "plamo3": frozenset({"swa_idx"}),
                                        # step3p5.py Step3p5Model.__call__: ``if self._full_idx is not None``
                                        "step3p5": frozenset({"_swa_idx", "_full_idx"}),
                                        # olmo_hybrid.py: ``if self._fa_idx is not None``
                                        "olmo_hybrid": frozenset({"_fa_idx", "_lin_idx"}),
                                        # afmoe.py AfmoeModel.__call__: ``if self.swa_idx is not None``
                                        "afmoe": frozenset({"swa_idx"}),
                                        # gear.py GearModel.__call__: ``if self.fa_idx is not None`` (each kind)
                                        "gear": frozenset({"fa_idx", "swa_idx", "conv_idx"})}

#: Mixed-kind architectures whose stages are verified exact by tests/engine/test_zoo.py.
PATTERN_VERIFIED = frozenset((
    "afmoe baichuan_m1 bailing_hybrid bailing_moe_linear bailing_moe_v3 cohere2 exaone4 exaone_moe gear gemma3 "
    "gemma3_text gpt_oss granitemoehybrid jamba kimi_linear laguna lfm2 lfm2-vl lfm2_moe llama llama4 mellum "
    "mimo_v2_flash ministral3 muse_glimmer nemotron_h olmo3 olmo_hybrid plamo2 plamo3 qwen3_5 qwen3_5_moe qwen3_next "
    "recurrent_gemma spark2_5 step3p5").split())

#: Architectures that cannot be split, and why (shown in the PlanError).
#: Architectures (mlx-lm ``model_type``) whose every split the zoo (tests/engine/test_zoo.py)
#: shows equal to mlx-lm's whole model; the test fails when this set and the zoo disagree.
#: A split of any other architecture is refused: "not yet in the zoo" is not safe
#: (deepseek_v41, untested, gave wrong logits on every split while its layers all looked
#: alike). ``RINGLET_SPLIT_UNVERIFIED=1`` lets such a split run, at the user's risk.
SPLIT_VERIFIED = frozenset((
    "afmoe apertus baichuan_m1 bailing_hybrid bailing_moe bailing_moe_linear bailing_moe_v3 cohere cohere2 dbrx "
    "deepseek deepseek_v2 deepseek_v3 deepseek_v32 dots1 ernie4_5 ernie4_5_moe exaone exaone4 exaone_moe "
    "falcon_h1 gear gemma gemma2 gemma3 gemma3_text glm glm4 glm4_moe glm4_moe_lite glm_moe_dsa gpt2 "
    "gpt_bigcode gpt_neox gpt_oss gptj granite granitemoe granitemoehybrid helium hunyuan hunyuan_v1_dense "
    "internlm2 internlm3 jamba kimi_k25 kimi_linear kimi_vl Klear laguna lfm2 lfm2-vl lfm2_moe lille-130m llama "
    "llama4 llama4_text longcat_flash mamba mamba2 mellum mimo mimo_v2_flash minicpm minicpm3 minimax "
    "minimax_m3_vl ministral3 mistral mistral3 mistral4 mixtral muse_glimmer nanbeige nanochat nemotron nemotron-nas "
    "nemotron_h olmo2 olmo3 olmo_hybrid olmoe openelm phi phi3 phi3small phimoe phixtral pixtral plamo plamo2 plamo3 "
    "qwen qwen2 "
    "qwen2_moe qwen2_vl qwen3 qwen3_5 qwen3_5_moe qwen3_moe qwen3_next qwen3_vl qwen3_vl_moe recurrent_gemma "
    "rwkv7 seed_oss smollm3 solar_open spark2_5 stablelm starcoder2 step3p5 talkie telechat3 youtu_llm").split())
#: the environment variable that lets a split of an unverified architecture run
UNVERIFIED_ENV = "RINGLET_SPLIT_UNVERIFIED"

REFUSED: dict[str, str] = {
    "gemma3n": "its forward scales the embedding and shares KV across layers by global position (gemma3n.py)",
    "gemma4_text": "its last num_kv_shared_layers layers reuse the KV of earlier layers (gemma4_text.py "
                   "Attention.has_kv, shared_kv) and every layer takes per-layer inputs embedded from the token "
                   "ids (embed_tokens_per_layer), which a stage that is not first does not have",
    "gemma4": "it serves text through gemma4_text.Model (gemma4.py), whose last num_kv_shared_layers layers reuse "
              "the KV of earlier layers and whose layers take per-layer inputs embedded from the token ids",
    "deepseek_v41": "its layers pass hc_mult residual streams, a pre_mix and shared state to each other "
                    "(deepseek_v41.py HyperConnection, TextModel.__call__), not the one hidden state a stage "
                    "boundary carries",
    "afm7": "its last num_kv_reuse_layers layers attend over the KV of the layer before them (afm7.py "
            "AFMModel.__call__: keys, values = cache[-1].keys_and_values()) and have no caches of their own",
    "iquestloopcoder": "its forward runs the layers twice, the second pass over caches cache[len(layers):] and "
                       "the first pass's KV (iquestloopcoder.py IQuestLoopCoderModel.__call__), so its caches "
                       "are not one per layer and a layer range is not one pass",
    "kimi_k3": "its layers pass attention-residual blocks to each other (kimi_k3.py KimiK3TextModel.__call__: "
               "h, blocks = layer(h, ..., blocks=blocks)) and index their own list by start_idx/num_layers, "
               "not the one hidden state a stage boundary carries",
    "longcat_flash_ngram": "its n-gram embedding keeps the last token ids in cache[0] and the layers take "
                           "cache[1:] (longcat_flash_ngram.py LongcatFlashNgramModel.__call__), so caches are not "
                           "one per layer and a stage that is not first has no token ids",
    "muse_spark": "its residual stream is float32 but its inner forward returns it rounded to bfloat16 "
                  "(muse_spark.py MuseSparkTextModel.__call__: self.norm(h).astype(mx.bfloat16)), and each "
                  "layer hands the next its fused pre-normed attention input (norm_add_norm(..., next_norm=...)), "
                  "which a stage's first layer would compute with input_layernorm instead, so a stage boundary "
                  "changes the hidden states; its kernels are Metal-only (mlx_lm/kernels, mx.fast.metal_kernel), "
                  "so no split of it can be checked against the whole model on a machine without Metal",
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
        num_layers: the whole model's decoder layers.
        indices: the inner model's index attributes (:data:`INDEX_ATTRS`) as the whole
            model set them (global positions; ``None`` kept as ``None``).
        lists: the inner model's per-position lists (:data:`POSITION_LISTS`), whole.
        sets: the inner model's sets of global positions (:data:`POSITION_SETS`), whole.
        missing: global positions of the layers the model's cache list has no entry for
            (their ``caches`` entries are length caches, :mod:`cacheless`).
        unwritten: global positions of the layers whose cache nothing writes (the
            ``missing`` ones included): the stage advances them.
    """

    caches: list
    model_type: str = ""
    num_layers: int = 0
    indices: dict[str, int | None] = field(default_factory=dict)
    lists: dict[str, list] = field(default_factory=dict)
    sets: dict[str, set] = field(default_factory=dict)
    missing: frozenset[int] = frozenset()
    unwritten: frozenset[int] = frozenset()

    @property
    def signatures(self) -> list[tuple]:
        """:func:`cache_signature` of every global layer."""
        return [cache_signature(c) for c in self.caches]

    @property
    def mixed(self) -> bool:
        """Whether the layers are of more than one kind."""
        return len(set(self.signatures)) > 1

    def make_cache(self, start: int, end: int) -> list:
        """Fresh caches for global layers ``[start, end)``: copies of the whole model's (all
        of them for the whole model, even when they are not one per layer:
        longcat_flash_ngram.py keeps its n-gram context in ``cache[0]``)."""
        if start == 0 and end == self.num_layers:
            return copy.deepcopy(self.caches)
        return copy.deepcopy(self.caches[start:end])

    def apply(self, inner: Any, start: int, end: int) -> None:
        """Point ``inner``'s index attributes, per-position lists and position sets at the
        layers ``[start, end)`` it now holds (its layer list already sliced to them).

        An index whose kind the stage lacks points at the stage's first layer of the
        same mask family (attention caches take ``window_size``, state caches do not),
        else is ``None`` where the forward skips ``None`` (:data:`NULLABLE`), else at a
        *stand-in*: a fresh cache of the whole model's kind for that index, handed to the
        forward after the stage's own caches (:func:`_with_stand_ins`). The forward builds
        that kind's mask from it (lfm2.py ``Lfm2Model.__call__`` builds both masks
        unconditionally; so do kimi_linear.py, olmo_hybrid.py, step3p5.py ...) and gives it
        to no layer: ``zip(self.layers, cache)`` stops at the stage's last layer, so no
        layer ever reads or updates a stand-in. (A cache of another kind could not build the
        mask: ``ArraysCache.make_mask`` takes no ``window_size``.)
        """
        sigs = self.signatures
        # the forward indexes the model's own cache list, which has no entry for a missing layer
        real = [g for g in range(len(sigs)) if g not in self.missing]  # (a whole model may have fewer: afm7)
        local = [sigs[g] for g in real if start <= g < end]
        if self.missing and not local:  # a stage of such layers alone hands its first length cache on
            local = [sigs[start]]
        stand_ins: list = []
        for name, value in self.indices.items():
            if value is None:
                continue
            want = sigs[real[value]]
            same = [i for i, s in enumerate(local) if s == want]
            family = [i for i, s in enumerate(local) if _attention(s) == _attention(want)]
            if same or family:
                setattr(inner, name, (same or family)[0])
            elif name == recurrent_position.POSITION_INDEX.get(self.model_type):  # the position, per forward
                setattr(inner, name, len(local) + len(stand_ins))
                stand_ins.append(recurrent_position.Position(self.counted))
            elif name in NULLABLE.get(self.model_type, ()):
                setattr(inner, name, None)
            else:
                setattr(inner, name, len(local) + len(stand_ins))
                stand_ins.append(copy.deepcopy(self.caches[real[value]]))
        for name, whole in self.lists.items():
            owner = inner
            if "." in name:  # a field of a sub-object (``args``): a copy, so the layers keep theirs
                head, name = name.split(".")
                owner = copy.copy(getattr(inner, head))
                setattr(inner, head, owner)
            setattr(owner, name, whole[start:end])
        for name, positions in self.sets.items():
            setattr(inner, name, {g - start for g in positions if start <= g < end})
        if stand_ins or "_ringlet_stand_ins" in inner.__dict__ or self.counted or self.unwritten:
            inner.__class__ = mixed(_StandIns, type(inner))
            inner.__dict__["_ringlet_stand_ins"] = stand_ins  # attributes, not child modules
            inner.__dict__["_ringlet_counted"] = self.counted
            inner.__dict__["_ringlet_missing"] = frozenset(g - start for g in self.missing if start <= g < end)
            inner.__dict__["_ringlet_unwritten"] = frozenset(g - start for g in self.unwritten if start <= g < end)

    @property
    def counted(self) -> int:
        """Entries of the recurrent caches that count their tokens, the count included
        (:func:`recurrent_position.carry`); 0: none do."""
        return recurrent_position.counted(self.caches, self.model_type)


class _StandIns:
    """Mixed into the class of the module whose forward indexes the caches: the caches
    it is given lose the length caches of layers the model gives none and get the
    pattern's stand-ins appended (:meth:`LayerPattern.apply`), a
    :class:`~recurrent_position.Position` bound to them; recurrent caches that count
    their tokens count the forward's (:func:`recurrent_position.advance`), and length
    caches grow by its tokens (:func:`cacheless.advance`)."""

    def __call__(self, *args, **kwargs):
        own = kwargs.get("cache") if "cache" in kwargs else (args[1] if len(args) > 1 else None)
        extra = self.__dict__.get("_ringlet_stand_ins") or []
        if own is not None:
            extra = [s.bind(own) if isinstance(s, recurrent_position.Position) else s for s in extra]
        given, named = _with_caches(own, extra, self.__dict__.get("_ringlet_missing"), args, kwargs)
        out = super().__call__(*given, **named)
        x = args[0] if args else kwargs["inputs"]
        if own is not None and (counted := self.__dict__.get("_ringlet_counted")):
            recurrent_position.advance(own, x, counted)
        if own is not None:
            cacheless.advance(own, self.__dict__.get("_ringlet_unwritten") or frozenset(), x)
        return out


def _with_caches(own: list | None, extra: list, missing: frozenset[int] | None, args: tuple, kwargs: dict) -> tuple:
    """``(args, kwargs)`` of a forward ``(inputs, cache, ...)`` given the model's own
    caches of ``own`` (:func:`cacheless.model_caches`) with ``extra`` after them."""
    if own is None or not (extra or missing):
        return args, kwargs
    caches = [*cacheless.model_caches(own, missing or frozenset()), *extra]
    if "cache" in kwargs:
        return args, {**kwargs, "cache": caches}
    return (args[0], caches, *args[2:]), kwargs




def _attention(signature: tuple) -> bool:
    return "KVCache" in signature[0]


def capture(model: Any, inner: Any, model_type: str, n: int) -> LayerPattern:
    """The :class:`LayerPattern` of a whole mlx-lm model (built, not pruned; nothing is
    evaluated: empty caches hold no arrays). ``inner``: the module whose attribute is the
    decoder layer list (its forward keeps the index attributes); ``n``: the list's length."""
    from mlx_lm.models.cache import make_prompt_cache

    indices = {name: getattr(inner, name) for name in INDEX_ATTRS
               if hasattr(inner, name) and (getattr(inner, name) is None or isinstance(getattr(inner, name), int))}
    lists = {}
    for name in POSITION_LISTS:
        value = inner
        for step in name.split("."):
            value = getattr(value, step, None)
        if isinstance(value, list) and len(value) == n:
            lists[name] = list(value)
    sets = {name: set(getattr(inner, name)) for name in POSITION_SETS
            if isinstance(getattr(inner, name, None), (set, frozenset))}
    missing, unwritten = cacheless.positions(model_type, list(model.layers))
    caches = cacheless.one_per_layer(make_prompt_cache(model), missing, n)
    recurrent_position.carry(caches, model_type)
    return LayerPattern(caches=caches, model_type=model_type, num_layers=n, indices=indices, lists=lists, sets=sets,
                        missing=missing, unwritten=unwritten)


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
