"""A graceful leave: a stopping node tells its peers, then waits for their new plan.

On ``SIGTERM`` (``ringlet service stop``, launchd or systemd stopping the daemon) a
node that simply exited would look like a crash: its peers would learn it from
missed heartbeats (about a second) and keep routing to it meanwhile. Instead the
stopping node

1. announces its leave to every member (:meth:`Membership.announce_leave`): each
   removes it at once as ``left: stopped`` and re-plans without it;
2. keeps its gRPC server up until a peer has committed a plan without it, so the
   requests in flight on the old plan run on until their API nodes resume them on
   the new one (as on a kill, but without the heartbeat timeout first);
3. exits, by the deadline at the latest (``--drain-timeout-s``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from ringlet.daemon.cluster.membership import Membership
from ringlet.daemon.wire.rpc import ringlet_pb2 as pb

log = logging.getLogger(__name__)

#: Seconds between polls of the peers' committed plans while leaving.
POLL_S = 0.2
#: The announcement's own time limit, seconds (a member that does not answer by
#: then learns the leave from silence).
ANNOUNCE_TIMEOUT_S = 2.0


@dataclass
class Left:
    """How a leave went: one line for the log, and whether a peer committed a plan
    without this node (its new holders then fetch this node's KV before it exits)."""

    line: str
    replanned: bool = False


async def leave_cluster(membership: Membership, epoch: int, deadline: float) -> Left:
    """Announce this node's leave and wait until a peer serves a plan without it.

    Args:
        membership: this node's member table (its members are told).
        epoch: this node's committed epoch; the peers' new plan has a higher one.
        deadline: ``time.monotonic()`` by which to return in any case.

    Returns:
        How the leave went (:class:`Left`).
    """
    started = time.monotonic()
    if not membership.members:
        membership.leaving = True
        return Left("no peers to tell")
    acked = await membership.announce_leave(min(ANNOUNCE_TIMEOUT_S, max(0.1, deadline - time.monotonic())))
    if not acked:
        return Left("no peer acknowledged the leave; they will notice the silence")
    request = pb.NodeInfoRequest(caller_id=membership.node_id)  # no caller address: no handshake back
    waiting = set(acked)
    while waiting and time.monotonic() < deadline:
        for address in sorted(waiting):
            try:
                info = await membership.stub(address).GetNodeInfo(request, timeout=max(0.1, min(
                    1.0, deadline - time.monotonic())))
            except grpc.aio.AioRpcError:
                waiting.discard(address)  # gone too: it will not re-plan
                continue
            if info.leaving:
                waiting.discard(address)  # stopping too (the whole cluster is): nothing to wait for
            elif info.epoch > epoch and all(s.node_id != membership.node_id for s in info.plan):
                return Left(f"{len(acked)} peer(s) told; epoch {info.epoch} was committed without this node "
                            f"{time.monotonic() - started:.2f} s later", replanned=True)
        await asyncio.sleep(POLL_S)
    if not waiting:
        return Left(f"{len(acked)} peer(s) told; they are stopping or gone too")
    return Left(f"{len(acked)} peer(s) told; no plan without this node was committed before the drain timeout")
