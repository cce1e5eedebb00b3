"""GGUF model files: config, tokenizer and lazily read, per-stage weights for mlx-lm.

The file is memory-mapped with the ``gguf`` package (llama.cpp's reader), so only
the tensors a stage asks for are ever read from disk.

Quantized tensors of the types MLX's affine quantization can represent exactly are
repacked, bit for bit, into MLX's layout (``uint32`` words, 32-element groups,
``w = scale * q + bias``), the same layout ``mx.load`` produces for GGUF:

* Q4_0 (18-byte blocks: f16 d, 16 bytes of nibbles): ``w = d * (q - 8)`` -> bits 4,
  scale d, bias -8d;
* Q4_1 (20-byte blocks: f16 d, f16 m, 16 bytes of nibbles): ``w = d * q + m`` -> bits 4,
  scale d, bias m;
* Q8_0 (34-byte blocks: f16 d, 32 int8): ``w = d * q`` -> bits 8, scale d, bias -128d
  on ``q + 128``.

In a block, byte j holds element j in its low nibble and element j + 16 in its high
nibble (ggml-quants.c, ``dequantize_row_q4_1``). Other types (F32, F16, BF16,
K-quants) are dequantized to float32 by ``gguf.quants.dequantize``.

llama.cpp stores llama's q/k projection rows permuted for interleaved RoPE
(convert_hf_to_gguf.py, ``LlamaModel.permute``); they are un-permuted here so the
model runs with mlx-lm's default (non-traditional) RoPE, exactly as the Hugging
Face checkpoint would.

With ``dtype`` set (``float16``, ``bfloat16``, ``float32``) every quantized tensor is
dequantized with its scales and biases first cast to float32; for Q4_1 this gives
bit for bit the weights that transformers' GGUF loader produces.
"""

from __future__ import annotations

import functools
import importlib
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from ringlet.daemon.engine.gguf_index import TensorInfo
from ringlet.daemon.errors import ModelFormatError

log = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("llama",)
GROUP = 32

# GGUF name -> mlx-lm llama parameter name (blk.N.* -> model.layers.N.*)
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm.weight": "model.norm.weight",
    "output": "lm_head",
}
_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")


@dataclass
class GGUFModel:
    """An opened GGUF file: the mlx-lm config, tokenizer data and a tensor index.

    Attributes:
        path: the file.
        config: an mlx-lm ``config.json`` equivalent (``model_type``, sizes,
            ``quantization`` when tensors stay quantized).
        metadata: the GGUF key/value metadata (tokenizer arrays included).
        tensors: GGUF tensor name -> :class:`TensorInfo`.
    """

    path: Path
    config: dict
    metadata: dict
    tensors: dict
    quant_bits: dict[str, int] = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return int(self.config["num_hidden_layers"])


def _field_value(reader, key: str):
    f = reader.fields.get(key)
    if f is None:
        return None
    return f.contents()


@functools.lru_cache(maxsize=4)
def open_gguf(path: Path) -> GGUFModel:
    """Open a GGUF file (memory-mapped; cached per path) and derive the mlx-lm config.

    Raises:
        ModelFormatError: not a GGUF file, truncated (a tensor extends past the end
            of the file), or an architecture other than those supported.
    """
    from ringlet.daemon.engine import gguf_index

    size = path.stat().st_size
    found = gguf_index.load(path)
    if found is None:
        found = _parse(path)
        gguf_index.store(path, *found)
    meta, tensors = found
    for t in tensors.values():
        if t.data_offset + t.n_bytes > size:
            raise ModelFormatError(
                f"{path}: truncated GGUF file: tensor {t.name} needs bytes up to "
                f"{t.data_offset + t.n_bytes}, file has {size}"
            )
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelFormatError(
            f"{path}: GGUF architecture {arch!r} is not supported (supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}); an MLX/Hugging Face directory of it may work"
        )
    def need(key: str):
        value = meta.get(f"{arch}.{key}")
        if value is None:
            raise ModelFormatError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return value

    n_head = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    n_kv = int(meta.get(f"{arch}.attention.head_count_kv") or n_head)
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // n_head)
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or ())
    config = {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(need("block_count")),
        "intermediate_size": int(need("feed_forward_length")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base") or 10000.0),
        "vocab_size": int(vocab),
        "max_position_embeddings": int(meta.get(f"{arch}.context_length") or 4096),
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    model = GGUFModel(path=path, config=config, metadata=meta, tensors=tensors)
    return model


def model_classes(config: dict) -> tuple[type, type]:
    """mlx-lm's ``(Model, ModelArgs)`` classes for a config :func:`open_gguf` derived.

    Its ``model_type`` is always the name of an mlx-lm model module (``llama``; see
    :data:`SUPPORTED_ARCHITECTURES`), which mlx-lm does not remap, so the module is
    imported directly rather than through ``mlx_lm.utils._get_classes``: importing
    ``mlx_lm.utils`` imports transformers (about 1 s of CPU), which a process that
    never tokenizes (a tensor rank, a stage serving no API call) need not pay.
    """
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    return module.Model, module.ModelArgs


def _parse(path: Path) -> tuple[dict, dict[str, TensorInfo]]:
    """Metadata and tensor index of a GGUF file, read with the ``gguf`` package's reader
    (seconds for a large vocabulary: it decodes every tokenizer string).

    Raises:
        ModelFormatError: not a readable GGUF file.
    """
    import gguf

    try:
        reader = gguf.GGUFReader(str(path), "r")
    except Exception as exc:  # the reader raises ValueError, struct.error, IndexError...
        raise ModelFormatError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from None
    tensors = {t.name: TensorInfo(t.name, t.tensor_type, tuple(int(s) for s in t.shape.tolist()), int(t.n_bytes),
                                  int(t.data_offset), t.data.dtype.str, tuple(int(s) for s in t.data.shape))
               for t in reader.tensors}
    return {key: _field_value(reader, key) for key in reader.fields}, tensors


# --- quantized block repacking -------------------------------------------------------------

def _pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Pack unsigned ``bits``-wide values (rows, n), ``uint8``, into uint32 words
    (rows, n * bits / 32), element i of a word at bit ``bits * i`` (MLX affine layout).

    Little-endian words make this byte packing: 8-bit values are the bytes
    themselves; 4-bit values pair up as ``low | high << 4``. Only ``uint8``
    temporaries are made, so a large embedding repacks without a 4x blow-up.
    """
    rows = q.shape[0]
    if bits == 8:
        packed = np.ascontiguousarray(q, dtype=np.uint8)
    elif bits == 4:
        q = q.reshape(rows, -1, 2)
        packed = np.ascontiguousarray(q[..., 0] | (q[..., 1] << 4), dtype=np.uint8)
    else:
        raise ValueError(f"cannot pack {bits}-bit values")
    return packed.reshape(rows, -1).view("<u4")


def repack(raw: np.ndarray, type_name: str, rows: int, cols: int):
    """Repack one quantized GGUF matrix into MLX's affine layout.

    Args:
        raw: the tensor's bytes, ``uint8`` of shape (rows, bytes per row).
        type_name: ``"Q4_0"``, ``"Q4_1"`` or ``"Q8_0"``.
        rows, cols: the matrix shape (output features, input features).

    Returns:
        ``(weight uint32 (rows, cols*bits/32), scales f16 (rows, cols/32),
        biases f16 (rows, cols/32), bits)`` as NumPy arrays.
    """
    nb = cols // GROUP
    if type_name == "Q4_1":
        blocks = raw.reshape(rows, nb, 20)
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0]
        qs = blocks[..., 4:20]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
        return _pack(q.reshape(rows, cols), 4), d, m, 4
    if type_name == "Q4_0":
        blocks = raw.reshape(rows, nb, 18)
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
        qs = blocks[..., 2:18]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
        return _pack(q.reshape(rows, cols), 4), d, (d * np.float16(-8)).astype(np.float16), 4
    if type_name == "Q8_0":
        blocks = raw.reshape(rows, nb, 34)
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
        # int8 -> offset binary: q + 128 == q ^ 0x80 on the two's-complement byte
        qs = blocks[..., 2:34] ^ np.uint8(0x80)
        return _pack(qs.reshape(rows, cols), 8), d, (d * np.float16(-128)).astype(np.float16), 8
    raise ValueError(f"no MLX affine layout for {type_name}")


AFFINE_TYPES = ("Q4_0", "Q4_1", "Q8_0")


def _read(path: Path, tensor) -> np.ndarray:
    """Read one tensor's bytes with a plain file read (not through the memory map), so
    the file pages do not stay in this process's resident set after the tensor is
    converted; returned with the reader's dtype and shape."""
    with open(path, "rb") as fh:
        fh.seek(tensor.data_offset)
        buf = fh.read(tensor.n_bytes)
    if len(buf) != tensor.n_bytes:
        raise ModelFormatError(f"{path}: truncated GGUF file: tensor {tensor.name} is cut short")
    return np.frombuffer(buf, dtype=np.dtype(tensor.data_dtype)).reshape(tensor.data_shape)


def _unpermute(a: mx.array, n_head: int) -> mx.array:
    """Inverse of llama.cpp's q/k row permutation.

    llama.cpp views each head's rows as (2, half) and stores them as (half, 2); this
    views the stored rows as (head, half, 2) and swaps back to (head, 2, half).
    """
    rows = a.shape[0]
    rest = a.shape[1:]
    return a.reshape(n_head, rows // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def load_tensor(model: GGUFModel, name: str, dtype: mx.Dtype | None) -> dict[str, mx.array]:
    """Read one GGUF tensor as mlx-lm parameter arrays.

    Returns ``{"weight": ...}`` or, for a quantized tensor kept quantized
    (``dtype is None``), ``{"weight", "scales", "biases"}``; with ``dtype`` set the
    weight is dequantized (scales and biases in float32) and cast to ``dtype``.
    Unquantized float tensors keep float32 when ``dtype is None``.
    """
    import gguf

    t = model.tensors[name]
    type_name = t.tensor_type.name
    shape = tuple(reversed(t.shape))  # GGUF lists dims fastest-first
    raw = _read(model.path, t)
    if type_name in AFFINE_TYPES and len(shape) == 2:
        w, s, b, bits = repack(raw, type_name, shape[0], shape[1])
        w, s, b = mx.array(w), mx.array(s), mx.array(b)
        if dtype is None:
            return {"weight": w, "scales": s, "biases": b, "_bits": bits}
        full = mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=GROUP, bits=bits)
        return {"weight": full if dtype == mx.float32 else full.astype(dtype)}
    if type_name in ("F32", "F16"):
        arr = mx.array(raw.reshape(shape))
    elif type_name == "BF16":
        arr = mx.array(raw.view(np.uint16).reshape(shape)).view(mx.bfloat16)
    else:
        arr = mx.array(gguf.quants.dequantize(raw, t.tensor_type).reshape(shape).astype(np.float32))
    target = dtype or arr.dtype
    return {"weight": arr if arr.dtype == target else arr.astype(target)}


def stage_tensor_names(model: GGUFModel, start: int, end: int, first: bool, last: bool) -> list[str]:
    """GGUF tensor names a stage holding layers ``[start, end)`` needs: its blocks, the
    embedding on the first stage, and on the last the final norm and the head (the
    embedding when tied)."""
    names = []
    for name in model.tensors:
        m = _BLK.match(name)
        if m:
            if start <= int(m.group(1)) < end:
                names.append(name)
        elif name == "token_embd.weight":
            if first or (last and model.config["tie_word_embeddings"]):
                names.append(name)
        elif name in ("output_norm.weight", "output.weight"):
            if last:
                names.append(name)
    return names


def mlx_name(gguf_name: str) -> str:
    """Map a GGUF tensor name (minus ``.weight``) to the mlx-lm llama module path."""
    base = gguf_name[: -len(".weight")] if gguf_name.endswith(".weight") else gguf_name
    m = _BLK.match(base)
    if m:
        layer, rest = m.group(1), m.group(2)
        target = _LAYER_NAMES.get(rest) or _LAYER_NAMES.get(rest + ".weight")
        if target is None:
            raise ModelFormatError(f"unexpected GGUF tensor {gguf_name}")
        target = target.removesuffix(".weight")
        return f"model.layers.{layer}.{target}"
    target = _GLOBAL_NAMES.get(base) or _GLOBAL_NAMES.get(gguf_name)
    if target is None:
        raise ModelFormatError(f"unexpected GGUF tensor {gguf_name}")
    return target.removesuffix(".weight")


def stage_weights(
    model: GGUFModel, start: int, end: int, first: bool, last: bool, dtype: mx.Dtype | None,
    skip: set[str] | frozenset[str] = frozenset(),
):
    """Yield ``(mlx parameter prefix, {"weight"[, "scales", "biases", "_bits"]})`` for every
    tensor of the stage except those named in ``skip``, reading each from disk only
    when reached. Dequantized weights (``dtype`` set) come from the machine's
    :mod:`~ringlet.daemon.engine.dequant_cache` when it has them, and are added to it
    when it has not."""
    from ringlet.daemon.engine.dequant_cache import DequantCache, group_of

    cache = DequantCache.open(model.path, dtype)
    groups: dict[str, list[str]] = {}
    whole: dict[str, bool] = {}  # no tensor of the group skipped: it may be written to the cache
    for name in stage_tensor_names(model, start, end, first, last):
        group = group_of(name)
        groups.setdefault(group, [])
        whole[group] = whole.get(group, True) and name not in skip
        if name not in skip:
            groups[group].append(name)
    for group, names in groups.items():
        if not names:
            continue
        cached = cache.load(group, names) if cache is not None else None
        if cached is not None:
            for name in names:
                yield mlx_name(name), {"weight": cached[name]}
            continue
        keep = cache is not None and whole[group]
        made: dict[str, mx.array] = {}
        for name in names:
            arrays = _stage_tensor(model, name, dtype)
            if keep:
                mx.eval(arrays["weight"])
                made[name] = arrays["weight"]
            yield mlx_name(name), arrays
        if keep:
            cache.store(group, made)


def _stage_tensor(model: GGUFModel, name: str, dtype: mx.Dtype | None) -> dict[str, mx.array]:
    """One tensor as the stage loads it: :func:`load_tensor`, with llama's q/k rows un-permuted."""
    arrays = load_tensor(model, name, dtype)
    if name.endswith("attn_q.weight") or name.endswith("attn_k.weight"):
        heads = model.config["num_attention_heads"] if "attn_q" in name else model.config["num_key_value_heads"]
        arrays = {k: (_unpermute(v, heads) if k != "_bits" else v) for k, v in arrays.items()}
    return arrays


def tokenizer_dict(model: GGUFModel) -> tuple[dict, dict]:
    """The tokenizer description transformers' GGUF converter expects, from metadata.

    Returns ``(tokenizer_dict, tokenizer_config)`` shaped like
    ``transformers.integrations.gguf.get_gguf_tokenizer`` returns (that function
    itself needs PyTorch to read the file; the metadata here comes from ``gguf``).
    """
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        _SPECIAL_TOKENS,
        GGUF_TOKENIZER_MAPPING,
    )

    meta = model.metadata
    grouped = {
        group: {name: meta[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in meta}
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tok, tok_config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tok.get("tokenizer_type") == "llama":
        tok_config.setdefault("add_bos_token", True)
    for name, key in _SPECIAL_TOKENS.items():
        token_id = meta.get(f"tokenizer.ggml.{key}")
        tok_config[name] = tok["tokens"][int(token_id)] if token_id is not None else None
    return tok, tok_config


def load_tokenizer(model: GGUFModel):
    """Build the model's tokenizer (with its chat template) as an mlx-lm ``TokenizerWrapper``.

    Raises:
        ModelFormatError: the file carries no tokenizer.
    """
    from mlx_lm.tokenizer_utils import (
        BPEStreamingDetokenizer,
        SPMStreamingDetokenizer,
        TokenizerWrapper,
    )
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    tok, tok_config = tokenizer_dict(model)
    if "tokens" not in tok:
        raise ModelFormatError(f"{model.path}: GGUF file carries no tokenizer")
    backend = _cached_backend(model.path)
    if backend is None:
        backend, _ = convert_gguf_tokenizer(model.metadata.get("general.architecture"), tok)
        _store_backend(model.path, backend)
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, **tok_config)
    detok = BPEStreamingDetokenizer if tok.get("tokenizer_type") == "gpt2" else SPMStreamingDetokenizer
    return TokenizerWrapper(hf, detok)


def _cached_backend(path: Path):
    """The ``tokenizers.Tokenizer`` converted earlier from this file, or ``None``
    (converting the GGUF vocabulary with transformers takes seconds; loading the saved
    JSON a fraction of that). A cache that cannot be read is ignored."""
    from tokenizers import Tokenizer

    from ringlet.daemon.engine.gguf_index import cache_file

    try:
        return Tokenizer.from_file(str(cache_file(path, "tokenizers")))
    except Exception:  # missing, corrupt or from another tokenizers version: convert again
        return None


def _store_backend(path: Path, backend) -> None:
    """Save a converted tokenizer for :func:`_cached_backend` (atomically; failures ignored)."""
    from ringlet.daemon.engine.gguf_index import cache_file
    from ringlet.daemon.paths import write_atomically

    write_atomically(cache_file(path, "tokenizers"), backend.save)
