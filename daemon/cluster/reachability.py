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
    stage 0 (where its API requests go) and the stage after its own, at the plan's
    addresses. A node that advertised an address its peers cannot reach (a container
    bridge every host has, a stale route) is caught here, before any commit."""
    index = next((i for i, s in enumerate(serving.stages) if s.node_id == me), None)
    wanted = {0} if index != 0 else set()
    if index is not None and index + 1 < len(serving.stages):
        wanted.add(index + 1)

    async def dial(i: int) -> str | None:
        stage = serving.stages[i]
        try:
            await membership.stub(stage.address).Echo(pb.Ping(), timeout=REACH_TIMEOUT_S)
            return None
        except grpc.aio.AioRpcError as exc:
            role = "stage 0" if i == 0 else f"the next stage ({i})"
            host = stage.address.rsplit(":", 1)[0]
            return (f"cannot reach {role}, {stage.node_id[:8]} at {stage.address}, from this node "
                    f"({membership.address}): {exc.code().name}; if {host} is not an address its peers "
                    "can reach (a container or VM bridge such as docker0), start that node with "
                    "--advertise-host ADDRESS or --interface NAME")

    problems = [p for p in await asyncio.gather(*(dial(i) for i in sorted(wanted))) if p]
    return "; ".join(problems) or None

