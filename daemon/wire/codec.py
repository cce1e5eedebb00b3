"""Tensor codec: MLX arrays <-> ``ringlet.v1.Tensor`` messages (raw bytes, dtype, shape).

Hidden states travel between pipeline stages as row-major little-endian bytes plus
a dtype name and a shape. Nothing is pickled. ``decode`` trusts nothing: it checks
the dtype name, the shape (non-negative, bounded rank) and that the byte length is
exactly ``prod(shape) * itemsize`` before any memory is allocated.

bfloat16 has no NumPy dtype, so it travels through a same-width ``uint16`` view
(``mx.view``), which is a bit-exact reinterpretation.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from ringlet.daemon.wire.rpc import ringlet_pb2 as pb

#: Default cap on one tensor's payload: 256 MiB. A (1, 8192, 16384) float16 prefill
#: block of a large model is 256 MiB; larger prefills are chunked by the engine.
DEFAULT_MAX_TENSOR_BYTES = 256 * 1024 * 1024
MAX_RANK = 8
#: Largest dimension: MLX shapes are 32-bit signed integers.
MAX_DIM = 2**31 - 1

# name -> (mlx dtype, numpy dtype used on the wire)
_DTYPES: dict[str, tuple[mx.Dtype, np.dtype]] = {
    "bool": (mx.bool_, np.dtype(np.bool_)),
    "uint8": (mx.uint8, np.dtype("<u1")),
    "uint16": (mx.uint16, np.dtype("<u2")),
    "uint32": (mx.uint32, np.dtype("<u4")),
    "uint64": (mx.uint64, np.dtype("<u8")),
    "int8": (mx.int8, np.dtype("<i1")),
    "int16": (mx.int16, np.dtype("<i2")),
    "int32": (mx.int32, np.dtype("<i4")),
    "int64": (mx.int64, np.dtype("<i8")),
    "float16": (mx.float16, np.dtype("<f2")),
    "bfloat16": (mx.bfloat16, np.dtype("<u2")),  # bit pattern carried as uint16
    "float32": (mx.float32, np.dtype("<f4")),
    "float64": (mx.float64, np.dtype("<f8")),
    "complex64": (mx.complex64, np.dtype("<c8")),
}
_NAME_OF = {mx_dtype: name for name, (mx_dtype, _) in _DTYPES.items()}


class TensorDecodeError(ValueError):
    """A tensor message is malformed: unknown dtype, bad shape, wrong byte length,
    oversized payload, or non-finite values where finite ones are required."""


def dtype_name(dtype: mx.Dtype) -> str:
    """The wire name of an MLX dtype, e.g. ``mx.bfloat16`` -> ``"bfloat16"``.

    Raises:
        TensorDecodeError: the dtype has no wire name.
    """
    try:
        return _NAME_OF[dtype]
    except KeyError:
        raise TensorDecodeError(f"dtype {dtype} cannot be sent on the wire") from None


def encode(array: mx.array) -> pb.Tensor:
    """Encode an MLX array (any shape, a dtype listed in ``_DTYPES``) as a Tensor message.

    Evaluates the array. The payload is ``array.nbytes`` bytes.
    """
    name = dtype_name(array.dtype)
    wire_np = _DTYPES[name][1]
    if name == "bfloat16":
        array = array.view(mx.uint16)
    data = np.asarray(array, dtype=wire_np).tobytes(order="C")
    return pb.Tensor(dtype=name, shape=list(array.shape), data=data)


def check(message: pb.Tensor, *, max_bytes: int = DEFAULT_MAX_TENSOR_BYTES) -> tuple[mx.Dtype, np.dtype, tuple]:
    """Validate a Tensor message's framing without allocating: known dtype, rank <= 8,
    non-negative dims, payload == prod(shape) * itemsize <= ``max_bytes``, and the
    product of the non-zero dims within ``max_bytes`` too (a zero-size tensor of an
    absurd shape is refused rather than reshaped).

    Returns ``(mlx dtype, wire numpy dtype, shape)``.

    Raises:
        TensorDecodeError: naming the problem.
    """
    entry = _DTYPES.get(message.dtype)
    if entry is None:
        raise TensorDecodeError(f"unknown tensor dtype {message.dtype[:32]!r}")
    mx_dtype, wire_np = entry
    shape = tuple(int(d) for d in message.shape)
    if len(shape) > MAX_RANK:
        raise TensorDecodeError(f"tensor rank {len(shape)} exceeds {MAX_RANK}")
    if any(d < 0 for d in shape):
        raise TensorDecodeError(f"tensor shape {shape} has a negative dimension")
    if any(d > MAX_DIM for d in shape):  # e.g. (2**31, 0): zero bytes, but MLX cannot make it
        raise TensorDecodeError(f"tensor shape {shape} has a dimension above {MAX_DIM}")
    expected = math.prod(shape) * wire_np.itemsize
    if expected > max_bytes or len(message.data) > max_bytes:
        raise TensorDecodeError(
            f"tensor of {max(expected, len(message.data))} bytes exceeds the {max_bytes}-byte limit"
        )
    if math.prod(d for d in shape if d) * wire_np.itemsize > max_bytes:
        # e.g. (0, 3, 5174, 17232764, 17240788): zero bytes, but numpy cannot index that shape
        raise TensorDecodeError(f"tensor shape {shape} exceeds the {max_bytes}-byte limit in its non-zero "
                                "dimensions")
    if len(message.data) != expected:
        raise TensorDecodeError(
            f"tensor payload is {len(message.data)} bytes, but {message.dtype} x {list(shape)} "
            f"needs {expected}"
        )
    return mx_dtype, wire_np, shape


def decode(
    message: pb.Tensor,
    *,
    max_bytes: int = DEFAULT_MAX_TENSOR_BYTES,
    require_finite: bool = False,
) -> mx.array:
    """Decode a Tensor message into an MLX array.

    Args:
        message: the wire message.
        max_bytes: the largest payload accepted, in bytes.
        require_finite: reject NaN or infinite floating-point values (hidden states).

    Raises:
        TensorDecodeError: unknown dtype; rank > 8 or a negative dimension; payload
            length != prod(shape) * itemsize; payload larger than ``max_bytes``; or
            non-finite values when ``require_finite``.
    """
    mx_dtype, wire_np, shape = check(message, max_bytes=max_bytes)
    host = np.frombuffer(message.data, dtype=wire_np).reshape(shape)
    array = mx.array(host)
    if message.dtype == "bfloat16":
        array = array.view(mx.bfloat16)
    if require_finite and mx.issubdtype(mx_dtype, mx.inexact):
        if not bool(mx.all(mx.isfinite(array)).item()):
            raise TensorDecodeError("tensor holds NaN or infinite values")
    return array
