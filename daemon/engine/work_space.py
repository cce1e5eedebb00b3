"""The work space a stage needs beside its weights and KV caches: the activations of one step
(and, :func:`tokenizer_bytes`, the memory its tokenizer takes once the node serves a request).

A prefill chunk of ``c`` tokens through a decoder layer holds, at its peak, the layer's
input and output hidden states, the attention projections (queries, keys, values), the
attention scores of every head against the context (``heads x c x context``; a fused
kernel holds less) and the MLP's gate, up and activated tensors (``3 x c x intermediate``;
a mixture of experts: the routed experts' and the shared expert's). The last stage also
holds the output logits of the tokens it samples (a decode step's drafts: at most
:data:`LOGIT_TOKENS`). Layers run one after another, so one layer's peak is the stage's.
The chunk's hidden states also pass the wire in :data:`HOP_COPIES` copies at once (the
message received, the array made of it, the one sent on and its message).

Every figure is counted in float32 (the widest dtype MLX computes activations in here),
times :data:`MARGIN` for the temporaries a step makes and frees as it goes. Measured on a
llama of hidden 1,024, intermediate 3,072, 8 heads, with 256-token chunks at a 1,024-token
context: MLX's peak over its active memory was 22.6 MB; this estimate is 38.5 MB.
"""

from __future__ import annotations

from ringlet.daemon.engine.model_config import text_config

__all__ = ["HOP_COPIES", "LOGIT_TOKENS", "MARGIN", "TOKENIZER_BYTES_PER_TOKEN", "TOKENIZER_MIN_BYTES",
           "tokenizer_bytes", "work_space_bytes"]

#: Copies of a chunk's hidden states in transit at once (in, and out to the next stage).
HOP_COPIES = 4
#: Tokens whose logits one step of the last stage holds (the sampled token and its drafts).
LOGIT_TOKENS = 16
#: Factor over the counted tensors for the temporaries a step makes and frees.
MARGIN = 1.5
_FLOAT32 = 4


def _int(text: dict, *names: str) -> int:
    for name in names:
        value = text.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0


def work_space_bytes(config: dict, chunk_tokens: int, context_tokens: int) -> int:
    """Bytes of activations one step of a stage of this model may hold at its peak.

    Args:
        config: the model's ``config.json`` as a dict (a nested ``text_config`` is read).
        chunk_tokens: prompt tokens per prefill chunk (the widest step), > 0.
        context_tokens: the planned context (attention scores span it), > 0.

    Returns:
        Bytes, at least 0 (0 when the config names no hidden size).
    """
    text = text_config(config)
    hidden = _int(text, "hidden_size", "n_embd", "d_model")
    if hidden <= 0:
        return 0
    heads = _int(text, "num_attention_heads", "n_head") or 1
    kv_heads = _int(text, "num_key_value_heads") or heads
    head_dim = _int(text, "head_dim") or hidden // heads
    dense = _int(text, "intermediate_size", "ffn_dim", "n_inner") or 4 * hidden
    expert = _int(text, "moe_intermediate_size", "expert_intermediate_size")
    routed = _int(text, "num_experts_per_tok", "moe_top_k", "top_k", "experts_per_token")
    shared = _int(text, "n_shared_experts", "num_shared_experts")
    mlp = max(dense, expert * (routed + shared)) if expert else dense
    vocab = _int(text, "vocab_size")
    c, ctx = max(1, chunk_tokens), max(1, context_tokens)
    per_token = (2 + HOP_COPIES) * hidden + heads * head_dim + 2 * kv_heads * head_dim + 3 * mlp
    counted = c * per_token + heads * c * ctx + LOGIT_TOKENS * vocab
    return int(MARGIN * counted * _FLOAT32)

#: What a node's tokenizer takes once built (every node serves the API and builds it at its
#: first request), per token of the vocabulary: SmolLM2-135M's (49,152 tokens, from its
#: GGUF) took 70.1-71.5 MB of anonymous memory, 1.43-1.45 KB a token; rounded up.
TOKENIZER_BYTES_PER_TOKEN = 1536
#: ... and at least this (the tokenizer objects of a tiny vocabulary).
TOKENIZER_MIN_BYTES = 8 << 20


def tokenizer_bytes(config: dict) -> int:
    """Bytes a node's built tokenizer will take for this model (the constants above).

    Args:
        config: the model's ``config.json`` as a dict (a nested ``text_config`` is read).
    """
    return max(TOKENIZER_MIN_BYTES, TOKENIZER_BYTES_PER_TOKEN * _int(text_config(config), "vocab_size"))
