"""Members commit a plan moments apart: activations of the new epoch must not be lost
at a stage that has not switched yet.

CI saw it on a join: the new stage 0 headed a resumed request at once, and its first
activation reached the old plan's stage 0 before that node's commit; that node took it
for a token of one of its own requests, dropped it, and the request waited 60 s for a
token that never came. Two real :class:`Node` objects here, each with its own gRPC
server on loopback and the real model; the test drives prepare and commit by hand (as
negotiation does) so that one member commits late. Expected ids: transformers' greedy
continuation (``smollm2_135m_instruct_greedy.json``).
"""

from __future__ import annotations

import asyncio
import contextlib

from inproc import greedy_with_a_change, plan, started, switch

from ringlet.daemon.engine.sampling import SamplingParams
from ringlet.daemon.node import Node
from ringlet.daemon.node.config import COMMIT_WAIT_S

TOKENS = 12


@contextlib.asynccontextmanager
async def ring(location, *ranges: tuple[int, int]):
    """One started node per layer range, ``a``, ``b``, ... in that ring order on epoch 1."""
    async with started(location, len(ranges), prefix_cache_bytes=0) as nodes:
        await switch(plan(1, *((n, a, b) for n, (a, b) in zip(nodes, ranges, strict=True))), nodes)
        yield nodes


async def generate(node: Node, prompt: list[int]) -> list[int]:
    return [t async for t in node.generate(prompt, TOKENS, SamplingParams(temperature=0.0), set())]


async def late_commit(default_location, prompt: list[int], delay_s: float) -> tuple[list[int], list[dict]]:
    """Epoch 2 swaps the heads (``b`` heads ``[0, 12)``, ``a`` holds ``[12, 30)``); ``b``
    commits it and serves a request at once, ``a`` commits ``delay_s`` seconds later.
    Returns the request's ids and ``b``'s events."""
    async with ring(default_location, (0, 18), (18, 30)) as (a, b):
        second = plan(2, (b, 0, 12), (a, 12, 30))
        await a.prepare(second)
        await b.prepare(second)
        await b.commit(second)
        request = asyncio.ensure_future(generate(b, prompt))
        await asyncio.sleep(delay_s)
        assert not request.done(), "the request finished while a stage held the old plan"
        await a.commit(second)
        ids = await asyncio.wait_for(request, timeout=120)
        return ids, list(b.events)


def test_an_activation_for_an_epoch_a_stage_commits_a_moment_later_waits_for_that_commit(default_location,
                                                                                        reference):
    """``a`` still heads epoch 1 when ``b``'s first activation of epoch 2 reaches it; it
    holds the activation until its own commit and the request runs through, unresumed."""
    ref = reference[0]
    ids, events = asyncio.run(late_commit(default_location, ref["prompt_ids"], delay_s=1.0))
    assert ids == ref["completion_ids"][:TOKENS]
    assert not [e for e in events if e["kind"] == "resume"], events


def test_a_stage_still_behind_after_the_wait_answers_behind_and_the_request_starts_again(default_location,
                                                                                        reference):
    """A commit later than :data:`COMMIT_WAIT_S`: ``a`` (the old plan's head) answers
    "behind" along the ring instead of dropping the activation, and ``b`` starts the
    request again once ``a`` has switched; the ids are still the reference's."""
    ref = reference[0]
    ids, events = asyncio.run(late_commit(default_location, ref["prompt_ids"], delay_s=COMMIT_WAIT_S + 1.5))
    assert ids == ref["completion_ids"][:TOKENS]
    resumes = [e["message"] for e in events if e["kind"] == "resume"]
    assert resumes and all("serves epoch 1, not 2" in m for m in resumes), events


async def reordered_mid_stream(default_location, prompt: list[int], tokens: int) -> tuple[list[int], list[dict]]:
    """``a`` heads a request on ``a -> b -> c``; mid-stream epoch 2 reorders the ring to
    ``a -> c -> b`` (``a`` stays stage 0, with another next stage). Returns the ids and
    ``a``'s events."""
    async with ring(default_location, (0, 10), (10, 20), (20, 30)) as (a, b, c):
        got = await greedy_with_a_change(a, prompt, tokens, 5, lambda: switch(
            plan(2, (a, 0, 10), (c, 10, 20), (b, 20, 30)), [a, b, c]))
        return got, list(a.events)


def test_a_request_resumed_on_a_new_plan_is_not_ended_by_that_same_change(default_location, reference):
    """The head's commit ends its requests and resumes them on the new plan, here with a
    new next stage. The resumed try must not see the same change again and end as "the
    plan changed" (CI saw that when the head's commit still awaited the close of its old
    link after switching plans; the commit no longer awaits between the two)."""
    ref = reference[0]
    ids, events = asyncio.run(reordered_mid_stream(default_location, ref["prompt_ids"], 30))
    assert ids == ref["completion_ids"][:30]
    resumes = [e["message"] for e in events if e["kind"] == "resume"]
    assert len(resumes) == 1 and "the plan changed to epoch 2" in resumes[0], events
