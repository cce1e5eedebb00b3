"""Negotiated plans: one committed plan per membership change, on every member.

Protocol (all over ringlet's gRPC)::

    proposer                         every member (the proposer included)
    --------                         -----------------------------------
    Propose(epoch, digest, plan) --> check: proposer is a member, epoch is newer than
                                     the committed one, (epoch, proposer) is not older
                                     than a proposal already prepared, the membership
                                     digest equals its own view, the plan is for this
                                     model and covers every layer exactly once, and
                                     this node can dial stage 0 and its next stage at
                                     the plan's addresses;
                                     prepare: load its new layers in the background
                                     (keeping the layers it holds) while the old plan
                                     keeps serving
                                 <-- Vote(ok | reason)
    Commit(epoch, plan_id)       --> only for the plan it prepared: switch
                                 <-- Vote

* Exactly one proposer per change: the member with the lowest node id among the
  members of its view. Views converge through heartbeats; a proposal made from a
  stale view is refused ("membership differs") and re-proposed once views agree.
* Competing proposals are ordered by ``(epoch, proposer id)``; a member never
  prepares a proposal older than one it has prepared, and never commits one it did
  not prepare. A refusal carries the newest epoch the refusing member has prepared
  or committed (``Vote.newest_epoch``), and the proposer's next round proposes above
  it: a proposal that was prepared but never committed (its proposer lost the role
  when two partitions merged) would otherwise refuse every later one at its epoch.
* A refusal for a membership difference reconciles the two views and backs off
  (:mod:`.refusals`): the refuser dials the proposal's members it lacks, the proposer
  those the refusal lists, and the next round waits 1 s, doubling to 8 s, unless every
  member's beats report the proposer's view first (or its membership changes);
  refusals are logged once per cause with a count.
* Churn is debounced: the proposer waits until the membership has been stable for
  ``settle_s`` and proposes only when the plan would differ from the committed one
  or the membership changed, or a stage's address moved (a route broke or a faster one
  was measured: :mod:`.router`), or when its last commit did not reach every member
  (a split commit heals with the next epoch).
* A model that no longer fits gets an epoch too: the committed "plan" then carries
  only the reason ("model needs X GB, cluster has Y GB"), and requests get 503
  with it until a member joins.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import replace
from typing import Protocol

import grpc

from ringlet.daemon.cluster import features, refusals
from ringlet.daemon.cluster.cluster_view import cluster_view
from ringlet.daemon.cluster.kv_sources import mark_rebuilds, room_refusal
from ringlet.daemon.cluster.membership import Membership
from ringlet.daemon.cluster.model_agreement import ModelAgreement
from ringlet.daemon.cluster.proposal import layout, proposal_addresses, readdress, routes_moved
from ringlet.daemon.cluster.reachability import REACH_TIMEOUT_S, unreachable
from ringlet.daemon.cluster.topology import build_graph, planner_inputs
from ringlet.daemon.wire.rpc import ringlet_pb2 as pb
from ringlet.daemon.wire.serving_plan import ServingPlan, StageSpec
from ringlet.partitioning import Infeasible, InvalidPlan, ModelSpec, Plan, Policy, make_plan, validate_plan

log = logging.getLogger(__name__)


class PlanHost(Protocol):
    """What negotiation needs of the node it plans for (:class:`ringlet.daemon.node.Node`).

    Negotiation sits below the node: it drives the node through this interface and
    never imports it.
    """

    node_id: str

    @property
    def epoch(self) -> int:
        """The committed plan's epoch (0 before the first commit)."""

    @property
    def plan(self) -> ServingPlan | None:
        """The committed plan, if any."""

    async def prepare(self, plan: ServingPlan) -> int:
        """Load ``plan``'s stage for this node while the old plan serves; bytes read."""

    async def commit(self, plan: ServingPlan) -> None:
        """Switch to ``plan`` (prepared before)."""

    def event(self, kind: str, message: str) -> None:
        """Record a one-line event for status and the dashboard."""

    def kv_tokens_in_flight(self) -> int:
        """Tokens in the KV caches of the requests in flight on this node (every stage of a
        pipeline holds them all: they move with the layers at a re-plan)."""


class Negotiator:
    """Membership-driven planning for one node.

    Args:
        node: the node it plans for (a :class:`PlanHost`).
        membership: the member table.
        model_spec: the model as the planner sees it.
        model_name: the model's name (a proposal for another model is refused).
        num_layers: decoder layers of the model.
        policy: planner policy.
        settle_s: seconds the membership must be stable before proposing.
        initial_settle_s: the same for the very first plan (lets discovery find peers).
        prepare_timeout_s: how long the proposer waits for every member to load.
        tp: tensor-parallel serving (:class:`ringlet.daemon.tensor.serving.TPServing`): the
            proposer's mode decision travels in the proposal, and commits start or stop
            tensor groups; ``None`` = pipeline only.
        requires: the capabilities a node needs to hold a stage of this model
            (:func:`.features.required_by`); members lacking one are left out, named.
    """

    def __init__(self, node: PlanHost, membership: Membership, model_spec: ModelSpec, model_name: str,
                 num_layers: int, policy: Policy | None = None, *, settle_s: float = 0.3,
                 initial_settle_s: float = 1.0, prepare_timeout_s: float = 300.0, tp=None,
                 requires: frozenset[str] = frozenset()):
        self.node, self.membership, self.model_spec, self.model_name = node, membership, model_spec, model_name
        self.num_layers = num_layers
        self.policy = policy or Policy()
        self.settle_s, self.initial_settle_s, self.prepare_timeout_s = settle_s, initial_settle_s, prepare_timeout_s
        self.tp, self.requires = tp, requires
        self.state = "idle"
        self.committed_plan: Plan | None = None
        self.committed_digest = ""
        self.committed_reason: str | None = None
        self._prepared_key: tuple[int, str] | None = None
        self._epoch_floor = 0  # newest epoch a refusing member reported (Vote.newest_epoch)
        self._kv_reserve = 0  # most KV tokens in flight a member refused for (Vote.kv_tokens)
        self._split = False  # this node's last commit did not reach every member
        self._prepared: dict[tuple[int, str], tuple[ServingPlan, Plan | None, str]] = {}
        self._changed = asyncio.Event()
        self._last_change = time.monotonic()
        self._task: asyncio.Task | None = None
        self._started = time.monotonic()
        self.last_result = ""
        self.bytes_loaded_last = 0
        self.agreement = ModelAgreement(model_name, node.event)  # members of another model: kept out
        self._backoff = refusals.Backoff()  # rounds refused for a membership difference in a row
        self._retry_s = settle_s  # the wait before the next round after a refused one
        self.said = refusals.CountedLog(log)  # refusals, given and received: once per cause, with a count

    # --- wiring --------------------------------------------------------------------------

    def membership_changed(self) -> None:
        """Called by the membership on every join or leave."""
        self._last_change = time.monotonic()
        self._changed.set()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="negotiation")
        self._changed.set()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    # --- the proposer side ---------------------------------------------------------------

    def is_proposer(self) -> bool:
        """This node has the lowest id among the members it sees that hold the cluster's model."""
        return self.agreement.view(self.membership).eligible[:1] == [self.node.node_id]

    async def _loop(self) -> None:
        while True:
            await self._changed.wait()
            # debounce: wait until the membership has been quiet for settle_s
            while True:
                settle = self.initial_settle_s if self.node.plan is None else self.settle_s
                quiet = time.monotonic() - max(self._last_change, self._started)
                if quiet >= settle:
                    break
                await asyncio.sleep(settle - quiet)
            self._changed.clear()
            self.agreement.report(self.membership)
            if not self.is_proposer():
                continue
            try:
                retry = await self._propose_round()
            except Exception:  # a round must never kill the loop
                log.exception("negotiation round failed")
                retry = True
            if retry:  # views that came to agree, or a membership change, end a long wait early
                await refusals.wait_to_propose(self._retry_s, self.settle_s, self._changed, self.membership.views_agree)
                self._changed.set()

    def compute_plan(self, kv_tokens: int = 0) -> tuple[Plan | None, str | None]:
        """The plan for the current view, or ``(None, reason)`` when the model does not fit;
        with ``kv_tokens`` (the KV in flight, which moves with the layers) above the model's
        planning context, every stage is sized for that many tokens of KV."""
        ids = self.agreement.view(self.membership).eligible
        records = {i: self.membership.record_of(i) or {} for i in ids}
        unable = features.unable(records, self.requires, self.model_name)  # too old for this model: left out
        nodes, links = planner_inputs(build_graph({i: r for i, r in records.items() if i not in unable}))
        spec = self.model_spec
        if kv_tokens > spec.context_tokens:
            spec = replace(spec, context_tokens=kv_tokens)
        try:
            return make_plan(nodes, links, spec, previous=self.committed_plan, policy=self.policy), None
        except Infeasible as exc:
            have = sum(n.memory_bytes for n in nodes)
            need = have + exc.shortfall_bytes
            lost = "".join(f"; lost {i}: {self.membership.departed.get(i, '?')}" for i in sorted(self.membership.lost))
            lost += "".join(f"; left out: {why}" for _, why in sorted(unable.items()))
            return None, (f"model needs {need / 1e9:.2f} GB, cluster has {have / 1e9:.2f} GB usable across "
                          f"{len(nodes)} node(s); add a node or memory ({exc.message}){lost}")

    async def _propose_round(self) -> bool:
        """One proposal. Returns True to retry later (views differ, a vote failed)."""
        digest = self.membership.digest()
        plan, reason = self.compute_plan()
        ids = self.agreement.view(self.membership).eligible
        mode = self.tp.decide(ids) if self.tp is not None and plan is not None else None
        records = {i: self.membership.record_of(i) for i in ids}
        uses = features.plan_features(records, plan, mode)
        if self.node.plan is not None and digest == self.committed_digest and not self._split and (
                plan is None or self.node.plan.features == uses):  # a member's build changed: the plan's features too
            same = (plan is not None and self.committed_plan is not None
                    and plan.plan_id == self.committed_plan.plan_id) or (plan is None and reason
                                                                          and self.committed_reason)
            committed_mode = (self.node.plan.tp or {}).get("mode", "pipeline")
            if same and committed_mode == (mode or {}).get("mode", "pipeline") and not routes_moved(
                    self.node.plan, proposal_addresses(self.membership, ids, plan)):  # a route broke or sped up
                return False
        # a re-plan is due: the KV in flight moves with the layers, so the new stages must hold it
        reserve = max(self.node.kv_tokens_in_flight(), self._kv_reserve)
        if reserve > self.model_spec.context_tokens:
            plan, reason = self.compute_plan(reserve)
            log.info("planning with room for %d token(s) of KV in flight", reserve)
        epoch = max([self.node.epoch, self._epoch_floor,
                     *(m.committed_epoch for m in self.membership.members.values())]) + 1
        addresses = proposal_addresses(self.membership, ids, plan)
        body = features.plan_body(plan, uses) if plan is not None else json.dumps({"infeasible": reason})
        previous = readdress(await self._serving_stages(), addresses)  # KV holders where they answer now
        if plan is not None and not (mode and mode.get("mode") in ("tensor", "hybrid")):
            nodes, links = planner_inputs(build_graph({i: r or {} for i, r in records.items()}))
            stages = [(s.node_id, s.start, s.end) for s in plan.stages]
            mark_rebuilds(previous, stages, self.model_spec, nodes, links, self.policy, set(ids),
                          self.membership.departed)
        proposal = pb.Proposal(epoch=epoch, proposer_id=self.node.node_id, membership_digest=digest,
                               plan_json=body, model=self.model_name, addresses=addresses,
                               tp_json=json.dumps(mode, sort_keys=True) if mode else "", previous=previous)
        self.state = f"proposing epoch {epoch}"
        members = [self.membership.members[i] for i in ids if i != self.node.node_id]
        log.info("proposing epoch %d to %d member(s): %s%s", epoch, len(members) + 1, layout(plan, mode),
                 f"; {mode['reason']}" if mode else "")

        async def ask(member) -> pb.Vote:
            try:
                return await self.membership.stub(member.address).Propose(proposal, timeout=self.prepare_timeout_s)
            except grpc.aio.AioRpcError as exc:
                return pb.Vote(ok=False, reason=f"unreachable: {exc.code().name}", node_id=member.node_id)

        votes = await asyncio.gather(self.on_propose(proposal), *(ask(m) for m in members))
        refused = [v for v in votes if not v.ok]
        self._retry_s = self.settle_s
        if any(refusals.views_differ(v.reason) for v in refused):
            self.membership.learn((d.node_id, d.grpc_address) for v in refused for d in v.members)
            self._retry_s = self._backoff.next()
        else:
            self._backoff.reset()
        if refused:
            self.state = "idle"
            self._epoch_floor = max([self._epoch_floor, *(v.newest_epoch for v in refused)])
            self._kv_reserve = max([self._kv_reserve, *(v.kv_tokens for v in refused)])
            self._abandon((epoch, self.node.node_id))
            self.last_result = "; ".join(f"{v.node_id}: {v.reason}" for v in refused)
            self.said(logging.INFO, f"a proposal not accepted: {self.last_result}",
                      kind=f"received: {refused[0].reason.split(':')[0][:80]}")
            return True
        commit = pb.CommitRequest(epoch=epoch, proposer_id=self.node.node_id, plan_id=plan.plan_id if plan else "")

        async def tell(member) -> pb.Vote:
            try:
                return await self.membership.stub(member.address).Commit(commit, timeout=30)
            except grpc.aio.AioRpcError as exc:
                return pb.Vote(ok=False, reason=f"unreachable: {exc.code().name}", node_id=member.node_id)

        acks = await asyncio.gather(self.on_commit(commit), *(tell(m) for m in members))
        failed = [a for a in acks if not a.ok]
        self.state = "idle"
        self._split = bool(failed)  # the next round proposes again though nothing changed
        if failed:
            self.last_result = "; ".join(f"{a.node_id}: {a.reason}" for a in failed)
            log.warning("commit of epoch %d incomplete: %s; proposing again", epoch, self.last_result)
            return True
        self.last_result = f"epoch {epoch} committed"
        return False

    async def _serving_stages(self) -> list[pb.LayerRange]:
        """The stages of the plan the cluster serves now, for a proposal's ``previous``:
        this node's committed plan, else (a node that joins) the plan of the member with
        the newest committed epoch (empty: none, or it cannot be asked)."""
        current = self.node.plan
        if current is not None:
            return [pb.LayerRange(node_id=s.node_id, start=s.start, end=s.end, grpc_address=s.address)
                    for s in current.stages]
        newest = max(self.membership.members.values(), key=lambda m: m.committed_epoch, default=None)
        if newest is None or not newest.committed_epoch:
            return []
        try:
            info = await self.membership.stub(newest.address).GetNodeInfo(
                pb.NodeInfoRequest(caller_id=self.node.node_id), timeout=REACH_TIMEOUT_S)
        except grpc.aio.AioRpcError:
            return []
        return list(info.plan)

    # --- the member side -----------------------------------------------------------------

    def _refuse(self, why: str) -> pb.Vote:
        self.said(logging.INFO, f"refusing a proposal: {why}", kind=f"given: {why.split(':')[0][:80]}")
        newest = max(self.node.epoch, self._prepared_key[0] if self._prepared_key is not None else 0)
        return pb.Vote(ok=False, reason=why, node_id=self.node.node_id, newest_epoch=newest)

    def _reconcile(self, p: pb.Proposal, why: str) -> pb.Vote:
        """Refuse ``p``, made from another view: dial the members it lists that this node
        lacks, and list this node's members in the refusal (for the proposer to dial)."""
        self.membership.learn((a.node_id, a.grpc_address) for a in p.addresses)
        vote = self._refuse(why)
        vote.members.extend(self.membership.member_digests())
        return vote

    def _no_room(self, serving: ServingPlan) -> pb.Vote | None:
        """A refusal when this node's stage of ``serving`` cannot hold its weights with the
        KV in flight, which arrives with the layers (``None``: it can)."""
        mine = next((s for s in serving.stages if s.node_id == self.node.node_id), None)
        usable = int((self.membership.own_record or {}).get("usable_memory_bytes") or 0)
        if mine is None or usable <= 0:
            return None
        tokens = self.node.kv_tokens_in_flight()
        why = room_refusal(self.model_spec, mine.start, mine.end, tokens, usable)
        if why is None:
            return None
        vote = self._refuse(why)
        vote.kv_tokens = max(tokens, self.model_spec.context_tokens)
        return vote

    def _abandon(self, key: tuple[int, str]) -> None:
        """Forget this node's own proposal ``key`` after a member refused it.

        It will never be committed, so it must not refuse the proposals that follow.
        """
        self._prepared.pop(key, None)
        if self._prepared_key == key:
            self._prepared_key = max(self._prepared, default=None)

    async def on_propose(self, p: pb.Proposal) -> pb.Vote:
        """Check and prepare a proposal (see the module docstring for the rules)."""
        me = self.node.node_id
        if p.proposer_id != me and p.proposer_id not in self.membership.members:
            return self._reconcile(p, f"{refusals.NON_MEMBER} ({p.proposer_id[:32]!r})")
        if p.epoch <= self.node.epoch:
            return self._refuse(f"stale epoch {p.epoch}: epoch {self.node.epoch} is committed")
        key = (p.epoch, p.proposer_id)
        if self._prepared_key is not None and key < self._prepared_key:
            return self._refuse(f"superseded: proposal {self._prepared_key} is newer")
        if p.model != self.model_name:
            return self._refuse(f"plan for another model ({p.model[:64]!r}; this node serves {self.model_name!r})")
        if p.membership_digest != self.membership.digest():
            return self._reconcile(p, refusals.MEMBERSHIP_DIFFERS)
        try:
            body = json.loads(p.plan_json)
        except ValueError:
            return self._refuse("malformed plan JSON")
        addresses = {a.node_id: a.grpc_address for a in p.addresses}
        hops = {a.node_id: a.hop_address for a in p.addresses}  # where the stage before dials it
        ids = self.membership.alive_ids()
        if not isinstance(body, dict):
            return self._refuse("malformed plan JSON")
        if "infeasible" in body:
            plan, reason = None, str(body["infeasible"])[:500]
            serving = ServingPlan(epoch=p.epoch, stages=(), plan_id=f"infeasible:{p.epoch}", infeasible=reason)
        else:
            try:
                plan = Plan.from_dict(body)
                validate_plan(plan, self.num_layers, node_ids=ids)
            except (InvalidPlan, ValueError, TypeError, KeyError) as exc:
                return self._refuse(f"plan does not cover every layer of this model exactly once: {exc}")
            if plan.model_name != self.model_spec.name:
                return self._refuse(f"plan for another model ({plan.model_name!r})")
            missing = [s.node_id for s in plan.stages if not addresses.get(s.node_id)]
            if missing:
                return self._refuse(f"plan names stages without addresses: {missing}")
            stages = tuple(StageSpec(address=addresses[s.node_id], start=s.start, end=s.end, node_id=s.node_id,
                                     hop_address=hops.get(s.node_id, "")) for s in plan.stages)
            serving = ServingPlan(epoch=p.epoch, stages=stages, plan_id=plan.plan_id, detail=plan.to_dict())
            if p.tp_json:
                from ringlet.daemon.tensor.serving.mode import check_tp_dict

                try:
                    mode = json.loads(p.tp_json)
                except ValueError:
                    mode = None
                bad = check_tp_dict(mode, ids, p.proposer_id, self.num_layers)
                if bad:
                    return self._refuse(f"malformed mode decision: {bad}")
                if mode["mode"] in ("tensor", "hybrid"):
                    missing = [r for r in mode["ranks"] if not addresses.get(r)]
                    if missing:
                        return self._refuse(f"tensor plan names ranks without addresses: {missing}")
                    if self.tp is None:
                        return self._refuse("this node does not run tensor groups")
                if mode["mode"] == "tensor":
                    # every rank holds every layer (split by model.shard in its rank process)
                    stages = tuple(StageSpec(address=addresses[r], start=0, end=self.num_layers, node_id=r)
                                   for r in mode["ranks"])
                    serving = ServingPlan(epoch=p.epoch, stages=stages, plan_id=f"tensor:{plan.plan_id}",
                                          detail=plan.to_dict(), tp=mode)
                elif mode["mode"] == "hybrid":
                    # the stages are the groups' leaders, each with its group's layer range
                    stages = tuple(StageSpec(address=addresses[g[0]], start=int(a), end=int(b), node_id=g[0])
                                   for g, (a, b) in zip(mode["groups"], mode["layer_ranges"], strict=True))
                    serving = ServingPlan(epoch=p.epoch, stages=stages, plan_id=f"hybrid:{plan.plan_id}",
                                          detail=plan.to_dict(), tp=mode)
                else:
                    serving = replace(serving, tp=mode)
            reason = None
            previous = tuple(StageSpec(address=r.grpc_address, start=r.start, end=r.end, node_id=r.node_id,
                                       rebuild=r.rebuild, why=r.why, lost=r.lost) for r in p.previous)
            previous = previous or (self.node.plan.stages if self.node.plan is not None else ())  # unsaid
            serving = replace(serving, previous=previous, features=features.features_of(body))
            if why := features.split_refusal(self.membership.record_of, [s.node_id for s in serving.stages],
                                             self.requires, self.model_name):  # never run a split wrong
                return self._refuse(why)
            if not serving.is_tensor and (why := await unreachable(self.membership, self.node.node_id, serving)):
                return self._refuse(why)
            if not serving.is_tensor and not serving.is_hybrid and (vote := self._no_room(serving)) is not None:
                return vote
        self._prepared_key = key
        self.state = f"preparing epoch {p.epoch}"
        try:
            loaded = await self.node.prepare(serving)
        except Exception as exc:  # loading failed: refuse, keep serving the old plan
            log.log(refusals.load_failure_level(exc), "preparing epoch %d failed", p.epoch, exc_info=True)
            self.state = "idle"
            return self._refuse(f"cannot load its stage: {exc}")
        self.bytes_loaded_last = loaded
        self._prepared[key] = (serving, plan, p.membership_digest)
        self.state = f"prepared epoch {p.epoch}"
        return pb.Vote(ok=True, node_id=me)

    async def on_commit(self, c: pb.CommitRequest) -> pb.Vote:
        """Switch to a prepared plan."""
        key = (c.epoch, c.proposer_id)
        entry = self._prepared.get(key)
        if entry is None:
            return self._refuse(f"commit for epoch {c.epoch} by {c.proposer_id[:32]!r}, which this node never prepared")
        serving, plan, digest = entry
        if (plan.plan_id if plan is not None else "") != c.plan_id:
            return self._refuse("commit names another plan than the one prepared")
        try:
            await self.node.commit(serving)
        except Exception as exc:  # the proposer proposes again (a split commit heals)
            log.exception("committing epoch %d failed", c.epoch)
            return self._refuse(f"cannot switch to epoch {c.epoch}: {exc}")
        if self.tp is not None:
            self.tp.committed(serving)
        for k in [k for k in self._prepared if k <= key]:
            self._prepared.pop(k, None)
        self._prepared_key = None
        self.committed_plan = plan
        self.committed_digest = digest
        self.committed_reason = serving.infeasible
        self.state = "idle"
        if serving.infeasible:
            self.node.event("unplanned", serving.infeasible)
        elif serving.is_tensor:
            ranks = ", ".join(f"{i} {r[:8]}" for i, r in enumerate(serving.tp["ranks"]))
            self.node.event("replan", f"epoch {serving.epoch}: tensor over {serving.tp['backend']}, ranks {ranks}")
        elif serving.is_hybrid:
            groups = "; ".join(f"[{s.start},{s.end}) on {'+'.join(r[:8] for r in g)} ({b})" for s, g, b in
                               zip(serving.stages, serving.tp["groups"], serving.tp["group_backends"], strict=True))
            self.node.event("replan", f"epoch {serving.epoch}: hybrid: {groups}")
        else:
            ranges = ", ".join(f"{s.node_id[:8]} [{s.start},{s.end})" for s in serving.stages)
            self.node.event("replan", f"epoch {serving.epoch}: {ranges}; this node read "
                                      f"{self.bytes_loaded_last / 1e6:.1f} MB")
            if serving.tp and serving.tp.get("refused"):
                self.node.event("mode", serving.tp["reason"])
        self.bytes_loaded_last = 0
        return pb.Vote(ok=True, node_id=self.node.node_id)

    # --- introspection -------------------------------------------------------------------

    def info(self) -> dict:
        """Members, topology and negotiation state for ``/v1/cluster`` (:func:`.cluster_view.cluster_view`)."""
        return cluster_view(self)
