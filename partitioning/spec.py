"""Planner inputs: nodes, links, the model and the policy (frozen, validated).

Every number is checked when the object is built: NaN, infinite, negative or
non-numeric values (and ``bool``) raise :class:`ValueError` naming the field,
e.g. ``NodeSpec('m1').memory_bytes must be a finite number >= 0, got nan``.
Zero is allowed where it has a meaning the planner can act on (a node with zero
memory, bandwidth or compute is left out of the plan with a reason).

Units: bytes, seconds, bytes/s, FLOP/s (floating point operations per second).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, field, fields, replace
from numbers import Integral, Real
from typing import Any

POLICY_NAMES = ("balanced", "memory", "latency")

# One gigabit Ethernet: the network every pair of machines is assumed to share
# when no direct link between them was measured.
DEFAULT_FALLBACK_BANDWIDTH = 125_000_000.0  # bytes/s
DEFAULT_FALLBACK_LATENCY = 1e-3  # s


def _number(value: Any, what: str, *, positive: bool = False) -> float:
    """``value`` as a finite real >= 0 (> 0 when ``positive``), else ValueError naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"{what} must be a number, got {value!r}")
    v = float(value)
    if math.isnan(v) or math.isinf(v) or v < 0 or (positive and v == 0):
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{what} must be a finite number {bound}, got {value!r}")
    return v


def _whole(value: Any, what: str, *, positive: bool = False, floor: bool = False) -> int:
    """``value`` as a non-negative int; integral floats are accepted, others raise
    ValueError naming ``what`` (or are rounded down when ``floor``)."""
    v = _number(value, what, positive=positive)
    if isinstance(value, Integral):
        return int(value)
    if not v.is_integer():
        if not floor:
            raise ValueError(f"{what} must be a whole number, got {value!r}")
        v = math.floor(v)
        if positive and v == 0:
            raise ValueError(f"{what} must be >= 1, got {value!r}")
    return int(v)


def _per_layer(value: Any, n: int, what: str, convert) -> tuple:
    """A scalar repeated ``n`` times, or a sequence of exactly ``n`` values, each converted."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, Real)) or isinstance(value, bool):
        raise ValueError(f"{what} must be a number or a sequence of {n} numbers, got {value!r}")
    if isinstance(value, Real):
        one = convert(value, what)
        return (one,) * n
    if len(value) != n:
        raise ValueError(f"{what} has {len(value)} entries, expected one per layer ({n})")
    return tuple(convert(v, f"{what}[{i}]") for i, v in enumerate(value))


@dataclass(frozen=True)
class NodeSpec:
    """One machine that can hold a pipeline stage.

    Args:
        node_id: unique, non-empty identifier (the daemon's node id).
        memory_bytes: memory usable for weights and KV cache, bytes. A float is
            rounded down. 0 leaves the node out of the plan.
        bandwidth_bytes_per_s: memory bandwidth, bytes/s (decode reads every
            weight of a stage once per token). 0 leaves the node out.
        flops: compute throughput, FLOP/s. 0 leaves the node out.

    Raises:
        ValueError: an empty id, or a NaN/infinite/negative/non-numeric number
            (the message names the node and the field).
    """

    node_id: str
    memory_bytes: int
    bandwidth_bytes_per_s: float
    flops: float

    def __post_init__(self) -> None:
        if not isinstance(self.node_id, str) or not self.node_id.strip():
            raise ValueError(f"NodeSpec.node_id must be a non-empty string, got {self.node_id!r}")
        who = f"NodeSpec({self.node_id!r})"
        object.__setattr__(self, "memory_bytes", _whole(self.memory_bytes, f"{who}.memory_bytes", floor=True))
        object.__setattr__(
            self, "bandwidth_bytes_per_s", _number(self.bandwidth_bytes_per_s, f"{who}.bandwidth_bytes_per_s")
        )
        object.__setattr__(self, "flops", _number(self.flops, f"{who}.flops"))

    @property
    def signature(self) -> tuple[int, float, float]:
        """(memory, bandwidth, flops): two nodes with equal signatures are interchangeable."""
        return (self.memory_bytes, self.bandwidth_bytes_per_s, self.flops)

    def to_dict(self) -> dict:
        """JSON-safe dict with the constructor's field names."""
        return {
            "node_id": self.node_id,
            "memory_bytes": self.memory_bytes,
            "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
            "flops": self.flops,
        }

    @classmethod
    def from_dict(cls, data: dict) -> NodeSpec:
        """Inverse of :meth:`to_dict`. Raises ValueError naming a missing or bad field."""
        return cls(**_pick(data, cls, "NodeSpec"))


@dataclass(frozen=True)
class LinkSpec:
    """A measured direct link between two nodes (e.g. a Thunderbolt cable).

    The link is undirected: ``LinkSpec("a", "b", ...)`` and ``LinkSpec("b", "a", ...)``
    describe the same cable. Pairs without a link talk over the default network
    at ``Policy.fallback_bandwidth_bytes_per_s`` / ``Policy.fallback_latency_s``.

    Args:
        a, b: the two node ids (different).
        bandwidth_bytes_per_s: usable bandwidth, bytes/s (> 0). TB5 at 80 Gb/s is 10e9.
        latency_s: one-way latency, s (>= 0).
        kind: a label for explanations ("tb5", "tb4", "ethernet", ...).

    Raises:
        ValueError: a self-link, an empty id, or a bad number (naming the field).
    """

    a: str
    b: str
    bandwidth_bytes_per_s: float
    latency_s: float
    kind: str = "direct"

    def __post_init__(self) -> None:
        for name in ("a", "b"):
            v = getattr(self, name)
            if not isinstance(v, str) or not v.strip():
                raise ValueError(f"LinkSpec.{name} must be a non-empty node id, got {v!r}")
        if self.a == self.b:
            raise ValueError(f"LinkSpec({self.a!r}, {self.b!r}): a link needs two different nodes")
        who = f"LinkSpec({self.a!r}, {self.b!r})"
        object.__setattr__(
            self,
            "bandwidth_bytes_per_s",
            _number(self.bandwidth_bytes_per_s, f"{who}.bandwidth_bytes_per_s", positive=True),
        )
        object.__setattr__(self, "latency_s", _number(self.latency_s, f"{who}.latency_s"))
        if not isinstance(self.kind, str):
            raise ValueError(f"{who}.kind must be a string, got {self.kind!r}")

    @property
    def pair(self) -> tuple[str, str]:
        """The two ids, sorted."""
        return (self.a, self.b) if self.a < self.b else (self.b, self.a)

    def to_dict(self) -> dict:
        """JSON-safe dict with the constructor's field names."""
        return {
            "a": self.a,
            "b": self.b,
            "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
            "latency_s": self.latency_s,
            "kind": self.kind,
        }

    @classmethod
    def from_dict(cls, data: dict) -> LinkSpec:
        """Inverse of :meth:`to_dict`. Raises ValueError naming a missing or bad field."""
        return cls(**_pick(data, cls, "LinkSpec"))


@dataclass(frozen=True)
class ModelSpec:
    """What the planner needs to know about a model, per decoder layer.

    Layer-wise fields take either one number (the same for every layer) or a
    sequence with one entry per layer (e.g. dense first layers, MoE after).

    Args:
        layer_bytes: weight bytes of each decoder layer (sets the layer count).
        embedding_bytes: token embedding weights, held by the first stage.
        head_bytes: final norm + output projection, held by the last stage. When
            the embedding is tied (``tie_word_embeddings``) this is only the
            final norm and the last stage also holds a copy of the embedding.
        kv_bytes_per_token_per_layer: KV-cache bytes per token of context, per layer.
        context_tokens: the target context length the KV cache is sized for.
        flops_per_token_per_layer: FLOPs to decode one token through each layer
            (2 x parameters touched, active experts only; see daemon/engine/modelspec.py).
        name: model identity; part of the fingerprint that decides whether a
            previous plan's weights can be reused.
        layer_read_bytes: weight bytes read per decoded token per layer; less
            than ``layer_bytes`` for MoE layers (inactive experts are not read).
            Default: ``layer_bytes``.
        tie_word_embeddings: the output head reuses the embedding matrix.
        head_flops_per_token: FLOPs of the output projection per token.
        activation_bytes_per_token: bytes of hidden state sent between stages per
            token (hidden_size x dtype size); sets hop transfer times.
        kv_window_tokens: per layer, a sliding-window length (KV cache holds at
            most this many tokens) or None for full attention. Default: all full.
        state_bytes_per_layer: per layer, bytes of a constant-size state one request
            holds whatever its context (a recurrent layer's: linear attention, SSM,
            short convolution; 0 for attention). Default: 0.

    Raises:
        ValueError: no layers, a wrong-length sequence, or a bad number (naming
            the field and index, e.g. ``ModelSpec.layer_bytes[3]``).
    """

    layer_bytes: tuple[int, ...]
    embedding_bytes: int
    head_bytes: int
    kv_bytes_per_token_per_layer: tuple[float, ...]
    context_tokens: int
    flops_per_token_per_layer: tuple[float, ...]
    name: str = "model"
    layer_read_bytes: tuple[int, ...] | None = None
    tie_word_embeddings: bool = False
    head_flops_per_token: float = 0.0
    activation_bytes_per_token: int = 0
    kv_window_tokens: tuple[int | None, ...] | None = None
    state_bytes_per_layer: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        lb = self.layer_bytes
        if isinstance(lb, (str, bytes)) or not isinstance(lb, Sequence) or len(lb) == 0:
            raise ValueError(f"ModelSpec.layer_bytes must be a non-empty sequence of byte counts, got {lb!r}")
        n = len(lb)
        setattr_ = object.__setattr__
        setattr_(self, "layer_bytes", tuple(_whole(v, f"ModelSpec.layer_bytes[{i}]") for i, v in enumerate(lb)))
        if self.layer_read_bytes is None:
            setattr_(self, "layer_read_bytes", self.layer_bytes)
        else:
            setattr_(
                self,
                "layer_read_bytes",
                _per_layer(self.layer_read_bytes, n, "ModelSpec.layer_read_bytes", lambda v, w: _whole(v, w)),
            )
        setattr_(self, "embedding_bytes", _whole(self.embedding_bytes, "ModelSpec.embedding_bytes"))
        setattr_(self, "head_bytes", _whole(self.head_bytes, "ModelSpec.head_bytes"))
        setattr_(
            self,
            "kv_bytes_per_token_per_layer",
            _per_layer(self.kv_bytes_per_token_per_layer, n, "ModelSpec.kv_bytes_per_token_per_layer", _number),
        )
        setattr_(self, "context_tokens", _whole(self.context_tokens, "ModelSpec.context_tokens"))
        setattr_(
            self,
            "flops_per_token_per_layer",
            _per_layer(self.flops_per_token_per_layer, n, "ModelSpec.flops_per_token_per_layer", _number),
        )
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"ModelSpec.name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.tie_word_embeddings, bool):
            raise ValueError(f"ModelSpec.tie_word_embeddings must be a bool, got {self.tie_word_embeddings!r}")
        setattr_(self, "head_flops_per_token", _number(self.head_flops_per_token, "ModelSpec.head_flops_per_token"))
        setattr_(
            self,
            "activation_bytes_per_token",
            _whole(self.activation_bytes_per_token, "ModelSpec.activation_bytes_per_token"),
        )
        if self.kv_window_tokens is None:
            setattr_(self, "kv_window_tokens", (None,) * n)
        else:
            w = self.kv_window_tokens
            if isinstance(w, (str, bytes)) or not isinstance(w, Sequence) or len(w) != n:
                raise ValueError(f"ModelSpec.kv_window_tokens must have one entry per layer ({n}), got {w!r}")
            setattr_(
                self,
                "kv_window_tokens",
                tuple(
                    None if v is None else _whole(v, f"ModelSpec.kv_window_tokens[{i}]", positive=True)
                    for i, v in enumerate(w)
                ),
            )
        setattr_(self, "state_bytes_per_layer",
                 _per_layer(0 if self.state_bytes_per_layer is None else self.state_bytes_per_layer, n,
                            "ModelSpec.state_bytes_per_layer", _number))
        for i, (r, b) in enumerate(zip(self.layer_read_bytes, self.layer_bytes, strict=True)):
            if r > b:
                raise ValueError(
                    f"ModelSpec.layer_read_bytes[{i}] ({r}) exceeds layer_bytes[{i}] ({b}): "
                    "a token cannot read more weights than the layer holds"
                )

    @property
    def num_layers(self) -> int:
        """Number of decoder layers."""
        return len(self.layer_bytes)

    def kv_tokens(self, layer: int, context_tokens: int | None = None) -> int:
        """Tokens the KV cache of ``layer`` holds at ``context_tokens`` (default: the target)."""
        ctx = self.context_tokens if context_tokens is None else context_tokens
        w = self.kv_window_tokens[layer]
        return ctx if w is None else min(ctx, w)

    def layer_cache_bytes(self, layer: int, context_tokens: int | None = None) -> float:
        """Cache bytes of one request in ``layer`` at ``context_tokens`` (default: the
        target): its KV (at most its window) and its constant state."""
        return (self.kv_bytes_per_token_per_layer[layer] * self.kv_tokens(layer, context_tokens)
                + self.state_bytes_per_layer[layer])

    def kv_cache_bytes(self, context_tokens: int | None = None) -> float:
        """Cache bytes of all layers at ``context_tokens`` (default: the target): KV, at
        most each window, and constant states."""
        return sum(self.layer_cache_bytes(i, context_tokens) for i in range(self.num_layers))

    @property
    def weight_bytes(self) -> int:
        """Bytes of all weights, stored once: layers + embedding + head."""
        return sum(self.layer_bytes) + self.embedding_bytes + self.head_bytes

    def total_bytes(self, context_tokens: int | None = None) -> int:
        """Memory of the whole model on one machine: weights + KV cache at ``context_tokens``."""
        return self.weight_bytes + math.ceil(self.kv_cache_bytes(context_tokens))

    def with_context(self, context_tokens: int) -> ModelSpec:
        """A copy sized for another context length (tokens)."""
        return replace(self, context_tokens=context_tokens)

    @property
    def fingerprint(self) -> str:
        """A stable hash of the model's identity and weight layout (not its context).

        Two specs with the same fingerprint hold the same bytes in the same layers,
        so weights loaded under one plan are reusable under the next.
        """
        blob = json.dumps(
            [
                self.name,
                list(self.layer_bytes),
                self.embedding_bytes,
                self.head_bytes,
                self.tie_word_embeddings,
            ],
            separators=(",", ":"),
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def to_dict(self) -> dict:
        """JSON-safe dict with the constructor's field names."""
        return {
            "name": self.name,
            "layer_bytes": list(self.layer_bytes),
            "layer_read_bytes": list(self.layer_read_bytes),
            "embedding_bytes": self.embedding_bytes,
            "head_bytes": self.head_bytes,
            "tie_word_embeddings": self.tie_word_embeddings,
            "kv_bytes_per_token_per_layer": list(self.kv_bytes_per_token_per_layer),
            "kv_window_tokens": list(self.kv_window_tokens),
            "state_bytes_per_layer": list(self.state_bytes_per_layer),
            "context_tokens": self.context_tokens,
            "flops_per_token_per_layer": list(self.flops_per_token_per_layer),
            "head_flops_per_token": self.head_flops_per_token,
            "activation_bytes_per_token": self.activation_bytes_per_token,
        }

    @classmethod
    def from_dict(cls, data: dict) -> ModelSpec:
        """Inverse of :meth:`to_dict`. Raises ValueError naming a missing or bad field."""
        return cls(**_pick(data, cls, "ModelSpec"))


@dataclass(frozen=True)
class Policy:
    """How to choose among feasible plans.

    Args:
        name: ``"balanced"`` (default: minimise the largest stage time per token,
            i.e. maximise pipeline throughput), ``"memory"`` (exo parity: layers in
            proportion to memory) or ``"latency"`` (minimise one request's time per
            token: stage times plus hops; may leave out nodes that only add a hop).
        tolerance: with a previous plan, plans whose objective is within this
            fraction of the best are "as good" and the one moving the fewest
            weight bytes wins (default 1 %).
        fallback_bandwidth_bytes_per_s, fallback_latency_s: the default network
            between nodes without a direct link (default 1 GbE, 1 ms).
        token_bytes: bytes sent back from the last stage to the first per token
            (the sampled token id and framing).
        exact_ring_max_nodes: up to this many nodes the ring order is exact
            (Held-Karp); beyond, a networkx TSP approximation.
        max_candidate_orders: ring orders (rotations/reversals that tie on the
            links) evaluated by the split search.
        max_insertion_orders: with a previous plan, the most "insert the new nodes
            into the old ring" orders tried before falling back to re-choosing.
        ring_order: pin the ring order (node ids); usable nodes not listed are
            left out with a reason. None lets the planner choose.
        prefill_share: for ``balanced``, in [0, 1]: how much of the stages' time is
            prefill (prompt tokens, which skip the head) rather than decode. A stage's
            cost is ``(1 - share)`` x its share of a decoded token's time plus ``share``
            x its share of a prompt token's (:meth:`.costs.CostModel.balance_time`).
            0 balances decode alone (concurrent decoding's throughput), 1 prefill alone
            (a long prompt's time to first token). Default 0 here; the daemon plans
            with ``--prefill-share`` (0.5 by default).

    Raises:
        ValueError: an unknown name or a bad number (naming the field).
    """

    name: str = "balanced"
    tolerance: float = 0.01
    fallback_bandwidth_bytes_per_s: float = DEFAULT_FALLBACK_BANDWIDTH
    fallback_latency_s: float = DEFAULT_FALLBACK_LATENCY
    token_bytes: int = 16
    exact_ring_max_nodes: int = 10
    max_candidate_orders: int = 16
    max_insertion_orders: int = 720
    ring_order: tuple[str, ...] | None = field(default=None)
    prefill_share: float = 0.0

    def __post_init__(self) -> None:
        if self.name not in POLICY_NAMES:
            raise ValueError(f"Policy.name must be one of {', '.join(POLICY_NAMES)}, got {self.name!r}")
        tol = _number(self.tolerance, "Policy.tolerance")
        if tol >= 1:
            raise ValueError(f"Policy.tolerance must be < 1 (a fraction, 0.01 = 1 %), got {self.tolerance!r}")
        object.__setattr__(self, "tolerance", tol)
        object.__setattr__(
            self,
            "fallback_bandwidth_bytes_per_s",
            _number(self.fallback_bandwidth_bytes_per_s, "Policy.fallback_bandwidth_bytes_per_s", positive=True),
        )
        object.__setattr__(self, "fallback_latency_s", _number(self.fallback_latency_s, "Policy.fallback_latency_s"))
        share = _number(self.prefill_share, "Policy.prefill_share")
        if share > 1:
            raise ValueError(f"Policy.prefill_share must be in [0, 1], got {self.prefill_share!r}")
        object.__setattr__(self, "prefill_share", share)
        object.__setattr__(self, "token_bytes", _whole(self.token_bytes, "Policy.token_bytes"))
        for name in ("exact_ring_max_nodes", "max_candidate_orders", "max_insertion_orders"):
            object.__setattr__(self, name, _whole(getattr(self, name), f"Policy.{name}", positive=True))
        if self.exact_ring_max_nodes > 12:
            raise ValueError("Policy.exact_ring_max_nodes must be <= 12 (Held-Karp is O(2^n n^2))")
        if self.ring_order is not None:
            ro = self.ring_order
            if isinstance(ro, (str, bytes)) or not isinstance(ro, Sequence) or not ro:
                raise ValueError(f"Policy.ring_order must be a non-empty sequence of node ids, got {ro!r}")
            ro = tuple(ro)
            if any(not isinstance(x, str) or not x for x in ro):
                raise ValueError(f"Policy.ring_order must contain node ids (strings), got {ro!r}")
            if len(set(ro)) != len(ro):
                raise ValueError(f"Policy.ring_order lists a node twice: {ro!r}")
            object.__setattr__(self, "ring_order", ro)

    def to_dict(self) -> dict:
        """JSON-safe dict with the constructor's field names."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["ring_order"] = None if self.ring_order is None else list(self.ring_order)
        return d

    @classmethod
    def from_dict(cls, data: dict) -> Policy:
        """Inverse of :meth:`to_dict` (missing fields take their defaults)."""
        return cls(**_pick(data, cls, "Policy"))


def _pick(data: Any, cls: type, what: str) -> dict:
    """The keyword arguments of ``cls`` found in ``data``; ValueError on a non-dict,
    an unknown key or a missing required key."""
    if not isinstance(data, dict):
        raise ValueError(f"{what} must be a JSON object, got {type(data).__name__}")
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{what}: unknown field {unknown[0]!r} (expected some of {', '.join(sorted(names))})")
    required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
    missing = [n for n in required if n not in data]
    if missing:
        raise ValueError(f"{what}: missing field {missing[0]!r}")
    return dict(data)

