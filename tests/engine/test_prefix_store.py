"""The prefix store of one stage on its own (MLX in this process, no daemons).

Caches are real mlx-lm ``KVCache`` objects filled through ``update_and_fetch`` with values
that name where they came from: the key at (layer L, position p) of a cache tagged t is
``t * 100_000 + L * 1_000 + p`` and its value is the negative of that minus 0.5, on every
head and channel. Expected contents and byte counts are written from that rule and from
the shapes: a cached token costs ``KV_HEADS * HEAD_DIM * 4`` bytes (float32) for its keys
and as much for its values, per layer.
"""

from __future__ import annotations

import asyncio

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache

from ringlet.daemon.engine.prefix_store import PrefixStore

KV_HEADS, HEAD_DIM = 2, 8
#: bytes of one token in one layer: keys and values, float32
TOKEN_LAYER_BYTES = KV_HEADS * HEAD_DIM * 4 * 2  # = 128
BIG = 1 << 30


def key_at(tag: int, layer: int, positions) -> np.ndarray:
    return tag * 100_000 + layer * 1_000 + np.asarray(positions, dtype=np.float32)


def filled(n: int, start: int = 0, end: int = 2, tag: int = 0, chunks: tuple[int, ...] = ()) -> list[KVCache]:
    """One KVCache per layer of ``[start, end)`` holding ``n`` tokens, fed in ``chunks``
    (sizes; the rest in one go) through ``update_and_fetch``."""
    sizes = [*chunks, n - sum(chunks)] if n > sum(chunks) else list(chunks)
    caches = []
    for layer in range(start, end):
        c = KVCache()
        p = 0
        for size in sizes:
            append(c, tag, layer, range(p, p + size))
            p += size
        caches.append(c)
    mx.eval([(c.keys, c.values) for c in caches])
    return caches


def append(cache: KVCache, tag: int, layer: int, positions) -> None:
    """Feed ``positions`` (their key/value rule under ``tag``) to ``cache``."""
    keys = mx.array(key_at(tag, layer, list(positions)))[None, None, :, None]
    keys = mx.broadcast_to(keys, (1, KV_HEADS, keys.shape[2], HEAD_DIM))
    cache.update_and_fetch(keys, -keys - 0.5)


def expect_contents(caches: list, n: int, start: int, tag: int = 0, tail: tuple[int, list] | None = None) -> None:
    """``caches`` (layers from ``start``) hold exactly ``n`` tokens: positions ``0..n-1``
    under ``tag``, or with ``tail = (tail_tag, positions)`` the last ones under another tag."""
    for i, c in enumerate(caches):
        layer = start + i
        assert type(c) is KVCache
        assert c.offset == n
        keys, values = c.state[0][..., :n, :], c.state[1][..., :n, :]
        want = key_at(tag, layer, range(n))
        if tail is not None:
            tail_tag, positions = tail
            want[n - len(positions):] = key_at(tail_tag, layer, positions)
        want = np.broadcast_to(want[None, None, :, None], (1, KV_HEADS, n, HEAD_DIM))
        np.testing.assert_array_equal(np.array(keys), want)
        np.testing.assert_array_equal(np.array(values), -want - 0.5)


def entry_arrays(store: PrefixStore) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """Copies of every entry's arrays (to compare later)."""
    return [[(np.array(k), np.array(v)) for k, v in e.layers] for e in store.entries()]


T = list(range(10, 20))  # a 10-token conversation
A, B, C, D = ([100 + i] * 4 for i in range(4))  # four 4-token conversations with distinct first tokens


# --- longest --------------------------------------------------------------------------------


def test_longest_exact_shorter_longer_and_diverging_prompts_with_limits():
    store = PrefixStore(BIG, 0, 2)
    assert store.longest("a", T) == 0  # empty store
    assert store.insert("a", T, filled(10))
    assert store.longest("a", T) == 10  # exact
    assert store.longest("a", T[:6]) == 6  # the prompt is shorter than the entry
    assert store.longest("a", T[:1]) == 1
    assert store.longest("a", [*T, 99, 98]) == 10  # longer prompt
    assert store.longest("a", [*T[:4], 77, 78]) == 4  # diverges after 4 tokens
    assert store.longest("a", [T[0], 77]) == 1
    assert store.longest("a", [77, *T]) == 0  # differs at the first token
    assert store.longest("a", []) == 0
    assert store.longest("a", T, limit=7) == 7
    assert store.longest("a", [*T, 99], limit=3) == 3
    assert store.longest("a", [*T, 99], limit=11) == 10
    assert store.longest("a", T, limit=50) == 10
    assert store.longest("a", [*T[:4], 77], limit=2) == 2
    assert store.longest("a", T, limit=0) == 0


def test_scopes_are_isolated():
    store = PrefixStore(BIG, 0, 2)
    store.insert("a", T, filled(10, tag=1))
    assert store.longest("b", T) == 0
    assert store.longest("", T) == 0
    assert store.take("b", T[:3]) is None
    assert store.stats.misses == 1
    # the same tokens in another scope are another entry; neither drops the other
    store.insert("b", T, filled(10, tag=2))
    store.insert("b", [*T, 20], filled(11, tag=3))  # extends b's entry, not a's
    assert sorted((e.scope, len(e.tokens)) for e in store.entries()) == [("a", 10), ("b", 11)]
    expect_contents(store.take("a", T), 10, 0, tag=1)
    expect_contents(store.take("b", T), 10, 0, tag=3)


# --- take -----------------------------------------------------------------------------------


def test_take_builds_caches_of_exactly_the_asked_tokens():
    store = PrefixStore(BIG, 0, 3)
    store.insert("a", T, filled(10, 0, 3, chunks=(3, 4)))
    for n in (10, 6, 1):
        caches = store.take("a", T[:n])
        assert len(caches) == 3
        for c in caches:
            assert c.keys.shape == (1, KV_HEADS, n, HEAD_DIM) and c.values.shape == (1, KV_HEADS, n, HEAD_DIM)
        expect_contents(caches, n, 0)
    # a prefix the prompt shares with the entry before diverging
    expect_contents(store.take("a", T[:4]), 4, 0)
    assert (store.stats.hits, store.stats.hit_tokens, store.stats.misses) == (4, 10 + 6 + 1 + 4, 0)


def test_extending_or_overwriting_a_taken_cache_never_changes_the_entry():
    store = PrefixStore(BIG, 0, 2)
    store.insert("a", T, filled(10, chunks=(4,)))
    before = entry_arrays(store)

    # extend every layer (as a request's next prefill chunk and decode steps do)
    caches = store.take("a", T)
    for layer, c in enumerate(caches):
        append(c, 7, layer, range(10, 13))
        append(c, 7, layer, [13])
    mx.eval([(c.keys, c.values) for c in caches])
    expect_contents(caches, 14, 0, tail=(7, [10, 11, 12, 13]))

    # trim, then write in place inside the taken arrays' extent
    caches = store.take("a", T)
    for layer, c in enumerate(caches):
        assert c.trim(4) == 4
        append(c, 8, layer, range(6, 9))
    mx.eval([(c.keys, c.values) for c in caches])
    expect_contents(caches, 9, 0, tail=(8, [6, 7, 8]))

    # a short take, extended over the entry's later positions
    caches = store.take("a", T[:5])
    for layer, c in enumerate(caches):
        append(c, 9, layer, range(5, 10))
    mx.eval([(c.keys, c.values) for c in caches])
    expect_contents(caches, 10, 0, tail=(9, list(range(5, 10))))

    after = entry_arrays(store)
    for layer_before, layer_after in zip(before[0], after[0], strict=True):
        np.testing.assert_array_equal(layer_before[0], layer_after[0])
        np.testing.assert_array_equal(layer_before[1], layer_after[1])
    expect_contents(store.take("a", T), 10, 0)
    assert store.info()["bytes"] == 10 * TOKEN_LAYER_BYTES * 2


def test_two_takes_of_one_entry_are_independent():
    store = PrefixStore(BIG, 0, 2)
    store.insert("a", T, filled(10))
    first, second = store.take("a", T[:8]), store.take("a", T[:8])
    for layer in range(2):
        append(first[layer], 1, layer, range(8, 11))
        append(second[layer], 2, layer, range(8, 10))
    mx.eval([(c.keys, c.values) for c in first + second])
    expect_contents(first, 11, 0, tail=(1, [8, 9, 10]))
    expect_contents(second, 10, 0, tail=(2, [8, 9]))
    expect_contents(store.take("a", T), 10, 0)


def test_a_take_the_store_cannot_serve_returns_none_and_counts_a_miss():
    store = PrefixStore(BIG, 0, 2)
    assert store.take("a", T) is None  # empty store
    store.insert("a", T, filled(10))
    assert store.take("a", [*T, 99]) is None  # more tokens than held
    assert store.take("a", [*T[:4], 77]) is None  # diverges
    assert store.take("a", []) is None
    assert store.take("b", T) is None  # another scope
    assert (store.stats.misses, store.stats.hits, store.stats.hit_tokens) == (5, 0, 0)
    store.miss()
    assert store.stats.misses == 6
    assert store.take("a", T) is not None
    assert (store.stats.misses, store.stats.hits, store.stats.hit_tokens) == (6, 1, 10)


# --- insert ---------------------------------------------------------------------------------


def test_insert_stores_compact_arrays():
    store = PrefixStore(BIG, 0, 3)
    source = filled(10, 0, 3)
    assert source[0].keys.shape[2] == 256  # KVCache's padded buffer
    assert store.insert("a", T, source)
    (entry,) = store.entries()
    assert (entry.scope, entry.tokens, entry.start, entry.end) == ("a", T, 0, 3)
    assert len(entry.layers) == 3
    for k, v in entry.layers:
        assert k.shape == v.shape == (1, KV_HEADS, 10, HEAD_DIM)
        assert k.nbytes == v.nbytes == 10 * KV_HEADS * HEAD_DIM * 4  # 640
    assert entry.nbytes == store.nbytes == 10 * 2 * 8 * 4 * 2 * 3 == 3840
    # the request's cache may go on (it does not, in the engine) without touching the entry
    for layer, c in enumerate(source):
        c.trim(5)
        append(c, 5, layer, range(5, 10))
    mx.eval([(c.keys, c.values) for c in source])
    expect_contents(store.take("a", T), 10, 0)


def test_insert_refuses_what_it_cannot_store():
    store = PrefixStore(BIG, 0, 2)
    assert not store.insert("a", [], filled(1))
    assert not store.insert("a", T, [])
    assert not store.insert("a", T[:9], filled(10))  # the cache holds more tokens than named
    assert not store.insert("a", T, filled(9))
    assert (len(store), store.nbytes, store.stats.inserted) == (0, 0, 0)
    # another kind of cache (a window) is kept whole, reusable at exactly its length
    # (tests/engine/test_cache_kinds.py); named with fewer tokens than it holds, never
    rotating = [RotatingKVCache(max_size=64) for _ in range(2)]
    for layer, c in enumerate(rotating):
        append(c, 0, layer, range(10))
    assert not store.insert("a", T[:9], rotating)
    assert store.insert("a", T, rotating) and store.entries()[0].exact
    assert store.longest("a", T + [1]) == len(T) and store.longest("a", T[:9] + [1]) == 0


def test_an_extension_drops_the_entry_it_extends():
    store = PrefixStore(BIG, 0, 2)
    store.insert("a", T[:6], filled(6))
    store.insert("a", T, filled(10, tag=1))
    assert [e.tokens for e in store.entries()] == [T]
    assert store.nbytes == 10 * TOKEN_LAYER_BYTES * 2
    assert store.longest("a", T[:6]) == 6
    expect_contents(store.take("a", T[:6]), 6, 0, tag=1)
    # the same tokens again: the new entry replaces the old
    store.insert("a", T, filled(10, tag=2))
    assert len(store) == 1 and store.nbytes == 10 * TOKEN_LAYER_BYTES * 2
    expect_contents(store.take("a", T), 10, 0, tag=2)
    # a chain: each turn extends the last; only the last is held
    store.insert("a", [*T, 20, 21], filled(12, tag=3))
    store.insert("a", [*T, 20, 21, 22, 23, 24], filled(15, tag=4))
    assert [len(e.tokens) for e in store.entries()] == [15]
    assert store.nbytes == 15 * TOKEN_LAYER_BYTES * 2
    assert store.stats.inserted == 5


def test_an_extension_drops_a_one_token_entry():
    """``PromptTrie.search`` reports a one-token prefix as neither ``exact`` nor ``shorter``."""
    store = PrefixStore(BIG, 0, 2)
    store.insert("a", [5], filled(1))
    assert store.longest("a", [5, 6, 7]) == 1  # (lookups find it: as "longer", with a common prefix of 1)
    expect_contents(store.take("a", [5]), 1, 0)
    store.insert("a", [5, 6], filled(2, tag=1))
    assert [e.tokens for e in store.entries()] == [[5, 6]]
    assert store.nbytes == 2 * TOKEN_LAYER_BYTES * 2
    store.insert("a", [7], filled(1))
    store.insert("a", [7, 8, 9], filled(3))
    store.insert("a", [7, 8, 9, 10], filled(4, tag=2))
    assert sorted(e.tokens for e in store.entries()) == [[5, 6], [7, 8, 9, 10]]
    assert store.nbytes == (2 + 4) * TOKEN_LAYER_BYTES * 2


def test_diverging_conversations_sharing_a_prefix_keep_one_entry_each():
    system = [1, 2, 3, 4, 5]
    first, second = [*system, 6, 7], [*system, 8, 9, 10]
    store = PrefixStore(BIG, 0, 2)
    store.insert("a", first, filled(7, tag=1))
    store.insert("a", second, filled(8, tag=2))
    assert sorted(e.tokens for e in store.entries()) == [first, second]
    assert store.nbytes == (7 + 8) * TOKEN_LAYER_BYTES * 2
    assert store.longest("a", [*first, 99]) == 7
    assert store.longest("a", second) == 8
    assert store.longest("a", [*system, 42]) == 5
    expect_contents(store.take("a", first), 7, 0, tag=1)
    expect_contents(store.take("a", second), 8, 0, tag=2)
    taken = store.take("a", system)  # from either entry: the same positions, a whole system prompt
    assert all(c.offset == 5 for c in taken)


def test_budget_zero_stores_nothing():
    store = PrefixStore(0, 0, 2)
    assert not store.insert("a", T, filled(10))
    assert (len(store), store.nbytes, store.longest("a", T), store.take("a", T)) == (0, 0, 0, None)
    assert PrefixStore(-5).budget_bytes == 0
    source = PrefixStore(BIG, 0, 2)
    source.insert("a", T, filled(10))
    assert not store.import_entry(*PrefixStore.export_entry(source.entries()[0]))
    assert len(store) == 0


def test_an_entry_over_the_budget_is_refused():
    size = 10 * TOKEN_LAYER_BYTES * 2  # 2560
    store = PrefixStore(size - 1, 0, 2)
    assert store.insert("a", A, filled(4))
    assert not store.insert("a", T, filled(10))
    assert [e.tokens for e in store.entries()] == [A]  # nothing was evicted for it
    assert (store.nbytes, store.stats.evictions, store.stats.inserted) == (4 * TOKEN_LAYER_BYTES * 2, 0, 1)
    exact = PrefixStore(size, 0, 2)
    assert exact.insert("a", T, filled(10)) and exact.nbytes == size


def test_lru_eviction_by_bytes_evicts_the_least_recently_used():
    entry = 4 * TOKEN_LAYER_BYTES * 2  # a 4-token entry: 1024 bytes
    budget = 3 * entry + 100
    store = PrefixStore(budget, 0, 2)
    for tokens in (A, B, C):
        assert store.insert("a", tokens, filled(4))
        assert store.nbytes <= budget
    assert store.take("a", A) is not None  # A is now the most recently used
    assert store.longest("a", B) == 4  # a lookup alone does not refresh
    assert store.insert("a", D, filled(4))
    assert [e.tokens for e in store.entries()] == [C, A, D]  # B went, not A
    assert (store.nbytes, store.stats.evictions) == (3 * entry, 1)
    # an 8-token entry needs two 4-token entries' room: the two least recently used go
    store.take("a", C)
    big = [200] * 8
    assert store.insert("a", big, filled(8))
    assert [e.tokens for e in store.entries()] == [C, big]
    assert (store.nbytes, store.stats.evictions) == (entry + 2 * entry, 3)
    assert store.nbytes <= budget
    assert store.longest("a", A) == store.longest("a", B) == store.longest("a", D) == 0


def test_bytes_never_exceed_the_budget_after_any_insert():
    budget = 25 * TOKEN_LAYER_BYTES * 2
    store = PrefixStore(budget, 0, 2)
    for i, n in enumerate([3, 9, 1, 12, 7, 25, 4, 11, 26, 2, 8, 5]):
        tokens = [1000 + i, *range(n - 1)]
        kept = store.insert("a", tokens, filled(n))
        assert kept == (n <= 25)
        assert store.nbytes <= budget
        assert store.nbytes == sum(len(e.tokens) for e in store.entries()) * TOKEN_LAYER_BYTES * 2
    assert store.stats.inserted == 11 and store.stats.evictions > 0


def test_set_budget_evicts():
    entry = 4 * TOKEN_LAYER_BYTES * 2
    store = PrefixStore(BIG, 0, 2)
    for tokens in (A, B, C):
        store.insert("a", tokens, filled(4))
    store.take("a", A)
    store.set_budget(2 * entry)
    assert [e.tokens for e in store.entries()] == [C, A]
    assert (store.nbytes, store.stats.evictions, store.budget_bytes) == (2 * entry, 1, 2 * entry)
    store.set_budget(entry + 1)
    assert [e.tokens for e in store.entries()] == [A]
    store.set_budget(0)
    assert (len(store), store.nbytes, store.stats.evictions) == (0, 0, 3)
    assert not store.insert("a", A, filled(4))


def test_clear_drops_everything():
    store = PrefixStore(BIG, 0, 2)
    store.insert("a", T, filled(10))
    store.insert("b", A, filled(4))
    store.clear()
    assert (len(store), store.nbytes, store.longest("a", T), store.longest("b", A)) == (0, 0, 0, 0)
    assert store.insert("a", T, filled(10))  # the trie is usable again
    assert store.longest("a", T) == 10


# --- retain, export, import -----------------------------------------------------------------


def test_retain_slices_entries_covering_the_new_range():
    store = PrefixStore(BIG, 0, 4)
    store.insert("a", T, filled(10, 0, 4))
    store.insert("a", A, filled(4, 0, 4, tag=1))
    assert store.nbytes == (10 + 4) * TOKEN_LAYER_BYTES * 4
    store.retain(1, 3)
    assert store.nbytes == (10 + 4) * TOKEN_LAYER_BYTES * 2  # shrank by (10 + 4) tokens x 2 layers x 128
    assert [(e.start, e.end, len(e.layers), e.nbytes) for e in store.entries()] == [
        (1, 3, 2, 10 * TOKEN_LAYER_BYTES * 2), (1, 3, 2, 4 * TOKEN_LAYER_BYTES * 2)]
    assert store.info()["layer_range"] == [1, 3]
    assert store.longest("a", T) == 10
    caches = store.take("a", T)
    assert len(caches) == 2
    expect_contents(caches, 10, 1)  # layers 1 and 2, as they were
    expect_contents(store.take("a", A), 4, 1, tag=1)
    assert store.stats.dropped_on_replan == 0
    store.retain(2, 3)  # narrower again
    expect_contents(store.take("a", T), 10, 2)
    assert store.nbytes == (10 + 4) * TOKEN_LAYER_BYTES


def test_retain_drops_entries_not_covering_the_new_range():
    store = PrefixStore(BIG, 1, 3)
    store.insert("a", T, filled(10, 1, 3))
    store.insert("b", A, filled(4, 1, 3))
    store.retain(0, 3)  # layer 0 was never here
    assert (len(store), store.nbytes, store.stats.dropped_on_replan) == (0, 0, 2)
    assert store.longest("a", T) == 0 and store.longest("b", A) == 0
    assert store.info()["layer_range"] == [0, 3]
    assert store.insert("a", T, filled(10, 0, 3))
    assert store.nbytes == 10 * TOKEN_LAYER_BYTES * 3


def test_export_and_import_into_a_store_of_a_narrower_range(tmp_path):
    source = PrefixStore(BIG, 0, 4)
    source.insert("key-1", T, filled(10, 0, 4, tag=3))
    arrays, meta = PrefixStore.export_entry(source.entries()[0])
    assert meta == {"scope": "key-1", "start": "0", "end": "4"}
    assert sorted(arrays) == sorted(["tokens", *(f"layer.{i}.{kind}" for i in range(4) for kind in ("keys", "values"))])
    assert arrays["tokens"].tolist() == T
    # through a file, as KV moves with its layers
    path = str(tmp_path / "entry.safetensors")
    mx.save_safetensors(path, arrays, metadata=meta)
    arrays, meta = mx.load(path, return_metadata=True)

    target = PrefixStore(BIG, 1, 3)
    assert target.import_entry(arrays, meta)
    (entry,) = target.entries()
    assert (entry.scope, entry.tokens, entry.start, entry.end, len(entry.layers)) == ("key-1", T, 1, 3, 2)
    assert entry.nbytes == target.nbytes == 10 * TOKEN_LAYER_BYTES * 2
    assert target.longest("key-1", [*T, 99]) == 10
    expect_contents(target.take("key-1", T), 10, 1, tag=3)
    # an entry is re-exported with absolute layer numbers
    arrays2, meta2 = PrefixStore.export_entry(entry)
    assert sorted(arrays2) == ["layer.1.keys", "layer.1.values", "layer.2.keys", "layer.2.values", "tokens"]
    assert (meta2["start"], meta2["end"]) == ("1", "3")
    # a store whose range the entry does not cover keeps nothing (and does not fail)
    other = PrefixStore(BIG, 2, 5)
    assert not other.import_entry(arrays, meta)
    assert len(other) == 0
    # an import extending an entry drops it, as an insert does
    target.insert("key-1", T[:4], filled(4, 1, 3))
    source.insert("key-1", [*T, 20], filled(11, 0, 4, tag=4))
    assert target.import_entry(*PrefixStore.export_entry(source.entries()[0]))
    assert sorted(e.tokens for e in target.entries()) == [[*T, 20]]
    assert target.nbytes == 11 * TOKEN_LAYER_BYTES * 2


def test_an_imported_entry_over_the_budget_is_refused():
    source = PrefixStore(BIG, 0, 2)
    source.insert("a", T, filled(10))
    target = PrefixStore(10 * TOKEN_LAYER_BYTES - 1, 1, 2)  # one layer's 1280 bytes do not fit
    assert not target.import_entry(*PrefixStore.export_entry(source.entries()[0]))
    target.set_budget(10 * TOKEN_LAYER_BYTES)
    assert target.import_entry(*PrefixStore.export_entry(source.entries()[0]))
    assert target.nbytes == 10 * TOKEN_LAYER_BYTES


def _malformed(change) -> tuple[dict, dict]:
    source = PrefixStore(BIG, 0, 4)
    source.insert("a", T, filled(10, 0, 4))
    arrays, meta = PrefixStore.export_entry(source.entries()[0])
    arrays = dict(arrays)
    change(arrays)
    return arrays, meta


@pytest.mark.parametrize(("change", "layer"), [
    (lambda a: a.pop("layer.2.values"), 2),
    (lambda a: a.pop("layer.0.keys"), 0),
    (lambda a: a.update({"layer.1.keys": a["layer.1.keys"][..., :9, :]}), 1),
    (lambda a: a.update({"layer.3.values": a["layer.3.values"][..., :9, :]}), 3),
    (lambda a: a.update({"layer.3.keys": a["layer.3.keys"][0]}), 3),
    (lambda a: a.update({"layer.1.values": a["layer.1.values"][0, 0]}), 1),
    (lambda a: a.update({"tokens": a["tokens"][:9]}), 0),
], ids=["missing-values", "missing-keys", "short-keys", "short-values", "keys-3d", "values-2d", "short-tokens"])
def test_a_malformed_export_raises_value_error_naming_the_layer(change, layer):
    arrays, meta = _malformed(change)
    target = PrefixStore(BIG, 0, 4)
    with pytest.raises(ValueError, match=rf"prefix entry: layer {layer} "):
        target.import_entry(arrays, meta)
    assert (len(target), target.nbytes) == (0, 0)


# --- figures --------------------------------------------------------------------------------


def test_info_figures():
    store = PrefixStore(20 * TOKEN_LAYER_BYTES * 2, 0, 2)
    assert store.info() == {"disk": None,
                            "budget_bytes": 5120, "bytes": 0, "entries": 0, "tokens": 0, "hits": 0, "misses": 0,
                            "hit_tokens": 0, "evictions": 0, "inserted": 0, "dropped_on_replan": 0,
                            "exact_dropped": 0, "exact_entries": 0, "layer_range": [0, 2], "pinned": 0}
    store.insert("a", T, filled(10))  # 2560 bytes
    store.insert("b", A, filled(4))  # 1024
    store.take("a", T[:7])
    store.take("b", A)
    store.take("a", [*T, 1])  # miss
    store.insert("c", [300] * 8, filled(8))  # 2048: over 5120, "a" (least recently used) goes
    assert store.info() == {"disk": None,
                            "budget_bytes": 5120, "bytes": 1024 + 2048, "entries": 2, "tokens": 12, "hits": 2,
                            "misses": 1, "hit_tokens": 11, "evictions": 1, "inserted": 3, "dropped_on_replan": 0,
                            "exact_dropped": 0, "exact_entries": 0, "layer_range": [0, 2], "pinned": 0}
    store.retain(1, 2)
    assert store.info() == {"disk": None,
                            "budget_bytes": 5120, "bytes": 512 + 1024, "entries": 2, "tokens": 12, "hits": 2,
                            "misses": 1, "hit_tokens": 11, "evictions": 1, "inserted": 3, "dropped_on_replan": 0,
                            "exact_dropped": 0, "exact_entries": 0, "layer_range": [1, 2], "pinned": 0}


# --- through the stage engine ---------------------------------------------------------------


def test_stage_engine_keeps_released_requests_and_reuses_them(tmp_path):
    """The first two layers of the tiny llama (tiny_models.CONFIGS: 2 KV heads of 64 / 4 = 16,
    float32): a release with token ids stores the request's KV (4 tokens x 2 x 16 x 4 x 2
    x 2 layers = 2,048 bytes); a request starting from it gives the hidden states of the
    same tokens prefilled cold; a prefix the store lacks fails with what it holds."""
    from tiny_models import make_tiny_model

    from ringlet.daemon.engine.scheduler import PrefixMiss, StageEngine
    from ringlet.daemon.engine.sources import resolve
    from ringlet.daemon.engine.stage import load_stage
    from ringlet.daemon.wire import codec

    location = resolve(str(make_tiny_model("llama", tmp_path / "llama")))
    per_token = 2 * 16 * 4 * 2 * 2  # 512

    async def go():
        engine = await StageEngine.create(lambda: load_stage(location, 0, 2, "float32"),
                                          prefix=PrefixStore(BIG, 0, 2))
        store = engine.prefix
        try:
            await engine.submit("r1", 0, 0, [5, 6, 7, 8], None, scope="k")
            assert await engine.submit_release("r1", [5, 6, 7, 8, 9])  # the ids may run past the cache
            assert [(e.scope, e.tokens, e.nbytes) for e in store.entries()] == [("k", [5, 6, 7, 8], 4 * per_token)]

            warm = await engine.submit("r2", 0, 4, [9, 10], None, prefix_ids=[5, 6, 7, 8], scope="k")
            cold = await engine.submit("r3", 0, 0, [5, 6, 7, 8, 9, 10], None, scope="k")
            warm, cold = np.array(codec.decode(warm)), np.array(codec.decode(cold))
            assert warm.shape == (1, 2, 64) and cold.shape == (1, 6, 64)
            np.testing.assert_allclose(warm, cold[:, 4:], rtol=1e-4, atol=1e-5)
            assert (store.stats.hits, store.stats.hit_tokens) == (1, 4)

            with pytest.raises(PrefixMiss, match="holds 2 of the 3 prefix tokens") as miss:
                await engine.submit("r4", 0, 3, [9], None, prefix_ids=[5, 6, 11], scope="k")
            assert miss.value.holds == 2
            with pytest.raises(PrefixMiss) as miss:
                await engine.submit("r5", 0, 2, [9], None, prefix_ids=[5, 6], scope="other")
            assert miss.value.holds == 0
            assert store.stats.misses == 2

            assert await engine.submit_release("r3")  # no ids: nothing stored
            assert len(store) == 1
            assert await engine.submit_release("r2", [5, 6, 7, 8, 9, 10])  # extends the entry
            assert [(e.tokens, e.nbytes) for e in store.entries()] == [([5, 6, 7, 8, 9, 10], 6 * per_token)]
            assert not await engine.submit_release("r2", [5, 6])  # released already
        finally:
            engine.close()

    asyncio.run(go())


def test_a_request_in_flight_across_a_re_plan_is_pinned_until_taken():
    """KV that moved with a re-plan for a request in flight stays whatever the budget
    (here 8 tokens' worth for a 10-token request), other entries are evicted around it,
    and once the resumed request takes it, it is an entry like any other (evicted to
    fit the budget)."""
    store = PrefixStore(8 * TOKEN_LAYER_BYTES * 2, 0, 2)
    layers = [(c.keys[..., :10, :], c.values[..., :10, :]) for c in filled(10)]
    assert store.adopt("s", list(range(10)), 0, 2, layers, pinned=True)
    assert not store.adopt("s", list(range(10)), 2, 4, layers)  # another layer range: refused
    assert store.insert("s", list(range(100, 104)), filled(4))  # 4 tokens: within the budget
    assert len(store) == 2 and store.info()["pinned"] == 1
    assert store.insert("s", list(range(200, 206)), filled(6))  # evicts the 4-token entry, not the pinned one
    assert store.longest("s", list(range(10))) == 10 and store.longest("s", list(range(100, 104))) == 0
    caches = store.take("s", list(range(9)))
    expect_contents(caches, 9, 0)
    assert store.info()["pinned"] == 0
    assert store.nbytes <= store.budget_bytes  # unpinned, the 10-token entry no longer fits
