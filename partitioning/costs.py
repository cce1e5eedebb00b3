"""The per-stage cost model: memory, time per token and bytes to load of a layer range.

A stage holding layers ``[s, e)`` of an ``L``-layer model on node ``n`` needs

    memory(s, e) = sum(layer_bytes[s:e]) + KV(s, e)
                   + embedding_bytes   if the stage embeds (s == 0, or e == L with tied embeddings)
                   + head_bytes        if e == L

    KV(s, e)     = sum over layers l in [s, e) of kv_bytes_per_token_per_layer[l] * kv_tokens(l)
                   + state_bytes_per_layer[l]
                   (kv_tokens = context_tokens, or the sliding window if smaller; a
                   recurrent layer's state is constant)

and spends per decoded token (the roofline of a memory-bound decode step, with
the memory and compute terms added as the issue specifies)

    time_n(s, e) = read(s, e) / bandwidth_n + flops(s, e) / flops_n
    read(s, e)   = sum(layer_read_bytes[s:e]) + KV(s, e) + head read if e == L
    flops(s, e)  = sum(flops_per_token_per_layer[s:e]) + head_flops_per_token if e == L

The KV term is read in full for every token at the target context (attention
reads the whole cache), the worst case the plan must sustain. Reading one
embedding row per token is negligible and not counted.

A prompt token costs a stage (prefill, compute-bound: a chunk of tokens shares each
weight read)

    prefill_n(s, e) = sum(flops_per_token_per_layer[s:e]) / flops_n

without the head, which a prefill computes for one position of the whole prompt. The
balanced policy weighs the two by ``Policy.prefill_share`` (:meth:`CostModel.balance_time`): a decode-balanced split
leaves the stages before a heavy head (a small model's tied embedding is 8 of SmolLM2's
30 layers) with most of a prompt's work, and a prefill runs at the pace of its slowest
stage.

All quantities are tabulated once per model as ``(L+1) x (L+1)`` matrices indexed
``[s, e]`` (entries with ``s > e`` are infinite; ``s == e`` is "this node holds
nothing" and costs 0), so every split search below is a handful of vectorised
numpy operations per node. Byte counts stay exact in float64 below 2**53 bytes.
"""

from __future__ import annotations

import math

import numpy as np

from .spec import ModelSpec, NodeSpec

INF = math.inf


class CostModel:
    """Stage cost matrices for one model at one context length (see module docstring).

    Construction is O(L^2) time and memory; per-node matrices are cached by the
    node's (bandwidth, flops) and memory so identical machines share them.
    """

    def __init__(self, model: ModelSpec, context_tokens: int | None = None) -> None:
        self.model = model
        self.L = L = model.num_layers
        ctx = model.context_tokens if context_tokens is None else context_tokens
        self.context_tokens = ctx
        kv = np.array([model.layer_cache_bytes(i, ctx) for i in range(L)], dtype=np.float64)
        w = np.array(model.layer_bytes, dtype=np.float64)
        r = np.array(model.layer_read_bytes, dtype=np.float64)
        f = np.array(model.flops_per_token_per_layer, dtype=np.float64)
        self.prefix_weight = _prefix(w)
        prefix_kv = _prefix(kv)
        prefix_read = _prefix(r)
        prefix_flops = _prefix(f)

        idx = np.arange(L + 1)
        s = idx[:, None]
        e = idx[None, :]
        self.valid = s <= e
        held = s < e
        embeds = held & ((s == 0) | ((e == L) if model.tie_word_embeddings else False))
        heads = held & (e == L)
        self.embeds = embeds
        self.heads = heads

        def span(p):
            return p[None, :] - p[:, None]

        kv_span = span(prefix_kv)
        self.weights = np.where(self.valid, span(self.prefix_weight), INF)
        # Memory, bytes.
        self.memory = np.where(
            self.valid,
            span(self.prefix_weight) + kv_span + embeds * model.embedding_bytes + heads * model.head_bytes,
            INF,
        )
        self.memory[~held & self.valid] = 0.0
        head_read = model.head_bytes + (model.embedding_bytes if model.tie_word_embeddings else 0)
        self.read = np.where(self.valid, span(prefix_read) + kv_span + heads * head_read, INF)
        self.flops = np.where(self.valid, span(prefix_flops) + heads * model.head_flops_per_token, INF)
        self.prefill_flops = np.where(self.valid, span(prefix_flops), INF)
        self.read[~held & self.valid] = 0.0
        self.flops[~held & self.valid] = 0.0
        self.prefill_flops[~held & self.valid] = 0.0
        self.stages = held.astype(np.float64)  # 1 for a stage that holds layers, 0 for "skip"
        self._time_cache: dict[tuple[float, float], np.ndarray] = {}
        self._fit_cache: dict[int, np.ndarray] = {}
        self._feasible_cache: dict[tuple, np.ndarray] = {}
        self._ns_cache: dict[tuple, np.ndarray] = {}
        self._util_cache: dict[int, np.ndarray] = {}
        self._balance_cache: dict[tuple, np.ndarray] = {}

    # --- per node -----------------------------------------------------------------

    def time(self, node: NodeSpec) -> np.ndarray:
        """Seconds per token of every range on ``node`` (inf where s > e), ignoring memory."""
        key = (node.bandwidth_bytes_per_s, node.flops)
        t = self._time_cache.get(key)
        if t is None:
            with np.errstate(divide="ignore", invalid="ignore"):
                t = self.read / node.bandwidth_bytes_per_s + self.flops / node.flops
            t[~self.valid] = INF
            t[np.isnan(t)] = INF
            self._time_cache[key] = t
        return t

    def fits(self, node: NodeSpec) -> np.ndarray:
        """Boolean matrix: the range fits in ``node``'s memory (s == e always fits)."""
        m = self._fit_cache.get(node.memory_bytes)
        if m is None:
            m = self.memory <= node.memory_bytes
            self._fit_cache[node.memory_bytes] = m
        return m

    def feasible_time(self, node: NodeSpec) -> np.ndarray:
        """:meth:`time` with ranges that do not fit in memory set to inf (do not modify)."""
        t = self._feasible_cache.get(node.signature)
        if t is None:
            t = np.where(self.fits(node), self.time(node), INF)
            self._feasible_cache[node.signature] = t
        return t

    def prefill_time(self, node: NodeSpec) -> np.ndarray:
        """Seconds per prompt token of every range on ``node`` (see module docstring;
        inf where s > e), ignoring memory."""
        with np.errstate(divide="ignore", invalid="ignore"):
            t = self.prefill_flops / node.flops
        t[~self.valid] = INF
        t[np.isnan(t)] = INF
        return t

    def balance_time(self, node: NodeSpec, prefill_share: float, decode_ref_s: float,
                     prefill_ref_s: float) -> np.ndarray:
        """What the balanced policy evens out (dimensionless): ``(1 - prefill_share)`` x
        :meth:`feasible_time` / ``decode_ref_s`` + ``prefill_share`` x :meth:`prefill_time`
        / ``prefill_ref_s``. The references are a decoded token's and a prompt token's
        time through the whole model (on the cluster's fastest node), so each term is a
        stage's share of that work and the blend does not depend on how fast prefill is
        against decode on the machine. Inf where the range does not fit (do not modify)."""
        if prefill_share == 0:
            return self.feasible_time(node)
        key = (node.signature, prefill_share, decode_ref_s, prefill_ref_s)
        t = self._balance_cache.get(key)
        if t is None:
            decode = self.feasible_time(node)
            with np.errstate(invalid="ignore"):
                t = ((1.0 - prefill_share) * decode / decode_ref_s
                     + prefill_share * self.prefill_time(node) / prefill_ref_s)
            t[~np.isfinite(decode)] = INF  # does not fit (or s > e), whatever the blend
            self._balance_cache[key] = t
        return t

    def feasible_time_ns(self, node: NodeSpec) -> np.ndarray:
        """:meth:`feasible_time` in whole nanoseconds (exact integer sums in float64)."""
        t = self._ns_cache.get(node.signature)
        if t is None:
            f = self.feasible_time(node)
            with np.errstate(invalid="ignore"):
                t = np.where(np.isfinite(f), np.rint(f * 1e9), INF)
            self._ns_cache[node.signature] = t
        return t

    def utilisation(self, node: NodeSpec) -> np.ndarray:
        """Fraction of ``node``'s memory each range uses (0 for s == e; inf where s > e)."""
        u = self._util_cache.get(node.memory_bytes)
        if u is None:
            u = self.memory / node.memory_bytes
            self._util_cache[node.memory_bytes] = u
        return u

    def smallest_stage_bytes(self) -> float:
        """The least memory any non-empty stage needs (one layer, with whatever it must hold)."""
        held = self.valid & (self.stages > 0)
        return float(self.memory[held].min())

    # --- per stage ----------------------------------------------------------------

    def stage_time(self, node: NodeSpec, s: int, e: int) -> float:
        """Seconds per token for ``[s, e)`` on ``node`` (same arithmetic as :meth:`time`)."""
        return float(self.time(node)[s, e])

    def stage_memory(self, s: int, e: int) -> int:
        """Bytes ``[s, e)`` needs, rounded up to a whole byte."""
        return math.ceil(self.memory[s, e])

    def needs(self, s: int, e: int) -> tuple[bool, bool]:
        """(holds the embedding, holds the head) for a stage ``[s, e)``, s < e."""
        return bool(self.embeds[s, e]), bool(self.heads[s, e])

    def load_matrix(self, held: tuple[int, int] | None, has_embedding: bool, has_head: bool) -> np.ndarray:
        """Bytes a node must load to hold each range, given what it already holds.

        Args:
            held: the layer range ``[p, q)`` the node held in the previous plan, or None.
            has_embedding, has_head: whether it held the embedding / the head.
        """
        L = self.L
        idx = np.arange(L + 1)
        s = idx[:, None]
        e = idx[None, :]
        total = self.prefix_weight[None, :] - self.prefix_weight[:, None]
        if held is not None:
            p, q = held
            lo = np.maximum(s, p)
            hi = np.minimum(e, q)
            overlap = np.where(hi > lo, self.prefix_weight[np.maximum(hi, lo)] - self.prefix_weight[lo], 0.0)
            total = total - overlap
        model = self.model
        extra = np.zeros_like(total)
        if not has_embedding:
            extra = extra + self.embeds * model.embedding_bytes
        if not has_head:
            extra = extra + self.heads * model.head_bytes
        out = np.where(self.valid, total + extra, INF)
        out[(s == e) & self.valid] = 0.0
        return out

    def stage_load(self, held, has_embedding: bool, has_head: bool, s: int, e: int) -> int:
        """Bytes to load for one stage (see :meth:`load_matrix`)."""
        if s == e:
            return 0
        p_lo, p_hi = held if held is not None else (0, 0)
        lo, hi = max(s, p_lo), min(e, p_hi)
        reused = self.prefix_weight[hi] - self.prefix_weight[lo] if hi > lo else 0.0
        emb, head = self.needs(s, e)
        extra = (self.model.embedding_bytes if emb and not has_embedding else 0) + (
            self.model.head_bytes if head and not has_head else 0
        )
        return int(self.prefix_weight[e] - self.prefix_weight[s] - reused) + extra


def _prefix(a: np.ndarray) -> np.ndarray:
    out = np.zeros(len(a) + 1, dtype=np.float64)
    np.cumsum(a, out=out[1:])
    return out
