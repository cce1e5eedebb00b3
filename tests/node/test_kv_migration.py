"""KV caches move with their layers on a re-plan: a request in flight resumes without
prefilling again.

Real :class:`Node` objects with their own gRPC servers on loopback and the real model
(float32); the test drives prepare and commit as negotiation does, with the plan's
``previous`` stages. Expected ids: transformers' greedy continuation
(``smollm2_135m_instruct_greedy.json``); expected bytes: the model's KV size, by hand
(SmolLM2-135M: 3 key/value heads of 64, so keys and values of one token in one layer
take 2 x 192 float32 values).
"""

from __future__ import annotations

import asyncio
import contextlib

from test_commit_skew import free_port, plan

from ringlet.daemon.engine.sampling import SamplingParams
from ringlet.daemon.node import Node, NodeConfig
from ringlet.daemon.wire.serving_plan import ServingPlan

KV_BYTES_PER_TOKEN_LAYER = 2 * 3 * 64 * 4
TOKENS = 36


@contextlib.asynccontextmanager
async def nodes(location, n: int):
    started = [Node(NodeConfig(host="127.0.0.1", port=free_port(), model=location, dtype="float32",
                               node_id=chr(ord("a") + i) * 16, step_timeout_s=20.0)) for i in range(n)]
    try:
        for node in started:
            await node.start()
        yield started
    finally:
        for node in started:
            await node.stop()


async def switch(new: ServingPlan, members: list[Node]) -> None:
    for node in members:
        await node.prepare(new)
    await asyncio.gather(*(node.commit(new) for node in members))


async def join_mid_stream(location, prompt: list[int]) -> dict:
    """``a [0, 18) -> b [18, 30)``; after 12 tokens, ``c`` joins: ``a [0, 10) -> b [10, 20)
    -> c [20, 30)``. Returns the ids and every node's ``kv_migration`` figures."""
    async with nodes(location, 3) as (a, b, c):
        first = plan(1, (a, 0, 18), (b, 18, 30))
        await switch(first, [a, b, c])
        got: list[int] = []

        async def consume() -> None:
            async for t in a.generate(prompt, TOKENS, SamplingParams(temperature=0.0), set()):
                got.append(t)

        request = asyncio.ensure_future(consume())
        while len(got) < 12 and not request.done():
            await asyncio.sleep(0.02)
        second = plan(2, (a, 0, 10), (b, 10, 20), (c, 20, 30))
        second = ServingPlan(second.epoch, second.stages, second.plan_id, previous=first.stages)
        await switch(second, [a, b, c])
        await asyncio.wait_for(request, timeout=120)
        return {"ids": got, "resumed_at": 12, **{n.node_id[0]: n.kv_migration for n in (a, b, c)},
                "events": list(a.events)}


def test_a_join_moves_the_kv_of_the_request_in_flight(default_location, reference):
    ref = reference[0]
    prompt = ref["prompt_ids"]
    out = asyncio.run(join_mid_stream(default_location, prompt))
    assert out["ids"] == ref["completion_ids"][:TOKENS]
    head = out["a"]
    assert head["resumed"] == 1, head
    assert head["reprefilled_tokens"] == 0 and head["full_reprefills"] == 0, head
    # c took [20, 30) from b (b held [18, 30)); b took [10, 18) from a and kept [18, 20)
    c, b = out["c"]["last"], out["b"]["last"]
    assert c["inflight"] == 1 and b["inflight"] == 1, (b, c)
    cached = c["tokens"]  # the tokens in the request's caches when b parked it
    assert len(prompt) + 12 - 1 <= cached <= len(prompt) + TOKENS, c
    assert c["kv_bytes_received"] == cached * 10 * KV_BYTES_PER_TOKEN_LAYER, c
    assert list(c["from"]) == [f"{'b' * 8} [20, 30)"] and not c["failed"], c
    assert b["from"] and list(b["from"]) == [f"{'a' * 8} [10, 18)"], b
