"""Several models on one node: one lane per model, memory shared by priority.

``ringlet run --model A --model B`` runs one *lane* per model: a ``ringlet run`` child
process serving that model alone (:mod:`.lane_args`). The first model's lane is the node as
a single-model daemon would be (its ``--cluster``, data directory and node id), so a node
restarted with more models stays in that model's ring; each other model's lane is in the
cluster ``<cluster>/<model key>`` with its data under ``<data dir>/models/<key>``. So each
model forms its own ring over the nodes with its own plans, epochs, KV
moves, prefix store, batching and mode, and a fault in one model's engine stays in its
process. The parent serves the API on the node's port (:mod:`ringlet.daemon.api.front`)
and sends each request to the lane of the model it names.

Memory is pooled by priority (the order of ``--model``; a model loaded at run time comes
last). Lane *i* offers the planner what the lanes before it leave on this node::

    share_i = usable - sum(footprint_j for j < i)

where ``usable`` is what a single daemon would offer here (the memory probe's rule, or
``--memory-limit``) and ``footprint_j`` is lane *j*'s planned footprint on this node
(weights, KV at its context, stores, work space, tokenizer, runtime: ``/v1/cluster``'s
``memory.planned.total_bytes``), or what it reserved to load a new stage, whichever is
larger. Each lane follows its share from a file (``--lane-share-file``) as it follows a
changed cgroup limit: a share that no longer holds its plan re-plans it, and a model that
fits nowhere is left out with the reason (503 naming what would fit it). Lane 0 takes the
whole figure: a lower model never takes memory a higher one needs.

Before a lane loads a stage, it reserves the memory it will hold while loading
(``POST /v1/lanes/reserve``, :meth:`Lanes.reserve`): the lanes after it get smaller shares
at once, re-plan and drop what they can no longer hold, and the load waits (at most
:data:`RESERVE_WAIT_S`) until the lanes after it hold no more than what is left. So a
higher model that grows on a survivor of a lost node never loads beside a lower model's
layers past the node's memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from ringlet.daemon.ops.lane_args import lane_argv, lane_key
from ringlet.daemon.probes.memory import size_text
from ringlet.daemon.wire.ports import claim_port, free_ports

log = logging.getLogger("ringlet.daemon.lanes")

__all__ = ["POLL_S", "RESERVE_WAIT_S", "Lane", "Lanes"]

#: Seconds between two reads of every lane's ``/v1/cluster``.
POLL_S = 1.0
#: Seconds a lane's load waits at most for the lanes after it to give the memory back.
RESERVE_WAIT_S = 30.0
#: Seconds a lane gets to answer before the next lane starts anyway.
START_WAIT_S = 180.0
#: Seconds a lane's ring may serve without a stage here before the next lane starts anyway.
SETTLE_S = 20.0
#: A lane that exits this soon after starting, :data:`GIVE_UP_AFTER` times in a row, is not restarted.
QUICK_EXIT_S = 20.0
GIVE_UP_AFTER = 3
#: A share that moved by less than this fraction is not rewritten.
SHARE_STEP = 0.05


@dataclass
class Lane:
    """One model's child daemon on this node.

    ``model`` is the ``--model`` value (path, short or Hub name), ``key`` its
    :func:`~.lane_args.lane_key`, ``served`` the model id its API answers to (known once it
    answers), ``aliases`` the other names requests may use. Bytes: ``footprint`` (planned on
    this node), ``reserved`` (asked for a load in progress), ``share`` (offered to it)."""

    model: str
    key: str
    aliases: list[str] = field(default_factory=list)
    served: str | None = None
    grpc_port: int = 0
    api_port: int = 0
    proc: asyncio.subprocess.Process | None = None
    state: str = "starting"
    footprint: int = 0
    reserved: int = 0
    share: int | None = None
    view: dict | None = None
    restarts: int = 0
    quick_exits: int = 0
    primary: bool = False  # the node's first --model: the node's own cluster, data dir and identity
    reason: str | None = None  # why it is failed or restarting
    started_at: float = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    def names(self) -> set[str]:
        """Every name a request may give for this lane."""
        return {n for n in (self.served, self.key, self.model, *self.aliases) if n}

    def to_dict(self) -> dict:
        return {"model": self.model, "key": self.key, "served": self.served, "aliases": list(self.aliases),
                "state": self.state, "footprint_bytes": self.footprint, "reserved_bytes": self.reserved,
                "share_bytes": self.share, "restarts": self.restarts, "reason": self.reason,
                "pid": self.proc.pid if self.proc is not None else None}


class Lanes:
    """The lanes of this node: started in priority order, watched, restarted, shared memory.

    Args:
        run_argv: the parent's command line after the program name (``run`` and its options).
        models: ``--model`` values in priority order; ``aliases``: alias -> model value.
        grpc_port: the node's ``--port`` (lane *i* binds ``grpc_port + i`` when free).
        data_dir: the node's data directory (each lane gets ``models/<key>`` under it).
        cluster: the node's ``--cluster``.
        usable_bytes: what a single daemon would offer here (``share_i``'s ``usable``).
        public_api_url: the node's API (the lanes advertise it as theirs).
        supervisor_url: where the lanes reach this object's HTTP endpoints (the same API).
        headers: headers of this node's own calls to its lanes (its API key).
    """

    def __init__(self, run_argv: list[str], models: list[str], aliases: dict[str, str], *, grpc_port: int,
                 data_dir: Path, cluster: str, usable_bytes: int, public_api_url: str, supervisor_url: str,
                 headers: dict[str, str] | None = None, contexts: dict[str, int] | None = None):
        self.run_argv = run_argv
        self.contexts = dict(contexts or {})  # --model value -> its --model-context (the others: --context)
        self.grpc_port = grpc_port
        self.data_dir = data_dir
        self.cluster = cluster
        self.usable_bytes = usable_bytes
        self.public_api_url = public_api_url
        self.supervisor_url = supervisor_url
        self.headers = dict(headers or {})
        self.lanes: list[Lane] = []
        self.version = 0  # of the set of models, for the members' agreement (front.py)
        self._task: asyncio.Task | None = None
        self._starting: asyncio.Task | None = None
        self._stopping = False
        self._client = httpx.AsyncClient(timeout=5.0)
        self._relays: set[asyncio.Task] = set()
        self.log_prefix = True  # text logs: each lane's lines start with its model's key (not JSON logs)
        self.on_event = lambda kind, message: None
        for m in models:
            self.add(m, [a for a, target in aliases.items() if target == m])

    # --- the set of models -----------------------------------------------------------------

    def add(self, model: str, aliases: list[str]) -> Lane:
        """Add ``model`` at the lowest priority (not started).

        Raises:
            ValueError: a model of that name is already served.
        """
        key = lane_key(model)
        if any(lane.key == key for lane in self.lanes):
            raise ValueError(f"--model {model}: a model named {key!r} is already served")
        lane = Lane(model, key, aliases, primary=not self.lanes)
        self.lanes.append(lane)
        return lane

    def find(self, name: str | None) -> Lane | None:
        """The lane serving ``name`` (a served id, key, ``--model`` value or alias);
        ``None`` (or an empty name): none."""
        if not name:
            return None
        for lane in self.lanes:
            if name in lane.names():
                return lane
        return None

    @property
    def default(self) -> Lane:
        """The first lane: requests that name no model, and the node's own views."""
        return self.lanes[0]

    def models(self) -> dict:
        """``GET /v1/lanes``: this node's set of models, in priority order, and its version."""
        return {"version": self.version, "models": [lane.to_dict() for lane in self.lanes]}

    async def load(self, model: str, aliases: list[str]) -> Lane:
        """Start a lane for ``model`` at the lowest priority.

        Raises:
            ValueError: a model of that name is already served.
        """
        lane = self.add(model, aliases)
        self.version += 1
        self.on_event("models", f"loading {model} (priority {len(self.lanes)})")
        await self._start(lane, len(self.lanes) - 1)
        return lane

    async def unload(self, name: str) -> Lane:
        """Stop the lane serving ``name``: its requests drain, its layers go, the lanes
        after it get its memory.

        Raises:
            KeyError: no lane serves ``name``.
            ValueError: it is the only model.
        """
        lane = self.find(name)
        if lane is None:
            raise KeyError(name)
        if len(self.lanes) == 1:
            raise ValueError(f"{name} is the only model this node serves")
        if lane.primary:
            raise ValueError(f"{lane.key} is this node's first model: its ring is the node itself (its --cluster and "
                             f"node id); restart the nodes with another first --model to drop it")
        self.lanes.remove(lane)
        self.version += 1
        self.on_event("models", f"unloading {lane.model}")
        await self._stop_lane(lane)
        return lane

    # --- processes -------------------------------------------------------------------------

    def _share_file(self, lane: Lane) -> Path:
        return self.data_dir / "models" / lane.key / "share"

    async def start(self) -> None:
        """Start the lanes in priority order (each once the one before answers) and the watch."""
        self._task = asyncio.create_task(self._watch(), name="lanes")
        self._starting = asyncio.create_task(self._start_all(), name="lanes-start")

    async def _start_all(self) -> None:
        for i, lane in enumerate(list(self.lanes)):
            await self._start(lane, i)
            deadline = time.monotonic() + START_WAIT_S
            while not self._settled(lane) and time.monotonic() < deadline and not self._stopping:
                await asyncio.sleep(0.2)  # the next model is planned beside this one's footprint

    @staticmethod
    def _settled(lane: Lane) -> bool:
        """Whether ``lane``'s footprint here is its plan's: it holds its stage, or it is left
        out, or its ring has had :data:`SETTLE_S` to give this node a stage and did not."""
        view = lane.view or {}
        if lane.state == "left out" or view.get("layer_range") is not None:
            return True
        return lane.state == "serving" and time.monotonic() - lane.started_at > SETTLE_S

    async def _start(self, lane: Lane, index: int) -> None:
        if self._stopping:
            return
        wanted = self.grpc_port + index
        lane.grpc_port = wanted if claim_port(wanted) else free_ports(1)[0]
        if lane.grpc_port != wanted:
            log.warning("lane %s: gRPC port %d is taken, using %d (peers given by --peers expect %d)",
                        lane.key, wanted, lane.grpc_port, wanted)
        lane.api_port = free_ports(1)[0]
        share_file = self._share_file(lane) if index > 0 else None
        # the first model keeps the node's cluster, data dir and identity: a node that goes from
        # one model to several (or back) stays a member of that model's ring, one node at a time
        data = self.data_dir if lane.primary else self.data_dir / "models" / lane.key
        cluster = self.cluster if lane.primary else f"{self.cluster}/{lane.key}"
        data.mkdir(parents=True, exist_ok=True)
        if share_file is not None:
            self._write_share(lane, self._share_of(lane))
        argv = lane_argv(self.run_argv, model=lane.model, grpc_port=lane.grpc_port, api_port=lane.api_port,
                         data_dir=data, cluster=cluster, share_file=share_file,
                         supervisor_url=self.supervisor_url, public_api_url=self.public_api_url, index=index,
                         context=self.contexts.get(lane.model))
        lane.state, lane.started_at, lane.view = "starting", time.monotonic(), None
        env = dict(os.environ, RINGLET_LANE=lane.key)  # cluster/peer_browser.py: sibling models' adverts are quiet
        lane.proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL, env=env,
                                                         stdout=asyncio.subprocess.PIPE,
                                                         stderr=asyncio.subprocess.STDOUT)
        self._relays.add(asyncio.create_task(self._relay(lane, lane.proc), name=f"lane-log-{lane.key}"))
        log.info("lane %s (%s): pid %d, gRPC port %d%s", lane.key, lane.model, lane.proc.pid, lane.grpc_port,
                 f", offered {size_text(lane.share)}" if lane.share is not None else "")

    async def _relay(self, lane: Lane, proc: asyncio.subprocess.Process) -> None:
        """The lane's log lines on this process's stderr (where a live dashboard keeps them
        above its frame), each after ``[<model key>]`` in text logs."""
        prefix = f"[{lane.key}] ".encode() if self.log_prefix else b""
        try:
            while line := await proc.stdout.readline():
                sys.stderr.write((prefix + line).decode(errors="replace"))
                sys.stderr.flush()
        except (OSError, ValueError):
            pass
        finally:
            self._relays.discard(asyncio.current_task())

    async def _stop_lane(self, lane: Lane, timeout_s: float = 60.0) -> None:
        proc = lane.proc
        lane.state = "stopping"
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), timeout_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
        lane.state = "stopped"

    async def stop(self, timeout_s: float = 60.0) -> None:
        """Stop every lane (the lowest priority first, each draining its requests)."""
        self._stopping = True
        for task in (self._task, self._starting):
            if task is not None:
                task.cancel()
        await asyncio.gather(*(self._stop_lane(lane, timeout_s) for lane in reversed(self.lanes)),
                             return_exceptions=True)
        await self._client.aclose()

    # --- memory ----------------------------------------------------------------------------

    def _share_of(self, lane: Lane) -> int:
        """``share_i``: the usable figure less the footprints of the lanes before ``lane``."""
        above = 0
        for other in self.lanes:
            if other is lane:
                break
            above += max(other.footprint, other.reserved)
        return max(0, self.usable_bytes - above)

    def _write_shares(self) -> None:
        for i, lane in enumerate(self.lanes):
            if i == 0 or lane.proc is None:
                continue
            share = self._share_of(lane)
            if lane.share is not None and abs(share - lane.share) < SHARE_STEP * max(1, lane.share):
                continue
            if lane.share is not None:
                log.info("lane %s: offered %s (was %s): the models before it hold the rest", lane.key,
                         size_text(share), size_text(lane.share))
            self._write_share(lane, share)

    def _write_share(self, lane: Lane, share: int) -> None:
        """Offer ``share`` bytes to ``lane`` (its file, replaced whole: it reads it any time)."""
        lane.share = share
        path = self._share_file(lane)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(str(share))
        os.replace(tmp, path)

    def held_after(self, lane: Lane) -> int:
        """What the lanes after ``lane`` hold on this node now, bytes."""
        i = self.lanes.index(lane)
        return sum(other.footprint for other in self.lanes[i + 1:] if other.state != "stopped")

    async def reserve(self, name: str, nbytes: int) -> dict:
        """``POST /v1/lanes/reserve``: lane ``name`` is about to load a stage that holds
        ``nbytes`` on this node. The lanes after it get smaller shares now; returns once
        they hold no more than what is left beside ``nbytes`` (or after
        :data:`RESERVE_WAIT_S`, saying so)."""
        lane = self.find(name)
        if lane is None:
            return {"ok": True, "waited_s": 0.0}
        lane.reserved = nbytes
        self._write_shares()
        t0 = time.monotonic()
        left = max(0, self._share_of(lane) - nbytes)  # what the lanes after it may hold beside the load
        while self.held_after(lane) > left and time.monotonic() - t0 < RESERVE_WAIT_S:
            await asyncio.sleep(0.25)
        waited = time.monotonic() - t0
        ok = self.held_after(lane) <= left
        if waited > 0.5 or not ok:
            message = (f"{lane.key} loads {size_text(nbytes)}: the models after it "
                       f"{'gave back their memory' if ok else 'still hold ' + size_text(self.held_after(lane))} "
                       f"in {waited:.1f} s")
            log.info("%s", message)
            self.on_event("memory", message)
        return {"ok": ok, "waited_s": round(waited, 2)}

    # --- watching --------------------------------------------------------------------------

    async def _watch(self) -> None:
        while not self._stopping:
            await asyncio.sleep(POLL_S)
            for lane in list(self.lanes):
                with contextlib.suppress(Exception):
                    await self._poll(lane)
            with contextlib.suppress(OSError):
                self._write_shares()

    async def _poll(self, lane: Lane) -> None:
        proc = lane.proc
        if proc is None or lane.state in ("stopping", "stopped"):
            return
        if proc.returncode is not None:  # it died: say so and start it again (backing off)
            if lane.state == "failed":
                return
            quick = time.monotonic() - lane.started_at < QUICK_EXIT_S
            lane.quick_exits = lane.quick_exits + 1 if quick else 0
            if lane.quick_exits >= GIVE_UP_AFTER:  # it cannot start (a bad model, a taken port): say so, stop
                lane.state, lane.footprint, lane.view = "failed", 0, None
                lane.reason = message = (
                    f"model {lane.key}: its process exited ({proc.returncode}) {lane.quick_exits} times "
                    f"within {QUICK_EXIT_S:.0f} s of starting; not restarting it (its log says why; "
                    f"`ringlet models unload {lane.key}` removes it)")
                log.error("%s", message)
                self.on_event("models", message)
                return
            lane.restarts += 1
            lane.state, lane.footprint, lane.view = "restarting", 0, None
            message = lane.reason = f"model {lane.key}: its process exited ({proc.returncode}); restarting it"
            log.warning("%s", message)
            self.on_event("models", message)
            await asyncio.sleep(min(30.0, 2.0 ** min(lane.restarts, 5)))
            if lane in self.lanes and not self._stopping:
                await self._start(lane, self.lanes.index(lane))
            return
        try:
            r = await self._client.get(f"{lane.url}/v1/cluster", headers=self.headers)
            view = r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            view = None
        if view is None:
            return
        lane.view, lane.reason = view, None
        lane.served = lane.served or view.get("model")
        planned = ((view.get("memory") or {}).get("planned") or {}).get("total_bytes") or 0
        lane.footprint = int(planned)
        if lane.reserved and lane.footprint >= lane.reserved * 0.9:
            lane.reserved = 0  # the load it reserved for is committed: the plan's figure holds it
        plan = view.get("plan")
        lane.state = "serving" if plan else ("left out" if view.get("infeasible") else "planning")
