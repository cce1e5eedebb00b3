"""One step's activations a stage plans for (#43 must-have 2: the plan's figure is the
node's real footprint). Expected values are worked by hand from the terms in
daemon/engine/work_space.py's docstring: per chunk token (2 + 4 hop copies) x hidden +
the query, key and value projections + 3 x the MLP width; the scores of every head against
the context; 16 tokens of logits; all in float32 (4 bytes), times 1.5."""

from __future__ import annotations

from ringlet.daemon.engine.work_space import tokenizer_bytes, work_space_bytes

SMOLLM2_135M = {"model_type": "llama", "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
                "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152}


def test_the_default_model_by_hand():
    # 256-token chunks (the CPU default), 512 tokens of context:
    # 256 x (6 x 576 + 9 x 64 + 2 x 3 x 64 + 3 x 1536) = 256 x 9,024 = 2,310,144
    # + 9 x 256 x 512 = 1,179,648 scores + 16 x 49,152 = 786,432 logits = 4,276,224 floats
    assert work_space_bytes(SMOLLM2_135M, 256, 512) == 4_276_224 * 4 * 3 // 2 == 25_657_344


def test_the_cgroup_tests_llama_by_hand():
    # tests/probes/test_cgroup_cluster.py: hidden 1024, MLP 3072, 8 heads of 128, 2 KV heads,
    # 98 tokens; 256-token chunks at a 256-token context:
    # 256 x (6,144 + 1,024 + 512 + 9,216) = 4,325,376 + 8 x 256 x 256 = 524,288 + 1,568
    config = {"model_type": "llama", "hidden_size": 1024, "intermediate_size": 3072, "num_attention_heads": 8,
              "num_key_value_heads": 2, "vocab_size": 98}
    assert work_space_bytes(config, 256, 256) == 4_851_232 * 6 == 29_107_392


def test_a_mixture_of_experts_counts_its_routed_and_shared_experts():
    # DeepSeek-V3-like widths, nested as a text_config: hidden 7168, 128 heads of 56 (no
    # head_dim given), dense MLP 18,432 wide, experts 2048 wide (8 routed + 2 shared): the
    # wider of the two counts; 64-token chunks, 4,096 tokens of context, 129,280 tokens.
    text = {"hidden_size": 7168, "num_attention_heads": 128, "num_key_value_heads": 128, "intermediate_size": 18432,
            "moe_intermediate_size": 2048, "num_experts_per_tok": 8, "n_shared_experts": 2, "vocab_size": 129280}
    # MoE width 2048 x 10 = 20,480 > 18,432. Per token: 6 x 7168 + 7168 + 2 x 7168 + 3 x 20480 = 125,952
    # 64 x 125,952 = 8,060,928; scores 128 x 64 x 4096 = 33,554,432; logits 16 x 129,280 = 2,068,480
    assert work_space_bytes({"model_type": "x", "text_config": text}, 64, 4096) == 43_683_840 * 6


def test_no_hidden_size_is_no_work_space():
    assert work_space_bytes({"model_type": "llama"}, 256, 512) == 0


def test_the_tokenizer_is_planned_by_its_vocabulary():
    # 1.5 KiB per token (SmolLM2's 49,152-token tokenizer took 70-72 MB once built), 8 MiB at least
    assert tokenizer_bytes(SMOLLM2_135M) == 49_152 * 1536 == 75_497_472
    assert tokenizer_bytes({"model_type": "llama", "vocab_size": 98}) == 8 << 20
    assert tokenizer_bytes({"model_type": "x", "text_config": {"vocab_size": 151_936}}) == 151_936 * 1536
