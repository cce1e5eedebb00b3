"""The random llama the memory-cgroup tests share (written once per test process: its page
cache is charged to the test's own cgroup, not to a daemon's), and mlx-lm's greedy answer
of the whole model to their prompt."""

from __future__ import annotations

import pytest
from tiny_models import make_chat_model, whole_model_greedy

#: 10 layers of 48 MiB (float32: hidden 1024, MLP 3072, 8 query and 2 key/value heads) and
#: the tests' 98-token vocabulary: 483 MB in all.
CGROUP_LLAMA = {
    "model_type": "llama", "hidden_size": 1024, "num_hidden_layers": 10, "intermediate_size": 3072,
    "num_attention_heads": 8, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": 98,
    "max_position_embeddings": 1024, "rope_theta": 10000.0, "tie_word_embeddings": False,
}
PROMPT = [5, 17, 42, 90, 8, 50, 3, 77]
TOKENS = 8


@pytest.fixture(scope="session")
def cgroup_llama(tmp_path_factory) -> tuple:
    """``(model directory, mlx-lm's greedy ids of the whole model for PROMPT, TOKENS)``."""
    model = make_chat_model("llama", tmp_path_factory.mktemp("cgroup-llama") / "model", CGROUP_LLAMA)
    return model, whole_model_greedy(model, PROMPT, TOKENS)
