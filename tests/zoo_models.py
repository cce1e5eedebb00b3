"""Tiny configs, one per text architecture of mlx-lm, for the split zoo (tests/engine/test_zoo.py).

Written by us, small (hidden 64, 4 heads, vocabulary 160), with enough layers for two
periods of the architecture's layer pattern and sliding windows of 4 tokens (the zoo's
prompt is 7 tokens and 5 decode steps, so the windows rotate). Built and saved by
:func:`tiny_models.make_tiny_model` (random float32 weights through mlx-lm's own classes).
"""

from __future__ import annotations

WINDOW = 4

_BASE = {
    "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "rms_norm_eps": 1e-5, "vocab_size": 160, "max_position_embeddings": 256,
    "rope_theta": 10000.0, "tie_word_embeddings": False,
}


def _cfg(model_type: str, layers: int, **extra) -> dict:
    return {"model_type": model_type, **_BASE, "num_hidden_layers": layers, **extra}


ZOO: dict[str, dict] = {
    "llama": _cfg("llama", 4),
    "llama_sliding": _cfg("llama", 4, layer_types=["sliding_attention", "full_attention"] * 2,
                          sliding_window=WINDOW),
    "mistral": _cfg("mistral", 4, sliding_window=None),
    "qwen2": _cfg("qwen2", 4, tie_word_embeddings=True),
    "qwen3": _cfg("qwen3", 4, tie_word_embeddings=True),
    "qwen3_moe": _cfg("qwen3_moe", 4, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                      mlp_only_layers=[0], moe_intermediate_size=32, norm_topk_prob=True),
    "phi3": _cfg("phi3", 4),
    "olmo2": _cfg("olmo2", 4),
    "olmo3": _cfg("olmo3", 4, sliding_window=WINDOW,
                  layer_types=["sliding_attention", "full_attention"] * 2),
    "cohere2": _cfg("cohere2", 4, sliding_window=WINDOW, sliding_window_pattern=2, layer_norm_eps=1e-5,
                    logit_scale=0.0625),
    "granite": _cfg("granite", 4, logits_scaling=2.0, attention_multiplier=0.25, embedding_multiplier=3.0,
                    residual_multiplier=0.5, attention_bias=False, mlp_bias=False),
    "granitemoehybrid": _cfg("granitemoehybrid", 4, attention_bias=False, embedding_multiplier=3.0,
                             attention_multiplier=0.25, logits_scaling=2.0, residual_multiplier=0.5,
                             layer_types=["mamba", "attention"] * 2, num_local_experts=4,
                             num_experts_per_tok=2, shared_intermediate_size=64, mamba_n_heads=4,
                             mamba_d_head=16, mamba_proj_bias=False, mamba_d_state=8, mamba_d_conv=4,
                             mamba_n_groups=1, mamba_conv_bias=True),
    "exaone4": _cfg("exaone4", 4, rope_scaling=None, sliding_window=WINDOW, sliding_window_pattern="LG"),
    "gemma3_text": _cfg("gemma3_text", 6, sliding_window=WINDOW, sliding_window_pattern=3,
                        query_pre_attn_scalar=16, rope_local_base_freq=10000.0),
    "gpt_oss": _cfg("gpt_oss", 4, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
                    layer_types=["sliding_attention", "full_attention"] * 2),
    "qwen3_next": _cfg("qwen3_next", 4, linear_num_value_heads=4, linear_num_key_heads=2,
                       linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                       num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                       shared_expert_intermediate_size=64, mlp_only_layers=[], moe_intermediate_size=32,
                       partial_rotary_factor=0.25, full_attention_interval=2),
    "lfm2": {"model_type": "lfm2", "vocab_size": 160, "hidden_size": 64, "num_hidden_layers": 5,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
             "norm_eps": 1e-5, "conv_bias": False, "conv_L_cache": 3, "block_dim": 64,
             "block_multiple_of": 16, "block_ffn_dim_multiplier": 1.0, "block_auto_adjust_ff_dim": False,
             "block_ff_dim": 128, "rope_theta": 10000.0,
             "layer_types": ["conv", "full_attention", "conv", "conv", "full_attention"]},
    "glm4_moe": _cfg("glm4_moe", 4, moe_intermediate_size=32, norm_topk_prob=True, n_group=1, topk_group=1,
                     n_shared_experts=1, n_routed_experts=4, routed_scaling_factor=1.0, num_experts_per_tok=2,
                     first_k_dense_replace=1, rope_scaling=None, use_qk_norm=True, attention_bias=False,
                     partial_rotary_factor=0.5),
    "deepseek_v3": {"model_type": "deepseek_v3", "vocab_size": 160, "hidden_size": 64, "intermediate_size": 128,
                    "moe_intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
                    "num_key_value_heads": 4, "n_shared_experts": 1, "n_routed_experts": 4,
                    "routed_scaling_factor": 2.5, "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8,
                    "v_head_dim": 16, "qk_nope_head_dim": 16, "topk_method": "noaux_tc",
                    "scoring_func": "sigmoid", "norm_topk_prob": True, "n_group": 2, "topk_group": 1,
                    "num_experts_per_tok": 2, "moe_layer_freq": 1, "first_k_dense_replace": 1,
                    "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0},
    "mixtral": _cfg("mixtral", 4, num_local_experts=4, num_experts_per_tok=2),
    "starcoder2": _cfg("starcoder2", 4, norm_epsilon=1e-5, tie_word_embeddings=True),
    "qwen2_moe": _cfg("qwen2_moe", 4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64),
    "olmoe": _cfg("olmoe", 4, num_experts=4, num_experts_per_tok=2),
    "smollm3": _cfg("smollm3", 4, no_rope_layer_interval=2),
    "seed_oss": _cfg("seed_oss", 4),
    "gemma": _cfg("gemma", 4),
    "gemma2": _cfg("gemma2", 4, query_pre_attn_scalar=16, attn_logit_softcapping=50.0,
                   final_logit_softcapping=30.0),
    "granitemoe": _cfg("granitemoe", 4, logits_scaling=2.0, attention_multiplier=0.25, embedding_multiplier=3.0,
                       residual_multiplier=0.5, attention_bias=False, num_local_experts=4,
                       num_experts_per_tok=2),
    "minicpm": _cfg("minicpm", 4, dim_model_base=32, scale_depth=1.4, scale_emb=12.0),
    "minicpm3": _cfg("minicpm3", 4, dim_model_base=32, scale_depth=1.4, scale_emb=12.0, q_lora_rank=24,
                     qk_nope_head_dim=16, qk_rope_head_dim=8, kv_lora_rank=16,
                     rope_scaling={"original_max_position_embeddings": 256, "short_factor": [1.0] * 4,
                                   "long_factor": [1.0] * 4}),
    "llama4_text": _cfg("llama4_text", 4, intermediate_size_mlp=128, no_rope_layers=[1, 1, 1, 0],
                        use_qk_norm=True),
}
