"""Build a planner :class:`~ringlet.partitioning.ModelSpec` from a model's ``config.json``.

No weights are read. The mlx-lm model class is instantiated from the config;
MLX arrays are lazy, so the random initial parameters are never materialised,
yet every parameter has its final shape and dtype. The planner's byte counts are
therefore exact for any architecture mlx-lm supports:

1. ``mlx_lm.utils._get_classes`` picks the Model/ModelArgs classes (with mlx-lm's
   own remapping, e.g. ``kimi_k2`` -> ``deepseek_v3``);
2. floating parameters are cast to the checkpoint dtype (``torch_dtype`` /
   ``dtype``, default bfloat16), honouring the model's ``cast_predicate`` exactly as
   ``mlx_lm.convert`` does;
3. quantization is applied the way ``mlx_lm.utils.load_model`` does: a
   ``quantization`` block (per-module overrides included), or a legacy
   ``quantization_config`` (mxfp4, mxfp8, ue8m0 fp8, compressed-tensors, modelopt
   nvfp4, awq/gptq; other fp8 checkpoints are dequantized by mlx-lm and stay in the
   float dtype). Which modules are quantized: the loader decides from the
   ``<path>.scales`` tensors present in the checkpoint -- when the model directory
   has ``*.safetensors`` files their headers (names, shapes, dtypes only) are read
   and fed through the model's ``sanitize`` as lazy placeholders, so the decision is
   the loader's own; without weights, mlx-lm's converter rule is used (every module
   with ``to_quantized`` whose input size is a multiple of the group size, filtered
   by the model's ``quant_predicate``);
4. bytes are summed per decoder layer (``model.layers``), for the embedding
   (``nn.Embedding``/``nn.QuantizedEmbedding`` outside the layers) and for the head
   (everything else: final norm and ``lm_head``; only the norm when tied).

Per token and layer:

* KV-cache bytes: MLA (``kv_lora_rank``) caches the latent and the rope key,
  ``(kv_lora_rank + qk_rope_head_dim) x dtype`` (mlx-lm ``deepseek_v3``); otherwise
  the K and V projections' output widths x dtype (``2 x kv_heads x head_dim x dtype``
  for standard attention). The layer's cache type from ``make_cache()`` decides
  full attention, a sliding window (``RotatingKVCache.max_size``) or a constant
  state (SSM / linear attention: 0 bytes per token).
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

import json
import math
import struct
from pathlib import Path
from typing import Any

from ringlet.partitioning import ModelSpec

_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "half": "float16", "float32": "float32", "float": "float32"}
_EXPERTS_PER_TOKEN_KEYS = (
    "num_experts_per_tok",
    "num_experts_per_token",
    "moe_top_k",
    "top_k",
    "n_activated_experts",
    "num_selected_experts",
    "experts_per_token",
)
# safetensors dtype -> mlx dtype name with the same item size (fp8 has no mlx dtype; uint8 is the same size).
_ST_DTYPES = {
    "BF16": "bfloat16",
    "F16": "float16",
    "F32": "float32",
    "F64": "float32",
    "U32": "uint32",
    "I32": "int32",
    "U8": "uint8",
    "I8": "int8",
    "U16": "uint16",
    "I16": "int16",
    "I64": "int64",
    "U64": "uint64",
    "BOOL": "bool_",
    "F8_E4M3": "uint8",
    "F8_E5M2": "uint8",
    "F8_E8M0": "uint8",
}


class ModelSpecError(ValueError):
    """The config cannot be turned into a model spec (unreadable, unsupported architecture,
    missing fields). The message is one line and names the file or field."""


def load_config(source: str | Path | dict) -> tuple[dict, str, Path | None]:
    """Resolve ``source`` into (config dict, default model name, weights directory or None).

    Args:
        source: a config dict, a ``config.json`` path, or a model directory holding one.

    Raises:
        ModelSpecError: the path does not exist or is not a JSON object.
    """
    if isinstance(source, dict):
        return dict(source), str(source.get("_name_or_path") or source.get("model_type") or "model"), None
    path = Path(source).expanduser()
    if path.is_dir():
        directory, file = path, path / "config.json"
    else:
        directory, file = path.parent, path
    if not file.is_file():
        raise ModelSpecError(f"{file}: no such config file")
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelSpecError(f"{file}: not a readable JSON config ({exc})") from None
    if not isinstance(config, dict):
        raise ModelSpecError(f"{file}: the config must be a JSON object")
    name = directory.name if file.name == "config.json" else file.stem
    has_weights = any(directory.glob("*.safetensors"))
    return config, name or "model", directory if has_weights else None


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
    text = _text_config(config)
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

    dtype = getattr(mx, _dtype_name(config))
    _cast(model, dtype)
    weights = _placeholder_weights(weights_dir, model) if weights_dir is not None else None
    _quantize(model, config, weights, nn)
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
    text = _text_config(config)
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
    kv, windows = _kv_per_token(model, layers, config, text, dtype_bytes)
    hidden = text.get("hidden_size") or config.get("hidden_size") or 0
    return ModelSpec(
        layer_bytes=tuple(layer_bytes),
        layer_read_bytes=tuple(read_bytes),
        embedding_bytes=embedding_bytes,
        head_bytes=head_bytes,
        tie_word_embeddings=tied,
        kv_bytes_per_token_per_layer=tuple(kv),
        kv_window_tokens=tuple(windows),
        context_tokens=int(context_tokens),
        flops_per_token_per_layer=tuple(flops),
        head_flops_per_token=head_flops,
        activation_bytes_per_token=int(hidden) * dtype_bytes,
        name=name,
    )


# --- helpers ------------------------------------------------------------------------


def _text_config(config: dict) -> dict:
    text = config.get("text_config")
    return {**config, **text} if isinstance(text, dict) else config


def _get(config: dict, text: dict, key: str, default: Any = None) -> Any:
    if key in text:
        return text[key]
    return config.get(key, default)


def _dtype_name(config: dict) -> str:
    text = _text_config(config)
    raw = config.get("torch_dtype") or config.get("dtype") or text.get("torch_dtype") or text.get("dtype")
    return _DTYPES.get(str(raw), "bfloat16") if raw else "bfloat16"


def _dtype_bytes(config: dict, model: Any) -> int:
    import mlx.core as mx

    if any(k in config for k in ("torch_dtype", "dtype")) or "text_config" in config:
        return getattr(mx, _dtype_name(config)).size
    from mlx.utils import tree_flatten

    for _, v in tree_flatten(model.parameters()):
        if mx.issubdtype(v.dtype, mx.floating):
            return v.dtype.size
    return 2


def _cast(model: Any, dtype: Any) -> None:
    """Cast floating parameters like ``mlx_lm.convert`` (respecting ``cast_predicate``)."""
    import mlx.core as mx
    from mlx.utils import tree_map_with_path

    cast_predicate = getattr(model, "cast_predicate", lambda _: True)

    def cast(path, v):
        if cast_predicate(path) and mx.issubdtype(v.dtype, mx.floating):
            return v.astype(dtype)
        return v

    model.update(tree_map_with_path(cast, model.parameters()))


def _read_safetensors_header(file: Path) -> dict:
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > 100_000_000:
            raise ModelSpecError(f"{file}: implausible safetensors header size {n}")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def _placeholder_weights(directory: Path, model: Any) -> dict | None:
    """Checkpoint tensors as lazy zero arrays (names, shapes, dtypes from the headers),
    passed through the model's ``sanitize`` like the loader does. Nothing is allocated."""
    import mlx.core as mx

    weights = {}
    for file in sorted(directory.glob("model*.safetensors")) or sorted(directory.glob("*.safetensors")):
        try:
            header = _read_safetensors_header(file)
        except (OSError, ValueError, struct.error) as exc:
            raise ModelSpecError(f"{file}: unreadable safetensors header ({exc})") from None
        for key, info in header.items():
            dtype = getattr(mx, _ST_DTYPES.get(str(info.get("dtype")), "uint8"))
            weights[key] = mx.zeros(tuple(info.get("shape", ())), dtype=dtype)
    if not weights:
        return None
    if hasattr(model, "sanitize"):
        try:
            weights = model.sanitize(weights)
        except Exception:  # noqa: BLE001 - a sanitize that needs real values: fall back to the config rule
            return None
    return weights


def _quantization(config: dict) -> dict | None:
    """The quantization parameters mlx-lm's loader would apply, or None."""
    if config.get("quantization") is not None:
        return config["quantization"]
    qc = config.get("quantization_config") or _text_config(config).get("quantization_config")
    if not isinstance(qc, dict):
        return None
    method = qc.get("quant_method")
    if method == "mxfp4":
        return {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    if method == "mxfp8":
        return {"group_size": 32, "bits": 8, "mode": "mxfp8"}
    if method == "fp8" and qc.get("scale_fmt") == "ue8m0" and list(qc.get("weight_block_size", ())) == [32, 32]:
        return {"group_size": 32, "bits": 8, "mode": "mxfp8"}
    if method == "compressed-tensors":
        from mlx_lm.utils import _compressed_tensors_quantization

        try:
            return _compressed_tensors_quantization(qc)
        except ValueError as exc:
            raise ModelSpecError(f"config.quantization_config: {exc}") from None
    if method == "modelopt":
        settings = qc.get("quantization", qc)
        algo = settings.get("quant_algo")
        if algo != "NVFP4":
            raise ModelSpecError(f"config.quantization_config: unsupported modelopt quant_algo {algo!r}")
        return {"group_size": settings.get("group_size", 16), "bits": 4, "mode": "nvfp4"}
    if method in ("awq", "gptq"):
        return {"group_size": qc.get("group_size", 128), "bits": qc.get("bits", 4), "mode": "affine"}
    if method == "bitnet":
        return {"bitnet": qc}
    return None  # e.g. block fp8: mlx-lm dequantizes to the float dtype in sanitize


def _quantize(model: Any, config: dict, weights: dict | None, nn: Any) -> None:
    q = _quantization(config)
    if q is None:
        return
    if "bitnet" in q:
        from mlx_lm.models.bitlinear_layers import bitnet_quantize

        bitnet_quantize(model, q["bitnet"])
        return
    try:
        group_size, bits = int(q["group_size"]), int(q["bits"])
    except (KeyError, TypeError, ValueError):
        raise ModelSpecError(f"config.quantization must give group_size and bits, got {q!r}") from None
    mode = q.get("mode", "affine")
    model_predicate = getattr(model, "quant_predicate", None)

    def predicate(path, module):
        if path in q:  # per-module override written by mlx_lm.convert
            return q[path]
        if not hasattr(module, "to_quantized"):
            return False
        if weights is not None:  # the loader's rule: quantized iff the checkpoint has scales
            if f"{path}.scales" not in weights:
                return False
            from mlx_lm.utils import infer_quant_config

            return infer_quant_config(path, module, weights)
        weight = getattr(module, "weight", None)
        if weight is not None and weight.shape[-1] % group_size != 0:  # the converter's rule
            return False
        return model_predicate(path, module) if model_predicate is not None else True

    nn.quantize(model, group_size=group_size, bits=bits, mode=mode, class_predicate=predicate)


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
    text = _text_config(config)
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


def _kv_per_token(model: Any, layers: list, config: dict, text: dict, dtype_bytes: int) -> tuple[list, list]:
    """Per layer: (KV-cache bytes per token, sliding window or None)."""
    kinds = _cache_kinds(model, len(layers))
    kv, windows = [], []
    for layer, (kind, window) in zip(layers, kinds, strict=True):
        if kind == "state":
            kv.append(0)
            windows.append(None)
            continue
        kv.append(_kv_width(layer, config, text) * dtype_bytes)
        windows.append(window)
    return kv, windows


def _cache_kinds(model: Any, n: int) -> list[tuple[str, int | None]]:
    """("kv", window or None) or ("state", None) per layer, from ``model.make_cache()``."""
    make = getattr(model, "make_cache", None)
    if make is None:
        return [("kv", None)] * n
    try:
        caches = make()
    except Exception:  # noqa: BLE001 - any failure: assume full attention everywhere
        return [("kv", None)] * n
    if not isinstance(caches, list) or len(caches) != n:
        return [("kv", None)] * n
    out = []
    for c in caches:
        name = type(c).__name__
        if "Rotating" in name and getattr(c, "max_size", None):
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
