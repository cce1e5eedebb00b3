"""The web console every node serves at ``/``: the cluster live, and a chat.

``GET /`` is the page and ``/console/*`` its assets (all from the package: a cluster is often
offline; ``static/vendor/`` holds the libraries ``vendor.py`` copies from npm), loaded without
an API key; what the page fetches is under ``/v1`` and needs the key when keys are set (the
page asks once and keeps it in the browser). ``GET /v1/console/events`` is the live view:
server-sent events, one ``data:`` line a second with this node's ``/v1/cluster`` view plus a
few figures each other member reports about itself (memory used, state, download).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).resolve().parent / "static"
#: seconds between two views the live stream sends
PERIOD_S = 1.0
#: what the page shows of another member, from that member's own /v1/cluster
PEER_FIELDS = ("state", "release", "memory", "download", "loading_progress", "requests_in_flight",
               "prefilling", "speculation", "batching", "recent_requests", "layer_range", "epoch")

log = logging.getLogger(__name__)


async def _peer(client: httpx.AsyncClient, url: str, headers: dict[str, str]) -> dict | None:
    try:
        reply = await client.get(url.rstrip("/") + "/v1/cluster", headers=headers)
        reply.raise_for_status()
        info = reply.json()
    except (httpx.HTTPError, ValueError):
        return None
    return {k: info.get(k) for k in PEER_FIELDS}


class _Peers:
    """The other members' own figures, fetched at most once a period whichever number of pages
    watch (every page of a node shares them; any key that passed the guard sees the same cluster)."""

    def __init__(self):
        self.client: httpx.AsyncClient | None = None
        self.fetches: dict[str, tuple[float, asyncio.Future]] = {}  # api_url -> (when, its fetch)

    async def figures(self, url: str, headers: dict[str, str]) -> dict | None:
        if self.client is None:
            self.client = httpx.AsyncClient(timeout=httpx.Timeout(0.8), trust_env=False)
        now = time.monotonic()
        for stale in [u for u, (when, _) in self.fetches.items() if now - when > 60]:
            del self.fetches[stale]
        when, fetch = self.fetches.get(url, (-1e9, None))
        if fetch is None or now - when >= PERIOD_S * 0.9:
            fetch = asyncio.ensure_future(_peer(self.client, url, headers))
            self.fetches[url] = (now, fetch)
        return await asyncio.shield(fetch)


async def _views(request: Request, snapshot: Callable[[], dict], peers: _Peers) -> AsyncIterator[str]:
    headers = {k: v for k, v in request.headers.items() if k in ("authorization", "x-api-key")}
    # until the page goes, or the node stops (app.state.stopping: the view must not hold the drain)
    while not await request.is_disconnected() and not getattr(request.app.state, "stopping", False):
        view = snapshot()
        others = [m for m in view.get("members", ()) if m.get("state") != "self" and m.get("api_url")]
        found = await asyncio.gather(*(peers.figures(m["api_url"], headers) for m in others))
        view["peers"] = {m["node_id"]: f for m, f in zip(others, found, strict=True) if f is not None}
        yield "data: " + json.dumps(view, default=str) + "\n\n"
        await asyncio.sleep(PERIOD_S)


def register(app: FastAPI, snapshot: Callable[[], dict]) -> None:
    """Serve the page, its assets and the live stream; ``snapshot`` gives the ``/v1/cluster`` view.
    An install without the console's files (package data left out) serves the API without it."""
    if not (STATIC / "index.html").is_file():
        log.warning("web console: its files are missing from this install (%s); the API serves without it", STATIC)
        return
    peers = _Peers()

    @app.get("/", include_in_schema=False)
    async def page():
        return FileResponse(STATIC / "index.html", headers={"cache-control": "no-cache"})

    @app.get("/v1/console/events", include_in_schema=False)
    async def events(request: Request):
        return StreamingResponse(_views(request, snapshot, peers), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache", "x-accel-buffering": "no"})

    app.mount("/console", StaticFiles(directory=STATIC), name="console")
