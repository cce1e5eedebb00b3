"""The boundary store: requests in flight record what they sent on, finished ones stay by
token ids, everything within one byte budget. Sizes by hand: float32 states of width 8
are 32 bytes a token."""

from __future__ import annotations

import mlx.core as mx

from ringlet.daemon.engine.boundary import Boundary, BoundaryStore

WIDTH = 8
PER_TOKEN = WIDTH * 4


def states(n: int, start: float = 0.0) -> mx.array:
    return (mx.arange(n * WIDTH).reshape(1, n, WIDTH) + start).astype(mx.float32)


def test_a_request_records_and_its_states_stay_after_release():
    store = BoundaryStore(100 * PER_TOKEN, layer=10)
    rec = store.begin("s", [])
    for n in (5, 1, 1):  # a prefill chunk, then two decode steps
        rec = store.record(rec, states(n))
    assert rec.rows == 7 and store.inflight_bytes == 7 * PER_TOKEN
    kept = store.end(rec, "s", list(range(100, 107)))
    assert store.inflight_bytes == 0 and store.nbytes == 7 * PER_TOKEN and len(store) == 1
    assert kept.layer == 10 and kept.released_at > 0 and not kept.inflight
    # a later turn's first 5 tokens: the states of exactly them
    found = store.find("s", [100, 101, 102, 103, 104])
    assert found.tokens == [100, 101, 102, 103, 104] and found.hidden.shape == (1, 5, WIDTH)
    assert mx.array_equal(found.hidden, states(5)).item()
    assert store.find("s", [100, 999]) is None and store.find("other", [100]) is None
    # the next turn starts from them: its recording is seeded with those 5 tokens' states
    seeded = store.begin("s", [100, 101, 102, 103, 104])
    assert seeded.rows == 5 and store.inflight_bytes == 5 * PER_TOKEN


def test_the_budget_counts_requests_in_flight_and_evicts_finished_ones_first():
    store = BoundaryStore(10 * PER_TOKEN, layer=3)
    for i in range(2):  # two finished sequences of 4 tokens: 8 of 10 tokens' room
        store.end(store.record(store.begin("s", []), states(4)), "s", [i, 1, 2, 3])
    assert len(store) == 2 and store.nbytes == 8 * PER_TOKEN
    rec = store.record(store.begin("s", []), states(5))  # 5 more: the oldest finished one goes
    assert rec is not None and len(store) == 1 and store.find("s", [0, 1, 2, 3]) is None
    assert store.find("s", [1, 1, 2, 3]) is not None and store.evictions == 1
    rec = store.record(rec, states(6))  # 11 in flight: no longer fits; dropped, counted
    assert rec is None and store.dropped == 1 and store.inflight_bytes == 0
    assert store.figures()["bytes"] == store.nbytes <= 10 * PER_TOKEN


def test_no_budget_records_nothing_and_another_layer_is_dropped():
    off = BoundaryStore(0, layer=5)
    assert off.begin("s", []) is None and off.record(None, states(3)) is None
    store = BoundaryStore(100 * PER_TOKEN, layer=5)
    store.end(store.record(store.begin("s", []), states(2)), "s", [1, 2])
    store.retain(5)
    assert len(store) == 1
    store.retain(6)  # the stage now ends elsewhere: those states enter another layer
    assert len(store) == 0 and store.layer == 6
    assert not store.add(Boundary("s", [1], 5, states(1)))  # not this store's layer


def test_an_entry_extended_by_a_later_turn_goes():
    store = BoundaryStore(100 * PER_TOKEN, layer=1)
    store.add(Boundary("s", [1, 2], 1, states(2)))
    store.add(Boundary("s", [1, 2, 3, 4], 1, states(4)))
    assert len(store) == 1 and store.nbytes == 4 * PER_TOKEN
    assert store.find("s", [1, 2]).hidden.shape == (1, 2, WIDTH)


def test_a_long_decode_is_kept_in_few_arrays_and_whole():
    store = BoundaryStore(10_000 * PER_TOKEN, layer=1)
    rec = store.begin("s", [])
    for i in range(200):  # 200 decode steps of one row each
        rec = store.record(rec, states(1, start=float(i)))
    assert rec.rows == 200 and len(rec.parts) == 3 + 8  # 3 blocks of 64 rows, 8 rows after them
    want = mx.concatenate([states(1, start=float(i)) for i in range(200)], axis=1)
    assert mx.array_equal(rec.hidden(), want).item()
