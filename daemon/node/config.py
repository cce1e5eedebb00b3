"""A node's settings and the timing constants of its serving path."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from ringlet.daemon.engine.defaults import DEFAULT_MAX_BATCH, default_prefill_chunk
from ringlet.daemon.engine.drafting import DEFAULT_SPEC_TOKENS
from ringlet.daemon.engine.sources import ModelLocation
from ringlet.daemon.wire.serving_plan import StageSpec
from ringlet.daemon.wire.transport import TransportConfig

#: Seconds a failed request waits for a new plan before its error is reported:
#: detection (2 s) + negotiation + loading, with room to spare.
RESUME_WAIT_S = 10.0
#: Prompt tokens per step timeout while waiting for the first token: a prefill may
#: take one ``step_timeout_s`` per this many tokens (MLX on a CPU core prefills about
#: 30 tokens/s per stage of a 135M model, so 64 tokens is ~2 s per stage of 30 s).
PREFILL_TIMEOUT_TOKENS = 64
#: Seconds between retries while stage 0 and this node hold different epochs.
EPOCH_SKEW_RETRY_S = 0.25
#: Seconds a stage holds an activation of an epoch newer than its own before it answers
#: "behind": the sender has committed that epoch, so this node's commit is on its way
#: (members commit one plan within moments; a busy engine thread can delay the switch).
COMMIT_WAIT_S = 5.0
#: Tries with a shorter cached prefix after a stage's prefix store missed, before the
#: request prefills from scratch.
PREFIX_ATTEMPTS = 3
#: Tests only: seconds stage 0 waits after each prefill chunk, to make a prefill long on
#: a fast machine (tests/api/test_long_prefill.py); unset (no wait) in service.
TEST_CHUNK_DELAY_ENV = "RINGLET_TEST_PREFILL_CHUNK_DELAY_S"
#: Tests and benchmarks only: "1" makes stage 0 draft whatever a verifying trip is measured
#: to cost (:class:`ringlet.daemon.engine.draft_length.TripMeter`), so that exactness tests
#: verify drafts on every step they can; unset in service.
SPEC_ALWAYS_ENV = "RINGLET_TEST_SPEC_ALWAYS"
#: Default prefix store budget: this share of the usable memory the stage's weights leave
#: free (the rest is for in-flight KV caches, activations and MLX's own buffers).
PREFIX_CACHE_FRACTION = 0.25

@dataclass
class NodeConfig:
    """Settings of one node.

    Attributes:
        host: address the gRPC server binds and peers use (``127.0.0.1`` for loopback).
        port: gRPC port.
        model: the resolved model.
        plan: a static plan (ring order), or ``None`` to take negotiated plans.
        dtype: ``None`` (model precision) or float16 / bfloat16 / float32.
        node_id: this node's id.
        transport: gRPC settings (message limit, keepalive, secret).
        step_timeout_s: seconds stage 0 waits for a token before failing the request
            (for the first token, this per ``PREFILL_TIMEOUT_TOKENS`` prompt tokens).
        plan_wait_s: seconds a request waits for a plan while the cluster forms.
        resume_attempts: how many times a request is resumed on a new plan.
        reserve: a model's lane of a node serving several (ops/lanes.py): ``await
            reserve(nbytes)`` before a stage loads, until the node's lower-priority models
            leave ``nbytes`` for this one.
        fetch: for a node without the model files, ``await fetch(start, end)`` pulls that
            stage's tensors from a member into the local sparse copy before loading.
        max_batch: the most decode steps a stage runs as one forward (1: no batching).
        prefill_chunk: prompt tokens per prefill chunk; stage 0 sends each chunk on
            as soon as it is computed, so stages prefill in a pipeline. ``None``: this
            device's default (:func:`ringlet.daemon.engine.defaults.default_prefill_chunk`),
            and half of it on a plan of several stages.
        ring_prefill_chunk: the same on a plan of several pipeline stages; ``None``:
            ``prefill_chunk`` when that is given, else the device's default for a ring.
        spec_tokens: the most tokens stage 0 drafts per decode step for speculative
            decoding (:mod:`ringlet.daemon.engine.drafting`; 0: off).
        vocab_size: the tokenizer's vocabulary (token ids at or past it are refused).
        context_tokens: the model's context length, tokens.
        dtype_choice: how ``--dtype`` resolved (:meth:`ringlet.daemon.engine.dtype.DtypeChoice.to_dict`),
            for ``/v1/cluster``.
        prefix_cache_bytes: the prefix store's budget, bytes (``None``: the default
            fraction, :data:`PREFIX_CACHE_FRACTION`; 0: off).
        usable_memory_bytes: memory this node offers, bytes (``None``: the machine's total).
        prefix_cache_scope: ``key`` (entries per API key, when keys are configured) or
            ``cluster`` (one scope for every caller).
        prefix_cache_disk_bytes: the prefix store's disk tier budget, bytes (0: off).
        prefix_cache_dir: where the disk tier keeps its files (the data dir's
            ``prefix-cache``).
        kv_migration: on a re-plan, move KV caches with their layers
            (:mod:`ringlet.daemon.node.migration`); off: drop them, requests re-prefill.
        boundary_cache_bytes: the most bytes of boundary activations (the hidden states
            this stage sent on) kept to rebuild a lost next stage's layers (0: none;
            ``None``: a sixteenth of the usable memory, at most
            :data:`~ringlet.daemon.engine.defaults.DEFAULT_BOUNDARY_CACHE_BYTES`).
    """

    host: str
    port: int
    model: ModelLocation
    plan: list[StageSpec] | None = None
    dtype: str | None = None
    node_id: str = ""
    transport: TransportConfig = field(default_factory=TransportConfig)
    step_timeout_s: float = 30.0
    plan_wait_s: float = 30.0
    resume_attempts: int = 8
    fetch: Callable[[int, int], Awaitable[None]] | None = None
    reserve: Callable[[int], Awaitable[None]] | None = None
    max_batch: int = DEFAULT_MAX_BATCH
    prefill_chunk: int | None = None
    ring_prefill_chunk: int | None = None
    spec_tokens: int = DEFAULT_SPEC_TOKENS
    vocab_size: int | None = None
    context_tokens: int | None = None
    dtype_choice: dict | None = None
    prefix_cache_bytes: int | None = None
    usable_memory_bytes: int | None = None
    prefix_cache_scope: str = "key"
    prefix_cache_disk_bytes: int = 0
    prefix_cache_dir: Path | None = None
    kv_migration: bool = True
    boundary_cache_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.ring_prefill_chunk is None:
            self.ring_prefill_chunk = self.prefill_chunk
        if self.prefill_chunk is None or self.ring_prefill_chunk is None:
            from ringlet.daemon.engine.dtype import on_cpu  # imports MLX: only when needed

            cpu = on_cpu()
            if self.prefill_chunk is None:
                self.prefill_chunk = default_prefill_chunk(cpu)
            if self.ring_prefill_chunk is None:
                self.ring_prefill_chunk = default_prefill_chunk(cpu, stages=2)

    def chunk_for(self, stages: int) -> int:
        """Prompt tokens per prefill chunk on a plan of ``stages`` pipeline stages."""
        return max(1, self.ring_prefill_chunk if stages > 1 else self.prefill_chunk)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


