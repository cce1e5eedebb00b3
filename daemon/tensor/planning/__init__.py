"""Tensor-parallel planning: pick a mode and an MLX backend, and write MLX's host configuration.

Pure: no I/O (except :meth:`HostConfig.write`), no asyncio, no MLX import,
deterministic for the same inputs in any order.

* :mod:`.inputs`: members (:class:`TPMember`), links (:class:`TPLink`) and the
  model (:class:`TPModelSpec`), and whether a model splits ``n`` ways;
* :mod:`.links`: link builders (:func:`loopback_links`, :func:`lan_links`,
  :func:`links_from_thunderbolt` from ``ringlet.daemon.probes.match_links``);
* :mod:`.topology`: the best link per pair and ring finding (:func:`find_ring`);
* :mod:`.prediction`: predicted decode seconds per token of each mode;
* :mod:`.decision`: the mode decision (:func:`decide`: pipeline, tensor or hybrid,
  the backend and the rank order);
* :mod:`.mlx_hosts`: MLX's host configuration of a tensor group (:func:`host_config`).

This package re-exports that public API (``from ringlet.daemon.tensor import planning``);
code inside the daemon imports from the modules themselves.
"""

from __future__ import annotations

from ringlet.daemon.tensor.planning.decision import BACKENDS, MEMORY_HEADROOM, MODES, TPDecision, TPRefused, decide
from ringlet.daemon.tensor.planning.inputs import (
    LINK_DEFAULTS,
    TPLink,
    TPMember,
    TPModelSpec,
    tensor_refusal,
    tp_spec_from_config,
)
from ringlet.daemon.tensor.planning.links import lan_links, links_from_thunderbolt, loopback_links
from ringlet.daemon.tensor.planning.mlx_hosts import (
    HOSTFILE_NAME,
    IBV_DEVICES_NAME,
    HostConfig,
    decision_host_configs,
    host_config,
)
from ringlet.daemon.tensor.planning.prediction import DEFAULT_MEMORY_BANDWIDTH, allreduce_seconds, predict_token_seconds
from ringlet.daemon.tensor.planning.topology import EXACT_RING_LIMIT, LinkGraph, find_ring

__all__ = [
    "BACKENDS",
    "DEFAULT_MEMORY_BANDWIDTH",
    "EXACT_RING_LIMIT",
    "HOSTFILE_NAME",
    "IBV_DEVICES_NAME",
    "LINK_DEFAULTS",
    "MEMORY_HEADROOM",
    "MODES",
    "HostConfig",
    "LinkGraph",
    "TPDecision",
    "TPLink",
    "TPMember",
    "TPModelSpec",
    "TPRefused",
    "allreduce_seconds",
    "decide",
    "decision_host_configs",
    "find_ring",
    "host_config",
    "lan_links",
    "links_from_thunderbolt",
    "loopback_links",
    "predict_token_seconds",
    "tensor_refusal",
    "tp_spec_from_config",
]
