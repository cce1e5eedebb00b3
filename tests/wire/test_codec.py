"""Tensor codec: exact round trips and clear rejection of malformed messages."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from ringlet.daemon.wire import codec
from ringlet.daemon.wire.rpc import ringlet_pb2 as pb

DTYPES = [mx.bool_, mx.uint8, mx.uint16, mx.uint32, mx.uint64, mx.int8, mx.int16, mx.int32, mx.int64,
          mx.float16, mx.bfloat16, mx.float32, mx.complex64]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (7,), (1, 5, 64), (2, 3, 4, 5)])
def test_round_trip_is_bit_exact(dtype, shape):
    a = (mx.random.normal(shape) * 100).astype(dtype)
    msg = codec.encode(a)
    assert msg.dtype == codec.dtype_name(dtype)
    assert list(msg.shape) == list(shape)
    assert len(msg.data) == a.nbytes
    b = codec.decode(pb.Tensor.FromString(msg.SerializeToString()))
    assert b.dtype == dtype and b.shape == a.shape
    assert mx.array_equal(a, b, equal_nan=False).item()


def test_bfloat16_bits_travel_unchanged():
    # 1.0 in bfloat16 is 0x3F80; -2.0 is 0xC000 (IEEE 754 bfloat16 layout).
    msg = codec.encode(mx.array([1.0, -2.0], dtype=mx.bfloat16))
    assert np.frombuffer(msg.data, "<u2").tolist() == [0x3F80, 0xC000]


def test_wrong_byte_length_is_rejected():
    msg = codec.encode(mx.zeros((2, 3), dtype=mx.float32))
    msg.data = msg.data[:-1]
    with pytest.raises(codec.TensorDecodeError, match="needs 24"):
        codec.decode(msg)


def test_unknown_dtype_is_rejected():
    with pytest.raises(codec.TensorDecodeError, match="unknown tensor dtype"):
        codec.decode(pb.Tensor(dtype="float8", shape=[1], data=b"\0"))


def test_oversized_message_is_rejected_before_allocation():
    msg = pb.Tensor(dtype="float32", shape=[1 << 20, 1 << 20], data=b"")
    with pytest.raises(codec.TensorDecodeError, match="exceeds"):
        codec.decode(msg, max_bytes=1 << 20)


def test_negative_dimension_and_huge_rank_are_rejected():
    with pytest.raises(codec.TensorDecodeError, match="negative"):
        codec.decode(pb.Tensor(dtype="int8", shape=[-1], data=b""))
    with pytest.raises(codec.TensorDecodeError, match="rank"):
        codec.decode(pb.Tensor(dtype="int8", shape=[1] * 9, data=b"\0"))


def test_non_finite_hidden_states_are_rejected_when_required():
    msg = codec.encode(mx.array([1.0, float("nan")]))
    assert codec.decode(msg).shape == (2,)
    with pytest.raises(codec.TensorDecodeError, match="NaN"):
        codec.decode(msg, require_finite=True)
