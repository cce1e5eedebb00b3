"""The members agree on the set of models: loads and unloads reach every member.

``ringlet models load`` (``POST /v1/models/load``) on any node loads the model there and
asks every member it knows (the first lane's members, at the API each advertises) to load
it too; ``unload`` likewise. Each node's set carries a version (one more at each change);
every :data:`SYNC_S` seconds a node reads its members' sets (``GET /v1/lanes``) and takes a
newer one: a node that was down during a load, or that joins later, loads the cluster's
models by itself. The set and its version are kept in ``<data dir>/models.json``, so a
restarted node serves what it served.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from pathlib import Path

import httpx

log = logging.getLogger("ringlet.daemon.lanes")

__all__ = ["SYNC_S", "ModelSync"]

#: Seconds between two reads of the members' sets of models.
SYNC_S = 3.0


def _check_model(model: str) -> None:
    """A model path or short name must resolve here before a lane starts for it (a Hub
    name is fetched by the lane, as ``ringlet run`` does).

    Raises:
        ValueError: it cannot be found or read, with the loader's reason.
    """
    from ringlet.daemon.engine.hub import parse_ref
    from ringlet.daemon.engine.sources import resolve
    from ringlet.daemon.errors import RingletError

    if parse_ref(model) is not None and not Path(model).exists():
        return
    try:
        resolve(model)
    except (RingletError, OSError, ValueError) as exc:
        raise ValueError(f"cannot load {model}: {exc}") from None


def _order(models: dict) -> tuple[int, int, tuple[str, ...]]:
    """Which of two sets of models is newer: the higher version; at one version (two changes
    at once on two nodes) the set of more models, then the keys in order, so every member
    takes the same."""
    names = tuple(sorted(str(m.get("key", "")) for m in models.get("models", [])))
    return int(models.get("version", 0)), len(names), names


class ModelSync:
    """Loads, unloads and the set's agreement for this node's :class:`~.lanes.Lanes`.

    Args:
        lanes: the node's lanes.
        path: the file the set is kept in (``<data dir>/models.json``).
        own_url: this node's API (left out of the members asked).
        headers: headers of this node's own calls to its members (its API key).
    """

    def __init__(self, lanes, path: Path, own_url: str, headers: dict[str, str]):
        self.lanes = lanes
        self.path = path
        self.own_url = own_url.rstrip("/")
        self.headers = headers
        self.cli_models = [lane.model for lane in lanes.lanes]
        self._client = httpx.AsyncClient(timeout=10.0)
        self._lock = asyncio.Lock()

    def restore(self) -> None:
        """Before the lanes start: take the kept set (models loaded and unloaded at run time),
        unless the command line changed since it was kept (then the command line's set; the
        first model is never dropped)."""
        try:
            kept = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return
        self.lanes.version = int(kept.get("version", 0))
        if kept.get("cli") != self.cli_models:
            return
        wanted = {m["key"]: m for m in kept.get("models", []) if isinstance(m, dict) and m.get("key")}
        for lane in list(self.lanes.lanes):
            if lane.key not in wanted and len(self.lanes.lanes) > 1 and not lane.primary:
                self.lanes.lanes.remove(lane)  # unloaded at run time
        for key, m in wanted.items():
            if self.lanes.find(key) is None:
                self.lanes.add(m["model"], list(m.get("aliases") or []))  # loaded at run time

    def save(self) -> None:
        models = [{"model": lane.model, "key": lane.key, "aliases": list(lane.aliases)} for lane in self.lanes.lanes]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"version": self.lanes.version, "models": models, "cli": self.cli_models},
                                  indent=1))
        os.replace(tmp, self.path)

    def member_urls(self) -> list[str]:
        """The other members' API URLs, from the first lane's view of its ring."""
        view = self.lanes.default.view or {}
        urls = {(m.get("api_url") or "").rstrip("/") for m in view.get("members") or []}
        return sorted(u for u in urls if u and u != self.own_url)

    async def _tell_members(self, path: str, body: dict, headers: dict[str, str],
                            urls: list[str] | None = None) -> dict[str, str]:
        """POST ``body`` to ``path`` on every member (``urls``, default :meth:`member_urls`);
        returns each one's answer in words."""
        results: dict[str, str] = {}

        async def one(url: str) -> None:
            try:
                r = await self._client.post(url + path, json={**body, "propagate": False}, headers=headers,
                                            timeout=30.0)
                # a member that already took the change from the set's agreement (run) answers 409 or 404
                done = (path.endswith("/load") and r.status_code == 409) or (
                    path.endswith("/unload") and r.status_code == 404)
                results[url] = "ok" if r.status_code < 300 else "ok (it had it already)" if done else (
                    f"{r.status_code}: {r.text[:200]}")
            except httpx.HTTPError as exc:
                results[url] = f"unreachable ({exc}); it takes the set when it answers"

        await asyncio.gather(*(one(u) for u in (self.member_urls() if urls is None else urls)))
        return results

    async def load(self, model: str, aliases: list[str], headers: dict[str, str], propagate: bool) -> dict:
        """Load ``model`` here (lowest priority) and, with ``propagate``, on every member.

        Raises:
            ValueError: it is already served here.
        """
        await asyncio.get_running_loop().run_in_executor(None, _check_model, model)
        async with self._lock:
            lane = await self.lanes.load(model, aliases)
            self.save()
        members = await self._tell_members("/v1/models/load", {"model": model, "aliases": aliases},
                                           headers) if propagate else {}
        return {"model": lane.key, "state": lane.state, "priority": self.lanes.lanes.index(lane),
                "version": self.lanes.version, "members": members}

    async def unload(self, name: str, headers: dict[str, str], propagate: bool) -> dict:
        """Unload the model ``name`` here and, with ``propagate``, on every member.

        Raises:
            KeyError: no such model here. ValueError: it is the only one.
        """
        urls = self.member_urls()  # before the first lane may be the one that goes
        async with self._lock:
            lane = await self.lanes.unload(name)
            self.save()
        members = await self._tell_members("/v1/models/unload", {"model": lane.key}, headers,
                                           urls) if propagate else {}
        return {"model": lane.key, "state": "unloaded", "version": self.lanes.version, "members": members}

    async def run(self) -> None:
        """Every :data:`SYNC_S` seconds, take a member's newer set of models."""
        while True:
            await asyncio.sleep(SYNC_S)
            with contextlib.suppress(Exception):
                await self._sync_once()

    async def _sync_once(self) -> None:
        for url in self.member_urls():
            try:
                r = await self._client.get(url + "/v1/lanes", headers=self.headers, timeout=5.0)
                theirs = r.json() if r.status_code == 200 else None
            except (httpx.HTTPError, ValueError):
                continue
            if not theirs or _order(theirs) <= _order(self.lanes.models()):
                continue
            async with self._lock:
                models = theirs.get("models") or []
                keys = {m.get("key") for m in models}
                for lane in list(self.lanes.lanes):
                    if lane.key not in keys and len(self.lanes.lanes) > 1 and not lane.primary:
                        log.info("model %s was unloaded on %s: unloading it here", lane.key, url)
                        await self.lanes.unload(lane.key)
                for m in models:
                    if self.lanes.find(m.get("key")) is None:
                        log.info("model %s was loaded on %s: loading it here", m.get("model"), url)
                        await self.lanes.load(m["model"], list(m.get("aliases") or []))
                self.lanes.version = int(theirs["version"])
                self.save()
            return
