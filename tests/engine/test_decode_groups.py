"""Decode groups (``daemon/engine/decode_groups.py``) and how the stage engine forms its
batches with them, on a real tiny llama (tiny_models.py; no network).

The reference for every output is mlx-lm's own forward of each request alone, on its own
``KVCache``: a group must compute the same thing while copying no cache between steps.
"""

from __future__ import annotations

import asyncio

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, QuantizedKVCache, RotatingKVCache
from tiny_models import NUM_LAYERS, make_tiny_model

from ringlet.daemon.engine.decode_groups import DecodeGroups
from ringlet.daemon.engine.scheduler import StageEngine
from ringlet.daemon.engine.sources import resolve
from ringlet.daemon.engine.stage import load_stage, mergeable

PROMPTS = [[5, 9, 17], [3, 3, 40, 41, 42, 7, 8], [100, 2], [60, 61, 62, 63, 64]]
# which requests step together at each decode step, in the order of their rows:
# a group of all 4, the same group with its rows in another order, 3 of them (1 alone), all 4
SCHEDULE = [[0, 1, 2, 3], [0, 1, 2, 3], [3, 1, 0, 2], [0, 2, 3], [0, 1, 2, 3]]


@pytest.fixture(scope="module")
def location(tmp_path_factory):
    return resolve(str(make_tiny_model("llama", tmp_path_factory.mktemp("groups") / "llama")))


@pytest.fixture(scope="module")
def stage(location):
    return load_stage(location, 0, None, "float32")


def prefilled(stage, ids: list[int]) -> list:
    cache = stage.make_cache()
    mx.eval(stage(mx.array([ids], dtype=mx.int32), cache))
    return cache


def test_grouped_steps_equal_each_request_alone_and_merge_only_when_the_company_changes(stage, monkeypatch):
    merges = []
    real_merge = BatchKVCache.merge.__func__
    monkeypatch.setattr(BatchKVCache, "merge", classmethod(lambda cls, caches: merges.append(1) or
                                                           real_merge(cls, caches)))
    solo = [prefilled(stage, p) for p in PROMPTS]
    own = [prefilled(stage, p) for p in PROMPTS]
    groups = DecodeGroups()
    for step, rows in enumerate(SCHEDULE):
        tokens = [10 + 7 * step + i for i in range(len(PROMPTS))]
        want = {i: stage(mx.array([[tokens[i]]], dtype=mx.int32), solo[i]) for i in range(len(PROMPTS))}
        x = mx.array([[tokens[i]] for i in rows], dtype=mx.int32)
        out = groups.forward(stage, rows, x, [own[i] for i in rows], mergeable)
        for row, i in enumerate(rows):
            assert mx.allclose(out[row, 0], want[i][0, 0], rtol=1e-4, atol=1e-4).item(), (step, i)
        for i in set(range(len(PROMPTS))) - set(rows):  # a step alone needs its own cache back
            groups.dissolve([i])
            assert mx.allclose(stage(mx.array([[tokens[i]]], dtype=mx.int32), own[i])[0, 0], want[i][0, 0],
                               rtol=1e-4, atol=1e-4).item()
    # formed at steps 0, 3 (1 left) and 4 (1 back): once per layer each; steps 1 and 2 copied nothing
    assert len(merges) == 3 * NUM_LAYERS
    assert groups.members(2) == (0, 1, 2, 3)
    assert all(own[i] == [] for i in range(4)) and groups.nbytes() > 0  # the group holds their KV
    groups.dissolve_all()
    assert groups.members(2) is None and len(groups) == 0
    for i, p in enumerate(PROMPTS):
        assert [c.offset for c in own[i]] == [len(p) + len(SCHEDULE)] * NUM_LAYERS
        for mine, ref in zip(own[i], solo[i], strict=True):
            for got, want in ((mine.keys, ref.keys), (mine.values, ref.values)):
                assert mx.allclose(got[..., :mine.offset, :], want[..., :ref.offset, :],
                                   rtol=1e-4, atol=1e-4).item()


def test_caches_that_cannot_merge_are_left_whole(stage):
    """mlx-lm has no batched QuantizedKVCache: such requests run one at a time, counted."""
    caches = [[QuantizedKVCache() for _ in range(NUM_LAYERS)] for _ in range(2)]  # (the forward never runs)
    groups = DecodeGroups()
    assert groups.forward(stage, ["a", "b"], mx.array([[1], [2]], dtype=mx.int32), caches, mergeable) is None
    assert all(len(c) == NUM_LAYERS for c in caches) and len(groups) == 0 and groups.unmerged == 1
    # nor do requests whose windows differ
    windows = [[RotatingKVCache(max_size=m) for _ in range(NUM_LAYERS)] for m in (8, 16)]
    assert not mergeable(windows) and mergeable([windows[0], windows[0]])
    keeping = [RotatingKVCache(max_size=8, keep=4) for _ in range(NUM_LAYERS)]  # no batched form keeps them
    assert not mergeable([keeping, keeping])


def _engine_run(location, body, **kwargs):
    async def go():
        engine = await StageEngine.create(lambda: load_stage(location, 0, None, "float32"), **kwargs)
        try:
            return await body(engine)
        finally:
            engine.close()

    return asyncio.run(go())


async def _two_groups_of_two(engine, ids: list[str]) -> set:
    """Prefill ``ids`` (one per prompt) and run their first decode step on a 2-stage ring:
    stage 0 forms 2 groups of 2. Returns the groups."""
    engine.ring_depth = 2
    first = [await engine.submit(r, 0, 0, p, None) for r, p in zip(ids, PROMPTS, strict=True)]
    await asyncio.gather(*(engine.submit(r, 1, len(p), [t], None) for r, p, t in zip(ids, PROMPTS, first, strict=True)))
    return {engine.batch_of(r) for r in ids}


def test_stage0_forms_one_group_per_stage_and_keeps_it(location):
    """4 requests on a 2-stage ring: stage 0 batches them in 2 groups of 2, so both stages
    have a batch to run; the next step keeps the same groups whatever order the steps come in."""
    async def body(engine):
        ids = ["r0", "r1", "r2", "r3"]
        groups = await _two_groups_of_two(engine, ids)
        order = [ids[0], ids[2], ids[1], ids[3]]
        await asyncio.gather(*(engine.submit(r, 2, len(PROMPTS[ids.index(r)]) + 1, [7], None) for r in order))
        return groups, {engine.batch_of(r) for r in ids}, dict(engine.batch_histogram)

    groups, again, histogram = _engine_run(location, body)
    assert sorted(len(g) for g in groups) == [2, 2] and set().union(*groups) == {"r0", "r1", "r2", "r3"}
    assert again == groups
    assert histogram == {2: 4}


def test_a_step_waits_for_the_batch_the_previous_stage_named_but_not_for_released_members(location):
    async def body(engine):
        for r, p in zip(["a", "b", "c", "gone"], PROMPTS, strict=True):
            await engine.submit(r, 0, 0, p, None)
        await engine.submit_release("gone")
        # the previous stage ran a and b together; b's step arrives 50 ms after a's
        first = engine.submit("a", 1, len(PROMPTS[0]), [7], None, siblings=["a", "b"])
        await asyncio.sleep(0.05)
        second = engine.submit("b", 1, len(PROMPTS[1]), [7], None, siblings=["a", "b"])
        await asyncio.gather(first, second)
        together = engine.batch_of("a"), engine.batch_of("b")
        # c's sibling was released here: c runs at once, not after the 30 s wait
        await asyncio.wait_for(engine.submit("c", 1, len(PROMPTS[2]), [7], None, siblings=["c", "gone"]), 5)
        return together, engine.batch_of("c")

    together, alone = _engine_run(location, body, group_wait_s=30.0)
    assert together == (("a", "b"), ("a", "b"))
    assert alone == ("c",)


def test_stage0_lets_new_requests_join_a_group_below_the_cap(location):
    """On one stage (cap: every request) a request that starts after a group formed joins
    it at its first decode step, instead of running beside it alone."""
    async def body(engine):
        tokens = {r: await engine.submit(r, 0, 0, p, None) for r, p in zip(["r0", "r1"], PROMPTS, strict=False)}
        await asyncio.gather(*(engine.submit(r, 1, len(p), [tokens[r]], None)
                               for r, p in zip(["r0", "r1"], PROMPTS, strict=False)))
        formed = engine.batch_of("r0")
        tokens["r2"] = await engine.submit("r2", 0, 0, PROMPTS[2], None)
        await asyncio.gather(engine.submit("r0", 2, len(PROMPTS[0]) + 1, [7], None),
                             engine.submit("r1", 2, len(PROMPTS[1]) + 1, [7], None),
                             engine.submit("r2", 1, len(PROMPTS[2]), [tokens["r2"]], None))
        return formed, engine.batch_of("r2")

    formed, joined = _engine_run(location, body)
    assert formed == ("r0", "r1")
    assert joined == ("r0", "r1", "r2")


def test_stage0_merges_groups_below_the_cap_when_all_their_steps_wait(location):
    """Groups that formed while the cap was lower (2 groups of 2 on a 2-stage ring) become
    one group of 4 once the cap allows it (here the ring shrinks to 1 stage: cap 4) and
    every member's step is waiting; the merged group is then kept."""
    async def body(engine):
        ids = ["r0", "r1", "r2", "r3"]
        before = await _two_groups_of_two(engine, ids)
        engine.ring_depth = 1
        for step in (2, 3):
            await asyncio.gather(*(engine.submit(r, step, len(p) + step - 1, [7], None)
                                   for r, p in zip(ids, PROMPTS, strict=True)))
        return before, {engine.batch_of(r) for r in ids}, dict(engine.batch_histogram)

    before, after, histogram = _engine_run(location, body)
    assert sorted(len(g) for g in before) == [2, 2]
    assert len(after) == 1 and set(next(iter(after))) == {"r0", "r1", "r2", "r3"}
    assert histogram == {2: 2, 4: 2}
