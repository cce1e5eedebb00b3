"""Real :class:`Node` objects in the test's own process, each with its own gRPC server on
loopback and the real model, driven through prepare and commit by hand (as negotiation
drives them)."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace

from ringlet.daemon.engine.sampling import SamplingParams
from ringlet.daemon.node import Node, NodeConfig
from ringlet.daemon.wire.ports import free_ports
from ringlet.daemon.wire.serving_plan import ServingPlan, StageSpec


def free_port() -> int:
    """A port free on 127.0.0.1, outside the ephemeral range (no client connection takes it)."""
    return free_ports(1)[0]


def plan(epoch: int, *stages: tuple[Node, int, int], previous: ServingPlan | None = None,
         lost: tuple[Node, ...] = (), recompute: tuple[Node, ...] = ()) -> ServingPlan:
    """A pipeline plan of ``(node, start, end)`` stages in ring order; ``previous``: the plan
    it replaces (where gained layers' KV is fetched from), its stages held by ``lost``
    nodes marked to be rebuilt (as a proposer marks a member that is gone), and those of
    ``recompute`` nodes too (as a proposer that predicts recomputing faster than moving)."""
    specs = tuple(StageSpec(address=n.config.address, start=a, end=b, node_id=n.node_id) for n, a, b in stages)
    gone = {n.node_id for n in lost}
    marked = gone | {n.node_id for n in recompute}
    before = tuple(replace(s, rebuild=True, why="test", lost=s.node_id in gone) if s.node_id in marked else s
                   for s in (previous.stages if previous is not None else ()))
    return ServingPlan(epoch=epoch, stages=specs, plan_id=f"test:{epoch}:{[(n.node_id, a, b) for n, a, b in stages]}",
                       previous=before)


async def crash(node: Node) -> None:
    """``node`` stops answering at once, as a killed process does (its gRPC server and its
    hop stream close with no goodbye)."""
    if node._next is not None:
        await node._next.close()
    await node._server.stop(grace=None)


@contextlib.asynccontextmanager
async def started(location, n: int, **config):
    """``n`` started nodes ``a``, ``b``, ... (float32; ``config``: more NodeConfig fields)."""
    nodes = [Node(NodeConfig(host="127.0.0.1", port=free_port(), model=location, dtype="float32",
                             node_id=chr(ord("a") + i) * 16, step_timeout_s=20.0, **config)) for i in range(n)]
    try:
        for node in nodes:
            await node.start()
        yield nodes
    finally:
        for node in nodes:
            await node.stop()


async def switch(new: ServingPlan, nodes: list[Node]) -> None:
    """Prepare ``new`` on every node, then commit it on all at once."""
    for node in nodes:
        await node.prepare(new)
    await asyncio.gather(*(node.commit(new) for node in nodes))


async def greedy_with_a_change(node: Node, prompt: list[int], tokens: int, after: int, change) -> list[int]:
    """Greedy ids of ``tokens`` tokens that ``node`` generates (resuming as it must), with
    ``await change()`` run once ``after`` of them have come."""
    got: list[int] = []

    async def consume() -> None:
        async for t in node.generate(prompt, tokens, SamplingParams(temperature=0.0), set()):
            got.append(t)

    request = asyncio.ensure_future(consume())
    while len(got) < after and not request.done():
        await asyncio.sleep(0.02)
    await change()
    await asyncio.wait_for(request, timeout=120)
    return got
