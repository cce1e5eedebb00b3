"""Pruning an unevaluated mlx-lm model to a stage's layer range ``[start, end)``.

The decoder layer list is sliced; on a stage that is not first the embedding becomes a
pass-through (the forward takes hidden states where it took token ids); on a stage that
is not last the final norm and the head become identities (it returns hidden states).
Nothing here reads or allocates a weight: MLX arrays are lazy until evaluated.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import mlx.core as mx
import mlx.nn as nn

from ringlet.daemon.engine.embed_scale import neutralize, refusal
from ringlet.daemon.engine.layer_pattern import LayerPattern, capture, check_split
from ringlet.daemon.engine.local_index import own_masks
from ringlet.daemon.engine.mixins import mixed
from ringlet.daemon.engine.stage_tensors import validate_range
from ringlet.daemon.engine.token_shape import accept_hidden, unwrap
from ringlet.daemon.errors import ModelFormatError, PlanError

#: Names of the inner model's final norm: ``norm`` in most of mlx-lm, ``final_layernorm``
#: in phi.py (``PhiModel.__call__``: ``return self.final_layernorm(x)``), ``embedding_norm``
#: in lfm2.py (``Lfm2Model.__call__``: ``return self.embedding_norm(h)``), ``norm_f``
#: (dbrx.py ``DBRX``, mamba.py), ``ln_f`` (gpt2.py ``GPT2Model``, gpt_bigcode.py, gptj.py,
#: qwen.py ``QwenModel``, exaone.py ``ExaoneModel``), ``final_layer_norm`` (gpt_neox.py
#: ``GPTNeoXModel``), ``final_norm`` (recurrent_gemma.py ``Griffin``).
FINAL_NORMS = ("norm", "final_layernorm", "norm_f", "embedding_norm", "ln_f", "final_layer_norm", "final_norm")

#: Names of the inner model's token embedding: ``embed_tokens`` in most of mlx-lm,
#: ``tok_embeddings`` (internlm2.py InternLM2Model), ``word_embeddings`` (bailing_moe.py
#: BailingMoeModel), ``embeddings`` (mamba.py Mamba, mamba2.py Mamba2, nemotron_h.py
#: NemotronHModel, whose final norms are ``norm_f``), ``token_embeddings`` (openelm.py OpenELMModel),
#: ``wte`` (gpt2.py, gpt_bigcode.py, gptj.py, dbrx.py, qwen.py, exaone.py), ``embed_in``
#: (gpt_neox.py), ``embedding`` (spark2_5.py ``Spark2_5Model``), ``embd`` (phixtral.py
#: ``TransformerDecoder``, an ``Embd`` holding ``wte``), ``embed`` (talkie.py ``TalkieModel``).
EMBEDDINGS = ("embed_tokens", "tok_embeddings", "word_embeddings", "embeddings", "token_embeddings", "wte",
              "embed_in", "embedding", "embd", "embed")

#: Where the decoder layer list lives, from the module holding the embedding: ``layers`` in
#: most of mlx-lm, ``h`` (gpt2.py ``GPT2Model``, gpt_bigcode.py, gpt_neox.py, gptj.py, qwen.py,
#: exaone.py, phixtral.py ``TransformerDecoder``), ``blocks`` (dbrx.py ``DBRX``), ``layers.layers``
#: (plamo.py / plamo2.py / plamo3.py: ``PlamoModel.layers`` is a ``PlamoDecoder`` holding the list).
LAYER_LISTS = ("layers", "h", "blocks", "layers.layers")


#: Names of the outer model's untied head: ``lm_head`` in most of mlx-lm, ``output`` in
#: internlm2.py and llama4_text.py (``Model.__init__``: ``self.output = nn.Linear(...)``);
#: ``embed_out`` on the inner model itself in gpt_neox.py (``GPTNeoXModel.__call__``:
#: ``out = self.embed_out(out)`` after the final norm).
HEADS = ("lm_head", "output", "embed_out")


def _head_at(model: nn.Module) -> tuple[list[str], str]:
    """``(path of the head's owner from model, head attribute)``, found once per model and
    kept on it: the last stage asks on every forward (``last_position_only``), and the
    walk over ``named_modules`` costs milliseconds (4.5 ms a decode step on SmolLM2)."""
    cached = model.__dict__.get("_ringlet_head_at")
    if cached is not None:
        return cached
    inner = inner_module(model)
    steps = next(p for p, m in model.named_modules() if m is inner).split(".")
    found: tuple[list[str], str] = ([], "lm_head")
    for i in range(len(steps) + 1):  # model, then inner's ancestors, then inner
        owner = _get(model, steps[:i])
        name = next((n for n in HEADS if isinstance(owner.get(n), nn.Module)), None)
        if name is not None:
            found = (steps[:i], name)
            break
    model.__dict__["_ringlet_head_at"] = found  # an attribute, not a child module or parameter
    return found


def head_owner(model: nn.Module) -> nn.Module:
    """The module holding the untied head: ``model``, or the wrapper between it and the
    inner model that has one (qwen3_5.py ``TextModel.lm_head``, under ``language_model``)."""
    return _get(model, _head_at(model)[0])


def _get(module: nn.Module, steps: list[str]) -> nn.Module:
    for step in steps:
        module = module[step]
    return module


def _path(module: object, dotted: str) -> object:
    for step in dotted.split("."):
        module = getattr(module, step, None)
    return module


def _layers_at(inner: nn.Module) -> str:
    return inner.__dict__.get("_ringlet_layers", "layers")


def layer_list(inner: nn.Module) -> list:
    """The decoder layer list of ``inner`` (:func:`inner_module`), wherever it lives (:data:`LAYER_LISTS`)."""
    return _path(inner, _layers_at(inner))


def set_layer_list(inner: nn.Module, layers: list) -> None:
    """Replace the decoder layer list of ``inner`` (:func:`inner_module`) by ``layers``."""
    *owner, name = _layers_at(inner).split(".")
    setattr(_path(inner, ".".join(owner)) if owner else inner, name, layers)


def prefix_of(model: nn.Module, name: str = "") -> str:
    """The parameter-name prefix of the inner model's attribute ``name`` (``""``: the layer
    list), from ``model``: ``model.layers.`` in most of mlx-lm, ``model.h.`` (gpt2.py),
    ``transformer.blocks.`` (dbrx.py), ``language_model.model.norm.``..."""
    inner = inner_module(model)
    return ".".join([*model.__dict__["_ringlet_inner_at"], name or _layers_at(inner)]) + "."


def layer_list_owner(inner: nn.Module) -> nn.Module:
    """The module whose attribute is the decoder layer list: ``inner``, or the decoder between
    (plamo3.py ``Plamo3Decoder``, which also keeps the forward's ``full_idx``/``swa_idx``)."""
    *owner, _ = _layers_at(inner).split(".")
    return _path(inner, ".".join(owner)) if owner else inner


def head_name(model: nn.Module) -> str:
    """The attribute of ``head_owner(model)`` holding its untied head (:data:`HEADS`), else ``lm_head``."""
    return _head_at(model)[1]


def embedding_name(inner: nn.Module) -> str:
    """The attribute of ``inner`` holding the token embedding (:data:`EMBEDDINGS`)."""
    for name in EMBEDDINGS:
        if hasattr(inner, name):
            return name
    raise ModelFormatError(f"{type(inner).__module__}: cannot find the token embedding")


class StageEmbedding(nn.Module):
    """Stands in for ``embed_tokens``: embeds on the first stage, passes hidden states
    through elsewhere; ``as_linear`` (tied head) projects only on the last stage, and
    only the last position while ``last_only`` is set (:meth:`Stage.__call__`)."""

    def __init__(self, real: nn.Module | None, embed_input: bool, head_output: bool):
        super().__init__()
        if real is not None:
            self.real = real
        self._embed_input = embed_input
        self._head_output = head_output
        self.last_only = False

    def __call__(self, x: mx.array) -> mx.array:
        return self.real(x) if self._embed_input else unwrap(x)

    def as_linear(self, x: mx.array) -> mx.array:
        if not self._head_output:
            return x
        return self.real.as_linear(x[:, -1:, :] if self.last_only else x)


class Identity(nn.Module):
    """Stands in for a final norm or head that a stage does not run: returns its input."""

    def __call__(self, x: mx.array, *args, **kwargs) -> mx.array:
        return x


#: Architectures whose outer forward does something to the head's output that no value
#: neutralizes, after ``out = self.model(inputs, cache)``: on a stage without the head the
#: outer forward is that call alone (:class:`_Headless`). gemma2.py ``Model.__call__``:
#: ``out = mx.tanh(out / self.final_logit_softcapping) * self.final_logit_softcapping``;
#: nanochat.py ``Model.__call__``: ``logits = softcap(logits)`` (``cap * mx.tanh(logits / cap)``);
#: muse_glimmer.py ``Model.__call__``: ``out = out * self.args.output_multiplier`` and
#: ``mx.tanh(out / cap) * cap``; talkie.py ``Model.__call__``: ``self.lm_head_gain(out @ self.lm_head.T)``,
#: its head a bare parameter, not a module.
HEADLESS = frozenset({"gemma2", "nanochat", "muse_glimmer", "talkie"})


class _Headless:
    """Mixed into an outer model's class (:data:`HEADLESS`): while the stage runs no head
    (its tied head's ``as_linear`` passes hidden states through, or its head is an
    :class:`Identity`), the forward is ``self.model(inputs, cache)`` alone."""

    def __call__(self, inputs, cache=None, *args, **kwargs):
        inner = inner_module(self)
        embedding = getattr(inner, embedding_name(inner))
        head = head_owner(self).get(head_name(self))
        if isinstance(head, Identity) or (head is None and isinstance(embedding, StageEmbedding)
                                          and not embedding._head_output):
            return inner(inputs, cache)
        return super().__call__(inputs, cache, *args, **kwargs)


def _headless(model: nn.Module, model_type: str) -> None:
    if model_type in HEADLESS:
        model.__class__ = mixed(_Headless, type(model))


class LastPosition(nn.Module):
    """An untied head applied to the last position only: ``(B, T, H) -> (B, 1, vocab)``."""

    def __init__(self, head: nn.Module):
        super().__init__()
        self.head = head

    def __call__(self, x: mx.array) -> mx.array:
        return self.head(x[:, -1:, :])


def inner_module(model: nn.Module) -> nn.Module:
    """The sub-module that owns the decoder layer list and the embedding (``model.model`` in
    mlx-lm; the list may sit below it, :data:`LAYER_LISTS`, read it with :func:`layer_list`).
    Its path is found once per model and kept on it (pruning keeps the module, and the last
    stage asks on every forward; the walk costs about a millisecond)."""
    at = model.__dict__.get("_ringlet_inner_at")
    if at is not None:
        return _get(model, at)
    layers = list(model.layers)  # may be a fresh list (e.g. ``pipeline_layers``)
    found = []
    for path, module in model.named_modules():
        if module is model or not layers:
            continue
        for name in LAYER_LISTS:
            if isinstance(getattr(type(module), name.split(".")[0], None), property):
                continue  # a wrapper's view of an inner model's list (qwen3_5.py TextModel.layers)
            owned = _path(module, name)
            if isinstance(owned, list) and owned and owned[0] is layers[0]:
                found.append((path, name, module))
    # the module that also holds the embedding (plamo.py: PlamoModel, not its PlamoDecoder)
    found.sort(key=lambda f: not any(isinstance(getattr(f[2], e, None), nn.Module) for e in EMBEDDINGS))
    if not found:
        raise ModelFormatError(f"{type(model).__module__}: cannot find the module holding the decoder layers")
    path, name, module = found[0]
    module.__dict__["_ringlet_layers"] = name  # attributes, not children or parameters
    model.__dict__["_ringlet_inner_at"] = path.split(".")
    return module


def prune(model: nn.Module, start: int, end: int, model_type: str) -> tuple[bool, bool, LayerPattern]:
    """Prune an (unevaluated) mlx-lm model in place to the stage ``[start, end)``; the
    stage keeps its layers' global pattern (:mod:`~ringlet.daemon.engine.layer_pattern`).

    Returns ``(first, last, pattern)``: ``pattern`` captured from the whole model.

    Raises:
        PlanError: bad range, or a split of an architecture that cannot be split exactly
            (:func:`~ringlet.daemon.engine.layer_pattern.check_split`).
    """
    num_layers = len(list(model.layers))
    validate_range(start, end, num_layers)
    first, last = start == 0, end == num_layers
    if not (first and last):  # refused before looking for modules it may not have (gpt2.py ``h``)
        check_split(model_type, None, type(model).__module__.rsplit(".", 1)[-1])
    inner = inner_module(model)
    pattern = capture(model, layer_list_owner(inner), model_type, num_layers)
    if not (first and last):
        check_split(model_type, pattern, type(model).__module__.rsplit(".", 1)[-1])
        if len(pattern.caches) != num_layers:  # caches must map to layers one to one
            raise PlanError(f"architecture {model_type!r} cannot be split into stages: its cache has "
                            f"{len(pattern.caches)} entries for {num_layers} layers; run it on one node")
        if (reason := refusal(model, model_type)) is not None:
            raise PlanError(f"architecture {model_type!r} cannot be split into stages: {reason}; run it on one node")
    set_layer_list(inner, layer_list(inner)[start:end])
    own_masks(inner, model_type, start, layer_list(inner))
    pattern.apply(layer_list_owner(inner), start, end)
    owner, head = head_owner(model), head_name(model)
    tied = not hasattr(owner, head)
    if first and last and not any(hasattr(inner, name) for name in EMBEDDINGS):
        pass  # a whole model keeps an embedding of its own kind (longcat_flash_ngram.py ``ngram_embeddings``)
    else:
        embedding = embedding_name(inner)
        real = getattr(inner, embedding)
        keep_embedding = first or (last and tied)
        setattr(inner, embedding, StageEmbedding(real if keep_embedding else None, first, last))
    neutralize(model, inner, model_type, embed=first, head=last)
    accept_hidden(model, model_type)
    _headless(model, model_type)
    if not last:
        for name in FINAL_NORMS:
            if hasattr(inner, name):
                setattr(inner, name, Identity())
        if hasattr(owner, head):
            setattr(owner, head, Identity())
    return first, last, pattern


@contextlib.contextmanager
def last_position_only(model: nn.Module) -> Iterator[None]:
    """Within the block, a pruned last stage's forward projects only the last position onto
    the vocabulary: its logits are ``(batch, 1, vocab)``, the same values as the last row of
    all of them. Applies where the architecture projects through ``lm_head`` or a tied
    embedding's ``as_linear`` (mlx-lm's models do); elsewhere every position still is.
    The model is restored on leaving (one forward at a time per model)."""
    inner = inner_module(model)
    owner, head = head_owner(model), head_name(model)
    embedding = next((getattr(inner, name) for name in EMBEDDINGS if hasattr(inner, name)), None)
    lm_head = owner.get(head)
    try:
        if isinstance(embedding, StageEmbedding):
            embedding.last_only = True
        if isinstance(lm_head, nn.Module):
            setattr(owner, head, LastPosition(lm_head))
        yield
    finally:
        if isinstance(embedding, StageEmbedding):
            embedding.last_only = False
        if isinstance(lm_head, nn.Module):
            setattr(owner, head, lm_head)
