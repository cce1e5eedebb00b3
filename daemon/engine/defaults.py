"""Serving defaults shared by the CLI and the engine (no imports: the CLI starts fast)."""

#: Most decode steps one stage runs as one batched forward (``--max-batch``).
DEFAULT_MAX_BATCH = 8

#: Prompt tokens per prefill chunk (``--prefill-chunk``). A chunk holds a stage's
#: worker for one forward, so other requests' decode steps wait at most one chunk;
#: 512 is mlx-lm's own ``prefill_step_size`` for batched generation.
DEFAULT_PREFILL_CHUNK = 512

#: Bytes of boundary activations a stage keeps (``--boundary-cache-bytes``, 1 GiB): the
#: hidden states of 100k tokens of a 4,096-wide bfloat16 model (Llama 3 8B: 8 KiB a
#: token), or 70k of DeepSeek V3's 7,168-wide ones (14 KiB).
DEFAULT_BOUNDARY_CACHE_BYTES = 1 << 30
