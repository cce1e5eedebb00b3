"""Tensor groups as pipeline stages (hybrid plans), at the group level: real rank processes on
127.0.0.1 holding only a layer range (``TPGroup(layers=...)``, ``tp_worker --layers``), MLX's ring
backend over loopback, hidden states passed from one group to the next by the test.

- tiny random llama / qwen3 models, two 2-rank groups holding layers [0, 2) and [2, 4): the
  logits of the last position after a prefill and after one decode step equal mlx-lm's
  single-process forward to 1e-4 relative error; a prefill chunk that more chunks follow
  (``head=False``) returns nothing and fills the cache; a verifying step (``head=None``)
  gives every position's logits, and positions trimmed from it leave every rank's cache; a batched decode step of three
  requests of different lengths gives each one its own single-process logits;
- the default model (9 heads: groups of 3), float32: a 3-rank group holding layers [0, 15)
  chained with an ordinary in-process stage [15, 30) decodes the reference greedy ids
  (tests/smollm2_135m_instruct_greedy.json, first 20 tokens);
- a rank process killed: the group re-plans (here on the one survivor), a step for a cache of
  the old group epoch fails with TPStageLost (the request must prefill again), a new prefill
  gives the reference logits, and no rank is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import numpy as np
import pytest
from tp_support import make_model, rank_env, worker_pids

from ringlet.daemon.tensor.group import TPGroup
from ringlet.daemon.tensor.group_errors import TPGroupError, TPStageLost

pytestmark = pytest.mark.timeout(300)

FIRST = 20
PROMPT = [1, 40, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]
DRAFTS = [9, 10, 11]  # a verifying step's tokens after the decoded 7: the last two get rejected


def mlx_logits(path, ids: list[int]) -> np.ndarray:
    """mlx-lm's single-process logits of every position (the independent reference)."""
    import mlx.core as mx
    from mlx_lm.utils import load_model

    model, _ = load_model(path)
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


def mlx_last_logits(path, ids: list[int]) -> np.ndarray:
    """mlx-lm's single-process logits of the last position."""
    return mlx_logits(path, ids)[-1]


def rel_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


async def wait_no_ranks(before: list[int], timeout: float = 10.0) -> list[int]:
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        left = sorted(set(worker_pids()) - set(before))
        if not left:
            return []
        await asyncio.sleep(0.1)
    return sorted(set(worker_pids()) - set(before))


@contextlib.asynccontextmanager
async def two_groups(path):
    """Two 2-rank groups of a tiny model: layers [0, 2) and [2, 4); no rank left after."""
    before = worker_pids()
    env = rank_env(4)
    a = TPGroup.local(str(path), 2, extra_env=env, layers=(0, 2))
    b = TPGroup.local(str(path), 2, extra_env=env, layers=(2, 4))
    try:
        await asyncio.gather(a.start(), b.start())
        yield a, b
    finally:
        await asyncio.gather(a.close(), b.close())
        assert await wait_no_ranks(before) == []


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_two_tiny_groups_chained_match_single_process(tmp_path, arch):
    path = make_model(arch, tmp_path / arch)
    want_prefill = mlx_last_logits(path, PROMPT)
    want_decode = mlx_last_logits(path, [*PROMPT, 7])

    async def go():
        async with two_groups(path) as (a, b):
            assert (a.info()["mode"], a.info()["size"], a.info()["layers"]) == ("tensor", 2, [0, 2])
            ea, h, _ = await a.stage_forward(1, None, tokens=PROMPT[:9])
            assert h.shape == (1, 9, 64)
            eb, none, _ = await b.stage_forward(1, None, hidden=h, head=False)  # a chunk: cache only
            assert none is None
            _, h, _ = await a.stage_forward(1, ea, tokens=PROMPT[9:])
            _, prefill, _ = await b.stage_forward(1, eb, hidden=h)
            _, h, _ = await a.stage_forward(1, ea, tokens=[7])
            _, decode, dt = await b.stage_forward(1, eb, hidden=h)
            # a verifying step (speculative decoding): every position's logits; then the
            # last two drafts are rejected and leave every rank's cache
            _, h, _ = await a.stage_forward(1, ea, tokens=DRAFTS, head=None)
            _, verifying, _ = await b.stage_forward(1, eb, hidden=h, head=None)
            a.trim_slot(1, 2, ea)
            b.trim_slot(1, 2, eb)
            _, h, _ = await a.stage_forward(1, ea, tokens=[12])
            _, after, _ = await b.stage_forward(1, eb, hidden=h)
            a.free_slot(1, ea)
            b.free_slot(1, eb)
            with pytest.raises(TPGroupError, match="no KV cache for slot 1"):
                await a.stage_forward(1, ea, tokens=[7])
            assert dt == "float32"
            return prefill, decode, verifying, after

    prefill, decode, verifying, after = asyncio.run(asyncio.wait_for(go(), 200))
    assert prefill.shape == decode.shape == after.shape == (1, 1, 160)
    assert rel_error(prefill[0, 0], want_prefill) < 1e-4
    assert rel_error(decode[0, 0], want_decode) < 1e-4
    assert verifying.shape == (1, 3, 160)
    for j, want in enumerate(mlx_logits(path, [*PROMPT, 7, *DRAFTS])[-3:]):
        assert rel_error(verifying[0, j], want) < 1e-4, j
    assert rel_error(after[0, 0], mlx_last_logits(path, [*PROMPT, 7, DRAFTS[0], 12])) < 1e-4


def test_a_batched_decode_step_through_two_groups_matches_single_process(tmp_path):
    """Three requests of different lengths, prefilled one by one, then one decode step for all
    three as one batched step of each group (their KV caches merged into a left-padded
    BatchKVCache in every rank): each request's logits equal mlx-lm's single-process forward."""
    path = make_model("llama", tmp_path / "llama")
    prompts = [PROMPT, PROMPT[:5], PROMPT[3:12]]
    nxt = [7, 33, 120]
    want = [mlx_last_logits(path, [*p, t]) for p, t in zip(prompts, nxt, strict=True)]

    async def go():
        async with two_groups(path) as (a, b):
            for slot, p in enumerate(prompts):
                ea, h, _ = await a.stage_forward(slot, None, tokens=p)
                eb, _, _ = await b.stage_forward(slot, None, hidden=h)
            _, h, _ = await a.stage_forward([0, 1, 2], ea, tokens=nxt)
            assert h.shape == (3, 1, 64)
            _, logits, _ = await b.stage_forward([0, 1, 2], eb, hidden=h)
            return logits

    logits = asyncio.run(asyncio.wait_for(go(), 200))
    assert logits.shape == (3, 1, 160)
    for row, w in enumerate(want):
        assert rel_error(logits[row, 0], w) < 1e-4, row


def test_default_model_group_as_first_stage_decodes_the_reference(reference, default_location):
    """Layers [0, 15) on 3 ranks (the group), [15, 30) in this process (a plain stage)."""
    import mlx.core as mx

    from ringlet.daemon.engine.stage import load_stage

    case = next(c for c in reference if c["name"] == "raw_once")
    tail = load_stage(default_location, 15, 30, "float32")
    from mlx_lm.models.cache import make_prompt_cache

    before = worker_pids()

    async def go():
        group = TPGroup.local(None, 3, dtype="float32", extra_env=rank_env(3), layers=(0, 15), step_timeout=60)
        try:
            await group.start()
            cache = make_prompt_cache(tail.model)
            epoch, feed, out = None, case["prompt_ids"], []
            for _ in range(FIRST):
                epoch, h, _ = await group.stage_forward(5, epoch, tokens=feed)
                logits = tail(mx.array(h), cache)
                out.append(int(mx.argmax(logits[0, -1]).item()))
                feed = [out[-1]]
            return out
        finally:
            await group.close()
            assert await wait_no_ranks(before) == []

    assert asyncio.run(asyncio.wait_for(go(), 240)) == case["completion_ids"][:FIRST]


def test_a_restarted_group_loses_its_caches_and_says_so(tmp_path):
    path = make_model("llama", tmp_path / "llama")
    before = worker_pids()

    async def go():
        group = TPGroup.local(str(path), 2, extra_env=rank_env(2), layers=(0, 4))
        try:
            await group.start()
            epoch, _, _ = await group.stage_forward(3, None, tokens=PROMPT)
            os.kill(group.rank_pids()[1], signal.SIGKILL)
            with pytest.raises(TPStageLost, match="KV cache is gone"):
                await group.stage_forward(3, epoch, tokens=[7])
            again, logits, _ = await group.stage_forward(3, None, tokens=[*PROMPT, 7])
            assert again > epoch and group.info()["size"] == 1  # rank1's member counts as lost: one process
            return logits
        finally:
            await group.close()
            assert await wait_no_ranks(before) == []

    logits = asyncio.run(asyncio.wait_for(go(), 200))
    assert rel_error(logits[0, 0], mlx_last_logits(path, [*PROMPT, 7])) < 1e-4
