"""Caches other than plain ``KVCache`` through the prefix store, decode groups, a
re-plan's KV handoff and speculative decoding's trim check: a gpt_oss-like model (sliding-window
``RotatingKVCache`` layers beside full ``KVCache`` ones), a qwen3_next-like model
(recurrent ``ArraysCache`` layers beside ``KVCache`` ones) and a bailing_moe_linear-like one
(recurrent linear attention rotated by the position an attention layer's cache gives:
a stage without one counts it in its recurrent states) and a nemotron_h-like one (mamba and
attention blocks beside MLP and MoE blocks that cache nothing, given length caches:
cacheless.py), split into stages.

Expected tokens come from mlx-lm's whole model alone (``mlx_lm.utils.load_model``,
``make_prompt_cache``, its forward, greedy argmax over the whole prompt, nothing cached);
expected reuse lengths from the issue's rule: a window's or a recurrent state is
reusable only at exactly the length it was saved, the end of the previous turn.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache
from test_rebuild import park_survivors, run_ring
from tiny_models import make_tiny_model, whole_model_greedy
from zoo_models import ZOO

from ringlet.daemon.engine import cache_kinds, kv_handoff, speculation
from ringlet.daemon.engine.boundary import Boundary
from ringlet.daemon.engine.decode_groups import DecodeGroups
from ringlet.daemon.engine.kv_pieces import Piece, assemble
from ringlet.daemon.engine.prefix_store import PrefixStore
from ringlet.daemon.engine.rebuild import rebuild
from ringlet.daemon.engine.sources import resolve
from ringlet.daemon.engine.stage import load_stage, mergeable

#: The zoo's configs with 6 layers (windows of 4 tokens: every turn rotates them).
MODELS = {
    "gpt_oss": {**ZOO["gpt_oss"], "num_hidden_layers": 6, "max_position_embeddings": 4096,
                "layer_types": ["sliding_attention", "full_attention"] * 3},
    "qwen3_next": {**ZOO["qwen3_next"], "num_hidden_layers": 6, "max_position_embeddings": 4096},
    # attention at layers 2 and 5 (layer_group_size 3): stage [0, 2) holds linear attention alone, whose RoPE
    # offset comes from the recurrent states' own token count (recurrent_position)
    "bailing_moe_linear": {**ZOO["bailing_moe_linear"], "num_hidden_layers": 6, "max_position_embeddings": 4096,
                           "layer_group_size": 3},
    # MLP and MoE blocks cache nothing: each stage holds one, given a length cache (cacheless.py)
    "nemotron_h": {**ZOO["nemotron_h"], "max_position_embeddings": 4096,
                   "hybrid_override_pattern": ["M", "-", "*", "E", "M", "*"]},
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


def test_a_replan_keeps_exact_entries_on_their_node_and_never_sends_them(model):
    _, _, stages = model
    store = PrefixStore(1 << 26, stages[1].start, stages[1].end)
    ring_turn(stages, [PrefixStore(1 << 26, stages[0].start, stages[0].end), store,
                       PrefixStore(1 << 26, stages[2].start, stages[2].end)], TURNS[0], NEW)
    saved = len(TURNS[0]) + NEW - 1
    (piece,) = kv_handoff.park(stages[1], {}, store)
    assert piece.exact and len(piece.tokens) == saved and len(store) == 0
    assert kv_handoff.declined([piece], piece.start, piece.end) == []  # FetchKV leaves it out
    # the node keeps the layers: back in its store, served at exactly its length
    again = PrefixStore(1 << 26, piece.start, piece.end)
    assert kv_handoff.install(again, [piece], piece.start, piece.end).sequences == 1
    assert again.longest("", piece.tokens + [1]) == saved and again.longest("", piece.tokens[:-1]) == 0


def test_no_stage_of_these_models_drafts(model):
    """Speculative decoding would trim drafted positions (mlx-lm's trim_prompt_cache): a stage 0 drafts only
    when the whole model's caches are all plain KVCache (head._may_speculate), so a window or a recurrent state,
    and a recurrent state's token count (recurrent_position), is never trimmed."""
    _, _, stages = model
    assert all(not speculation.trimmable(s.pattern.caches) for s in stages)
    prefilled = stages[0].make_cache()
    mx.eval(stages[0](mx.array([TURNS[0]]), prefilled))
    assert not cache_kinds.trimmable(prefilled, 1)


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


@pytest.mark.parametrize("chunk", [64, 4])
def test_a_lost_middle_stage_is_rebuilt_from_boundary_states_and_decodes_as_the_whole_model(model, chunk):
    """Stages [0, 2) [2, 5) [5, 6) prefill a prompt; [2, 5) is lost, the new plan is [0, 3)
    [3, 6). The first new stage rebuilds layer 2 from the states stage 0 sent on, the second
    layers 3-4 from what that sends on; joined with the whole states the survivors parked
    (kv_handoff.park) into each stage's prefix store (kv_handoff.install), they decode the
    tokens mlx-lm's whole model decodes after the prompt."""
    name, path, old = model
    prompt = TURNS[0] + TURNS[1]
    caches, sent = run_ring(old, prompt)
    parked = park_survivors(old, caches, prompt)
    assert [p.exact for p in parked] == [True, cache_kinds.exact_only(caches[2])]

    location = resolve(str(path))
    first, second = load_stage(location, 0, 3), load_stage(location, 3, 6)
    rebuilt_2, out_3 = rebuild(first, 2, 3, [Boundary("", prompt, 2, sent[0], inflight=True)], chunk)
    rebuilt_3, _ = rebuild(second, 3, 5, out_3, chunk)
    assert len(rebuilt_2) == len(rebuilt_3) == 1
    stores = [PrefixStore(1 << 26, 0, 3), PrefixStore(1 << 26, 3, 6)]
    for store, pieces in zip(stores, ([parked[0], *rebuilt_2], [*rebuilt_3, parked[1]]), strict=True):
        done = kv_handoff.install(store, pieces, store.start, store.end)
        assert (done.inflight, done.left_out) == (1, 0), name
    new_caches = [store.take("", prompt) for store in stores]
    x = mx.array([[whole_model_greedy(path, prompt, 1)[0]]])
    got = [x.item()]
    for _ in range(4):
        for stage, cache in zip((first, second), new_caches, strict=True):
            x = stage(x, cache)
        got.append(mx.argmax(x[0, -1]).item())
        x = mx.array([[got[-1]]])
    assert got == whole_model_greedy(path, prompt, 5), (name, chunk)


def test_whole_states_join_only_at_their_own_length(model):
    _, _, stages = model
    prompt = TURNS[0]
    cache = stages[0].make_cache()
    mx.eval(stages[0](mx.array([prompt]), cache))
    whole = Piece("", prompt, 0, 2, cache_kinds.freeze(cache), inflight=True)
    shorter = Piece("", prompt[:-2], 2, 3, [(mx.zeros((1, 2, 8, 16)), mx.zeros((1, 2, 8, 16)))])
    longer = Piece("", prompt + [4, 4], 2, 3, [(mx.zeros((1, 2, 12, 16)), mx.zeros((1, 2, 12, 16)))])
    assert assemble([whole, shorter], 0, 3) == []  # it cannot be cut to 8 tokens
    (joined,) = assemble([whole, longer], 0, 3)  # the plain one is cut to its 10
    assert joined.tokens == prompt and joined.exact
    assert kv_handoff.declined([whole, longer], 0, 3) == [longer]  # only plain KV goes on the wire


@pytest.mark.parametrize("kind", ["KVCache", "RotatingKVCache", "ArraysCache", "ChunkedKVCache", "QuantizedKVCache",
                                  "CacheList"])
def test_every_kind_is_kept_whole_and_goes_on_as_the_original(kind):
    """freeze/thaw (the prefix store's exact entries): a restored cache, fed the same next
    tokens, returns what the original returns (mlx-lm's own update_and_fetch), and the
    original going on never changes the kept copy."""
    from mlx_lm.models.cache import CacheList, ChunkedKVCache, QuantizedKVCache

    make = {"KVCache": KVCache, "RotatingKVCache": lambda: RotatingKVCache(max_size=6, keep=1),
            "ChunkedKVCache": lambda: ChunkedKVCache(8), "QuantizedKVCache": lambda: QuantizedKVCache(32, 8),
            "ArraysCache": lambda: ArraysCache(2), "CacheList": lambda: CacheList(ArraysCache(2), KVCache())}[kind]

    def feed(cache, t: int):
        """t tokens of keys and values (or states), as the layer kinds write them."""
        kv = mx.random.normal((1, 2, t, 64))
        for c in getattr(cache, "caches", None) or (cache,):
            if isinstance(c, ArraysCache):
                c[0], c[1] = kv[:, :, -1], (c[1] if c[1] is not None else 0) + kv.sum(axis=2)
                out = (c[0], c[1])
            else:
                if isinstance(c, ChunkedKVCache):
                    c.maybe_trim_front()
                out = c.update_and_fetch(kv, kv)
        return out

    mx.random.seed(3)
    original = make()
    feed(original, 5)
    for _ in range(4):  # decode steps: the window wraps, the chunk fills
        feed(original, 1)
    (kept,) = cache_kinds.freeze([original])
    restored = cache_kinds.thaw([kept])[0]
    outputs = []
    for step, t in enumerate((1, 1, 3)):
        mx.random.seed(10 + step)
        a = feed(original, t)
        mx.random.seed(10 + step)
        b = feed(restored, t)
        outputs.append([x + 0 for _, x in tree_flatten(a)])  # copies: a window's buffer is written in place
        mx.eval(outputs[-1])
        for (_, x), (_, y) in zip(tree_flatten(a), tree_flatten(b), strict=True):
            assert mx.array_equal(x, y).item(), (kind, step)
    again = cache_kinds.thaw([kept])[0]  # the copy kept is untouched by both going on
    mx.random.seed(10)
    for x, (_, y) in zip(outputs[0], tree_flatten(feed(again, 1)), strict=True):
        assert mx.array_equal(x, y).item(), kind
    assert kept.kind == kind and kept.nbytes > 0
