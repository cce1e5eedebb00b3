"""The node: serves its stage of the committed plan, heads generations, talks gRPC.

:class:`Node` holds the plan and the engine and switches plans (prepare, commit); its
parts are mixins, one idea each: :mod:`.resume` (any node: run and resume a request),
:mod:`.head` (stage 0), :mod:`.relay` (any stage: incoming activations);
:mod:`.servicer` is its gRPC face.

Data path of one generation (plan with stages 0..n-1 in ring order)::

    API node --Generate--> stage 0 --Hop--> stage 1 --Hop--> ... stage n-1
                              ^                                   |
                              +------- Hop (sampled token) -------+

Stage 0 heads the generation: it embeds the prompt (prefill, step 0), and each
token the last stage samples comes back to it over the ring; it streams the token
to the API node and embeds it for the next decode step, until an end-of-sequence
token or ``max_tokens``. Then a release travels the ring and every stage drops the
request's KV cache. A stage failing a request sends the error forward; it reaches
stage 0, which ends that request with the error.

Plans change by epoch (see :mod:`ringlet.daemon.cluster.negotiation`): :meth:`Node.prepare`
loads the new stage in the background (reusing the layers it already holds) while
the old plan serves; :meth:`Node.commit` switches. The API node owns each request's
tokens so far: when the plan changes or a stage fails, it resumes the request on
the new plan by re-prefilling prompt + tokens so far, so the client sees one stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import statistics
import time
from collections import deque
from typing import Any

import grpc
import psutil

from ringlet.daemon.engine import dequant_cache
from ringlet.daemon.engine.boundary import BoundaryStore
from ringlet.daemon.engine.draft_length import TripMeter
from ringlet.daemon.engine.drafting import SpecTotals
from ringlet.daemon.engine.prefix_disk import PrefixDisk, model_key
from ringlet.daemon.engine.prefix_store import PrefixStore
from ringlet.daemon.engine.scheduler import StageEngine
from ringlet.daemon.engine.stage import Stage, load_stage
from ringlet.daemon.errors import GenerationError, first_line
from ringlet.daemon.node.config import COMMIT_WAIT_S, NodeConfig
from ringlet.daemon.node.drop_first import DropFirst
from ringlet.daemon.node.footprint import MemoryAccounting
from ringlet.daemon.node.head import Generation, Head
from ringlet.daemon.node.memory import (
    mlx_active_bytes,
    peak_rss_bytes,
    reset_peak_rss,
    warm_up_mlx,
)
from ringlet.daemon.node.migration import Migration
from ringlet.daemon.node.rebuild import Rebuilding
from ringlet.daemon.node.relay import Relay
from ringlet.daemon.node.resume import ResumingClient
from ringlet.daemon.node.servicer import RingServicer
from ringlet.daemon.node.signals import PlanChanged
from ringlet.daemon.probes import blas
from ringlet.daemon.wire import versions
from ringlet.daemon.wire.hop import HopLink
from ringlet.daemon.wire.rpc import ringlet_pb2_grpc as pb_grpc
from ringlet.daemon.wire.serving_plan import ServingPlan, StageSpec
from ringlet.daemon.wire.transport import make_server

log = logging.getLogger("ringlet.daemon.node")


class Node(ResumingClient, Head, Relay, Migration, Rebuilding, MemoryAccounting, DropFirst):
    """One ringlet daemon's serving core (no HTTP; see :mod:`ringlet.daemon.api.app`).

    ``cluster`` (set by the runner in negotiated mode) handles membership and
    negotiation RPCs; see :class:`ringlet.daemon.cluster.negotiation.Negotiator`.
    """

    def __init__(self, config: NodeConfig):
        self.config = config
        self.node_id = config.node_id or config.address
        self.state = "starting"
        self.engine: StageEngine | None = None
        self.plan: ServingPlan | None = None
        self.index: int | None = None
        self.cluster = None
        self.tp = None  # tensor-parallel serving (tp_serving.TPServing) in negotiated mode
        self.cluster_id = ""
        self.incarnation = ""
        self._server: grpc.aio.Server | None = None
        self._next: HopLink | None = None
        self._generations: dict[str, Generation] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._prepared: dict[tuple[int, str], Stage | None] = {}
        self._plan_changed = asyncio.Event()
        self.hop_latency_s: deque[float] = deque(maxlen=512)
        self.memory: dict[str, Any] = {}
        self.recent: deque[dict] = deque(maxlen=32)
        self.tokens_generated_total = 0
        self.spec_totals = SpecTotals()  # speculative decoding headed here
        self.trip_meter = TripMeter()  # what a verifying trip costs here, measured
        self.draft_model: Any = None  # --draft-model (engine.draft_model.DraftModel), run here when heading
        self.requests_served = 0
        self.commits = 0  # plans committed since start (/metrics' re-plans)
        self.events: deque[dict] = deque(maxlen=100)
        self.loading_progress: float | None = None  # 0..1 while a stage loads
        self.download = None  # a DownloadProgress (shards.hub_fetch) while the stage's files download
        self._tasks: set[asyncio.Task] = set()
        self._token_times: deque[float] = deque(maxlen=4096)  # monotonic time of each token headed here
        self._init_migration()
        self._init_rebuilding()

    # --- plan views ------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self.plan.epoch if self.plan else 0

    @property
    def stage_spec(self) -> StageSpec | None:
        return self.plan.stages[self.index] if self.plan and self.index is not None else None

    @property
    def is_head(self) -> bool:
        return self.index == 0

    @property
    def prefill_chunk(self) -> int:
        """Prompt tokens per prefill chunk on the current plan (:meth:`NodeConfig.chunk_for`)."""
        return self.config.chunk_for(len(self.plan.stages) if self.plan else 1)

    @property
    def is_last(self) -> bool:
        return self.plan is not None and self.index == len(self.plan.stages) - 1

    def event(self, kind: str, message: str) -> None:
        """Append to the event log shown by ``/v1/cluster`` and the dashboard: one line of
        plain words (a message of several lines keeps its first; the whole goes to the
        debug log)."""
        line = first_line(message)
        if line != message.strip():
            log.debug("event %s in full: %s", kind, message)
        self.events.append({"ts": time.time(), "kind": kind, "message": line})

    def _disk_off(self, reason: str) -> None:
        """A cache tier turned itself off (a full disk; from any thread): an event."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: the daemon is stopping
            self._loop.call_soon_threadsafe(self.event, "disk", f"cache tier off: {reason}")

    # --- lifecycle --------------------------------------------------------------------

    async def start(self, serve_grpc: bool = True) -> None:
        """Start the gRPC server and the MLX worker; with a static plan, load and serve it."""
        self.state = "starting"
        self._loop = asyncio.get_running_loop()
        if serve_grpc:
            self._server = make_server(self.config.transport, self.config.address)
            pb_grpc.add_RingServicer_to_server(RingServicer(self), self._server)
            await self._server.start()
        executor = StageEngine.new_executor()
        # An empty daemon: server up, MLX worker started, no weights. Its RSS is the
        # baseline the memory figures in info() are read against.
        await asyncio.get_running_loop().run_in_executor(executor, warm_up_mlx)
        self.memory["rss_before_load_bytes"] = psutil.Process().memory_info().rss
        reset_peak_rss()  # the first load's peak, not that of reading the model's metadata before it
        disk = await asyncio.get_running_loop().run_in_executor(executor, self._prefix_disk)
        if disk is not None:  # a full disk turns a cache tier off: said in the event log
            disk.on_off = self._disk_off
        dequant_cache.on_off.append(self._disk_off)
        self.engine = StageEngine(None, executor, max_tensor_bytes=self.config.transport.max_message_bytes,
                                  max_batch=self.config.max_batch, prefix=PrefixStore(0, disk=disk),
                                  boundaries=BoundaryStore(self.boundary_budget()))
        if self.config.plan is not None:
            stages = tuple(self.config.plan)
            digest = ",".join(f"{s.address}={s.start}:{s.end}" for s in stages)
            plan = ServingPlan(epoch=1, stages=stages, plan_id=f"static:{digest}")
            await self.prepare(plan)
            await self.commit(plan)
        else:
            self.state = "discovering"

    def _prefix_disk(self) -> PrefixDisk | None:
        """The prefix store's disk tier (``--prefix-cache-disk-bytes``), its index rebuilt
        from the files an earlier run left; ``None`` when off or its directory cannot be
        made (said once in the log)."""
        cfg = self.config
        if cfg.prefix_cache_disk_bytes <= 0 or cfg.prefix_cache_dir is None:
            return None
        path = cfg.model.path
        files = [path] if path.is_file() else [p for p in path.iterdir() if p.is_file()]
        if cfg.model.revision and cfg.model.headers:  # a Hub commit, whose files arrive per stage
            files = [cfg.model.headers]
        try:
            key = model_key(files, cfg.dtype or "native")
            disk = PrefixDisk(cfg.prefix_cache_dir, cfg.prefix_cache_disk_bytes, key)
        except OSError as exc:
            log.warning("prefix cache: no disk tier (%s)", exc)
            return None
        log.info("prefix cache disk tier: %d entries, %.1f MB of %.1f MB in %s", len(disk), disk.nbytes / 1e6,
                 disk.budget_bytes / 1e6, disk.dir)
        return disk

    async def stop(self) -> None:
        """Stop serving: fail open generations, close streams and the server, and write the
        prefix store's entries to its disk tier (when it has one)."""
        for gen in list(self._generations.values()):
            self._finish(gen, GenerationError("the node is shutting down"))
        if self._next is not None:
            await self._next.close()
        for ch in self._channels.values():
            await ch.close()
        if self._server is not None:
            await self._server.stop(grace=0.5)
        if self.engine is not None:
            if self.engine.prefix.disk is not None:  # a restart finds them there
                saved = await self.engine.run(self.engine.prefix.save_to_disk)
                log.info("prefix cache: saved %d entries to the disk tier", saved)
            self.engine.close()
        with contextlib.suppress(ValueError):
            dequant_cache.on_off.remove(self._disk_off)
        self.state = "stopped"

    async def reconnect(self) -> None:
        """An address of this machine went away (renumbered, unplugged): a connection opened
        from it hangs, no reset comes. Close the hop link and the cached channels; the next
        message or call connects afresh, from an address that works (messages lost on the
        old ones end as a lost stage's do: their requests resume)."""
        link, channels, self._channels = self._next, list(self._channels.values()), {}
        for old in [link, *channels]:  # closed first: a new channel must not share their connection
            if old is not None:
                with contextlib.suppress(Exception):
                    await old.close()
        if link is not None and self._next is link:
            self._next = HopLink(link.address, self.config.transport)

    # --- plans: prepare, commit ----------------------------------------------------------

    async def prepare(self, plan: ServingPlan) -> int:
        """Load this node's stage of ``plan`` while the current plan keeps serving, and pull
        a snapshot of the KV of the layers it gains (:meth:`precopy`).

        Layers this node already holds are reused; only the others are read.
        Returns the bytes read from disk.

        Raises:
            ModelFormatError / PlanError / OSError: the stage cannot be loaded.
        """
        key = (plan.epoch, plan.plan_id)
        index = plan.index_of(self.node_id, self.config.address)
        if stale := [k for k in self._prepared if k[0] <= plan.epoch]:
            # superseded (the negotiation never prepares an older proposal after a newer one;
            # an abandoned one may come back with the same key): their stages go before this
            # one loads, or a node in a tight cgroup held two stages at once and the kernel
            # killed it (#43: seen on a restart whose first proposal was refused)
            for k in stale:
                self._prepared.pop(k, None)
            await self.engine.run(mlx_active_bytes)  # frees MLX's buffer cache (mx.clear_cache)
        if plan.infeasible or index is None or plan.is_tensor:  # tensor: the rank processes load
            self._prepared[key] = None
            return 0
        if plan.is_hybrid:  # the group's rank processes load, once the plan is committed
            self._prepared[key] = self.tp.group_stage(plan, index)
            return 0
        spec = plan.stages[index]
        current = self.engine.stage if isinstance(self.engine.stage, Stage) else None
        if current is not None and (current.start, current.end) == (spec.start, spec.end):
            self._prepared[key] = current
            return 0
        over = self.load_overfills(current, spec.start, spec.end)
        if self.config.reserve is not None:  # beside other models: the lower ones make room first
            await self.config.reserve(self.load_footprint(current, spec.start, spec.end, dropped=bool(over),
                                                          plan=plan))
        if over:  # both ranges would not fit: drop first
            await self.drop_first(current, spec.start, spec.end, plan.epoch, over)
        self.state = "loading" if current is None else self.state
        t0 = time.perf_counter()
        if self.config.fetch is not None:
            self.state = "fetching" if current is None else self.state
            await self.config.fetch(spec.start, spec.end)

        def progress(done: int, total: int) -> None:  # worker thread; a float store is atomic
            self.loading_progress = done / total if total else 1.0

        self.loading_progress = 0.0
        try:
            stage = await self.engine.run(lambda: load_stage(self.config.model, spec.start, spec.end,
                                                             self.config.dtype, reuse=current, progress=progress))
        finally:
            self.loading_progress = None
        loaded = stage.loaded_bytes()
        self._prepared[key] = stage
        log.info("prepared epoch %d: layers [%d, %d), read %.1f MB of %.1f MB in %.2f s", plan.epoch,
                 spec.start, spec.end, loaded / 1e6, stage.nbytes() / 1e6, time.perf_counter() - t0)
        if "first_load" not in self.memory:
            self.memory["first_load"] = {
                "weights_bytes": stage.nbytes(), "rss_before_bytes": self.memory.pop("rss_before_load_bytes", 0),
                "mlx_active_after_bytes": await self.engine.run(mlx_active_bytes),
                "peak_rss_after_bytes": peak_rss_bytes()}
        await self.precopy(plan, spec.start, spec.end)  # the KV of the layers gained, while the old plan serves
        return loaded

    async def commit(self, plan: ServingPlan) -> None:
        """Switch to ``plan`` (prepared before). In-flight requests of the old plan
        are ended here with a plan-changed error; their API nodes resume them.

        Raises:
            KeyError: ``plan`` was never prepared.
        """
        key = (plan.epoch, plan.plan_id)
        stage = self._prepared.pop(key)
        self._committing = plan.epoch  # FetchKV callers wait for this commit (migration.serve_kv)
        for old in [k for k in self._prepared if k[0] <= plan.epoch]:
            self._prepared.pop(old, None)
        old_index_spec = self.stage_spec
        await self._swap_moving_kv(plan, stage)
        await self.engine.run(self.engine.prefix.set_budget, self.prefix_budget(stage))
        self.engine.kv_room = self.kv_room_for(stage)  # a step beyond the node's memory ends its request
        # From here to changed.set() nothing awaits: a resumed request that starts on the
        # new plan must see the new plan and a fresh plan-changed event together, or the
        # old event would end it at once as changed again (CI saw that on a join).
        self.plan = plan
        self.commits += 1
        if self.engine is not None:
            self.engine.ring_depth = len(plan.stages)  # stage 0 forms this many decode groups at least
        changed, self._plan_changed = self._plan_changed, asyncio.Event()
        self.index = plan.index_of(self.node_id, self.config.address)
        for gen in list(self._generations.values()):
            self._finish(gen, PlanChanged(f"the plan changed to epoch {plan.epoch}", plan.epoch))
        successor = None
        if self.index is not None and len(plan.stages) > 1:
            successor = plan.stages[(self.index + 1) % len(plan.stages)].dial_from_previous  # our route to it
        retired = None  # the old plan's link, closed once the new plan is in place
        if self._next is not None and (successor is None or self._next.address != successor):
            retired, self._next = self._next, None
        if successor is not None and self._next is None:
            self._next = HopLink(successor, self.config.transport)
        if plan.infeasible:
            self.state = "unplanned"
        elif self.index is None:
            in_group = plan.is_hybrid and any(self.node_id in g for g in plan.tp.get("groups", ()))
            self.state = "ready" if in_group else "standby"  # a hybrid group's member runs a rank
        else:
            self.state = "ready"
        spec = self.stage_spec
        where = f"layers [{spec.start}, {spec.end})" if spec else "no stage"
        log.info("committed epoch %d: %s%s", plan.epoch, where,
                 f" (was [{old_index_spec.start}, {old_index_spec.end}))" if old_index_spec else "")
        self._committing = 0
        changed.set()
        if retired is not None:
            await retired.close()

    async def await_commit(self, epoch: int) -> None:
        """Wait up to :data:`~ringlet.daemon.node.config.COMMIT_WAIT_S` seconds for this
        node to commit ``epoch``, whose commit is on its way: a previous stage already
        sends activations of it (without the wait a stage a moment behind would answer
        "behind" and the request would start again; one that headed the old plan would
        take the activation for one of its own finished requests), or a peer that gained
        layers asks for their KV (:meth:`serve_kv`)."""
        deadline = time.monotonic() + COMMIT_WAIT_S
        while self.epoch < epoch and (left := deadline - time.monotonic()) > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._plan_changed.wait(), timeout=left)

    # --- introspection -------------------------------------------------------------------

    def kv_tokens_in_flight(self) -> int:
        """Tokens in the KV caches of the requests in flight on this node's stage (each stage
        of a pipeline holds them all; they move with the layers at a re-plan)."""
        return self.engine.tokens_in_flight() if self.engine is not None else 0

    def plan_json(self) -> str:
        """The committed plan as JSON (for peers' handshakes)."""
        if self.plan is None:
            return ""
        return json.dumps({"epoch": self.plan.epoch, "plan_id": self.plan.plan_id,
                           "infeasible": self.plan.infeasible,
                           "stages": [s.__dict__ for s in self.plan.stages]})

    def tokens_per_s(self, window_s: float = 10.0) -> float:
        """Aggregate tokens/s of the requests this node heads (stage 0): tokens in the
        last ``window_s`` seconds / ``window_s``, all requests together."""
        now = time.monotonic()
        return sum(1 for t in self._token_times if now - t <= window_s) / window_s

    def info(self) -> dict:
        """A JSON-safe summary of this node: stage, plan, state and live figures."""
        lat = list(self.hop_latency_s)
        spec = self.stage_spec
        stage = self.engine.stage if self.engine else None
        info = {
            "node_id": self.node_id,
            "release": versions.RELEASE,
            "protocol_version": versions.PROTOCOL_VERSION,
            "capabilities": sorted(versions.CAPABILITIES),
            "address": self.config.address,
            "state": self.state,
            "epoch": self.epoch,
            "plan_id": self.plan.plan_id if self.plan else None,
            "infeasible": self.plan.infeasible if self.plan else None,
            "model": self.config.model.name,
            "model_revision": self.config.model.revision,  # a Hub model: the commit the cluster agrees on
            "num_layers": stage.num_layers if stage else None,
            "stage": self.index,
            "layer_range": [spec.start, spec.end] if spec else None,
            "plan": [{"node_id": s.node_id, "address": s.address, "start": s.start, "end": s.end,
                      "hop_address": s.hop_address or None}
                     for s in (self.plan.stages if self.plan else ())],
            "plan_detail": self.plan.detail if self.plan else None,
            # the optional wire features the plan uses: those every node taking part speaks
            "plan_features": sorted(f for f in versions.CAPABILITIES if self.plan.uses(f)) if self.plan else None,
            "requests_in_flight": len(self._generations),
            "prefilling": self.prefilling(),
            "kv_caches": self.engine.active_requests if self.engine else [],
            "prefix_cache": ((self.tp.prefix_info() if self.tp is not None and self.plan is not None
                              and self.plan.is_tensor else None)
                             or (self.engine.prefix.info() if self.engine else None)),
            "kv_migration": self.kv_migration,
            "boundary_cache": self.engine.boundaries.figures() if self.engine else None,
            "weights_cache": dequant_cache.state(),  # dequantized GGUF weights (off after a full disk)
            "batching": {**self.engine.batch_stats(),
                         "prefill_chunk": self.prefill_chunk,
                         "head_tokens_per_s": self.tokens_per_s()} if self.engine else None,
            "speculation": {**self.spec_totals.figures(self.config.spec_tokens),
                            "trip_cost": self.trip_meter.cost(),
                            "draft_model": self.draft_model.name if self.draft_model is not None else None},
            "hop_latency_median_s": statistics.median(lat) if lat else None,
            "tokens_generated_total": self.tokens_generated_total,
            "loading_progress": self.loading_progress,
            "download": self.download.to_dict() if self.download is not None else None,
            "requests_served": self.requests_served,
            "memory": self.memory_info(stage),
            "recent_requests": list(self.recent),
            "events": list(self.events),
            "blas": {**blas.report().to_dict(), "mapped": blas.mapped_blas_libraries()},
            "dtype": self.config.dtype_choice or {"requested": self.config.dtype or "native",
                                                  "loaded": self.config.dtype or "native"},
        }
        if self.cluster is not None:
            info.update(self.cluster.info())
        return info


