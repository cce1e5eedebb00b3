"""Fetching the cluster's view: :class:`Collector` polls ``GET /v1/cluster`` of every API
URL known -- the ``--api`` URLs given (the first one that answers is the *primary*)
and every ``members[].api_url`` a node reported -- concurrently, each with a short
timeout, and builds snapshots (:mod:`ringlet.daemon.ops.status.snapshot`). A node
that does not answer is marked unreachable; nothing raises. It keeps the counter
history of each node for the client-side tokens/s.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque

import httpx

from ringlet.daemon.errors import RingletError
from ringlet.daemon.ops.client import auth_headers
from ringlet.daemon.ops.status.snapshot import build_snapshot
from ringlet.daemon.ops.status.urls import default_api_url, member_api_url, normalize_api_url
from ringlet.daemon.ops.status.values import as_int, as_str, dicts

#: Seconds of counter history the client-side rate is computed over.
RATE_WINDOW_S = 2.0


def _reason(exc: BaseException) -> str:
    if isinstance(exc, httpx.ConnectError):
        cause: BaseException | None = exc
        while cause is not None:
            if isinstance(cause, ConnectionRefusedError) or "refused" in str(cause).lower():
                return "connection refused"
            cause = cause.__cause__ or cause.__context__
        return f"cannot connect ({exc})"
    if isinstance(exc, httpx.TimeoutException):
        return "timed out"
    if isinstance(exc, httpx.HTTPStatusError):
        return f"HTTP {exc.response.status_code}"
    if isinstance(exc, (ValueError, json.JSONDecodeError)):
        return "answer is not JSON"
    return str(exc) or type(exc).__name__


class Collector:
    """Polls ``/v1/cluster`` of the given nodes (and of every member they report) and
    builds snapshots; keeps the counter history for client-side tokens/s.

    Args:
        api_urls: API base URLs; the first one that answers is the primary.
        timeout_s: per-request timeout.
    """

    def __init__(self, api_urls: list[str], timeout_s: float = 1.0, api_key: str | None = None):
        if not api_urls:
            api_urls = [default_api_url()]
        self.api_urls = [normalize_api_url(u) for u in api_urls]
        self.timeout_s = timeout_s
        self.discovered: list[str] = []
        self._samples: dict[str, deque[tuple[float, int]]] = {}
        #: api_url -> gRPC address, from every answer so far
        self.addresses: dict[str, str] = {}
        self._client: httpx.AsyncClient | None = None
        self._headers = auth_headers(api_key)

    async def _get(self, client: httpx.AsyncClient, url: str) -> dict:
        resp = await client.get(f"{url}/v1/cluster")
        resp.raise_for_status()
        data = resp.json()
        if not isinstance(data, dict):
            raise ValueError("not an object")
        return data

    async def fetch(self) -> tuple[str | None, dict[str, dict], dict[str, str]]:
        """One round of requests: ``(primary, infos, errors)``."""
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.timeout_s, trust_env=False, headers=self._headers)
        urls = list(dict.fromkeys(self.api_urls + self.discovered))
        results = await asyncio.gather(*(self._get(self._client, u) for u in urls), return_exceptions=True)
        infos: dict[str, dict] = {}
        errors: dict[str, str] = {}
        for url, res in zip(urls, results, strict=True):
            if isinstance(res, BaseException):
                if not isinstance(res, Exception):
                    raise res
                errors[url] = _reason(res)
            else:
                infos[url] = res
        primary = next((u for u in urls if u in infos), None)
        # members' API URLs: polled from the next round on (and now, when new)
        listed: list[str] = []  # members' API URLs, as the nodes that answered list them now
        for info in infos.values():
            for m in dicts(info.get("members")):
                url = member_api_url(m)
                if url:
                    try:
                        url = normalize_api_url(url)
                    except RingletError:
                        continue
                    if url not in listed:
                        listed.append(url)
        if infos:  # a member that left is no longer polled (the --api URLs always are)
            self.discovered = [u for u in self.discovered if u in listed]
        new = [u for u in listed if u not in urls]
        if new:
            self.discovered.extend(new)
            more = await asyncio.gather(*(self._get(self._client, u) for u in new), return_exceptions=True)
            for url, res in zip(new, more, strict=True):
                if isinstance(res, Exception):
                    errors[url] = _reason(res)
                elif isinstance(res, dict):
                    infos[url] = res
            if primary is None:
                primary = next((u for u in new if u in infos), None)
        return primary, infos, errors

    def rates(self, infos: dict[str, dict], now: float) -> tuple[dict[str, float], float | None]:
        """Client-side tokens/s per node (by gRPC address) from ``tokens_generated_total``."""
        rates: dict[str, float] = {}
        for info in infos.values():
            addr = as_str(info.get("address")) or as_str(info.get("node_id"))
            count = as_int(info.get("tokens_generated_total"))
            if not addr or count is None:
                continue
            samples = self._samples.setdefault(addr, deque())
            if samples and count < samples[-1][1]:
                samples.clear()  # the node restarted: its counter started over
            samples.append((now, count))
            while len(samples) > 2 and now - samples[1][0] >= RATE_WINDOW_S:
                samples.popleft()
            t0, c0 = samples[0]
            if now - t0 > 0.05:
                rates[addr] = (count - c0) / (now - t0)
        total = sum(rates.values()) if rates else None
        return rates, total

    async def snapshot(self, extra_events: list[dict] | None = None) -> dict:
        """Poll once and build a snapshot; never raises for an unreachable node."""
        primary, infos, errors = await self.fetch()
        now = time.time()
        rates, total = self.rates(infos, now)
        for url, info in infos.items():
            addr = as_str(info.get("address")) or as_str(info.get("node_id"))
            if addr:
                self.addresses[url] = addr
        return build_snapshot(primary, infos, errors, rates=rates, cluster_rate=total, now=now,
                              extra_events=extra_events, addresses=self.addresses)

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


def take_snapshot(api_urls: list[str], timeout_s: float = 2.0, api_key: str | None = None) -> dict:
    """One snapshot, synchronously (for ``ringlet status`` and scripts); ``api_key`` is
    sent as a bearer key (nodes run with ``--api-key-file``)."""

    async def once() -> dict:
        c = Collector(api_urls, timeout_s=timeout_s, api_key=api_key)
        try:
            return await c.snapshot()
        finally:
            await c.aclose()

    return asyncio.run(once())
