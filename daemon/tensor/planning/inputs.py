"""Tensor-parallel planning inputs: members, links and the model.

* members: :class:`TPMember` (node id, the address peers reach it on, usable
  memory, optionally its memory bandwidth);
* links: :class:`TPLink` between two members (kind, RDMA, bandwidth, latency
  and, for Thunderbolt, the interface and IP at each end), with the defaults of
  each link kind (:data:`LINK_DEFAULTS`); :mod:`ringlet.daemon.tensor.planning.links`
  builds them;
* the model: :class:`TPModelSpec` (head counts, bytes), from an mlx-lm
  ``config.json`` by :func:`tp_spec_from_config`.

Whether a model splits ``n`` ways (:func:`tensor_refusal`): ``tensor`` needs every
member to hold every layer, split by mlx-lm's ``model.shard(group)``: attention
heads *and* key/value heads (and the MLP width) must divide by the group size --
mlx-lm divides ``n_heads`` and ``n_kv_heads`` by N and slices q/k/v/o and
gate/up/down evenly (``mlx.nn.layers.distributed.shard_linear`` raises when a width
does not divide). SmolLM2-135M (9 heads, 3 kv heads) therefore runs on 3 ranks, not 2.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: Per link kind: (latency s, bandwidth bytes/s) assumed when a link does not say.
#: Loopback and TCP figures are this machine's (bench/bench_tp.py: a 2-rank
#: all_sum of one hidden vector over 127.0.0.1 takes ~70 us, i.e. ~35 us a hop).
LINK_DEFAULTS: dict[str, tuple[float, float]] = {
    "loopback": (35e-6, 5e9),
    "thunderbolt": (60e-6, 5e9),  # TCP over Thunderbolt (bridge / thunderbolt-net)
    "thunderbolt-rdma": (10e-6, 10e9),
    "ethernet": (200e-6, 125e6),
    "wifi": (3e-3, 30e6),
}


@dataclass(frozen=True)
class TPMember:
    """One machine that may hold a rank.

    Attributes:
        node_id: ringlet node id.
        host: the address peers reach this member on (ring fallback IP, JACCL coordinator).
        usable_memory: bytes it may fill with weights and caches.
        memory_bandwidth: measured bytes/s (probes' speed result), ``None`` = unknown.
    """

    node_id: str
    host: str
    usable_memory: int
    memory_bandwidth: float | None = None


@dataclass(frozen=True)
class TPLink:
    """A direct link between members ``a`` and ``b`` (either order).

    ``kind``: "loopback", "thunderbolt", "ethernet", "wifi" (other names use the
    ethernet defaults). ``rdma``: RDMA works both ways over it (Thunderbolt 5 with
    ``rdma_ctl`` enabled; ``ThunderboltLink.rdma_both``). ``iface_*``: the network
    interface at each end (JACCL device ``rdma_<iface>``); ``ip_*``: each end's IP
    on this link (ring addresses over Thunderbolt); ``None`` = use the member's host.
    """

    a: str
    b: str
    kind: str = "ethernet"
    rdma: bool = False
    bandwidth: float | None = None
    latency: float | None = None
    iface_a: str | None = None
    iface_b: str | None = None
    ip_a: str | None = None
    ip_b: str | None = None

    def other(self, node: str) -> str:
        return self.b if node == self.a else self.a

    def iface(self, node: str) -> str | None:
        return self.iface_a if node == self.a else self.iface_b

    def ip(self, node: str) -> str | None:
        return self.ip_a if node == self.a else self.ip_b

    def eff_latency(self) -> float:
        if self.latency is not None:
            return float(self.latency)
        return _kind_defaults(self)[0]

    def eff_bandwidth(self) -> float:
        if self.bandwidth is not None:
            return float(self.bandwidth)
        return _kind_defaults(self)[1]


def _kind_defaults(link: TPLink) -> tuple[float, float]:
    if link.kind == "thunderbolt" and link.rdma:
        return LINK_DEFAULTS["thunderbolt-rdma"]
    return LINK_DEFAULTS.get(link.kind, LINK_DEFAULTS["ethernet"])


@dataclass(frozen=True)
class TPModelSpec:
    """What tensor planning needs to know about a model.

    Attributes:
        num_heads, num_kv_heads: attention (query) heads and key/value heads.
        num_layers: decoder layers.
        total_bytes: all weight bytes.
        replicated_bytes: weights every rank holds whole (embedding, head, norms).
        hidden_size: width of the vector all-reduced twice per layer per token.
        intermediate_size: MLP width (sliced by N too); ``None`` = not checked.
        activation_itemsize: bytes per element of the all-reduced vector.
        shardable: the mlx-lm architecture has ``model.shard(group)``.
        quant_group_size: quantization group of the weights (``None`` = float):
            a sliced input dimension must stay a multiple of it.
        head_dim: per-head width (for the quantized o_proj input check).
        name: for messages.
        vocab_size: embedding entries (token ids are below it); ``None`` = unknown.
    """

    num_heads: int
    num_kv_heads: int
    num_layers: int
    total_bytes: int
    replicated_bytes: int = 0
    hidden_size: int = 0
    intermediate_size: int | None = None
    activation_itemsize: int = 4
    shardable: bool = True
    quant_group_size: int | None = None
    head_dim: int | None = None
    name: str = "model"
    vocab_size: int | None = None

    def sharded_bytes(self) -> int:
        return max(0, self.total_bytes - self.replicated_bytes)

    def bytes_per_rank(self, n: int) -> int:
        """Weight bytes one rank of an ``n``-way tensor group holds."""
        return self.replicated_bytes + math.ceil(self.sharded_bytes() / n)


def tp_spec_from_config(
    config: Mapping[str, Any],
    total_bytes: int,
    replicated_bytes: int = 0,
    *,
    shardable: bool = True,
    activation_itemsize: int = 4,
    name: str | None = None,
    num_layers: int | None = None,
) -> TPModelSpec:
    """A :class:`TPModelSpec` from an mlx-lm ``config.json`` dict and byte counts.
    ``num_layers``: the decoder layers counted in the built model (default: the config's
    ``num_hidden_layers``, which some configs leave out: nemotron_h.py derives it from its
    block list). A model without attention heads (mamba.py, rwkv7.py) gets ``num_heads``
    0, which :func:`tensor_refusal` refuses."""
    text = config.get("text_config") if isinstance(config.get("text_config"), Mapping) else {}

    def get(key: str, default: Any = None) -> Any:
        return config.get(key, text.get(key, default))

    heads = int(get("num_attention_heads") or 0)
    kv = int(get("num_key_value_heads") or heads)
    hidden = int(get("hidden_size") or 0)
    head_dim = get("head_dim")
    quant = get("quantization")
    return TPModelSpec(
        num_heads=heads,
        num_kv_heads=kv,
        num_layers=int(num_layers if num_layers is not None else get("num_hidden_layers") or 0),
        total_bytes=int(total_bytes),
        replicated_bytes=int(replicated_bytes),
        hidden_size=hidden,
        intermediate_size=int(get("intermediate_size")) if get("intermediate_size") else None,
        activation_itemsize=activation_itemsize,
        shardable=shardable,
        quant_group_size=int(quant["group_size"]) if isinstance(quant, Mapping) and "group_size" in quant else None,
        head_dim=int(head_dim) if head_dim else (hidden // heads if hidden and heads else None),
        name=str(name or config.get("_name_or_path") or config.get("model_type") or "model"),
        vocab_size=int(get("vocab_size")) if get("vocab_size") else None,
    )


def tensor_refusal(spec: TPModelSpec, n: int) -> str | None:
    """Why ``spec`` cannot be split ``n`` ways by ``model.shard`` (``None`` = it can)."""
    if n < 2:
        return f"tensor parallelism needs at least 2 ranks, got {n}"
    if spec.num_heads <= 0:
        return f"{spec.name}: it has no attention heads to split across ranks"
    if not spec.shardable:
        return f"{spec.name}: mlx-lm has no model.shard() for this architecture"
    bad = []
    if spec.num_heads % n:
        bad.append(f"{spec.num_heads} attention heads")
    if spec.num_kv_heads % n:
        bad.append(f"{spec.num_kv_heads} key/value heads")
    if spec.intermediate_size is not None and spec.intermediate_size % n:
        bad.append(f"MLP width {spec.intermediate_size}")
    if bad:
        ok = [d for d in range(2, max(spec.num_heads, 2) + 1) if _divides(spec, d)]
        hint = f"; group sizes that work: {', '.join(map(str, ok))}" if ok else "; no group size works"
        return f"{spec.name}: {' and '.join(bad)} do not divide by {n} ranks{hint}"
    g = spec.quant_group_size
    if g:
        widths = [("MLP width", spec.intermediate_size)]
        if spec.head_dim:
            widths.append(("attention width", spec.num_heads * spec.head_dim))
        for what, w in widths:
            if w and (w // n) % g:
                return f"{spec.name}: quantized {what} {w}/{n} = {w // n} is not a multiple of the group size {g}"
    return None


def _divides(spec: TPModelSpec, n: int) -> bool:
    return (
        spec.num_heads % n == 0
        and spec.num_kv_heads % n == 0
        and (spec.intermediate_size is None or spec.intermediate_size % n == 0)
    )
