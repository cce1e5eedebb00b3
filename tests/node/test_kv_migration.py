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

from inproc import crash, greedy_with_a_change, plan, started, switch

KV_BYTES_PER_TOKEN_LAYER = 2 * 3 * 64 * 4
TOKENS = 36


async def join_mid_stream(location, prompt: list[int], recompute: bool = False) -> dict:
    """``a [0, 18) -> b [18, 30)``; after 12 tokens, ``c`` joins: ``a [0, 10) -> b [10, 20)
    -> c [20, 30)``, prepared at once (c and b pull a snapshot of the KV they gain) and
    committed 4 tokens later. Returns the ids and every node's ``kv_migration`` figures."""
    async with started(location, 3) as (a, b, c):
        first = plan(1, (a, 0, 18), (b, 18, 30))
        await switch(first, [a, b, c])
        second = plan(2, (a, 0, 10), (b, 10, 20), (c, 20, 30), previous=first, recompute=(b,) if recompute else ())

        async def prepare_then_commit_later() -> None:
            for node in (a, b, c):
                await node.prepare(second)
            decoded = a.tokens_generated_total
            while a.tokens_generated_total < decoded + 4:
                await asyncio.sleep(0.01)
            await asyncio.gather(*(node.commit(second) for node in (a, b, c)))

        got = await greedy_with_a_change(a, prompt, TOKENS, 12, prepare_then_commit_later)
        return {"ids": got, "resumed_at": 12, **{n.node_id[0]: n.kv_migration for n in (a, b, c)},
                "events": list(a.events)}


def test_a_join_moves_the_kv_of_the_request_in_flight(default_location, reference):
    """The KV moves in two parts: a snapshot while the old plan serves on, then at the
    commit only the tokens decoded since (4 here); together, the tokens the joined
    sequence holds, whole tokens x 10 layers each."""
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
    per_token = 10 * KV_BYTES_PER_TOKEN_LAYER
    snapshot, rest = divmod(c["precopied_bytes"], per_token)
    assert rest == 0 and len(prompt) + 12 - 1 <= snapshot, c
    delta, rest = divmod(c["kv_bytes_received"], per_token)
    assert rest == 0 and 4 <= delta <= 6 and snapshot + delta >= cached, c  # 4 tokens (+1: b parked a step ahead)
    assert list(c["from"]) == [f"{'b' * 8} [20, 30)"] and not c["failed"], c
    assert b["from"] and list(b["from"]) == [f"{'a' * 8} [10, 18)"], b
    assert b["precopied_bytes"] > 0 and b["kv_bytes_received"] < b["precopied_bytes"], b


async def lose_the_middle_stage(location, prompt: list[int], boundary_bytes: int | None = None) -> dict:
    """``a [0, 10) -> b [10, 20) -> c [20, 30)``; after 12 tokens ``b`` crashes and the plan
    becomes ``a [0, 15) -> c [15, 30)``, ``b``'s range marked lost. Returns the ids and the
    figures of ``a`` and ``c``."""
    extra = {} if boundary_bytes is None else {"boundary_cache_bytes": boundary_bytes}
    async with started(location, 3, **extra) as (a, b, c):
        first = plan(1, (a, 0, 10), (b, 10, 20), (c, 20, 30))
        await switch(first, [a, b, c])
        second = plan(2, (a, 0, 15), (c, 15, 30), previous=first, lost=(b,))

        async def kill_then_replan() -> None:
            await crash(b)
            await switch(second, [a, c])

        got = await greedy_with_a_change(a, prompt, TOKENS, 12, kill_then_replan)
        return {"ids": got, "a": a.kv_migration, "c": c.kv_migration,
                "states": a.engine.boundaries.figures()}


def test_a_lost_middle_stage_is_rebuilt_from_the_states_its_previous_stage_kept(default_location, reference):
    """a rebuilds [10, 15) from the states it sent on at layer 10, c rebuilds [15, 20) from
    what a's rebuild sent on at 15; c keeps [20, 30) and a [0, 10). The request resumes
    with nothing prefilled again, and the tokens rebuilt are the sequence's tokens times
    the 10 lost layers of 30 (a share of 5 layers each)."""
    ref = reference[0]
    prompt = ref["prompt_ids"]
    out = asyncio.run(lose_the_middle_stage(default_location, prompt))
    assert out["ids"] == ref["completion_ids"][:TOKENS]
    head, c = out["a"], out["c"]
    assert head["resumed"] == 1 and head["reprefilled_tokens"] == 0 and head["full_reprefills"] == 0, head
    for figures, layers in ((head, "[10, 15)"), (c, "[15, 20)")):
        last = figures["last"]
        assert list(last["rebuilt"]) == [layers] and not last["failed"], last
        n = last["rebuilt"][layers]["tokens"]
        assert len(prompt) + 12 - 1 <= n <= len(prompt) + TOKENS, last
        assert last["rebuilt_tokens"] == round(n * 5 / 30), last
    assert c["last"]["from"] == {} and c["last"]["kv_bytes_received"] == 0  # nothing moved: c kept [20, 30)
    assert out["states"]["layer"] == 15 and out["states"]["entries"] >= 1  # a records on at its new end


def test_without_kept_states_a_loss_falls_back_to_a_full_prefill(default_location, reference):
    ref = reference[0]
    out = asyncio.run(lose_the_middle_stage(default_location, ref["prompt_ids"], boundary_bytes=0))
    assert out["ids"] == ref["completion_ids"][:TOKENS]
    head = out["a"]
    assert head["resumed"] == 1 and head["full_reprefills"] == 1, head
    assert head["rebuilt_tokens"] == 0 and out["c"]["rebuilt_tokens"] == 0


def test_a_range_chosen_for_recomputing_without_the_states_to_do_it_is_moved(default_location, reference):
    """The proposer chose to recompute b's [18, 30) (b still here), but the states entering
    layer 20 were never recorded (they are inside b's stage): c's rebuild of [20, 30) has
    nothing to start from, so c pulls what it lacks from b, and the request resumes with
    nothing prefilled again: the KV of whole tokens x 10 layers came from b."""
    ref = reference[0]
    out = asyncio.run(join_mid_stream(default_location, ref["prompt_ids"], recompute=True))
    assert out["ids"] == ref["completion_ids"][:TOKENS]
    head, c = out["a"], out["c"]["last"]
    assert head["resumed"] == 1 and head["reprefilled_tokens"] == 0 and head["full_reprefills"] == 0, head
    assert "rebuild [20, 30)" in c["failed"], c
    nbytes = c["from"][f"{'b' * 8} [20, 30)"]
    tokens, rest = divmod(nbytes, 10 * KV_BYTES_PER_TOKEN_LAYER)
    assert rest == 0 and tokens >= c["tokens"] > 0, c
