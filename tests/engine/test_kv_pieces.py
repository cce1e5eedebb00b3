"""KV pieces: joining layer ranges of one sequence, and their wire form.

Every cached value here is built as ``1000 * layer + token position`` (keys) and its
negation (values), so the expected arrays follow from the construction by hand.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from ringlet.daemon.engine.kv_pieces import KVPieceError, Piece, PieceReader, assemble, range_minus, to_chunks

HEADS, DIM = 2, 3


def layer_kv(layer: int, n: int, dtype=mx.float32) -> tuple[mx.array, mx.array]:
    pos = mx.broadcast_to(mx.arange(n, dtype=mx.float32).reshape(1, 1, n, 1), (1, HEADS, n, DIM))
    keys = (1000 * layer + pos).astype(dtype)
    return keys, (-keys).astype(dtype)


def piece(tokens: list[int], start: int, end: int, scope: str = "", inflight: bool = False, dtype=mx.float32):
    return Piece(scope, tokens, start, end, [layer_kv(i, len(tokens), dtype) for i in range(start, end)], inflight)


def expected(layer: int, n: int) -> np.ndarray:
    return np.broadcast_to((1000 * layer + np.arange(n)).reshape(1, 1, n, 1), (1, HEADS, n, DIM))


def test_two_holders_of_one_request_join_on_the_tokens_both_cached():
    # this stage kept [0, 2) and had taken one more decode step than the previous
    # holder of [2, 4)
    own = piece([5, 6, 7, 8], 0, 2, inflight=True)
    fetched = piece([5, 6, 7], 2, 4, inflight=True)
    [joined] = assemble([own, fetched], 0, 4)
    assert joined.tokens == [5, 6, 7] and (joined.start, joined.end) == (0, 4) and joined.inflight
    for layer, (k, v) in enumerate(joined.layers):
        assert k.shape == (1, HEADS, 3, DIM)
        np.testing.assert_array_equal(np.array(k), expected(layer, 3))
        np.testing.assert_array_equal(np.array(v), -expected(layer, 3))


def test_pieces_of_other_scopes_or_without_a_common_prefix_are_not_joined():
    own = piece([1, 2, 3], 0, 2, scope="a")
    other_scope = piece([1, 2, 3], 2, 4, scope="b")
    other_tokens = piece([9, 2, 3], 2, 4, scope="a")
    # a's tokens differ from the first on; b's piece cannot cover layers 0 and 1 at all
    assert assemble([own, other_scope, other_tokens], 0, 4) == []


def test_a_sequence_missing_a_layer_is_left_out_and_a_subrange_is_sliced():
    pieces = [piece([1, 2], 0, 2), piece([1, 2], 3, 4)]  # layer 2 was lost
    assert assemble(pieces, 0, 4) == []
    [sliced] = assemble([piece([1, 2, 3], 0, 6)], 2, 4)
    assert (sliced.start, sliced.end, len(sliced.layers)) == (2, 4, 2)
    np.testing.assert_array_equal(np.array(sliced.layers[0][0]), expected(2, 3))


def test_an_entry_and_a_request_give_one_sequence_each():
    pieces = [piece([1, 2, 3, 4], 0, 4, inflight=True), piece([1, 2], 0, 4), piece([1, 2, 3, 4], 0, 4)]
    out = assemble(pieces, 0, 4)
    assert sorted((tuple(p.tokens), p.inflight) for p in out) == [((1, 2), False), ((1, 2, 3, 4), True)]


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_the_wire_form_round_trips_split_along_tokens(dtype):
    original = [piece([4, 5, 6, 7, 8], 1, 3, scope="k", inflight=True, dtype=dtype), piece([4, 5], 1, 3, dtype=dtype)]
    per_token = 2 * HEADS * DIM * np.dtype(np.float32 if dtype == mx.float32 else np.float16).itemsize
    chunks = list(to_chunks(original, max_bytes=2 * per_token))  # two tokens per chunk
    assert len(chunks) == 2 * 3 + 2 * 1  # 5 tokens: 3 chunks per layer; 2 tokens: 1
    reader = PieceReader(1, 3, dtype, max_bytes=1 << 20)
    for chunk in chunks:
        reader.add(chunk)
    back = reader.pieces()
    assert [(p.scope, p.tokens, p.inflight) for p in back] == [("k", [4, 5, 6, 7, 8], True), ("", [4, 5], False)]
    for got, want in zip(back, original, strict=True):
        for (k, v), (k0, v0) in zip(got.layers, want.layers, strict=True):
            assert k.dtype == dtype and mx.array_equal(k, k0).item() and mx.array_equal(v, v0).item()
    assert reader.nbytes == sum(p.nbytes for p in original)


def test_a_layer_that_caches_nothing_crosses_the_wire_beside_real_ones():
    """A length cache (cacheless.py) holds keys and values of width 0, float32 whatever the
    stage's dtype: its piece layer arrives with its tokens' count and no values."""
    empty = mx.zeros((1, 1, 5, 0))
    real = piece([4, 5, 6, 7, 8], 2, 3, dtype=mx.bfloat16)
    original = Piece("", real.tokens, 1, 3, [(empty, empty), *real.layers], inflight=True)
    reader = PieceReader(1, 3, mx.bfloat16, max_bytes=1 << 20)
    for chunk in to_chunks([original], max_bytes=64):
        reader.add(chunk)
    (back,) = reader.pieces()
    assert back.tokens == original.tokens and back.layers[0][0].shape == (1, 1, 5, 0)
    assert mx.array_equal(back.layers[1][0], real.layers[0][0]).item()


def test_the_reader_names_what_is_wrong():
    chunks = list(to_chunks([piece([1, 2], 0, 2, dtype=mx.float16)], max_bytes=1 << 20))
    with pytest.raises(KVPieceError, match="dtype mlx.core.float16, this stage caches mlx.core.float32"):
        PieceReader(0, 2, mx.float32, 1 << 20).add(chunks[0])
    with pytest.raises(KVPieceError, match=r"layer 1 is outside the range \[0, 1\)"):
        reader = PieceReader(0, 1, None, 1 << 20)
        for chunk in chunks:
            reader.add(chunk)
    reader = PieceReader(0, 2, None, 1 << 20)
    reader.add(chunks[0])
    with pytest.raises(KVPieceError, match="piece 0 lacks layer 1"):
        reader.pieces()


def test_range_minus_and_the_layers_a_piece_gives_away():
    assert range_minus((0, 30), None) == [(0, 30)]
    assert range_minus((0, 30), (10, 20)) == [(0, 10), (20, 30)]
    assert range_minus((12, 24), (0, 18)) == [(18, 24)]  # a stage moving from [0, 18) to [12, 24) gains these
    assert range_minus((0, 10), (0, 18)) == []
    assert range_minus((0, 10), (20, 30)) == [(0, 10)]
    given = piece([1, 2], 0, 18).outside(12, 24)
    assert [(p.start, p.end, len(p.layers)) for p in given] == [(0, 12, 12)]
