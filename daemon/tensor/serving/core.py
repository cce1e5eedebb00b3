"""The tensor-parallel part of one daemon (:class:`TPServing`).

* **Group** (leader = rank 0 = the proposer): on commit it starts a
  :class:`~ringlet.daemon.tensor.serving.cluster_group.DaemonGroup` whose ranks run on their
  members' machines, and drives requests through it (:meth:`TPServing.generate`).
* **Ranks for another leader** (:meth:`TPServing.run_rank`, the ``RunRank`` servicer side):
  only for the committed tensor plan naming this node at that rank, led by a member, with
  the control address on the leader's host.
* **Failure**: a group that gives up makes its leader, the proposer, re-plan the same
  members on the pipeline, saying why.

See :mod:`ringlet.daemon.tensor.serving` for how a tensor plan is served.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import psutil

from ringlet.daemon.engine.sampling import SamplingParams
from ringlet.daemon.errors import GenerationError
from ringlet.daemon.tensor.control import TOKEN_ENV
from ringlet.daemon.tensor.group import TPGroup
from ringlet.daemon.tensor.group_errors import TPGroupError
from ringlet.daemon.tensor.group_stage import GroupStage
from ringlet.daemon.tensor.launch import LocalRankHandle
from ringlet.daemon.tensor.planning.decision import TPRefused
from ringlet.daemon.tensor.planning.inputs import TPModelSpec
from ringlet.daemon.tensor.serving.cluster_group import ClusterLauncher, DaemonGroup
from ringlet.daemon.tensor.serving.mode import (
    GROUP_MODES,
    REQUESTED_MODES,
    address_host,
    cluster_inputs,
    decide_mode,
    group_decision,
    group_of,
    pipeline_decision,
)
from ringlet.daemon.tensor.serving.ranks import (
    PRELOAD_ENV,
    RANK_DTYPES,
    RANK_ENV_KEYS,
    RANK_FILES,
    rank_base_env,
    spawn_rank,
    worker_argv,
)
from ringlet.daemon.wire.rpc import ringlet_pb2 as pb
from ringlet.daemon.wire.rpc import ringlet_pb2_grpc as pb_grpc
from ringlet.daemon.wire.serving_plan import ServingPlan

log = logging.getLogger(__name__)

#: Seconds a member waits for the commit of the plan a RunRank names (the leader starts
#: its group as soon as it committed; the other members commit moments later).
COMMIT_WAIT_S = 10.0
#: Seconds a request waits for the group of a tensor plan committed moments ago to exist
#: (the previous group is closed first); the group's own start is waited for by TPGroup.
GROUP_WAIT_S = 30.0


class TPServing:
    """Tensor-parallel part of one daemon (see :mod:`ringlet.daemon.tensor.serving`).

    Args:
        node: the serving node.
        membership: the member table (addresses, records, stubs).
        requested: ``--mode`` (auto, pipeline, tensor).
        spec: the model as tensor planning sees it.
        model: the model path or name rank processes load (this machine's copy).
        dtype: ``--dtype`` (``None`` = the model's own).
        hb_interval, hb_timeout, step_timeout: the group's health timing (s).
    """

    def __init__(self, node, membership, requested: str, spec: TPModelSpec, model: str, dtype: str | None,
                 *, hb_interval: float = 0.2, hb_timeout: float = 5.0, step_timeout: float = 30.0):
        if requested not in REQUESTED_MODES:
            raise ValueError(f"--mode must be one of {', '.join(REQUESTED_MODES)}")
        self.node = node
        self.membership = membership
        self.requested = requested
        self.spec = spec
        self.model = model
        self.dtype = dtype
        self.hb_interval = hb_interval
        self.hb_timeout = hb_timeout
        self.step_timeout = step_timeout
        self.group: TPGroup | None = None
        self.group_epoch = 0  # the plan epoch self.group serves
        self.group_error = ""
        self._switch_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()
        self._ranks: dict[tuple[int, int, int], LocalRankHandle] = {}  # (plan epoch, group epoch, rank) -> rank here
        self._stages: dict[int, GroupStage] = {}  # plan epoch -> the hybrid stage this node leads
        self._workdir: Path | None = None  # made at the first rank this node runs (a killed daemon leaks none before)
        self._closed = False
        #: (membership digest, reason) of a tensor group that could not serve: that membership
        #: gets the pipeline (a change of members tries tensor again).
        self.failed: tuple[str, str] | None = None
        #: called when this node's group gives up (the runner starts a negotiation round)
        self.on_failed = None

    # --- helpers ---------------------------------------------------------------------------

    def address_of(self, node_id: str) -> str | None:
        return self.membership.address_of(node_id)

    def stub(self, address: str) -> pb_grpc.RingStub:
        return self.membership.stub(address)

    async def _reachable(self, node_id: str, timeout_s: float = 1.0) -> bool:
        """The member's daemon is in the member table and answers an Echo within ``timeout_s``."""
        member = self.membership.members.get(node_id)
        if member is None or getattr(member, "state", "alive") not in ("alive", "self"):
            return False
        try:
            await self.stub(member.address).Echo(pb.Ping(echo=True), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return False
        return True

    def decide(self, ids: Sequence[str]) -> dict[str, Any]:
        """The proposer's mode decision for members ``ids`` (this node leads)."""
        records = {i: self.membership.record_of(i) or {} for i in ids}
        addresses = {i: self.membership.address_of(i) or "" for i in ids}
        out = decide_mode(self.requested, ids, records, addresses, self.spec, self.node.node_id)
        if out["mode"] in GROUP_MODES and self.failed is not None and self.failed[0] == self.membership.digest():
            why = self.failed[1][:500]
            return pipeline_decision(self.requested, f"{why}; serving the pipeline", refused=why)
        return out

    def group_stage(self, plan: ServingPlan, index: int) -> GroupStage:
        """The engine's stage for stage ``index`` of a hybrid ``plan`` (this node leads
        that stage's group); its group is attached when the plan is committed."""
        spec = plan.stages[index]
        found = group_of(plan.tp, self.node.node_id)
        if found is None or found[1][0] != self.node.node_id or found[3] != (spec.start, spec.end):
            raise TPGroupError(f"epoch {plan.epoch}: this node does not lead the group of layers "
                               f"[{spec.start}, {spec.end})")
        config = {"hidden_size": self.spec.hidden_size, "vocab_size": self.spec.vocab_size}
        m = self.spec  # the weights each rank holds: its share of the range's layers, the replicated part
        layers = (m.total_bytes - m.replicated_bytes) * (spec.end - spec.start) // max(1, m.num_layers)
        weights = m.replicated_bytes + layers // max(1, len(found[1]))
        stage = GroupStage(spec.start, spec.end, self.spec.num_layers, config, asyncio.get_running_loop(),
                           step_timeout_s=self.step_timeout, prefix_budget_bytes=self.node.prefix_budget_for(weights))
        self._stages[plan.epoch] = stage
        return stage

    # --- commit: start / stop the group ---------------------------------------------------

    def committed(self, plan: ServingPlan) -> None:
        """Called after this node committed ``plan``: stop what belongs to older plans and,
        when this node is rank 0 of a tensor plan, start its group (in the background)."""
        for key, handle in list(self._ranks.items()):
            if key[0] < plan.epoch:
                handle.kill()
        if self.failed is not None and self.failed[0] != self.membership.digest():
            self.failed = None  # other members now: tensor may work again
        own = self.membership.own_record
        if "tp_failed" in own and own["tp_failed"].get("epoch") != plan.epoch and (
                own["tp_failed"].get("digest") != self.membership.digest()):
            self.membership.set_record({k: v for k, v in own.items() if k != "tp_failed"})
        task = asyncio.create_task(self._switch(plan), name=f"tp-switch-{plan.epoch}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _switch(self, plan: ServingPlan) -> None:
        async with self._switch_lock:
            if self.group is not None:
                old, self.group = self.group, None
                await old.close()
            for epoch in [e for e in self._stages if e < plan.epoch]:
                self._stages.pop(epoch).attach(None)  # steps still waiting for that group fail
            self.group_error = ""
            found = group_of(plan.tp, self.node.node_id)
            if self._closed or found is None or found[1][0] != self.node.node_id:
                return
            if self.node.plan is not plan:
                return  # already superseded
            _, ranks, backend, layers = found
            decision = group_decision(ranks, backend, str(plan.tp.get("reason", "")))
            addresses = {i: self.address_of(i) or "" for i in ranks}
            addresses.update({s.node_id: s.address for s in plan.stages})
            records = {i: self.membership.record_of(i) or {} for i in decision.ranks}
            members, links = cluster_inputs(decision.ranks, records, addresses)
            group = DaemonGroup(
                self.model, members, links, reachable=self._reachable, leader=self.node.node_id, mode="tensor",
                dtype=self.dtype,
                spec=self.spec, fallback="none", launcher=ClusterLauncher(self, plan.epoch),
                control_host=address_host(addresses[self.node.node_id]), hb_interval=self.hb_interval,
                hb_timeout=self.hb_timeout, step_timeout=self.step_timeout, decision=decision,
                extra_env={"LD_PRELOAD": os.environ[PRELOAD_ENV]} if os.environ.get(PRELOAD_ENV) else None,
                layers=layers,
            )
            self.group, self.group_epoch = group, plan.epoch
            what = f"layers [{layers[0]}, {layers[1]})" if layers else "every layer"
            self.node.event("tensor", f"epoch {plan.epoch}: starting a {len(decision.ranks)}-rank group over "
                                      f"{decision.backend} ({what})")
        try:
            await group.start()
        except (TPGroupError, TPRefused, OSError) as exc:
            self.group_error = str(exc)
            self.node.event("error", f"tensor group of epoch {plan.epoch} did not start: {exc}")
            log.error("tensor group of epoch %d did not start: %s", plan.epoch, exc)
            stage = self._stages.get(plan.epoch)
            if stage is not None:
                stage.attach(None)
            await self._given_up(plan, f"tensor group did not start: {exc}")
            return
        stage = self._stages.get(plan.epoch)
        if stage is not None:
            stage.attach(group)
        self.node.event("tensor", f"epoch {plan.epoch}: group ready, ranks "
                                  f"{', '.join(r[:8] for r in decision.ranks)}")
        while group is self.group and group.state not in ("failed", "closed"):
            await asyncio.sleep(0.25)
        if group is self.group and group.state == "failed":
            self.group_error = group.reason
            await self._given_up(plan, f"tensor group failed: {group.reason}")

    async def _given_up(self, plan: ServingPlan, why: str) -> None:
        """The group of ``plan`` cannot serve: while the membership stays the same, the
        proposer decides pipeline with the reason, and a negotiation round starts. A group
        leader that is not the proposer (a later stage of a hybrid plan) says so in its
        membership record (``tp_failed``), which the proposer reads (:meth:`record_changed`).
        Not when a member does not answer: its removal re-plans anyway."""
        if self.node.plan is not plan or self._closed:
            return
        for node_id in plan.tp["ranks"]:
            if node_id != self.node.node_id and not await self._reachable(node_id):
                return
        if self.node.plan is not plan:
            return
        digest = self.membership.digest()
        self.failed = (digest, why)
        self.node.event("mode", f"{why[:300]}; re-planning on the pipeline")
        if plan.tp["ranks"][0] != self.node.node_id:
            record = dict(self.membership.own_record)
            record["tp_failed"] = {"digest": digest, "epoch": plan.epoch, "why": why[:500]}
            self.membership.set_record(record)
        elif self.on_failed is not None:
            self.on_failed()

    def record_changed(self, member) -> None:
        """A member's record changed: when it says that member's group of the committed plan
        gave up (same membership), the proposer re-plans on the pipeline, saying why."""
        failed = (member.record or {}).get("tp_failed")
        plan = self.node.plan
        if (not isinstance(failed, dict) or plan is None or group_of(plan.tp, member.node_id) is None
                or plan.tp["ranks"][0] != self.node.node_id or failed.get("epoch") != plan.epoch
                or failed.get("digest") != self.membership.digest()):
            return
        why = f"{member.node_id[:8]}: {str(failed.get('why', ''))[:400]}"
        if self.failed == (failed["digest"], why):
            return
        self.failed = (failed["digest"], why)
        self.node.event("mode", f"{why[:300]}; re-planning on the pipeline")
        if self.on_failed is not None:
            self.on_failed()

    # --- generation on rank 0 ----------------------------------------------------------------

    async def generate(self, request_id: str, prompt: list[int], max_tokens: int, sampling: SamplingParams,
                       stop_ids: frozenset[int], scope: str = "", info: dict | None = None,
                       spec: dict | None = None) -> AsyncIterator[int]:
        """Tokens of one request driven by this node's group (this node is rank 0). The
        group's prefix cache serves it under ``scope`` (``info`` gets ``cached_tokens``),
        within :meth:`prefix_budget` per rank; with ``spec`` rank 0 decodes speculatively
        (:meth:`ringlet.daemon.tensor.group_requests.GroupRequests.generate`; ``info`` gets
        ``drafts``, and the node's speculation figures count them).

        Raises:
            GenerationError: no group here for the committed plan, or the group failed.
        """
        plan = self.node.plan
        deadline = time.monotonic() + GROUP_WAIT_S
        while (plan is not None and plan is self.node.plan and self.group_epoch != plan.epoch and not self._closed
               and time.monotonic() < deadline):
            await asyncio.sleep(0.05)  # committed moments ago: the group is being set up
        group = self.group
        if group is None or plan is None or self.group_epoch != plan.epoch:
            why = f": {self.group_error}" if self.group_error else ""
            raise GenerationError(f"this node runs no tensor group for epoch {self.node.epoch}{why}")
        started = time.perf_counter()
        ttft = None
        count = 0
        self.node.state = "serving"
        try:
            prefix = {"scope": scope, "budget": self.prefix_budget(group)}
            info = info if info is not None else {}
            if spec and not group.trims:  # its caches cannot drop drafted positions exactly
                self.node.spec_totals.skip("cache")
                spec = None
            async for token in group.generate(prompt, max_tokens, sampling, sorted(stop_ids), prefix, info, spec):
                if ttft is None:
                    ttft = time.perf_counter() - started
                count += 1
                self.node.tokens_generated_total += 1
                times = getattr(self.node, "_token_times", None)  # the node's tokens/s window (batched decode)
                if times is not None:
                    times.append(time.monotonic())
                yield token
                if token in stop_ids:
                    return
        except TPGroupError as exc:
            raise GenerationError(f"tensor group: {exc}") from None
        finally:
            if info is not None and info.get("drafts"):
                self.node.spec_totals.add(*info["drafts"])
            elapsed = time.perf_counter() - started
            self.node.requests_served += 1
            self.node.recent.append({
                "request_id": request_id, "prompt_tokens": len(prompt), "completion_tokens": count, "ttft_s": ttft,
                "tokens_per_s": (count - 1) / (elapsed - ttft) if ttft is not None and count > 1 and elapsed > ttft
                else None,
            })
            if self.node.state == "serving" and not group.info()["in_flight"]:
                self.node.state = "ready"

    def prefix_info(self) -> dict | None:
        """The prefix cache figures of the tensor group this node leads (``None``: none)."""
        group = self.group
        return group.prefix_info if group is not None and group.layers is None else None

    def prefix_budget(self, group) -> int:
        """Bytes of prefix cache each rank of ``group`` may hold: the node's budget for
        weights of ``1/size`` of the model (:meth:`ringlet.daemon.node.core.Node.prefix_budget_for`)."""
        spec = group.spec
        size = max(1, len(group.decision.ranks) if group.decision else 1)
        weights = (spec.replicated_bytes + (spec.total_bytes - spec.replicated_bytes) // size) if spec else 0
        return self.node.prefix_budget_for(weights)

    # --- ranks for another leader -------------------------------------------------------------

    async def _check_rank(self, req: pb.RankStart) -> str | None:
        """Why this node must not run the rank ``req`` asks for (``None`` = run it)."""
        deadline = time.monotonic() + COMMIT_WAIT_S
        while self.node.epoch < req.plan_epoch and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        plan = self.node.plan
        if plan is None or plan.epoch != req.plan_epoch:
            return f"this node serves epoch {self.node.epoch}, not {req.plan_epoch}"
        found = group_of(plan.tp, self.node.node_id)
        if found is None:
            return f"epoch {plan.epoch} is not a tensor plan"
        _, ranks, _, layers = found
        if req.leader_id != ranks[0] or req.leader_id not in self.membership.members:
            return "the caller does not lead this plan's tensor group"
        if req.size != len(ranks) or req.rank >= len(ranks) or ranks[req.rank] != self.node.node_id:
            return f"this node is not rank {req.rank} of {req.size}"
        if (req.layer_start, req.layer_end) != (layers or (0, 0)):
            return "the layer range is not this group's"
        leader_host = address_host(self.membership.address_of(req.leader_id) or "")
        if address_host(req.control) != leader_host or not req.control.rsplit(":", 1)[-1].isdigit():
            return "the control address is not on the leader's host"
        if req.backend not in ("ring", "jaccl") or req.dtype not in RANK_DTYPES:
            return "unknown backend or dtype"
        if set(req.env) - RANK_ENV_KEYS or set(req.files) - RANK_FILES or not req.token:
            return "only MLX's own variables and host files may be set"
        if not 0 < req.hb_interval <= 10 or not 0 < req.prefill_chunk <= 1 << 16:
            return "bad health or prefill settings"
        return None

    async def run_rank(self, req: pb.RankStart, context) -> AsyncIterator[pb.RankEvent]:
        """The RunRank RPC: start the rank, report its pid, then its exit; cancelling the
        call kills it."""
        why = await self._check_rank(req)
        if why is not None or self._closed:
            log.warning("refused to run tensor rank %d for %s: %s", req.rank, req.leader_id[:16], why or "closing")
            yield pb.RankEvent(error=why or "this node is shutting down")
            return
        key = (req.plan_epoch, req.group_epoch, req.rank)
        if self._workdir is None:
            self._workdir = Path(tempfile.mkdtemp(prefix="ringlet-tp-ranks-"))
        directory = self._workdir / f"epoch-{req.plan_epoch}-group-{req.group_epoch}"
        directory.mkdir(parents=True, exist_ok=True)
        for name, text in req.files.items():
            (directory / name).write_text(text)
        env = rank_base_env()
        env.update({k: v.replace("{dir}", str(directory)) for k, v in req.env.items()})
        env[TOKEN_ENV] = req.token
        argv = worker_argv(self.model, control=req.control, rank=req.rank, size=req.size, epoch=req.group_epoch,
                           dtype=req.dtype, backend=req.backend, hb_interval=req.hb_interval,
                           prefill_chunk=req.prefill_chunk, side_host=req.side_host,
                           layers=(req.layer_start, req.layer_end) if req.layer_end else None)
        handle = await spawn_rank(argv, env, directory / f"rank-{req.rank}.log")
        self._ranks[key] = handle
        self.node.event("tensor", f"epoch {req.plan_epoch}: running rank {req.rank}/{req.size} for "
                                  f"{req.leader_id[:8]} (pid {handle.pid})")
        try:
            yield pb.RankEvent(pid=handle.pid)
            code = await handle.wait()
            yield pb.RankEvent(exit_code=code)
        finally:
            handle.kill()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(handle.wait()), 10)
            self._ranks.pop(key, None)

    # --- introspection / shutdown ----------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        """``tp`` of ``/v1/cluster``: the committed decision, and the group when this node leads it."""
        plan = self.node.plan
        out: dict[str, Any] = {"requested": self.requested}
        if plan is not None and plan.tp:
            out.update({k: plan.tp.get(k) for k in ("mode", "backend", "ranks", "reason", "refused", "groups",
                                                    "group_backends", "layer_ranges") if k in plan.tp})
        else:
            out.update({"mode": "pipeline", "backend": "none", "ranks": []})
        if self.group is not None:
            g = self.group.info()
            out["group"] = {k: g[k] for k in ("state", "epoch", "size", "backend", "ranks", "reason", "restarts",
                                              "in_flight", "layers")}
            out["group"]["plan_epoch"] = self.group_epoch
        elif self.group_error:
            out["group"] = {"state": "failed", "reason": self.group_error}
        local = [{"plan_epoch": k[0], "group_epoch": k[1], "rank": k[2], "pid": h.pid}
                 for k, h in sorted(self._ranks.items())]
        if self.group is not None and self.group.rank_pids().get(0):
            g = self.group.info()
            local.insert(0, {"plan_epoch": self.group_epoch, "group_epoch": g["epoch"], "rank": 0,
                             "pid": self.group.rank_pids()[0]})
        for r in local:  # what the rank processes on this machine hold (the daemon's own RSS excludes them)
            try:
                r["rss_bytes"] = psutil.Process(r["pid"]).memory_info().rss
            except psutil.Error:
                r["rss_bytes"] = None
        out["local_ranks"] = local
        return out

    async def close(self) -> None:
        """Stop the group and every rank this node runs."""
        self._closed = True
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self.group is not None:
            with contextlib.suppress(Exception):
                await self.group.close()
            self.group = None
        for handle in list(self._ranks.values()):
            handle.kill()
        for handle in list(self._ranks.values()):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(handle.wait()), 5)
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
