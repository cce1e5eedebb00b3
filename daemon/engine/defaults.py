"""Serving defaults shared by the CLI and the engine (no imports: the CLI starts fast)."""

#: Most decode steps one stage runs as one batched forward (``--max-batch``).
DEFAULT_MAX_BATCH = 8

#: The longest a decode step waits, seconds, for the rest of its decode group (or of the
#: batch the previous stage ran it in) to reach the stage. The steps of one batch leave a
#: stage together, one message after another on the same hop stream, so they normally
#: arrive moments apart; a member that has finished is released before its group's next
#: step, so the whole wait is paid only when a member is lost. 10 ms is about a quarter
#: of one stage's batched decode step on this development machine (35-45 ms, bench_groups).
DEFAULT_GROUP_WAIT_S = 0.010

#: ``--prefill-share``: how much the balanced plan weighs a prompt token's work on each
#: stage against a decoded token's (``Policy.prefill_share``). A decoded token also runs
#: the head, a prompt token does not (the head sees one position a prompt), so a
#: decode-balanced split gives the stages before the last more of every prompt: on
#: SmolLM2 (tied 49k x 576 head = 8 of its 30 layers' reads) 2 nodes split 18 / 12, and
#: a prompt's prefill runs at the pace of the 18-layer stage. ringlet's users are coding
#: agents, whose turns read long prompts (Claude Code's first is ~21,000 tokens, tool
#: results thousands) and write short answers, so prefill weighs as much as decode:
#: 0.5 (16 / 14 there). 0 balances decode alone, 1 prefill alone (issue #35).
DEFAULT_PREFILL_SHARE = 0.5

#: Prompt tokens per prefill chunk (``--prefill-chunk``) on a GPU. A chunk holds a
#: stage's worker for one forward, so other requests' decode steps wait at most one
#: chunk; 512 is mlx-lm's own ``prefill_step_size`` for batched generation.
DEFAULT_PREFILL_CHUNK = 512

#: The same on a CPU. MLX's CPU attention computes a chunk's scores against the whole
#: context (masked, not skipped) and its ``exp`` runs at ~20 ns an element, so smaller
#: chunks do less of that work; and a ring's stages overlap on more, smaller chunks.
#: Measured here (SmolLM2-135M, float32, 1,492-token prompt, 1 thread a process):
#: 256 against 512 costs 9% less CPU and, on 3 stages, 20% less time to first token.
CPU_PREFILL_CHUNK = 256


#: A ring of several pipeline stages prefills in chunks of this fraction of the one-stage
#: chunk. Stage k + 1 starts a chunk when stage k has sent it, so a prefill on balanced
#: stages takes one stage's whole work plus about one chunk (the pipeline's fill and
#: drain; the chunks' order cannot hide it): smaller chunks shorten that tail. Measured
#: here (bench_prefill_pipeline, 2 stages each pinned to a core, 3,006-token prompt):
#: 128-token chunks brought the time to first token from 0.60 to 0.55 of one process's
#: (1,006 tokens: 0.77 to 0.66; 6,006: 0.60 to 0.56). On a GPU the same rule halves 512
#: to 256, not measured here.
RING_CHUNK_FRACTION = 2


def default_prefill_chunk(on_cpu: bool, stages: int = 1) -> int:
    """Prompt tokens per prefill chunk when ``--prefill-chunk`` is not given: this
    device's chunk, divided by :data:`RING_CHUNK_FRACTION` on a plan of more than one
    pipeline stage."""
    chunk = CPU_PREFILL_CHUNK if on_cpu else DEFAULT_PREFILL_CHUNK
    return chunk if stages <= 1 else chunk // RING_CHUNK_FRACTION

#: Bytes of boundary activations a stage keeps (``--boundary-cache-bytes``, 1 GiB): the
#: hidden states of 100k tokens of a 4,096-wide bfloat16 model (Llama 3 8B: 8 KiB a
#: token), or 70k of DeepSeek V3's 7,168-wide ones (14 KiB).
DEFAULT_BOUNDARY_CACHE_BYTES = 1 << 30
