"""Make a freshly built mlx-lm model look like its checkpoint, without reading weights: dtype and quantization.

MLX arrays are lazy, so the random initial parameters of a model instantiated
from its config are never materialised, yet once these steps ran every
parameter has its final shape and dtype (used by
:func:`~ringlet.daemon.engine.modelspec.model_spec_from_config`):

* floating parameters are cast to the checkpoint dtype (``torch_dtype`` /
  ``dtype``, default bfloat16), honouring the model's ``cast_predicate`` exactly as
  ``mlx_lm.convert`` does (:func:`cast_parameters`);
* quantization is applied the way ``mlx_lm.utils.load_model`` does (:func:`quantize`): a
  ``quantization`` block (per-module overrides included), or a legacy
  ``quantization_config`` (mxfp4, mxfp8, ue8m0 fp8, compressed-tensors, modelopt
  nvfp4, awq/gptq; other fp8 checkpoints are dequantized by mlx-lm and stay in the
  float dtype). Which modules are quantized: the loader decides from the
  ``<path>.scales`` tensors present in the checkpoint -- when the model directory
  has ``*.safetensors`` files their headers (names, shapes, dtypes only) are read
  and fed through the model's ``sanitize`` as lazy placeholders
  (:func:`placeholder_weights`), so the decision is the loader's own; without
  weights, mlx-lm's converter rule is used (every module with ``to_quantized``
  whose input size is a multiple of the group size, filtered by the model's
  ``quant_predicate``).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from ringlet.daemon.engine.model_config import ModelSpecError, text_config

__all__ = ["cast_parameters", "placeholder_weights", "quantize"]

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


def cast_parameters(model: Any, dtype: Any) -> None:
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


def placeholder_weights(directory: Path, model: Any) -> dict | None:
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
    qc = config.get("quantization_config") or text_config(config).get("quantization_config")
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


def quantize(model: Any, config: dict, weights: dict | None, nn: Any) -> None:
    """Quantize ``model`` in place as mlx-lm's loader would (``weights``: the checkpoint's placeholders, or None)."""
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
