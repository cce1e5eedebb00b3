"""The errors of a tensor group (:class:`ringlet.daemon.tensor.group.TPGroup`)."""

from __future__ import annotations

from ringlet.daemon.errors import RingletError


class TPGroupError(RingletError):
    """The tensor group cannot serve (could not start, or every recovery failed)."""


class TPStageLost(TPGroupError):
    """Stage mode: the group restarted since a KV-cache slot was created, so the slot's
    cache is gone (the request must prefill again)."""
