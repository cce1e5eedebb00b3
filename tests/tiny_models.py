"""Tiny random-weight mlx-lm models of several architectures, saved as MLX directories.

Each config is small (4 decoder layers, hidden size 64) but exercises the
architecture's real code: grouped-query attention, q/k norms (qwen3), mixture of
experts (qwen3_moe, deepseek_v3), multi-head latent attention and a dense first
layer (deepseek_v3), tied and untied heads.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

NUM_LAYERS = 4

CONFIGS: dict[str, dict] = {
    "llama": {
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": NUM_LAYERS, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": 160,
        "max_position_embeddings": 256, "rope_theta": 10000.0, "tie_word_embeddings": False,
    },
    "qwen3": {
        "model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": NUM_LAYERS, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
        "vocab_size": 160, "max_position_embeddings": 256, "rope_theta": 10000.0, "tie_word_embeddings": True,
    },
    "qwen3_moe": {
        "model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": NUM_LAYERS, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4,
        "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [0], "moe_intermediate_size": 32,
        "rms_norm_eps": 1e-6, "vocab_size": 160, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "max_position_embeddings": 256, "norm_topk_prob": True,
    },
    "deepseek_v3": {
        "model_type": "deepseek_v3", "vocab_size": 160, "hidden_size": 64, "intermediate_size": 128,
        "moe_intermediate_size": 32, "num_hidden_layers": NUM_LAYERS, "num_attention_heads": 4,
        "num_key_value_heads": 4, "n_shared_experts": 1, "n_routed_experts": 4, "routed_scaling_factor": 2.5,
        "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8, "v_head_dim": 16, "qk_nope_head_dim": 16,
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True, "n_group": 2,
        "topk_group": 1, "num_experts_per_tok": 2, "moe_layer_freq": 1, "first_k_dense_replace": 1,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    },
}


def save_char_tokenizer(directory: Path, vocab_size: int) -> None:
    """A character-level tokenizer (``tokenizers`` WordLevel) over printable ASCII, with
    ``<unk>``, ``<s>``, ``</s>`` and a minimal chat template, so tiny models run end to end."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    chars = [chr(c) for c in range(32, 127)]
    vocab = {tok: i for i, tok in enumerate(["<unk>", "<s>", "</s>", *chars])}
    assert len(vocab) <= vocab_size
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.save(str(directory / "tokenizer.json"))
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant: "
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "bos_token": "<s>",
        "eos_token": "</s>", "chat_template": template}))


def make_tiny_model(arch: str, directory: Path, seed: int = 0, config: dict | None = None) -> Path:
    """Build ``arch`` (or ``config``, mlx-lm ``config.json`` form) with random float32
    weights and save ``config.json``, ``model.safetensors`` and a character-level tokenizer."""
    from mlx_lm.utils import _get_classes

    config = config or CONFIGS[arch]
    mx.random.seed(seed)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    params = dict(tree_flatten(model.parameters()))
    # Random init leaves some biases/norms at constants; perturb everything so a
    # misrouted tensor cannot go unnoticed.
    params = {k: (v + 0.02 * mx.random.normal(v.shape)).astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating)
              else v for k, v in params.items()}
    directory.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(directory / "model.safetensors"), params)
    (directory / "config.json").write_text(json.dumps(config))
    save_char_tokenizer(directory, config["vocab_size"])
    return directory


def sharded_model_files(arch: str = "llama", seed: int = 0, config: dict | None = None,
                        directory: Path | None = None, bits: int | None = None) -> dict[str, bytes]:
    """A tiny random model as a Hub repository holds it: ``config.json``, the character
    tokenizer, and the weights split into one safetensors file per decoder layer, one for
    the embedding and one for the final norm and head, with
    ``model.safetensors.index.json`` (``weight_map``) naming the file of every tensor.
    ``bits``: quantized as ``mlx_lm.convert`` does (``nn.quantize``, group size 32, and a
    ``quantization`` block in the config).
    Returns ``{file name: bytes}``; with ``directory``, the files are also left there (a
    local copy to load the same model from).

    File names follow the Hub's ``model-0000K-of-0000N.safetensors``: K = 1 holds the
    embedding, K = 2 + i layer i, K = N the norm and the head (see :func:`file_of_layer`).
    """
    import tempfile

    from mlx_lm.utils import _get_classes

    config = dict(config or CONFIGS[arch])
    layers = config["num_hidden_layers"]
    mx.random.seed(seed)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    params = {k: (v + 0.02 * mx.random.normal(v.shape)).astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating)
              else v for k, v in tree_flatten(model.parameters())}
    if bits:
        import mlx.nn as nn

        model.load_weights(list(params.items()))
        nn.quantize(model, group_size=32, bits=bits)
        config["quantization"] = {"group_size": 32, "bits": bits}
        params = dict(tree_flatten(model.parameters()))
    n = layers + 2
    groups: dict[str, dict] = {}
    for name, value in params.items():
        if ".layers." in name:
            k = 2 + int(name.split(".layers.")[1].split(".")[0])
        elif "embed_tokens" in name:
            k = 1
        else:
            k = n
        groups.setdefault(f"model-{k:05d}-of-{n:05d}.safetensors", {})[name] = value
    out: dict[str, bytes] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for file, tensors in sorted(groups.items()):
            mx.save_safetensors(str(Path(tmp) / file), tensors, metadata={"format": "mlx"})
            out[file] = (Path(tmp) / file).read_bytes()
        save_char_tokenizer(Path(tmp), config["vocab_size"])
        for extra in ("tokenizer.json", "tokenizer_config.json"):
            out[extra] = (Path(tmp) / extra).read_bytes()
    index = {"metadata": {"total_size": sum(v.nbytes for v in params.values())},
             "weight_map": {name: file for file, tensors in groups.items() for name in sorted(tensors)}}
    out["model.safetensors.index.json"] = json.dumps(index, indent=2, sort_keys=True).encode()
    out["config.json"] = json.dumps(config).encode()
    if directory is not None:
        directory.mkdir(parents=True, exist_ok=True)
        for name, data in out.items():
            (directory / name).write_bytes(data)
    return out


def file_of_layer(layer: int, num_layers: int = NUM_LAYERS) -> str:
    """The file of :func:`sharded_model_files` holding decoder layer ``layer``."""
    return f"model-{2 + layer:05d}-of-{num_layers + 2:05d}.safetensors"


def stage_file_names(start: int, end: int, num_layers: int = NUM_LAYERS) -> set[str]:
    """The safetensors files of :func:`sharded_model_files` a stage ``[start, end)`` of the
    untied llama needs, by the layout alone: its layers' files, the embedding's on the
    first stage, the norm and head's on the last."""
    n = num_layers + 2
    names = {file_of_layer(i, num_layers) for i in range(start, end)}
    if start == 0:
        names.add(f"model-00001-of-{n:05d}.safetensors")
    if end == num_layers:
        names.add(f"model-{n:05d}-of-{n:05d}.safetensors")
    return names


def whole_model_greedy(path: Path, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy token ids of mlx-lm's whole model alone (``mlx_lm.utils.load_model``,
    ``make_prompt_cache``, its forward): the prompt in one forward, then one token a step.
    The independent reference of the tests that run tiny models split."""
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(path))
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)
    out: list[int] = []
    for _ in range(n):
        out.append(mx.argmax(logits[0, -1]).item())
        logits = model(mx.array([[out[-1]]]), cache=cache)
    return out


def make_chat_model(arch: str, directory: Path, config: dict) -> Path:
    """:func:`make_tiny_model` for end-to-end chats over token ids: ``config``'s
    vocabulary should be the character tokenizer's 98 ids (a generated id is then a valid
    prompt id of the next turn), and the head's rows of the special tokens (``<unk>``,
    ``<s>``, ``</s>``) are zeroed: their logit is exactly 0, below the largest of the 95
    random others, so no greedy stream stops early at ``</s>``."""
    path = make_tiny_model(arch, directory, config=config)
    weights = mx.load(str(path / "model.safetensors"))
    # an untied head, talkie.py's bare ``lm_head`` parameter, or the tied embedding
    head = next(k for k in ("lm_head.weight", "lm_head", "model.embed_tokens.weight") if k in weights)
    weights[head] = mx.concatenate([mx.zeros_like(weights[head][:3]), weights[head][3:]])
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    return path
