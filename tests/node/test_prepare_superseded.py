"""A proposal prepared and then superseded (refused, or outbid by a newer one at the same
epoch) leaves nothing loaded behind when the next one is prepared (#43): a node in a tight
memory cgroup that held both stages at once was killed by the kernel (a restarted node whose
first proposal its peers refused, then proposed again at the same epoch with another range).
Two real :class:`Node` objects in this process (tests/node/inproc.py) and the real model;
expected ids: transformers' greedy continuation (``smollm2_135m_instruct_greedy.json``)."""

from __future__ import annotations

import asyncio

from inproc import plan, started, switch

from ringlet.daemon.engine.sampling import SamplingParams

TOKENS = 8


async def superseded(location, prompt: list[int]) -> tuple[list, list, list[int]]:
    async with started(location, 2, prefix_cache_bytes=0) as (a, b):
        await switch(plan(1, (a, 0, 15), (b, 15, 30)), [a, b])
        refused = plan(2, (b, 0, 20), (a, 20, 30))  # a would load [20, 30): refused by b, never committed
        await a.prepare(refused)
        held = sorted(a._prepared)
        again = plan(2, (a, 0, 10), (b, 10, 30))  # the next round, the same epoch, another plan
        await a.prepare(again)
        await b.prepare(again)
        after = sorted(a._prepared)
        await asyncio.gather(a.commit(again), b.commit(again))
        ids = [t async for t in a.generate(prompt, TOKENS, SamplingParams(temperature=0.0), set())]
        return held, after, ids


def test_a_superseded_prepared_stage_is_dropped_before_the_next_loads(default_location, reference):
    ref = reference[0]
    held, after, ids = asyncio.run(superseded(default_location, ref["prompt_ids"]))
    assert [k[0] for k in held] == [2] and len(after) == 1 and after != held  # only the plan it will commit
    assert ids == ref["completion_ids"][:TOKENS]
