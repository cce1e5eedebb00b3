"""Negotiation between three members over real gRPC: competing proposals.

A proposal that was prepared but never committed (its proposer lost the role when
two partitions merged: CI saw it in the netns cut-link test) must not refuse every
later proposal at its epoch. Each member here is a real :class:`Membership` and
:class:`Negotiator` behind a real gRPC server on loopback; only the node they
plan for is the small :class:`PlanHost` below (negotiation's own interface to it).
"""

from __future__ import annotations

import asyncio
import contextlib

from ringlet.daemon.cluster.membership import Member, Membership
from ringlet.daemon.cluster.negotiation import Negotiator
from ringlet.daemon.cluster.router import Router
from ringlet.daemon.wire.ports import free_ports
from ringlet.daemon.wire.rpc import ringlet_pb2 as pb
from ringlet.daemon.wire.rpc import ringlet_pb2_grpc as pb_grpc
from ringlet.daemon.wire.serving_plan import ServingPlan
from ringlet.daemon.wire.transport import TransportConfig, make_server
from ringlet.partitioning import ModelSpec, NodeSpec, make_plan

LAYERS = 6
SPEC = ModelSpec(layer_bytes=(10,) * LAYERS, embedding_bytes=3, head_bytes=2, kv_bytes_per_token_per_layer=1,
                 context_tokens=4, flops_per_token_per_layer=10.0, name="tiny")
RECORD = {"usable_memory_bytes": 1000}


class Host:
    """The node a negotiation plans for: holds the committed plan, records what happened."""

    def __init__(self, node_id: str):
        self.node_id = node_id
        self.plan: ServingPlan | None = None
        self.prepared: list[int] = []
        self.events: list[tuple[str, str]] = []
        self.tokens_in_flight = 0

    @property
    def epoch(self) -> int:
        return self.plan.epoch if self.plan is not None else 0

    async def prepare(self, plan: ServingPlan) -> int:
        self.prepared.append(plan.epoch)
        return 0

    async def commit(self, plan: ServingPlan) -> None:
        self.plan = plan

    def event(self, kind: str, message: str) -> None:
        self.events.append((kind, message))

    def kv_tokens_in_flight(self) -> int:
        return self.tokens_in_flight


class Ring(pb_grpc.RingServicer):
    def __init__(self, negotiation: Negotiator):
        self.negotiation = negotiation

    async def Propose(self, request, context):  # noqa: N802 - gRPC method name
        return await self.negotiation.on_propose(request)

    async def Commit(self, request, context):  # noqa: N802
        return await self.negotiation.on_commit(request)

    async def Echo(self, request, context):  # noqa: N802 - members dial stage 0 and their next stage
        return pb.Ping(sent_at=request.sent_at)


def free_port() -> int:
    """A port free on 127.0.0.1, outside the ephemeral range (no client connection takes it)."""
    return free_ports(1)[0]


@contextlib.asynccontextmanager
async def trio(records: dict[str, dict] | None = None):
    """Three members ``a`` < ``b`` < ``c`` that all see each other: ``{id: (host, membership, negotiator)}``;
    ``records``: their records by id (default :data:`RECORD` each); a record's ``model`` is the
    model that member serves (as ``ringlet run`` puts it there; default ``tiny-model``)."""
    ids = ["a" * 16, "b" * 16, "c" * 16]
    records = records or {}
    addresses = {i: f"127.0.0.1:{free_port()}" for i in ids}
    parts, servers = {}, []
    try:
        for i in ids:
            membership = Membership(i, addresses[i], "cluster", "inc", TransportConfig(node_id=i))
            membership.set_record(records.get(i, RECORD))
            for j in ids:
                if j != i:
                    membership.members[j] = Member(node_id=j, address=addresses[j], record=records.get(j, RECORD))
            host = Host(i)
            model = records.get(i, RECORD).get("model", "tiny-model")
            negotiator = Negotiator(host, membership, SPEC, model, LAYERS, settle_s=0.05)
            server = make_server(TransportConfig(node_id=i), addresses[i])
            pb_grpc.add_RingServicer_to_server(Ring(negotiator), server)
            await server.start()
            servers.append(server)
            parts[i] = (host, membership, negotiator)
        yield parts
    finally:
        for server in servers:
            await server.stop(None)
        for _, membership, _ in parts.values():
            for channel in membership._channels.values():
                await channel.close()


def test_a_prepared_proposal_that_never_commits_does_not_block_the_proposer():
    async def scenario():
        async with trio() as parts:
            a, b, c = sorted(parts)
            # c (not the proposer once it sees a) had proposed epoch 3; b and c prepared
            # it, and c never committed it (it lost the proposer's role when a came back)
            plan = make_plan([NodeSpec(b, 1000, 100e9, 1e12), NodeSpec(c, 1000, 100e9, 1e12)], [], SPEC)
            stale = pb.Proposal(epoch=3, proposer_id=c, membership_digest=parts[c][1].digest(),
                                plan_json=plan.to_json(), model="tiny-model",
                                addresses=[pb.LayerRange(node_id=i, grpc_address=parts[i][1].address)
                                           for i in (b, c)])
            for i in (b, c):
                assert (await parts[i][2].on_propose(stale)).ok
            neg_a = parts[a][2]
            assert neg_a.is_proposer()
            # a's first round (epoch 1: nothing is committed yet) loses to (3, c); the
            # refusals tell a about epoch 3
            assert await neg_a._propose_round() is True
            assert "superseded" in neg_a.last_result
            # its next round proposes above it, and every member commits it
            assert await neg_a._propose_round() is False, neg_a.last_result
            epochs = {i: parts[i][0].epoch for i in parts}
            assert set(epochs.values()) == {4}, epochs
            assert len({parts[i][0].plan.plan_id for i in parts}) == 1
            assert sorted(s.node_id for s in parts[a][0].plan.stages) == [a, b, c]

    asyncio.run(scenario())


def test_a_proposer_forgets_its_own_refused_proposal():
    async def scenario():
        async with trio() as parts:
            a, b, c = sorted(parts)
            # b proposes from a view that lacks a: its own member side prepares (1, b),
            # c refuses it (membership differs), and b must not keep (1, b) prepared
            del parts[b][1].members[a]
            neg_b = parts[b][2]
            assert neg_b.is_proposer()
            assert await neg_b._propose_round() is True
            assert "membership differs" in neg_b.last_result
            parts[b][1].members[a] = Member(node_id=a, address=parts[a][1].address, record=RECORD)
            # a's proposal at epoch 1 is then accepted by b at once
            neg_a = parts[a][2]
            assert await neg_a._propose_round() is False, neg_a.last_result
            assert {parts[i][0].epoch for i in parts} == {1}

    asyncio.run(scenario())


def test_a_member_that_cannot_dial_its_next_stage_refuses_naming_the_address():
    """A plan whose hop from b to c goes to an address nobody answers on (c advertised a
    container bridge, say) is refused by b before anything is committed, with the address
    and the flags that fix it; a, which only needs stage 0 (itself) and b, accepts."""
    async def scenario():
        async with trio() as parts:
            a, b, c = sorted(parts)
            dead = f"127.0.0.1:{free_port()}"  # nothing listens there
            specs = [NodeSpec(i, 1000, 100e9, 1e12) for i in (a, b, c)]
            plan = make_plan(specs, [], SPEC)
            addresses = {a: parts[a][1].address, b: parts[b][1].address, c: dead}
            proposal = pb.Proposal(epoch=1, proposer_id=a, membership_digest=parts[a][1].digest(),
                                   plan_json=plan.to_json(), model="tiny-model",
                                   addresses=[pb.LayerRange(node_id=i, grpc_address=addresses[i]) for i in (a, b, c)])
            order = [s.node_id for s in plan.stages]
            assert order == [a, b, c]  # equal nodes: in id order
            vote = await parts[b][2].on_propose(proposal)
            assert not vote.ok
            assert f"cannot reach the next stage (2), {c[:8]} at {dead}" in vote.reason
            assert "--advertise-host" in vote.reason and "UNAVAILABLE" in vote.reason
            assert (await parts[a][2].on_propose(proposal)).ok
            assert parts[b][0].prepared == []  # refused before loading anything

    asyncio.run(scenario())


def test_a_commit_that_misses_a_member_is_proposed_again():
    """c fails to switch when told to commit (its commit raises once): the proposer's
    next round, with nothing else changed, proposes a newer epoch, and then every member
    serves one plan. Before, the round saw "same plan, same membership" and left c on
    the old epoch until the next membership change."""
    async def scenario():
        async with trio() as parts:
            a, b, c = sorted(parts)
            host_c = parts[c][0]
            real_commit = host_c.commit
            failures = []

            async def failing_once(plan: ServingPlan) -> None:
                if not failures:
                    failures.append(plan.epoch)
                    raise RuntimeError("engine busy")
                await real_commit(plan)

            host_c.commit = failing_once
            neg_a = parts[a][2]
            assert await neg_a._propose_round() is True  # c's Commit failed
            assert failures == [1] and parts[a][0].epoch == 1 and host_c.epoch == 0
            assert f"{c}: cannot switch to epoch 1: engine busy" in neg_a.last_result, neg_a.last_result
            assert await neg_a._propose_round() is False, neg_a.last_result
            assert {parts[i][0].epoch for i in parts} == {2}, {i: parts[i][0].epoch for i in parts}
            assert await neg_a._propose_round() is False  # healed: nothing more to propose
            assert {parts[i][0].epoch for i in parts} == {2}

    asyncio.run(scenario())


def test_a_member_of_another_revision_is_named_and_kept_out_of_the_plan():
    """a (the lowest id) holds another commit of the model than b and c: the cluster serves
    the commit most members hold, b proposes (the lowest id holding it), the plan covers b
    and c only, a is asked nothing, and both sides say so by name."""
    old, new = "org/tiny@" + "1" * 40, "org/tiny@" + "2" * 40

    async def scenario():
        ids = ["a" * 16, "b" * 16, "c" * 16]
        async with trio({i: {**RECORD, "model": m} for i, m in zip(ids, (old, new, new), strict=True)}) as parts:
            a, b, c = sorted(parts)
            assert [parts[i][2].is_proposer() for i in (a, b, c)] == [False, True, False]
            neg_b = parts[b][2]
            assert await neg_b._propose_round() is False, neg_b.last_result
            for i in (b, c):
                assert sorted(s.node_id for s in parts[i][0].plan.stages) == [b, c]
            assert parts[a][0].prepared == [] and parts[a][0].plan is None
            for i in (a, b, c):
                parts[i][2].agreement.report(parts[i][1])
            (said,) = [m for k, m in parts[b][0].events if k == "kept-out"]
            assert a[:8] in said and old in said and new in said, said
            reason = parts[a][2].agreement.kept_out_reason
            assert reason.startswith(f"this node serves {old}, the cluster {new} (2 of 3 members")
            assert f"--model {new}" in reason and parts[a][0].events == [("kept-out", reason)]
            assert parts[b][2].info()["negotiation"]["kept_out"] == {a: old}
            assert parts[b][2].agreement.kept_out_reason is None

    asyncio.run(scenario())


def test_agreement_takes_the_most_held_model_and_a_tie_goes_to_the_lowest_id():
    from ringlet.daemon.cluster.model_agreement import agree

    held = {"a": "m@1", "b": "m@2", "c": "m@2", "d": None}
    got = agree(list(held), held.get, default="m@1")  # d's record is not known yet: counted as m@1
    assert (got.model, got.eligible) == ("m@1", ["a", "d"]) and got.kept_out == {"b": "m@2", "c": "m@2"}
    got = agree(["c", "b"], {"b": "m@2", "c": "m@3"}.get, default="m@9")
    assert (got.model, got.eligible, got.kept_out) == ("m@2", ["b"], {"c": "m@3"})
    assert agree(["x"], {}.get, default="m").eligible == ["x"]


def test_a_member_without_room_for_the_kv_in_flight_refuses_and_the_next_plan_is_sized_for_it():
    """The KV of the requests in flight moves with the layers. b holds 600 tokens of it
    (1 byte per token and layer here, so 600 bytes a layer) that a does not count: a's
    first plan gives b two layers (2 x 10 B of weights + 2 x 600 B of KV = 1,220 B > its
    1,000 B), which b refuses, saying so. a's next plan is sized for 600 tokens: b and c
    can hold one layer each (10 + 600 B), a (5,000 B) the other four."""
    async def scenario():
        ids = ["a" * 16, "b" * 16, "c" * 16]
        async with trio({ids[0]: {"usable_memory_bytes": 5000}}) as parts:
            a, b, c = sorted(parts)
            parts[b][0].tokens_in_flight = 600
            neg_a = parts[a][2]
            assert await neg_a._propose_round() is True
            assert f"{b}: no room for layers [2, 4) with the KV of 600 token(s) in flight" in neg_a.last_result
            assert parts[b][0].prepared == []
            assert await neg_a._propose_round() is False, neg_a.last_result
            ranges = {s.node_id: s.end - s.start for s in parts[a][0].plan.stages}
            assert ranges == {a: 4, b: 1, c: 1}, ranges

    asyncio.run(scenario())


def test_a_proposer_whose_address_is_refused_is_proposed_again_at_its_other_address():
    """a may be dialled at two addresses, and b and c last said they reach it at the first,
    where nothing answers any more. They refuse a's proposal naming it; their routers mark
    it unreachable and publish that (copied here to a, as the records' gossip would), and
    a's next proposal stands a at its other address, which every member accepts."""
    async def scenario():
        async with trio() as parts:
            a, b, c = sorted(parts)
            real, dead = parts[a][1].address, f"127.0.0.1:{free_port()}"  # nothing listens at dead
            for i in (b, c):
                Router(parts[i][1], [parts[i][1].address])  # it hooks itself to the membership
            parts[a][1].set_record({**RECORD, "addresses": [dead, real]})
            for i in (b, c):
                parts[i][1].members[a].record = parts[a][1].own_record
                stale = {"address": dead, "reachable": [dead, real], "unreachable": {}}
                parts[a][1].members[i].record = {**RECORD, "routes": {a: stale}}
            neg_a = parts[a][2]
            assert await neg_a._propose_round() is True  # refused
            assert f"cannot reach stage 0, {a[:8]} at {dead}" in neg_a.last_result, neg_a.last_result
            for i in (b, c):
                route = parts[i][1].own_record["routes"][a]
                assert (route["address"], route["unreachable"]) == (real, {dead: "UNAVAILABLE"}), route
                parts[a][1].members[i].record = parts[i][1].own_record  # gossip
            assert await neg_a._propose_round() is False, neg_a.last_result
            for i in (a, b, c):
                stage = next(s for s in parts[i][0].plan.stages if s.node_id == a)
                assert stage.address == real, parts[i][0].plan

    asyncio.run(scenario())
