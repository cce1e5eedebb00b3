"""Nodes kept out of the cluster because they speak another wire protocol version.

The handshake (``GetNodeInfo``, :meth:`.membership.Membership._handshake`) is where every
way of hearing of a node ends; a node whose ``protocol_version`` differs from this one's
is refused there, never admitted, and noted here with the reason, which names both
versions and which node to upgrade (:func:`ringlet.daemon.wire.versions.incompatible_reason`).
An mDNS advert of another protocol version leads to that handshake too (its node id and
port are read from the advert's TXT even though it is not accepted), so a node is kept
out for the same stated reason however it was found. ``GetNodeInfo``'s node id, protocol
version and record stay readable across protocol versions for that (docs/wire-compat.md).

The list feeds events (one per node and version), ``/v1/cluster``'s ``incompatible``,
``ringlet status``, the dashboard and ``ringlet doctor``. An entry is dropped when the node
is admitted (upgraded) or has not been heard of for :data:`FORGET_AFTER_S`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from ringlet.daemon.wire import versions

#: An incompatible node not heard of (handshake or advert) for this long is dropped, seconds.
FORGET_AFTER_S = 600.0


class Incompatible:
    """The nodes this node keeps out for their protocol version, by node id.

    Args:
        on_event: called with ``(kind, message)`` once per node and protocol version.
    """

    def __init__(self, on_event: Callable[[str, str], None] | None = None):
        self.on_event = on_event or (lambda kind, msg: None)
        self._nodes: dict[str, dict] = {}
        self._seen: dict[str, float] = {}  # node id -> monotonic time last heard of

    def seen(self, node_id: str, address: str, protocol: int, record_json: str = "") -> str:
        """A handshake with ``node_id`` at ``address`` found protocol version ``protocol``
        (its ``record_json`` may name its release); record it and return the reason it is
        kept out."""
        try:
            record = json.loads(record_json) if record_json else {}
        except ValueError:
            record = {}
        release = record.get(versions.RECORD_RELEASE) if isinstance(record, dict) else None
        release = release if isinstance(release, str) and release else "an unknown release"
        node_id = node_id or address
        reason = versions.incompatible_reason(node_id, release, protocol)
        entry = {"node_id": node_id, "address": address, "release": release, "protocol_version": protocol,
                 "reason": reason}
        known = self._nodes.get(node_id)
        self._nodes[node_id] = entry
        self._seen[node_id] = time.monotonic()
        if known is None or known["protocol_version"] != protocol:
            self.on_event("incompatible", f"kept out: {reason}")
        return reason

    def admitted(self, node_id: str) -> None:
        """``node_id`` passed a handshake (it was upgraded): it is no longer kept out."""
        self._nodes.pop(node_id, None)
        self._seen.pop(node_id, None)

    def info(self) -> list[dict]:
        """Every node kept out: ``{node_id, address, release, protocol_version, reason}``,
        sorted by node id (JSON-safe); entries not heard of for :data:`FORGET_AFTER_S` are
        dropped first."""
        now = time.monotonic()
        for node_id in [n for n, t in self._seen.items() if now - t > FORGET_AFTER_S]:
            self.admitted(node_id)
        return [dict(self._nodes[n]) for n in sorted(self._nodes)]
