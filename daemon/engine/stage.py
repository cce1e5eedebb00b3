"""A pipeline stage: an mlx-lm model with only the layers ``[start, end)`` materialised.

The stage runs the architecture's own forward code (any mlx-lm model whose decoder
layers are a list): the full model object is built lazily (MLX allocates nothing
until evaluated), then pruned *before* any weight is evaluated:

* the decoder layer list is sliced to ``[start, end)``;
* on a stage that is not first, the embedding is replaced by a pass-through, so the
  model's forward takes hidden states ``(batch, tokens, hidden_size)`` where it
  took token ids;
* on a stage that is not last, the final norm and the head are identities, so the
  forward returns hidden states; the last stage returns logits
  ``(batch, tokens, vocab)``.

Because the remaining computation is the same sequence of MLX operations as in the
unsplit model, a split model's logits equal the single-process logits exactly.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ringlet.daemon.engine import cache_kinds, streams
from ringlet.daemon.engine import gguf as gguf_source
from ringlet.daemon.engine.embed_scale import neutralize
from ringlet.daemon.engine.layer_pattern import LayerPattern
from ringlet.daemon.engine.prune import (
    FINAL_NORMS,
    Identity,
    StageEmbedding,
    embedding_name,
    head_name,
    head_owner,
    inner_module,
    last_position_only,
    layer_list,
    layer_list_owner,
    prefix_of,
    prune,
    set_layer_list,
)
from ringlet.daemon.engine.sources import ModelLocation, check_safetensors, read_config
from ringlet.daemon.engine.stage_tensors import validate_range
from ringlet.daemon.errors import ModelFormatError, PlanError

log = logging.getLogger(__name__)

DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


def token_id_error(ids: list[int], vocab_size: int | None) -> str | None:
    """Why ``ids`` cannot be embedded (``None`` = they can): an id outside
    ``[0, vocab_size)`` would index past the embedding table, which MLX does not check
    (the process would read outside it and crash). ``vocab_size=None``: not checked."""
    if vocab_size and (bad := next((t for t in ids if not 0 <= t < vocab_size), None)) is not None:
        return f"token id {bad} is outside the vocabulary [0, {vocab_size})"
    return None


def mergeable(caches: list[list]) -> bool:
    """Whether these requests' caches can join one batched forward
    (:func:`.cache_kinds.mergeable`: mlx-lm's batch caches for full attention, sliding
    windows and recurrent states; quantized or chunked caches run one request at a time)."""
    return cache_kinds.mergeable(caches)


class StageRange:
    """What a stage's layer range says about it; needs ``start``, ``end`` (the half-open
    range ``[start, end)``), ``num_layers`` and ``config`` (mlx-lm ``config.json`` form)."""

    start: int
    end: int
    num_layers: int
    config: dict

    @property
    def first(self) -> bool:
        """It embeds token ids (holds layer 0)."""
        return self.start == 0

    @property
    def last(self) -> bool:
        """It ends with the output head (holds the last layer)."""
        return self.end == self.num_layers

    @property
    def hidden_size(self) -> int:
        """Width of the hidden states it takes and gives, per token: the model's
        ``hidden_size``, or twice that where a stage boundary carries a second residual
        stream (:func:`~ringlet.daemon.engine.streams.width`)."""
        return streams.width(self.config)


@dataclass
class Stage(StageRange):
    """A loaded stage: a pruned model that maps its input to its output.

    Attributes:
        model: the pruned mlx-lm model.
        start, end: the half-open layer range ``[start, end)``.
        num_layers: layers in the whole model.
        config: the model config (mlx-lm ``config.json`` form).
        reused_prefixes: parameter prefixes taken from a previous stage, not read.
        pattern: the whole model's layer pattern (caches, index attributes), from
            :func:`~ringlet.daemon.engine.prune.prune`; ``None``: the model's own.
    """

    model: nn.Module
    start: int
    end: int
    num_layers: int
    config: dict
    reused_prefixes: frozenset[str] = frozenset()
    pattern: LayerPattern | None = None
    _span: tuple[int, int] | None = field(default=None, init=False, repr=False)

    def make_cache(self) -> list:
        """A fresh per-request cache: one entry per layer of this stage, of the type the
        whole model gives that layer's global position (inside :meth:`span`, its layers)."""
        from mlx_lm.models.cache import make_prompt_cache

        if self.pattern is None:
            return make_prompt_cache(self.model)
        lo, hi = self._span or (self.start, self.end)
        return self.pattern.make_cache(lo, hi)

    def __call__(self, x: mx.array, cache: list, head: bool | None = None) -> mx.array:
        """Run the stage.

        Args:
            x: token ids ``(batch, tokens)`` int32 on the first stage, hidden states
                ``(batch, tokens, hidden_size)`` on the others.
            cache: this request's cache from :meth:`make_cache` (updated in place).
            head: ``None``: the model's own forward, every position's output. ``True``
                (the engine, sampling the next token): on the last stage, only the last
                position's logits are computed -- a prefill chunk of T tokens would
                otherwise project all T onto the vocabulary (SmolLM2-135M: 57 of its 269
                MFLOP a token) to keep one row. ``False``: only the cache is needed (the
                output is lazy; :meth:`settle` evaluates the cache alone), as a
                tensor-group stage skips the head.

        Returns:
            Hidden states ``(batch, tokens, hidden_size)``, or logits on the last stage:
            ``(batch, tokens, vocab)``, or ``(batch, 1, vocab)`` with ``head=True``
            (when the architecture projects through ``lm_head`` or a tied embedding's
            ``as_linear``, as mlx-lm's do; otherwise every position). Lazy: evaluate it.
        """
        if not (head and self.last and x.shape[1] > 1):
            return self.model(x, cache=cache)
        with last_position_only(self.model):
            return self.model(x, cache=cache)

    @contextlib.contextmanager
    def span(self, lo: int, hi: int) -> Iterator[None]:
        """Within the block, this stage computes only its layers ``[lo, hi)``: ``self(x,
        cache)`` maps the hidden states entering layer ``lo`` (token ids when ``lo`` is 0)
        to those entering ``hi``, with no final norm or head, and :meth:`make_cache` gives
        ``hi - lo`` layers. The same layer objects run, so the KV they compute is the KV
        the whole stage computes for those layers. The model is restored on leaving (the
        engine's worker thread runs one thing at a time).

        Raises:
            PlanError: ``[lo, hi)`` is not a non-empty part of the stage's range.
        """
        if not self.start <= lo < hi <= self.end:
            raise PlanError(f"layers [{lo}, {hi}) are not within this stage's [{self.start}, {self.end})")
        inner = inner_module(self.model)
        embedding = embedding_name(inner)
        owner_of_list = layer_list_owner(inner)
        saved = {name: getattr(inner, name) for name in (embedding, *FINAL_NORMS) if hasattr(inner, name)}
        layers = layer_list(inner)
        owner, head_attr = head_owner(self.model), head_name(self.model)
        head = owner.get(head_attr)
        restore = None
        try:
            set_layer_list(inner, layers[lo - self.start:hi - self.start])
            if self.pattern is not None:
                self.pattern.apply(owner_of_list, lo, hi)
            self._span = (lo, hi)
            real = getattr(saved[embedding], "real", None) if lo == 0 else None
            setattr(inner, embedding, StageEmbedding(real, embed_input=lo == 0, head_output=False))
            restore = neutralize(self.model, inner, self.config.get("model_type", ""), embed=lo == 0, head=False)
            for name in FINAL_NORMS:
                if name in saved:
                    setattr(inner, name, Identity())
            if head is not None:
                setattr(owner, head_attr, Identity())
            yield
        finally:
            self._span = None
            if restore is not None:
                restore()
            for name, value in saved.items():
                setattr(inner, name, value)
            set_layer_list(inner, layers)
            if self.pattern is not None:  # the stage's own indices, lists and stand-ins again
                self.pattern.apply(owner_of_list, self.start, self.end)
            if head is not None:
                setattr(owner, head_attr, head)

    def settle(self, cache: list) -> None:
        """Evaluate a request's KV cache after a forward whose output is not needed."""
        mx.eval([c.state for c in cache])

    def nbytes(self) -> int:
        """Bytes of the parameters this stage holds."""
        return sum(v.nbytes for _, v in tree_flatten(self.model.parameters()))

    def loaded_bytes(self) -> int:
        """Bytes this stage read from disk (its parameters minus the reused ones)."""
        return sum(v.nbytes for name, v in tree_flatten(self.model.parameters())
                   if not any(name.startswith(p) for p in self.reused_prefixes))


def _model_classes(config: dict):
    from mlx_lm.utils import _get_classes

    try:
        return _get_classes(config)
    except ValueError:
        raise ModelFormatError(
            f"unsupported architecture {config.get('model_type')!r}: mlx-lm has no model class for it"
        ) from None


def _cast(model: nn.Module, dtype: mx.Dtype) -> None:
    def cast(path: str, module: nn.Module) -> None:
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            return
        for key, value in module.items():
            if isinstance(value, mx.array) and mx.issubdtype(value.dtype, mx.floating):
                module[key] = value.astype(dtype)

    model.apply_to_modules(cast)


def _reuse(model: nn.Module, start: int, end: int, num_layers: int, reuse: Stage | None) -> set[str]:
    """Move the already-materialised modules of ``reuse`` that the new stage
    ``[start, end)`` also needs into ``model``. Returns the model-relative prefixes
    that were reused (their tensors must not be read again)."""
    if reuse is None:
        return set()
    inner, old_inner = inner_module(model), inner_module(reuse.model)
    done: set[str] = set()
    for g in range(max(start, reuse.start), min(end, reuse.end)):
        layer_list(inner)[g - start] = layer_list(old_inner)[g - reuse.start]
        done.add(f"{prefix_of(model)}{g - start}.")
    embedding = embedding_name(inner)
    new_embed, old_embed = getattr(inner, embedding), getattr(old_inner, embedding_name(old_inner))
    if "real" in new_embed and isinstance(old_embed, StageEmbedding) and "real" in old_embed:
        new_embed.real = old_embed.real
        done.add(prefix_of(model, embedding))
    if reuse.last and end == num_layers:
        for name in FINAL_NORMS:  # norm, ln_f (gpt2.py), final_layernorm (phi.py)...
            if name in inner and name in old_inner:
                setattr(inner, name, old_inner[name])
                done.add(prefix_of(model, name))
        head, owner, old_owner = head_name(model), head_owner(model), head_owner(reuse.model)
        if hasattr(owner, head) and hasattr(old_owner, head):
            setattr(owner, head, getattr(old_owner, head))
            done.add(f"{head}.")
    return done


def build_lazy_model(location: ModelLocation, dtype: str | None = None) -> tuple[nn.Module, dict]:
    """The whole model, built but never evaluated (MLX allocates nothing), with the
    same quantization and dtype :func:`load_stage` would give it: for sizing plans
    (``modelspec.model_spec_from_model``) without reading weights.

    Raises:
        ModelFormatError: unreadable or unsupported model.
    """
    mx_dtype = DTYPES.get(dtype) if dtype else None
    if location.kind == "gguf":
        g = gguf_source.open_gguf(location.path)
        config = dict(g.config)
        model_class, args_class = gguf_source.model_classes(config)
        model = model_class(args_class.from_dict(config))
        bits = {}
        for name, tensor in g.tensors.items():
            width = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}.get(tensor.tensor_type.name)
            if width and mx_dtype is None and len(tensor.shape) == 2:
                bits[gguf_source.mlx_name(name)] = width
        # as loaded: quantized tensors carry float16 scales and biases, float32 tensors (the
        # norms) stay float32 and so make the activations and KV float32; --dtype casts all
        _cast(model, mx_dtype or mx.float16)
        wide = {gguf_source.mlx_name(n) for n, t in g.tensors.items() if t.tensor_type.name == "F32"}
        for path, module in model.named_modules() if mx_dtype is None else ():
            if path in wide and isinstance(getattr(module, "weight", None), mx.array):
                module.weight = module.weight.astype(mx.float32)

        def predicate(path: str, module: nn.Module) -> dict | bool:
            if path in bits and hasattr(module, "to_quantized"):
                return {"group_size": gguf_source.GROUP, "bits": bits[path]}
            return False

        if bits:
            nn.quantize(model, class_predicate=predicate)
        return model, config
    from mlx_lm.utils import load_model

    from ringlet.daemon.engine.partial_model import absent_files, build_partial_model

    config = read_config(location)
    _model_classes(config)
    try:
        if absent_files(location):  # some weights are not here yet: their headers size them
            model, config = build_partial_model(location)
        else:
            model, config = load_model(Path(location.path), lazy=True, strict=False)
    except (ValueError, KeyError, FileNotFoundError) as exc:
        raise ModelFormatError(f"{location.path}: cannot build the model: {exc}") from None
    if mx_dtype is not None:
        _cast(model, mx_dtype)
    return model, config


def load_stage(location: ModelLocation, start: int, end: int | None = None, dtype: str | None = None,
               reuse: Stage | None = None, progress: Callable[[int, int], None] | None = None) -> Stage:
    """Load the stage ``[start, end)`` of a model, reading only that stage's tensors.

    Args:
        location: from :func:`ringlet.daemon.engine.sources.resolve`.
        start, end: half-open layer range; ``end=None`` means the last layer.
        dtype: ``None`` keeps the model's own precision (GGUF Q4_0/Q4_1/Q8_0 stay
            quantized); ``"float16"``, ``"bfloat16"`` or ``"float32"`` dequantize/cast.
        reuse: a loaded stage of the same model and dtype; the layers (and embedding,
            norm, head) both stages need are taken from it instead of being read
            again, so re-sharding reads only the layers that moved.
        progress: called as ``progress(done, total)`` (tensors or layers) while loading.

    Raises:
        ModelFormatError: unreadable, truncated or unsupported model files.
        PlanError: a bad layer range.
        ValueError: an unknown ``dtype``.
    """
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    mx_dtype = DTYPES.get(dtype) if dtype else None
    if location.kind == "gguf":
        return _load_gguf_stage(location.path, start, end, mx_dtype, reuse, progress)
    return _load_mlx_stage(location, start, end, mx_dtype, reuse, progress)


def _load_mlx_stage(location: ModelLocation, start: int, end: int | None, dtype, reuse: Stage | None,
                    progress: Callable[[int, int], None] | None = None) -> Stage:
    from mlx_lm.utils import load_model

    from ringlet.daemon.engine.partial_model import absent_files, check_stage_present

    config = read_config(location)
    _model_classes(config)  # clear error for unknown architectures
    for path in sorted(Path(location.path).glob("*.safetensors")):
        check_safetensors(path)
    partial = bool(absent_files(location))  # only this stage's files are here: strict for the stage below
    try:
        model, config = load_model(Path(location.path), lazy=True, strict=not partial)
    except (ValueError, KeyError, FileNotFoundError) as exc:
        raise ModelFormatError(f"{location.path}: cannot build the model: {exc}") from None
    num_layers = len(model.layers)
    end = num_layers if end is None else end
    if partial:
        validate_range(start, end, num_layers)
        check_stage_present(model, location, start, end)
    _, _, pattern = prune(model, start, end, config.get("model_type", ""))
    if dtype is not None:
        _cast(model, dtype)
    reused = _reuse(model, start, end, num_layers, reuse)
    try:
        layers = layer_list(inner_module(model))
        for i, layer in enumerate(layers):  # layer by layer, for progress
            mx.eval(layer.parameters())
            if progress is not None:
                progress(i + 1, len(layers))
        mx.eval(model.parameters())
    except (RuntimeError, ValueError) as exc:
        raise ModelFormatError(f"{location.path}: cannot read the weights: {exc}") from None
    return Stage(model=model, start=start, end=end, num_layers=num_layers, config=config,
                 reused_prefixes=frozenset(reused), pattern=pattern)


def _load_gguf_stage(path: Path, start: int, end: int | None, dtype, reuse: Stage | None,
                     progress: Callable[[int, int], None] | None = None) -> Stage:
    g = gguf_source.open_gguf(path)
    config = dict(g.config)
    model_class, args_class = gguf_source.model_classes(config)
    model = model_class(args_class.from_dict(config))
    num_layers = len(model.layers)
    end = num_layers if end is None else end
    first, last, pattern = prune(model, start, end, config["model_type"])

    def local(name: str) -> str:
        # global layer index -> index within the stage; embedding sits under the stand-in
        if name.startswith("model.layers."):
            rest = name[len("model.layers.") :]
            idx, _, tail = rest.partition(".")
            return f"model.layers.{int(idx) - start}.{tail}"
        if name == "model.embed_tokens":
            return "model.embed_tokens.real"
        return name

    reused = _reuse(model, start, end, num_layers, reuse)
    weights: list[tuple[str, mx.array]] = []
    quant: dict[str, int] = {}
    skip = {name for name in gguf_source.stage_tensor_names(g, start, end, first, last)
            if any((local(gguf_source.mlx_name(name)) + ".").startswith(p) for p in reused)}
    total = len(gguf_source.stage_tensor_names(g, start, end, first, last)) - len(skip)
    for done, (prefix, arrays) in enumerate(gguf_source.stage_weights(g, start, end, first, last, dtype,
                                                                      skip=skip), start=1):
        if progress is not None:
            progress(done, total)
        bits = arrays.pop("_bits", None)
        target = local(prefix)
        if bits is not None:
            quant[target] = bits
        for key, arr in arrays.items():
            mx.eval(arr)
            weights.append((f"{target}.{key}", arr))
        mx.clear_cache()  # return intermediates (packed words, fp32 scales) before the next tensor
    if quant:
        config["quantization"] = {"group_size": gguf_source.GROUP, "bits": 4}

        def predicate(path: str, module: nn.Module) -> dict | bool:
            if path in quant and hasattr(module, "to_quantized"):
                return {"group_size": gguf_source.GROUP, "bits": quant[path]}
            return False

        nn.quantize(model, class_predicate=predicate)
    try:
        model.load_weights(weights, strict=not reused)
    except ValueError as exc:
        raise ModelFormatError(f"{path}: weights do not match the architecture: {exc}") from None
    if reused:  # strict check by hand: every parameter not reused was read
        loaded = {name for name, _ in weights}
        missing = [name for name, _ in tree_flatten(model.parameters())
                   if name not in loaded and not any(name.startswith(p) for p in reused)]
        if missing:
            raise ModelFormatError(f"{path}: no tensors for {missing[:3]}")
    mx.eval(model.parameters())
    return Stage(model=model, start=start, end=end, num_layers=num_layers, config=config,
                 reused_prefixes=frozenset(reused), pattern=pattern)
