"""SmolLM2-135M-Instruct's shapes, read by hand from its GGUF metadata, and the float32
bytes of a stage derived from them (the expected values of the memory tests)."""

from __future__ import annotations

#: hidden size, key/value width (3 kv heads of 64), MLP width, vocabulary, layers
HIDDEN, KV_DIM, MLP, VOCAB, LAYERS = 576, 3 * 64, 1536, 49152, 30
#: one decoder layer in float32: q/o (H x H), k/v (H x KV), gate/up/down (H x MLP), two norms
LAYER_BYTES = 4 * (2 * HIDDEN * HIDDEN + 2 * HIDDEN * KV_DIM + 3 * HIDDEN * MLP + 2 * HIDDEN)
#: the embedding table in float32 (tied: the last stage holds it again as its LM head)
EMBED_BYTES = 4 * VOCAB * HIDDEN
FULL_BYTES = LAYERS * LAYER_BYTES + EMBED_BYTES + 4 * HIDDEN


def stage_bytes(start: int, end: int) -> int:
    """float32 bytes of the stage holding layers ``[start, end)``: its layers, the
    embedding on the first stage, the final norm and the (tied) LM head on the last."""
    first = EMBED_BYTES if start == 0 else 0
    last = EMBED_BYTES + 4 * HIDDEN if end == LAYERS else 0
    return (end - start) * LAYER_BYTES + first + last
