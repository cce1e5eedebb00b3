"""Caches other than plain ``KVCache`` through the prefix store, decode groups, a
re-plan's KV handoff and speculative decoding's trim check: a gpt_oss-like model (sliding-window
``RotatingKVCache`` layers beside full ``KVCache`` ones) and a qwen3_next-like model
(recurrent ``ArraysCache`` layers beside ``KVCache`` ones), split into stages.

Expected tokens come from mlx-lm's whole model alone (``mlx_lm.utils.load_model``,
``make_prompt_cache``, its forward, greedy argmax over the whole prompt, nothing cached);
expected reuse lengths from the issue's rule: a window's or a recurrent state is
reusable only at exactly the length it was saved, the end of the previous turn.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache
from tiny_models import make_tiny_model, whole_model_greedy
from zoo_models import ZOO

from ringlet.daemon.engine import cache_kinds, kv_handoff
from ringlet.daemon.engine.decode_groups import DecodeGroups
from ringlet.daemon.engine.prefix_store import PrefixStore
from ringlet.daemon.engine.sources import resolve
from ringlet.daemon.engine.stage import load_stage, mergeable

#: The zoo's configs with 6 layers (windows of 4 tokens: every turn rotates them).
MODELS = {
    "gpt_oss": {**ZOO["gpt_oss"], "num_hidden_layers": 6, "max_position_embeddings": 4096,
                "layer_types": ["sliding_attention", "full_attention"] * 3},
    "qwen3_next": {**ZOO["qwen3_next"], "num_hidden_layers": 6, "max_position_embeddings": 4096},
}
SPLIT = [(0, 2), (2, 5), (5, 6)]
TURNS = ([5, 17, 42, 99, 8, 150, 3, 77, 12, 64], [33, 21, 9, 140], [55, 6, 88])
NEW = 6  # tokens generated per turn


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request, tmp_path_factory):
    name = request.param
    path = make_tiny_model(name, tmp_path_factory.mktemp(name), config=MODELS[name])
    location = resolve(str(path))
    return name, path, [load_stage(location, s, e) for s, e in SPLIT]


def ring_turn(stages, stores, prompt: list[int], n: int) -> tuple[list[int], int]:
    """One request through the stages as the ring runs it: stage 0 picks the longest
    prefix its store holds, every stage takes exactly that many (a stage holding fewer
    makes it retry with at most that many, as head._generate_local does), the rest is
    prefilled, ``n`` greedy tokens decoded, and every stage keeps its cache on release."""
    cap = len(prompt) - 1
    while True:
        reuse = stores[0].longest("", prompt, cap)
        caches = [s.take("", prompt[:reuse]) if reuse else st.make_cache()
                  for s, st in zip(stores, stages, strict=True)]
        if all(c is not None for c in caches):
            break
        cap = min(s.longest("", prompt, reuse) for s in stores)
        cap = cap if cap < reuse else reuse - 1
    x = mx.array([prompt[reuse:]])
    out: list[int] = []
    for _ in range(n):
        for stage, cache in zip(stages, caches, strict=True):
            x = stage(x, cache)
        out.append(mx.argmax(x[0, -1]).item())
        x = mx.array([[out[-1]]])
    tokens = prompt + out
    for store, cache in zip(stores, caches, strict=True):  # the last token was never computed
        assert store.insert("", tokens[:len(tokens) - 1], cache)
    return out, reuse


def test_a_chat_reuses_each_turns_end_state_and_equals_the_whole_model(model):
    name, path, stages = model
    kinds = {k for s in stages for k in cache_kinds.kinds(s.make_cache())}
    assert kinds == ({"KVCache", "RotatingKVCache"} if name == "gpt_oss" else {"KVCache", "ArraysCache"})
    stores = [PrefixStore(1 << 26, s.start, s.end) for s in stages]
    prompt: list[int] = []
    previous = 1
    for turn, user in enumerate(TURNS):
        prompt = prompt + user
        got, reuse = ring_turn(stages, stores, prompt, NEW)
        assert got == whole_model_greedy(path, prompt, NEW), f"{name}: turn {turn}"
        # the previous turn's end: its prompt and answer but the answer's last token
        assert reuse == (0 if turn == 0 else previous - 1), (turn, reuse)
        previous = len(prompt) + NEW
        prompt = prompt + got
    for store, stage in zip(stores, stages, strict=True):  # a stage of full-attention layers alone is plain
        assert store.stats.hits == 2 and store.info()["exact_entries"] == cache_kinds.exact_only(stage.make_cache())


def test_an_exact_state_is_never_served_cut_or_extended(model):
    name, _, stages = model
    stores = [PrefixStore(1 << 26, s.start, s.end) for s in stages]
    prompt = TURNS[0] + TURNS[1]
    ring_turn(stages, stores, prompt, NEW)
    saved = len(prompt) + NEW - 1
    for store in stores:
        held = store.entries()[0]
        assert len(held.tokens) == saved
        if not held.exact:  # full attention alone (gpt_oss's last stage): any prefix
            assert store.longest("", held.tokens[:saved - 3] + [7]) == saved - 3
            continue
        # a prompt that leaves the saved tokens before their end: nothing (a KVCache store would cut)
        forked = held.tokens[:saved - 3] + [7, 7, 7, 7]
        assert store.longest("", forked) == 0 and store.take("", forked[:saved - 3]) is None
        # a prompt shorter than the saved state: nothing either
        assert store.longest("", held.tokens, saved - 1) == 0
        # a prompt that extends it: exactly the saved length
        assert store.longest("", held.tokens + [1, 2]) == saved
    assert stores[0].stats.misses == 1


def test_a_replan_leaves_exact_entries_behind_counted(model):
    _, _, stages = model
    store = PrefixStore(1 << 26, stages[1].start, stages[1].end)
    ring_turn(stages, [PrefixStore(1 << 26, s.start, s.end) for s in (stages[0],)] + [store] +
              [PrefixStore(1 << 26, stages[2].start, stages[2].end)], TURNS[0], NEW)
    before = dict(kv_handoff.DECLINED)
    assert kv_handoff.park(stages[1], {}, store) == []
    assert kv_handoff.DECLINED["entries"] == before["entries"] + 1 and len(store) == 0


def test_trimmable_follows_mlx_lm():
    kv, window, state = KVCache(), RotatingKVCache(max_size=4), ArraysCache(2)
    k = mx.zeros((1, 2, 3, 8))
    kv.update_and_fetch(k, k)
    window.update_and_fetch(k, k)
    state[0] = mx.zeros((1, 3, 8))
    assert cache_kinds.trimmable([kv], 2) and not cache_kinds.trimmable([kv], 4)
    assert cache_kinds.trimmable([window], 1)  # before it wraps (RotatingKVCache.is_trimmable)
    window.update_and_fetch(k, k)  # 6 tokens in a window of 4
    assert not cache_kinds.trimmable([window], 1) and not cache_kinds.trimmable([kv, state], 1)
    assert cache_kinds.trimmable([window, state], 0)
    assert cache_kinds.plain([kv]) and cache_kinds.exact_only([kv, window])


def test_windows_and_recurrent_states_decode_as_one_batch_equal_each_alone(model):
    """mlx-lm's BatchRotatingKVCache and batched ArraysCache: a decode group of three
    requests (windows rotated) computes what each computes alone, also after one leaves."""
    name, _, stages = model
    stage = stages[0]
    prompts = [[5, 9, 17], [3, 3, 40, 41, 42, 7, 8, 9, 10], [100, 2, 5, 6, 7]]

    def prefilled(ids):
        cache = stage.make_cache()
        mx.eval(stage(mx.array([ids]), cache))
        return cache

    solo, own = [prefilled(p) for p in prompts], [prefilled(p) for p in prompts]
    groups = DecodeGroups()
    for step, rows in enumerate([[0, 1, 2], [0, 1, 2], [2, 0, 1], [0, 2], [0, 1, 2]]):
        tokens = [10 + 7 * step + i for i in range(3)]
        want = {i: stage(mx.array([[tokens[i]]]), solo[i]) for i in range(3)}
        out = groups.forward(stage, rows, mx.array([[tokens[i]] for i in rows]), [own[i] for i in rows], mergeable)
        assert out is not None, name
        for row, i in enumerate(rows):
            assert mx.allclose(out[row, 0], want[i][0, 0], rtol=1e-4, atol=1e-4).item(), (name, step, i)
        for i in set(range(3)) - set(rows):
            groups.dissolve([i])
            alone = stage(mx.array([[tokens[i]]]), own[i])
            assert mx.allclose(alone[0, 0], want[i][0, 0], rtol=1e-4, atol=1e-4).item(), (name, step, i)
    assert groups.unmerged == 0
