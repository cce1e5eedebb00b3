"""Tensor-parallel link builders: :class:`~ringlet.daemon.tensor.planning.inputs.TPLink`
sets for one machine (:func:`loopback_links`), one switched network (:func:`lan_links`)
and Thunderbolt cables (:func:`links_from_thunderbolt`, from
``ringlet.daemon.probes.match_links``).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ringlet.daemon.tensor.planning.inputs import TPLink


def loopback_links(node_ids: Sequence[str]) -> tuple[TPLink, ...]:
    """A full mesh of loopback links (ranks simulated on one machine)."""
    ids = sorted(node_ids)
    return tuple(TPLink(a, b, "loopback") for a, b in itertools.combinations(ids, 2))


def lan_links(
    node_ids: Sequence[str], *, latency: float | None = None, bandwidth: float | None = None, kind: str = "ethernet"
) -> tuple[TPLink, ...]:
    """Every pair on one switched network (a full mesh of ``kind`` links)."""
    ids = sorted(node_ids)
    return tuple(TPLink(a, b, kind, latency=latency, bandwidth=bandwidth) for a, b in itertools.combinations(ids, 2))


def links_from_thunderbolt(
    tb_links: Iterable[Any], ips: Mapping[tuple[str, str], str] | None = None, latency: float | None = None
) -> tuple[TPLink, ...]:
    """Convert ``probes.match_links`` results (``ThunderboltLink``) into :class:`TPLink`.

    ``ips`` maps ``(node_id, interface)`` to that interface's IPv4 address when
    known (the ring backend then runs over the cable itself).
    """
    ips = ips or {}
    out = []
    for t in tb_links:
        out.append(
            TPLink(
                a=t.node_a,
                b=t.node_b,
                kind="thunderbolt",
                rdma=bool(t.rdma_both),
                bandwidth=float(t.speed_bytes_per_s) if t.speed_bytes_per_s else None,
                latency=latency,
                iface_a=t.iface_a,
                iface_b=t.iface_b,
                ip_a=ips.get((t.node_a, t.iface_a or "")),
                ip_b=ips.get((t.node_b, t.iface_b or "")),
            )
        )
    return tuple(out)
