"""Thunderbolt ports in membership records: what a node publishes (:func:`thunderbolt_record`)
and what the proposer reads back (:func:`record_ports`) to pair cables across members
(``probes.match_links``), RDMA included.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

#: ThunderboltPort fields a node publishes in its record (``record["thunderbolt"]``): what
#: ``probes.match_links`` needs to pair cables across members, and whether RDMA works.
TB_FIELDS = ("port_id", "interface", "own_domain_uuid", "peer_domain_uuid", "link_speed_bytes_per_s", "peer_rdma")


def thunderbolt_record(ports: Sequence[Any]) -> list[dict]:
    """This node's cabled Thunderbolt ports (``probe.thunderbolt``) for its membership record."""
    return [{f: getattr(p, f, None) for f in TB_FIELDS} for p in ports
            if getattr(p, "own_domain_uuid", None) and getattr(p, "peer_domain_uuid", None)]


def record_ports(record: Mapping[str, Any]) -> tuple:
    """The ``ThunderboltPort`` entries a member published in its record (``record["thunderbolt"]``)."""
    from ringlet.daemon.probes.common import ThunderboltPort

    out = []
    for d in record.get("thunderbolt") or ():
        if not isinstance(d, dict):
            continue
        speed = d.get("link_speed_bytes_per_s")
        out.append(ThunderboltPort(
            port_id=str(d["port_id"]) if d.get("port_id") is not None else None,
            interface=str(d["interface"]) if d.get("interface") else None,
            own_domain_uuid=str(d.get("own_domain_uuid") or "") or None,
            peer_domain_uuid=str(d.get("peer_domain_uuid") or "") or None,
            link_speed_bytes_per_s=int(speed) if isinstance(speed, (int, float)) and speed > 0 else None,
            peer_rdma=d.get("peer_rdma") is True,
        ))
    return tuple(out)
