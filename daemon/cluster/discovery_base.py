"""What the parts of :class:`~ringlet.daemon.cluster.discovery.Discovery` share: its state and housekeeping.

:class:`~ringlet.daemon.cluster.discovery.Discovery` is this node's advertiser
(:mod:`ringlet.daemon.cluster.advertiser`) and a peer browser
(:mod:`ringlet.daemon.cluster.peer_browser`) on one asyncio loop and one
zeroconf instance. :class:`DiscoveryBase`, their common base, names the state
they share (set by ``Discovery.__init__``) and holds the housekeeping both use:
callbacks, background tasks owned by the object, logging a problem once.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

from ringlet.daemon.cluster.advert import Advert

__all__ = ["MAX_TRACKED", "DiscoveryBase", "GoodbyeCallback", "PeerCallback"]

# All of discovery logs under one name (its parts live in several modules).
log = logging.getLogger("ringlet.daemon.cluster.discovery")

#: Size bound for the "logged once" memory and the "last heard" table.
MAX_TRACKED = 4096

PeerCallback = Callable[[Advert], Awaitable[None] | None]
GoodbyeCallback = Callable[[str], Awaitable[None] | None]


class DiscoveryBase:
    """State and housekeeping shared by the advertiser and the browser.

    See :class:`~ringlet.daemon.cluster.discovery.Discovery`.
    """

    # Set by Discovery.__init__ (see there for what each holds).
    _node_id: str
    _cluster_id: str
    _grpc_port: int
    _api_port: int
    _interfaces: Sequence[str] | None
    _secret: bytes | None
    _on_peer: PeerCallback | None
    _on_goodbye: GoodbyeCallback | None
    _on_conflict: PeerCallback | None
    _on_incompatible: Callable[[tuple[str, list[str]]], Any] | None
    _started_at_ms: int
    _incarnation: str
    _address_poll_s: float
    _resign_s: float
    _aiozc: AsyncZeroconf | None
    _info: AsyncServiceInfo | None
    _addresses: list[str]
    _peers: dict[str, Advert]
    _instances: dict[str, Advert]
    _conflicts: set[str]
    _own_names: set[str]
    _logged: set[tuple[str, str]]
    _last_heard: dict[str, float]
    _resolving: set[str]
    _resolve_again: set[str]
    _unresolved: dict[str, tuple[int, float, float]]
    _retrying: set[str]
    _tasks: set[asyncio.Task[Any]]
    _last_signed: float
    _running: bool
    registration_s: float | None

    def _log_once(self, peer: str, reason: str, level: int, msg: str, *args: object) -> None:
        key = (peer, reason)
        if key in self._logged:
            return
        if len(self._logged) >= MAX_TRACKED:
            self._logged.clear()
        self._logged.add(key)
        log.log(level, msg, *args)

    def _call(self, callback: Callable[..., Any] | None, arg: object) -> None:
        if callback is None:
            return
        try:
            result = callback(arg)
            if inspect.isawaitable(result):
                self._track(result)
        except Exception:
            log.exception("mDNS: %s callback failed", getattr(callback, "__name__", "discovery"))

    def _track(self, aw: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(aw)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Future[Any]) -> None:
        self._tasks.discard(task)  # type: ignore[arg-type]
        if not task.cancelled() and task.exception() is not None:
            log.error("mDNS: background task failed", exc_info=task.exception())
