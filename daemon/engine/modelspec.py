"""Build a planner :class:`~ringlet.partitioning.ModelSpec` from a model's ``config.json``.

No weights are read. The mlx-lm model class is instantiated from the config;
MLX arrays are lazy, so the random initial parameters are never materialised,
yet every parameter has its final shape and dtype. The planner's byte counts are
therefore exact for any architecture mlx-lm supports:

1. ``mlx_lm.utils._get_classes`` picks the Model/ModelArgs classes (with mlx-lm's
   own remapping, e.g. ``kimi_k2`` -> ``deepseek_v3``);
2. floating parameters are cast to the checkpoint dtype and quantization is
   applied the way mlx-lm's loader does (:mod:`ringlet.daemon.engine.lazy_model`
   has the details: ``cast_predicate``, quantization blocks and legacy configs,
   which modules are quantized);
3. bytes are summed per decoder layer (``model.layers``), for the embedding
   (``nn.Embedding``/``nn.QuantizedEmbedding`` outside the layers) and for the head
   (everything else: final norm and ``lm_head``; only the norm when tied).

Per token and layer:

* KV-cache bytes: MLA (``kv_lora_rank``) caches the latent and the rope key,
  ``(kv_lora_rank + qk_rope_head_dim) x dtype`` (mlx-lm ``deepseek_v3``); otherwise
  the K and V projections' output widths x dtype (``2 x kv_heads x head_dim x dtype``
  for standard attention). The layer's cache type from ``make_cache()`` decides
  full attention, a sliding window (``RotatingKVCache.max_size``: the planner counts
  at most that many tokens) or a constant state (SSM / linear attention / short
  convolution, an ``ArraysCache``: 0 bytes per token).
* Constant state bytes (per request, whatever its context): the state a recurrent
  layer's cache holds after one token, found by running one such layer of each kind
  lazily over one token of zeros (shapes only: MLX evaluates nothing, no weight is
  read), e.g. qwen3_next's GatedDeltaNet: a convolution state ``(1, conv_kernel - 1,
  2 x key_dim + value_dim)`` in the activation dtype and a recurrent state
  ``(1, v_heads, v_head_dim, k_head_dim)`` in float32 (mlx-lm ``qwen3_next.py``,
  ``gated_delta.py``).
* FLOPs: ``2 x`` parameters touched per token -- the standard forward-pass estimate
  C_forward ~= 2N (Kaplan et al. 2020, "Scaling Laws for Neural Language Models",
  sec. 2.1) -- with N the *active* parameters: routed-expert weights
  (``SwitchLinear``) count ``experts_per_token / num_experts`` of their size, as in
  the "activated parameters" of the DeepSeek-V3 technical report (arXiv:2412.19437).
  Quantized weights count their logical parameters (packed size x 32 / bits). The
  attention-over-context term (~4 x context x attention width) is not included.
* Bytes read: the same expert fraction applied to the layer's bytes.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ringlet.daemon.engine.lazy_model import cast_parameters, placeholder_weights, quantize
from ringlet.daemon.engine.model_config import ModelSpecError, dtype_name, load_config, text_config
from ringlet.daemon.engine.streams import STREAMS
from ringlet.partitioning import ModelSpec

__all__ = ["model_spec_from_config", "model_spec_from_model"]

_EXPERTS_PER_TOKEN_KEYS = (
    "num_experts_per_tok",
    "num_experts_per_token",
    "moe_top_k",
    "top_k",
    "n_activated_experts",
    "num_selected_experts",
    "experts_per_token",
)


def model_spec_from_config(
    source: str | Path | dict,
    *,
    context_tokens: int | None = None,
    name: str | None = None,
) -> ModelSpec:
    """A :class:`ModelSpec` from a config alone (see the module docstring for the method).

    Args:
        source: a config dict, a ``config.json`` path, or a model directory (whose
            safetensors headers, if present, make the quantization layout exact).
        context_tokens: KV-cache length to plan for; default the config's
            ``max_position_embeddings`` (4096 if absent).
        name: model identity for the plan; default the directory or file name.

    Raises:
        ModelSpecError: unreadable config, unsupported ``model_type``, or a config
            mlx-lm rejects (the message names the problem).
    """
    import mlx.core as mx
    import mlx.nn as nn

    config, default_name, weights_dir = load_config(source)
    text = text_config(config)
    try:
        from mlx_lm.utils import _get_classes
    except ImportError as exc:  # pragma: no cover - mlx-lm is a dependency
        raise ModelSpecError(f"mlx-lm is required to read model configs ({exc})") from None
    if "model_type" not in config:
        raise ModelSpecError("config has no 'model_type': cannot pick an mlx-lm architecture")
    try:
        model_class, args_class = _get_classes(config)
        model = model_class(args_class.from_dict(config))
    except ValueError as exc:
        raise ModelSpecError(f"config: {exc}") from None
    except (KeyError, TypeError, AttributeError) as exc:
        raise ModelSpecError(f"config for model_type {config['model_type']!r} is incomplete: {exc!r}") from None

    dtype = getattr(mx, dtype_name(config))
    cast_parameters(model, dtype)
    weights = placeholder_weights(weights_dir, model) if weights_dir is not None else None
    quantize(model, config, weights, nn)
    ctx = context_tokens if context_tokens is not None else int(text.get("max_position_embeddings") or 4096)
    return model_spec_from_model(model, context_tokens=ctx, name=name or default_name, config=config)


def model_spec_from_model(
    model: Any,
    *,
    context_tokens: int,
    name: str = "model",
    config: dict | None = None,
) -> ModelSpec:
    """A :class:`ModelSpec` from an already-built mlx-lm model (e.g. one loaded from GGUF).

    Bytes are the parameters' actual ``nbytes``; nothing is evaluated.

    Args:
        model: an mlx-lm ``Model`` with a ``layers`` property.
        context_tokens: KV-cache length to plan for.
        name: model identity for the plan.
        config: the model's config dict; default ``vars(model.args)``.

    Raises:
        ModelSpecError: the model exposes no decoder layers.
    """
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    if config is None:
        config = dict(vars(getattr(model, "args", object())))
    text = text_config(config)
    layers = [layer for layer in (getattr(model, "layers", None) or []) if layer is not None]
    if not layers:
        raise ModelSpecError("the model exposes no decoder layers (model.layers is empty)")
    k_active = _experts_per_token(config)

    layer_bytes, read_bytes, flops = [], [], []
    layer_param_ids: set[int] = set()
    for layer in layers:
        total, read, active = _layer_counts(layer, k_active, nn, tree_flatten)
        layer_bytes.append(total)
        read_bytes.append(read)
        flops.append(2.0 * active)
        layer_param_ids.update(id(v) for _, v in tree_flatten(layer.parameters()))

    modules = dict(model.named_modules())
    embedding_bytes = head_bytes = 0
    embedding_params = head_params = 0.0
    embed_paths = [
        p for p, m in modules.items() if isinstance(m, (nn.Embedding, nn.QuantizedEmbedding)) and p != ""
    ]
    lm_head = False
    for path, value in tree_flatten(model.parameters()):
        if id(value) in layer_param_ids:
            continue
        owner_path = _owner(path, modules)
        owner = modules.get(owner_path)
        logical = _logical_params(path, owner, value)
        if any(owner_path == e for e in embed_paths):
            embedding_bytes += value.nbytes
            embedding_params += logical
        else:
            head_bytes += value.nbytes
            if isinstance(owner, (nn.Linear, nn.QuantizedLinear)):
                lm_head = True
                head_params += logical
    tied = bool(_get(config, text, "tie_word_embeddings", default=False)) and not lm_head
    if not lm_head and embedding_params:
        tied = True  # no output projection of its own: the embedding is the head
    head_flops = 2.0 * (embedding_params if tied else head_params)

    dtype_bytes = _dtype_bytes(config, model)
    caches = _layer_caches(model, layers, str(config.get("model_type", "")))
    kv, windows = _kv_per_token(caches, layers, config, text, dtype_bytes)
    hidden = text.get("hidden_size") or config.get("hidden_size") or 0
    states = _state_bytes(caches, layers, int(hidden), dtype_bytes)
    return ModelSpec(
        layer_bytes=tuple(layer_bytes),
        layer_read_bytes=tuple(read_bytes),
        embedding_bytes=embedding_bytes,
        head_bytes=head_bytes,
        tie_word_embeddings=tied,
        kv_bytes_per_token_per_layer=tuple(kv),
        kv_window_tokens=tuple(windows),
        state_bytes_per_layer=tuple(states),
        context_tokens=int(context_tokens),
        flops_per_token_per_layer=tuple(flops),
        head_flops_per_token=head_flops,
        # a hop may carry a second residual stream beside the hidden states (streams.py)
        activation_bytes_per_token=int(hidden) * dtype_bytes * (2 if config.get("model_type") in STREAMS else 1),
        name=name,
    )


# --- helpers ------------------------------------------------------------------------


def _get(config: dict, text: dict, key: str, default: Any = None) -> Any:
    if key in text:
        return text[key]
    return config.get(key, default)


def _dtype_bytes(config: dict, model: Any) -> int:
    import mlx.core as mx

    if any(k in config for k in ("torch_dtype", "dtype")) or "text_config" in config:
        return getattr(mx, dtype_name(config)).size
    from mlx.utils import tree_flatten

    # the activations take the widest floating type among the parameters (float32 norms
    # beside float16 scales make float32 hidden states and KV, as a loaded GGUF stage does)
    sizes = [v.dtype.size for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)]
    return max(sizes, default=2)


def _owner(path: str, modules: dict) -> str:
    """The longest module path that prefixes the parameter path."""
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        p = ".".join(parts[:i])
        if p in modules:
            return p
    return ""


def _logical_params(path: str, owner: Any, value: Any) -> float:
    """Parameters a tensor represents: packed quantized weights count size x 32 / bits;
    quantization scales and offsets count 0."""
    leaf = path.rsplit(".", 1)[-1]
    bits = getattr(owner, "bits", None) if owner is not None else None
    if bits:
        if leaf == "weight":
            return value.size * 32 / bits
        if leaf in ("scales", "biases", "global_scale"):
            return 0.0
    return float(value.size)


def _experts_per_token(config: dict) -> int | None:
    text = text_config(config)
    for key in _EXPERTS_PER_TOKEN_KEYS:
        v = text.get(key, config.get(key))
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def _layer_counts(layer: Any, k_active: int | None, nn: Any, tree_flatten) -> tuple[int, int, float]:
    """(bytes, bytes read per token, active logical parameters) of one decoder layer."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    modules = dict(layer.named_modules())
    total = 0
    read = 0.0
    active = 0.0
    for path, value in tree_flatten(layer.parameters()):
        owner = modules.get(_owner(path, modules))
        frac = 1.0
        if isinstance(owner, (SwitchLinear, QuantizedSwitchLinear)):
            experts = owner.num_experts
            frac = min(1.0, (k_active or experts) / experts)
        total += value.nbytes
        read += value.nbytes * frac
        active += _logical_params(path, owner, value) * frac
    return total, math.ceil(read), active


def _layer_caches(model: Any, layers: list, model_type: str) -> list | None:
    """The model's ``make_cache()`` as one cache per layer, a layer that caches nothing
    marked ``None`` (:mod:`~ringlet.daemon.engine.cacheless`); ``None`` when it has no
    ``make_cache``, it fails, or its caches do not map to the layers."""
    from ringlet.daemon.engine import cacheless

    make = getattr(model, "make_cache", None)
    try:
        caches = make() if make is not None else None
        missing, unwritten = cacheless.positions(model_type, layers)
        caches = cacheless.one_per_layer(caches, missing, len(layers)) if isinstance(caches, list) else None
    except Exception:  # noqa: BLE001 - any failure: no caches known
        return None
    if caches is None or len(caches) != len(layers):
        return None
    return [None if i in unwritten else c for i, c in enumerate(caches)]


def _kv_per_token(caches: list | None, layers: list, config: dict, text: dict,
                  dtype_bytes: int) -> tuple[list, list]:
    """Per layer: (KV-cache bytes per token, sliding window or None)."""
    kinds = _cache_kinds(caches, len(layers))
    kv, windows = [], []
    for layer, (kind, window) in zip(layers, kinds, strict=True):
        if kind in ("state", "none"):
            kv.append(0)
            windows.append(None)
            continue
        kv.append(_kv_width(layer, config, text) * dtype_bytes)
        windows.append(window)
    return kv, windows


def _state_bytes(caches: list | None, layers: list, hidden: int, dtype_bytes: int) -> list[int]:
    """Per layer: bytes of the constant state its cache holds after one token (0 for
    attention layers, and for a layer whose one-token forward cannot be run lazily)."""
    import mlx.core as mx

    if caches is None or not hidden:
        return [0] * len(layers)
    dtype = {2: mx.bfloat16, 4: mx.float32}.get(dtype_bytes, mx.float16)
    known: dict[tuple, int] = {}
    out = []
    for layer, cache in zip(layers, caches, strict=True):
        if cache is None:
            out.append(0)
            continue
        members = list(getattr(cache, "caches", None) or (cache,))  # a CacheList's members
        states = [m for m in members if type(m).__name__ in ("ArraysCache", "MambaCache")]
        if not states:
            out.append(0)
            continue
        key = (type(layer), tuple(type(m).__name__ for m in members), len(states[0].cache))
        if key not in known:
            try:  # lazily: shapes and dtypes only, nothing is evaluated
                layer(mx.zeros((1, 1, hidden), dtype=dtype), **_one_token_kwargs(layer, cache))
                known[key] = sum(a.nbytes for m in states for a in m.cache if isinstance(a, mx.array))
            except Exception:  # noqa: BLE001 - a layer of another call signature: not counted
                known[key] = 0
        out.append(known[key])
    return out


def _one_token_kwargs(layer: Any, cache: Any) -> dict:
    """Keyword arguments of a decoder layer's call after its input: ``cache``, and
    ``None`` for every other one without a default (masks: one token needs none)."""
    import inspect

    params = list(inspect.signature(layer.__call__).parameters.values())[1:]
    return {p.name: cache if p.name == "cache" else None for p in params
            if p.name == "cache" or (p.default is inspect.Parameter.empty
                                     and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))}


def _cache_kinds(caches: list | None, n: int) -> list[tuple[str, int | None]]:
    """("kv", window or None), ("state", None) or ("none", None) (a layer that caches
    nothing) per layer, from :func:`_layer_caches`; none known: full attention everywhere."""
    if caches is None:
        return [("kv", None)] * n
    out = []
    for c in caches:
        name = type(c).__name__
        if c is None:
            out.append(("none", None))
        elif "Rotating" in name and getattr(c, "max_size", None):
            out.append(("kv", int(c.max_size)))
        elif name in ("ArraysCache", "MambaCache"):
            out.append(("state", None))
        else:
            out.append(("kv", None))
    return out


def _kv_width(layer: Any, config: dict, text: dict) -> int:
    """Elements of K plus V (or the MLA latent) cached per token in one layer."""
    kv_lora = text.get("kv_lora_rank")
    if kv_lora:
        return int(kv_lora) + int(text.get("qk_rope_head_dim") or 0)
    for attr in ("self_attn", "attention", "attn"):
        attn = getattr(layer, attr, None)
        if attn is None:
            continue
        k, v = getattr(attn, "k_proj", None), getattr(attn, "v_proj", None)
        if k is not None and v is not None and hasattr(k, "weight") and hasattr(v, "weight"):
            return int(k.weight.shape[0]) + int(v.weight.shape[0])
    heads = int(text.get("num_attention_heads") or 0)
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or ((text.get("hidden_size") or 0) // heads if heads else 0))
    v_dim = int(text.get("v_head_dim") or head_dim)
    return kv_heads * (head_dim + v_dim)
