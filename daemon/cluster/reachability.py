"""Can this node serve a proposed plan's hops? A member dials, before it prepares, the
stages its requests and activations will go to."""

from __future__ import annotations

import asyncio

import grpc

from ringlet.daemon.cluster.membership import Membership
from ringlet.daemon.wire.rpc import ringlet_pb2 as pb
from ringlet.daemon.wire.serving_plan import ServingPlan

#: Seconds a member waits for stage 0 or its next stage to answer an ``Echo`` before
#: refusing a proposal as unreachable (a loopback or LAN round trip takes milliseconds).
REACH_TIMEOUT_S = 3.0


async def unreachable(membership: Membership, me: str, serving: ServingPlan) -> str | None:
    """Why this node cannot serve ``serving``'s hops (``None``: it can): it must dial
    stage 0 (where its API requests go) at its address and the stage after its own at the
    address its hop stream will dial (:attr:`StageSpec.dial_from_previous`). A node that
    advertised an address its peers cannot reach (a container bridge every host has, a
    stale route) is caught here, before any commit; the failure goes to the membership's
    ``on_dial_failed`` (the router publishes it, so the proposer plans over another address)."""
    index = next((i for i, s in enumerate(serving.stages) if s.node_id == me), None)
    wanted = {(0, serving.stages[0].address)} if index != 0 and serving.stages else set()
    if index is not None and len(serving.stages) > 1:  # the last stage's next is stage 0 (the tokens)
        nxt = (index + 1) % len(serving.stages)
        wanted.add((nxt, serving.stages[nxt].dial_from_previous))

    async def dial(i: int, address: str) -> str | None:
        stage = serving.stages[i]
        try:
            await membership.stub(address).Echo(pb.Ping(), timeout=REACH_TIMEOUT_S)
            return None
        except grpc.aio.AioRpcError as exc:
            if membership.on_dial_failed is not None:
                membership.on_dial_failed(stage.node_id, address, exc.code().name)
            role = "stage 0" if i == 0 else f"the next stage ({i})"
            host = address.rsplit(":", 1)[0]
            return (f"cannot reach {role}, {stage.node_id[:8]} at {address}, from this node "
                    f"({membership.node_id[:8]} at {membership.reachable_address()}): {exc.code().name}; if {host} "
                    "is not an address its peers "
                    "can reach (a container or VM bridge such as docker0), start that node with "
                    "--advertise-host ADDRESS or --interface NAME")

    problems = [p for p in await asyncio.gather(*(dial(i, a) for i, a in sorted(wanted))) if p]
    return "; ".join(problems) or None

