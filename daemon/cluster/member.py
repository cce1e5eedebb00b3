"""One member of the cluster as a node's member table holds it, and the digest of a view
(:mod:`.membership` keeps the table)."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

__all__ = ["Member", "membership_digest"]


@dataclass
class Member:
    """One peer admitted to the cluster.

    Attributes:
        node_id: its id.
        address: its gRPC ``host:port``.
        incarnation: changes every time its process starts.
        record: its self-description (see :meth:`Membership.own_record`).
        record_version: version of ``record`` (owned and bumped by the member).
        state: ``alive`` or ``suspect``.
        last_ok: ``time.monotonic()`` of the last successful exchange.
    """

    node_id: str
    address: str
    incarnation: str = ""
    record: dict = field(default_factory=dict)
    record_version: int = 0
    state: str = "alive"
    last_ok: float = field(default_factory=time.monotonic)
    joined_at: float = field(default_factory=time.time)
    committed_epoch: int = 0
    plan_id: str = ""
    failures: int = 0
    #: the digest of its view of the membership, from its last beat (:func:`membership_digest`)
    digest: str = ""


def membership_digest(node_ids) -> str:
    """sha256 (hex, 16 chars) of the sorted member ids: the view a plan is made for."""
    return hashlib.sha256("\n".join(sorted(node_ids)).encode()).hexdigest()[:16]
