"""Serving defaults shared by the CLI and the engine (no imports: the CLI starts fast)."""

#: Most decode steps one stage runs as one batched forward (``--max-batch``).
DEFAULT_MAX_BATCH = 8

#: Prompt tokens per prefill chunk (``--prefill-chunk``). A chunk holds a stage's
#: worker for one forward, so other requests' decode steps wait at most one chunk;
#: 512 is mlx-lm's own ``prefill_step_size`` for batched generation.
DEFAULT_PREFILL_CHUNK = 512
