"""Layers that cache nothing (``engine/cacheless.py``) on a nemotron-nas-like model, whose
caches are otherwise all plain ``KVCache``: a layer whose attention is a no-op has no
cache in mlx-lm's list, one whose attention is a linear map has one it never writes.
Split ``[0, 1) [1, 2) [2, 4)`` (the middle stage holds a no-op-attention layer alone),
each such layer gets a length cache, so the features of plain caches all hold: any
prefix served from the prefix store, drafted positions trimmed, decode groups.

Expected tokens come from mlx-lm's whole model alone (``tiny_models.whole_model_greedy``:
``load_model``, ``make_prompt_cache``, its forward, greedy argmax); expected lengths from
the prompts themselves.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, trim_prompt_cache
from tiny_models import make_tiny_model, whole_model_greedy
from zoo_models import ZOO

from ringlet.daemon.engine import cache_kinds, speculation
from ringlet.daemon.engine.decode_groups import DecodeGroups
from ringlet.daemon.engine.prefix_store import PrefixStore
from ringlet.daemon.engine.sources import resolve
from ringlet.daemon.engine.stage import load_stage, mergeable

SPLIT = [(0, 1), (1, 2), (2, 4)]
PROMPT = [5, 17, 42, 99, 8, 150, 3, 77, 12, 64]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_tiny_model("nemotron-nas", tmp_path_factory.mktemp("nas"), config=ZOO["nemotron-nas"])
    location = resolve(str(path))
    return path, [load_stage(location, s, e) for s, e in SPLIT]


def run(stages: list, caches: list, ids: list[int], n: int) -> list[int]:
    """Feed ``ids`` through the stages, then decode ``n`` greedy tokens."""
    x, out = mx.array([ids]), []
    for _ in range(n):
        for stage, cache in zip(stages, caches, strict=True):
            x = stage(x, cache)
        out.append(mx.argmax(x[0, -1]).item())
        x = mx.array([[out[-1]]])
    return out


def test_every_layer_holds_a_plain_cache_of_the_tokens_it_saw(model):
    path, stages = model
    caches = [s.make_cache() for s in stages]
    assert [len(c) for c in caches] == [e - s for s, e in SPLIT]
    assert all(type(c) is KVCache for cache in caches for c in cache)
    assert all(speculation.trimmable(s.pattern.caches) for s in stages)  # so stage 0 may draft
    got = run(stages, caches, PROMPT, 3)
    assert got == whole_model_greedy(path, PROMPT, 3)
    assert [c.offset for cache in caches for c in cache] == [len(PROMPT) + 2] * 4
    assert cache_kinds.nbytes(caches[1]) == 0  # the no-op layer's length cache holds nothing


def test_drafted_positions_are_trimmed_and_decoding_goes_on_as_the_whole_model(model):
    path, stages = model
    want = whole_model_greedy(path, PROMPT, 6)
    caches = [s.make_cache() for s in stages]
    assert run(stages, caches, PROMPT, 1) == want[:1]
    # a verifying step: the token and 3 drafts, the first right, the others not
    drafts = [want[1], (want[2] + 1) % 160, 7]
    x = mx.array([[want[0], *drafts]])
    for stage, cache in zip(stages, caches, strict=True):
        x = stage(x, cache)
    assert mx.argmax(x[0, 0]).item() == want[1] and mx.argmax(x[0, 1]).item() == want[2]
    for cache in caches:  # keep the token and the accepted draft: drop 2 positions
        assert cache_kinds.trimmable(cache, 2) and trim_prompt_cache(cache, 2) == 2
    assert {c.offset for cache in caches for c in cache} == {len(PROMPT) + 2}
    assert run(stages, caches, [want[2]], 3) == want[3:6]


def test_a_stored_turn_serves_any_prefix_of_it(model):
    path, stages = model
    stores = [PrefixStore(1 << 26, s.start, s.end) for s in stages]
    caches = [s.make_cache() for s in stages]
    first = run(stages, caches, PROMPT, 4)
    tokens = PROMPT + first[:-1]
    for store, cache in zip(stores, caches, strict=True):
        assert store.insert("", tokens, cache)
    assert all(not e.exact for store in stores for e in store.entries())  # plain: cut anywhere
    other = PROMPT[:6] + [1, 2, 3]
    assert [s.longest("", other, len(other) - 1) for s in stores] == [6, 6, 6]
    reused = [s.take("", other[:6]) for s in stores]
    assert run(stages, reused, other[6:], 4) == whole_model_greedy(path, other, 4)


@pytest.mark.parametrize("index", [1, 2])
def test_length_caches_decode_as_one_batch_equal_each_alone(model, index):
    """A decode group merges each length cache into a ``BatchKVCache`` and splits it back:
    three requests computed together equal each alone, also after one leaves (stage
    ``[1, 2)``: a no-op-attention layer alone; ``[2, 4)``: a linear-map one beside attention)."""
    _, stages = model
    stage = stages[index]
    prompts = [[5, 9, 17], [3, 3, 40, 41, 42, 7, 8, 9, 10], [100, 2, 5, 6, 7]]
    rng = mx.random.key(index)

    def prefilled(ids):
        cache = stage.make_cache()
        mx.eval(stage(mx.random.normal((1, len(ids), stage.hidden_size), key=rng), cache))
        return cache

    solo, own = [prefilled(p) for p in prompts], [prefilled(p) for p in prompts]
    groups = DecodeGroups()
    for step, rows in enumerate([[0, 1, 2], [0, 1, 2], [2, 0, 1], [0, 2], [0, 1, 2]]):
        x = {i: mx.random.normal((1, 1, stage.hidden_size), key=mx.random.key(100 * step + i)) for i in range(3)}
        want = {i: stage(x[i], solo[i]) for i in range(3)}
        out = groups.forward(stage, rows, mx.concatenate([x[i] for i in rows]), [own[i] for i in rows], mergeable)
        assert out is not None
        for row, i in enumerate(rows):
            assert mx.allclose(out[row, 0], want[i][0, 0], rtol=1e-4, atol=1e-4).item(), (step, i)
        for i in set(range(3)) - set(rows):
            groups.dissolve([i])
            alone = stage(x[i], own[i])
            assert mx.allclose(alone[0, 0], want[i][0, 0], rtol=1e-4, atol=1e-4).item(), (step, i)
    groups.dissolve_all()
    assert groups.unmerged == 0
    assert [{c.offset for c in cache} for cache in own] == [{len(p) + 5} for p in prompts]
