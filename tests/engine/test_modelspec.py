"""ModelSpec from config.json alone, checked against hand-computed byte counts.

Conventions in the hand computations: bfloat16 = 2 bytes; an affine-quantized
Linear(in -> out) with b bits and group g stores out x in x b / 8 bytes of packed
weights plus bf16 scales and biases of out x in / g entries each.
"""

import json

import mlx.core as mx
import pytest

from ringlet.daemon.engine.model_config import ModelSpecError
from ringlet.daemon.engine.modelspec import model_spec_from_config, model_spec_from_model

LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}

# Per llama layer (head_dim 16, 2 KV heads -> K/V width 32):
#   q 64x64 = 4096, k 64x32 = 2048, v 2048, o 4096, gate/up/down 3 x 64x128 = 24576, 2 norms x 64
#   = 36992 parameters = 73984 bytes in bf16.
LLAMA_LAYER_PARAMS = 4096 + 2048 + 2048 + 4096 + 3 * 8192 + 128


def test_llama_bf16():
    m = model_spec_from_config(LLAMA, context_tokens=100, name="tiny-llama")
    assert m.num_layers == 2
    assert m.layer_bytes == (2 * LLAMA_LAYER_PARAMS,) * 2 == (73984, 73984)
    assert m.layer_read_bytes == m.layer_bytes
    assert m.embedding_bytes == 256 * 64 * 2  # 32768
    assert m.tie_word_embeddings is True
    assert m.head_bytes == 64 * 2  # only the final norm: the head is the embedding
    assert m.kv_bytes_per_token_per_layer == ((32 + 32) * 2,) * 2  # K + V, bf16: 128
    assert m.flops_per_token_per_layer == (2.0 * LLAMA_LAYER_PARAMS,) * 2  # 73984
    assert m.head_flops_per_token == 2.0 * 256 * 64
    assert m.activation_bytes_per_token == 64 * 2
    assert m.context_tokens == 100 and m.name == "tiny-llama"


def test_llama_4bit_quantized():
    cfg = dict(LLAMA, quantization={"group_size": 32, "bits": 4})
    m = model_spec_from_config(cfg, context_tokens=10)
    # q: 64*64/2 = 2048 packed + scales/biases 2 x (64 x 2 groups x 2 B) = 512 -> 2560
    # k, v: 32*64/2 = 1024 + 2 x (32 x 2 x 2) = 256 -> 1280 each; o: 2560
    # gate, up: 128*64/2 = 4096 + 2 x (128 x 2 x 2) = 1024 -> 5120 each
    # down (in 128): 64*128/2 = 4096 + 2 x (64 x 4 x 2) = 1024 -> 5120; norms 256
    assert m.layer_bytes == (2560 + 1280 + 1280 + 2560 + 3 * 5120 + 256,) * 2 == (23296, 23296)
    # Embedding 256 x 64 quantized too: 8192 + 2 x (256 x 2 x 2) = 10240.
    assert m.embedding_bytes == 10240
    # FLOPs count logical parameters (packed size x 32 / bits): unchanged by quantization.
    assert m.flops_per_token_per_layer == (2.0 * LLAMA_LAYER_PARAMS,) * 2
    assert m.head_flops_per_token == 2.0 * 256 * 64


def test_qwen3_dense_with_explicit_head_dim():
    cfg = {
        "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "num_hidden_layers": 3, "vocab_size": 256,
        "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 4096,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }
    m = model_spec_from_config(cfg)
    # q 64 -> 4x32 = 8192, k 64 -> 2x32 = 4096, v 4096, o 128 -> 64 = 8192, q_norm + k_norm 32 + 32,
    # MLP 3 x 8192, 2 norms x 64: 49344 parameters = 98688 bytes.
    assert m.layer_bytes == (98688,) * 3
    assert m.embedding_bytes == 32768
    assert m.tie_word_embeddings is False
    assert m.head_bytes == 256 * 64 * 2 + 64 * 2  # lm_head + final norm = 32896
    assert m.kv_bytes_per_token_per_layer == ((64 + 64) * 2,) * 3  # 256
    assert m.context_tokens == 4096  # default: max_position_embeddings
    assert m.head_flops_per_token == 2.0 * 256 * 64


def test_qwen3_moe_counts_active_experts_only():
    cfg = {
        "model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 2,
        "num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "norm_topk_prob": True, "vocab_size": 256, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
        "max_position_embeddings": 1024, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }
    m = model_spec_from_config(cfg, context_tokens=16)
    # attention 4096 + 2048 + 2048 + 4096 + q_norm 16 + k_norm 16 = 12320; router 64 x 8 = 512;
    # experts 8 x (32x64 + 32x64 + 64x32) = 49152; norms 128 -> 62112 params = 124224 bytes.
    assert m.layer_bytes == (124224,) * 2
    # Per token only 2 of 8 experts: 12320 + 512 + 49152 / 4 + 128 = 25248 params.
    assert m.flops_per_token_per_layer == (2.0 * 25248,) * 2
    assert m.layer_read_bytes == (2 * 25248,) * 2
    assert m.kv_bytes_per_token_per_layer == ((32 + 32) * 2,) * 2


DSV3 = {
    "model_type": "deepseek_v3", "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 16,
    "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 16,
    "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8, "n_routed_experts": 4,
    "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "n_group": 1, "topk_group": 1, "num_hidden_layers": 2, "vocab_size": 256, "rms_norm_eps": 1e-6,
    "rope_theta": 10000, "max_position_embeddings": 2048, "tie_word_embeddings": False,
    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "routed_scaling_factor": 2.5,
    "norm_topk_prob": True, "torch_dtype": "bfloat16",
}
# MLA attention (mlx-lm deepseek_v3): q_a 64->32 = 2048, q_a_norm 32, q_b 32 -> 4x16 = 2048,
# kv_a 64 -> 16+8 = 1536, kv_a_norm 16, embed_q 4x16x8 = 512, unembed_out 4x8x16 = 512,
# o 32 -> 64 = 2048: 8752 parameters.
DSV3_ATTN = 2048 + 32 + 2048 + 1536 + 16 + 512 + 512 + 2048


def test_deepseek_v3_dense_then_moe_with_mla():
    m = model_spec_from_config(DSV3, context_tokens=64)
    # Layer 0 (dense, first_k_dense_replace = 1): 8752 + 3 x 64x128 + 2 x 64 = 33456 params.
    # Layer 1 (MoE): 8752 + router 4x64 + experts 4 x 3 x 1024 + shared 3 x 64x16 + norms 128
    #   = 24496 bf16 params, plus e_score_correction_bias: 4 float32 (kept by cast_predicate).
    assert m.layer_bytes == (2 * 33456, 2 * 24496 + 4 * 4) == (66912, 49008)
    # Active: 2 of 4 experts: 12288 / 2 = 6144 instead of 12288.
    assert m.flops_per_token_per_layer == (2.0 * 33456, 2.0 * (8752 + 256 + 4 + 6144 + 3072 + 128))
    assert m.layer_read_bytes == (66912, 49008 - 12288)
    # MLA caches the latent (16) and the rope key (8) per token: 24 x 2 bytes.
    assert m.kv_bytes_per_token_per_layer == (48, 48)
    assert m.embedding_bytes == 32768 and m.head_bytes == 32768 + 128


def test_kimi_k2_is_read_as_deepseek_v3():
    k2 = dict(DSV3, model_type="kimi_k2")
    assert model_spec_from_config(k2, context_tokens=64).layer_bytes == (66912, 49008)


def test_from_path_and_directory(tmp_path):
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.json").write_text(json.dumps(LLAMA))
    a = model_spec_from_config(tmp_path / "tiny", context_tokens=8)
    b = model_spec_from_config(tmp_path / "tiny" / "config.json", context_tokens=8)
    assert a.name == "tiny" and a.layer_bytes == b.layer_bytes == (73984, 73984)


def test_safetensors_headers_decide_what_is_quantized(tmp_path):
    # A 1-layer tied llama checkpoint whose MLP is 4-bit (group 32) but whose attention and
    # embedding stayed bf16 -- only the tensors' names and shapes tell.
    cfg = dict(LLAMA, num_hidden_layers=1, quantization={"group_size": 32, "bits": 4})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    bf16, u32 = mx.bfloat16, mx.uint32
    p = "model.layers.0."
    tensors = {
        "model.embed_tokens.weight": mx.zeros((256, 64), bf16),
        "model.norm.weight": mx.zeros((64,), bf16),
        p + "input_layernorm.weight": mx.zeros((64,), bf16),
        p + "post_attention_layernorm.weight": mx.zeros((64,), bf16),
        p + "self_attn.q_proj.weight": mx.zeros((64, 64), bf16),
        p + "self_attn.k_proj.weight": mx.zeros((32, 64), bf16),
        p + "self_attn.v_proj.weight": mx.zeros((32, 64), bf16),
        p + "self_attn.o_proj.weight": mx.zeros((64, 64), bf16),
    }
    for name, (out, inp) in {"gate_proj": (128, 64), "up_proj": (128, 64), "down_proj": (64, 128)}.items():
        tensors[p + f"mlp.{name}.weight"] = mx.zeros((out, inp * 4 // 32), u32)
        tensors[p + f"mlp.{name}.scales"] = mx.zeros((out, inp // 32), bf16)
        tensors[p + f"mlp.{name}.biases"] = mx.zeros((out, inp // 32), bf16)
    mx.save_safetensors(str(tmp_path / "model.safetensors"), tensors)
    m = model_spec_from_config(tmp_path, context_tokens=8)
    # attention bf16 12288 x 2 = 24576; MLP 3 x 5120 (as in the 4-bit test); norms 256.
    assert m.layer_bytes == (24576 + 3 * 5120 + 256,)
    assert m.embedding_bytes == 32768
    # Without the checkpoint, mlx-lm's converter rule would have quantized everything.
    assert model_spec_from_config(cfg, context_tokens=8).layer_bytes == (23296,)


def test_model_spec_from_a_built_model():
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(LLAMA)
    model = model_class(args_class.from_dict(LLAMA))
    model.set_dtype(mx.bfloat16)
    m = model_spec_from_model(model, context_tokens=32, name="built")
    assert m.layer_bytes == (73984, 73984)
    assert m.kv_bytes_per_token_per_layer == (128, 128)
    assert m.tie_word_embeddings is True


def test_plans_from_a_config():
    from ringlet.partitioning import NodeSpec, make_plan

    m = model_spec_from_config(DSV3, context_tokens=64)
    plan = make_plan([NodeSpec("a", 10**6, 1e9, 1e12), NodeSpec("b", 10**6, 1e9, 1e12)], [], m)
    assert plan.num_layers == 2 and len(plan.stages) in (1, 2)


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ({"hidden_size": 4}, "model_type"),
        ({"model_type": "no_such_arch"}, "not supported"),
        ({"model_type": "llama"}, "incomplete"),
    ],
)
def test_bad_configs_raise_a_clear_error(source, message):
    with pytest.raises(ModelSpecError, match=message):
        model_spec_from_config(source)


def test_missing_file(tmp_path):
    with pytest.raises(ModelSpecError, match="no such config"):
        model_spec_from_config(tmp_path / "nope")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelSpecError, match="not a readable JSON"):
        model_spec_from_config(tmp_path)


def test_sliding_windows_and_recurrent_states_are_sized_from_the_config():
    """Issue #33 point 4: a sliding-window layer holds at most its window, a recurrent
    layer a constant state. Hand computation, bfloat16 (2 bytes), from the configs:

    gpt_oss, layers sliding/full alternating, window 8, 2 KV heads of 16: K+V = 2 x 2 x 16
    x 2 = 128 bytes a token; at 100 tokens of context a sliding layer holds 8 of them (1,024
    bytes), a full one 100 (12,800).

    qwen3_next, full attention every 2nd layer (layers 1, 3), the others GatedDeltaNet
    (mlx-lm qwen3_next.py, gated_delta.py) with 2 key heads and 4 value heads of 16,
    convolution kernel 4: key_dim = 2 x 16 = 32, value_dim = 4 x 16 = 64, conv_dim = 2 x 32
    + 64 = 128; its state is a convolution state (1, 4 - 1, 128) bf16 = 768 bytes plus a
    recurrent state (1, 4, 16, 16) float32 = 4,096 bytes: 4,864 bytes whatever the context;
    an attention layer caches 2 KV heads x (16 + 16) x 2 = 128 bytes a token."""
    base = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "rms_norm_eps": 1e-5, "vocab_size": 160, "max_position_embeddings": 256,
            "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    gpt_oss = model_spec_from_config({**base, "model_type": "gpt_oss", "num_hidden_layers": 4, "num_local_experts": 4,
                                      "num_experts_per_tok": 2, "sliding_window": 8,
                                      "layer_types": ["sliding_attention", "full_attention"] * 2},
                                     context_tokens=100)
    assert gpt_oss.kv_window_tokens == (8, None, 8, None)
    assert gpt_oss.kv_bytes_per_token_per_layer == (128,) * 4 and gpt_oss.state_bytes_per_layer == (0,) * 4
    assert gpt_oss.kv_cache_bytes() == 2 * 8 * 128 + 2 * 100 * 128
    qwen3_next = model_spec_from_config(
        {**base, "model_type": "qwen3_next", "num_hidden_layers": 4, "linear_num_value_heads": 4,
         "linear_num_key_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
         "linear_conv_kernel_dim": 4, "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
         "shared_expert_intermediate_size": 64, "mlp_only_layers": [], "moe_intermediate_size": 32,
         "partial_rotary_factor": 0.25, "full_attention_interval": 2}, context_tokens=100)
    assert qwen3_next.kv_bytes_per_token_per_layer == (0, 128, 0, 128)
    assert qwen3_next.state_bytes_per_layer == (4864, 0, 4864, 0)
    assert qwen3_next.kv_cache_bytes() == 2 * 4864 + 2 * 100 * 128
    assert qwen3_next.kv_cache_bytes(10_000) == 2 * 4864 + 2 * 10_000 * 128  # the states stay constant
    from ringlet.partitioning.costs import CostModel

    assert CostModel(qwen3_next).memory[0, 2] == pytest.approx(sum(qwen3_next.layer_bytes[:2])
                                                               + qwen3_next.embedding_bytes + 4864 + 100 * 128)


def test_layers_that_cache_nothing_are_sized_at_nothing():
    """Issue #33 point 4 for cacheless.py's layers. Hand computation, bfloat16 (2 bytes):

    nemotron_h, blocks ``- M * E M *``: an attention block caches 2 KV heads x (16 + 16) x 2
    = 128 bytes a token; MLP (``-``) and MoE (``E``) blocks nothing; a mamba block a constant
    state: its convolution state (1, kernel 4 - 1, conv_dim) with conv_dim = 4 heads x 16 +
    2 x 1 group x 8 = 80, 3 x 80 x 2 = 480 bytes, plus an SSM state of 4 x 16 x 8 = 512
    elements of at least 2 bytes: at least 1,504 bytes.

    nemotron-nas, 4 heads of 16: layers 0 and 2 group 2 query heads per KV head (2 KV heads:
    128 bytes a token); layer 1's attention is a no-op and layer 3's a linear map: nothing."""
    from zoo_models import ZOO

    nemotron_h = model_spec_from_config({**ZOO["nemotron_h"], "torch_dtype": "bfloat16"}, context_tokens=100)
    assert nemotron_h.kv_bytes_per_token_per_layer == (0, 0, 128, 0, 0, 128)
    states = nemotron_h.state_bytes_per_layer
    assert states[1] == states[4] >= 1504 and [states[i] for i in (0, 2, 3, 5)] == [0] * 4
    assert nemotron_h.kv_cache_bytes() == 2 * states[1] + 2 * 100 * 128
    nas = model_spec_from_config({**ZOO["nemotron-nas"], "torch_dtype": "bfloat16"}, context_tokens=100)
    assert nas.kv_bytes_per_token_per_layer == (128, 0, 128, 0) and nas.state_bytes_per_layer == (0,) * 4


def test_the_default_gguf_models_kv_is_what_a_loaded_stage_allocates():
    """The Q4 GGUF keeps its norms float32, so its activations and KV are float32: the
    plan's KV per token must be mlx-lm's real cache's (3 KV heads x 64 x 2 x 4 B = 1,536 B
    per layer), not the float16 of its scales (#43: the plan's figure is the real footprint)."""
    from ringlet.daemon.engine import sources
    from ringlet.daemon.engine.stage import build_lazy_model, load_stage

    location = sources.resolve(None)
    model, config = build_lazy_model(location)
    spec = model_spec_from_model(model, context_tokens=512, config=config)
    assert spec.kv_bytes_per_token_per_layer[:2] == (1536, 1536)
    stage = load_stage(location, 0, 2)
    cache = stage.make_cache()
    mx.eval(stage(mx.array([[1, 2, 3, 4, 5, 6, 7, 8]]), cache))
    allocated = cache[0].keys.shape[2]  # mlx-lm allocates in steps of 256 tokens
    assert (cache[0].keys.nbytes + cache[0].values.nbytes) / allocated == 1536
    assert spec.activation_bytes_per_token == 576 * 4
