"""Hypothesis fuzzing of the parsers that face the network, 1000 cases each where the issue asks:

* the tensor codec (``codec.check``/``codec.decode``) raises only ``TensorDecodeError``;
* the mDNS TXT record, as raw wire bytes through zeroconf's own TXT unpacking into
  ``advert.parse_txt``, raises only ``AdvertError``;
* the RPC token verifier raises only ``AuthError``; the secret file check only ``SecretError``.

The daemons themselves are fuzzed in test_security_cluster.py (hostile tensors on Hop,
schemathesis on the HTTP API), which then checks a greedy completion is still correct.
"""

from __future__ import annotations

import math
import time

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from zeroconf import ServiceInfo

from ringlet.daemon.cluster import advert as advert_codec
from ringlet.daemon.cluster.identity import PROTOCOL_VERSION, cluster_id
from ringlet.daemon.wire import auth, codec
from ringlet.daemon.wire.rpc import ringlet_pb2 as pb

FUZZ = settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck))
NAMES = sorted(codec._DTYPES)
INT64 = st.integers(-(2**63), 2**63 - 1)


@st.composite
def consistent_tensor(draw) -> pb.Tensor:
    """A well-formed message (right byte count), sometimes with non-finite floats."""
    name = draw(st.sampled_from(NAMES))
    shape = draw(st.lists(st.integers(0, 6), max_size=4))
    itemsize = codec._DTYPES[name][1].itemsize
    data = draw(st.binary(min_size=math.prod(shape) * itemsize, max_size=math.prod(shape) * itemsize))
    return pb.Tensor(dtype=name, shape=shape, data=data)


@st.composite
def mutated_tensor(draw) -> pb.Tensor:
    t = draw(consistent_tensor())
    which = draw(st.sampled_from(["dtype", "shape", "data", "all"]))
    if which in ("dtype", "all"):
        t.dtype = draw(st.one_of(st.text(max_size=12), st.sampled_from(NAMES + ["float8", "FLOAT32", "bfloat16 "])))
    if which in ("shape", "all"):
        t.ClearField("shape")
        t.shape.extend(draw(st.lists(st.one_of(INT64, st.integers(-2, 8)), max_size=12)))
    if which in ("data", "all"):
        t.data = draw(st.binary(max_size=512))
    return t


TENSORS = st.one_of(consistent_tensor(), mutated_tensor())


@FUZZ
@given(msg=TENSORS, max_bytes=st.one_of(st.integers(0, 4096), st.just(codec.DEFAULT_MAX_TENSOR_BYTES)),
       finite=st.booleans())
def test_codec_raises_only_tensor_decode_error(msg, max_bytes, finite):
    wire = pb.Tensor.FromString(msg.SerializeToString())  # what gRPC hands the node
    try:
        codec.check(wire, max_bytes=max_bytes)
        array = codec.decode(wire, max_bytes=max_bytes, require_finite=finite)
    except codec.TensorDecodeError as exc:
        assert str(exc)
        return
    assert tuple(array.shape) == tuple(wire.shape)
    if wire.dtype == "float64":
        return  # MLX makes float64 input float32 (mx.array); no stage sends float64
    assert array.nbytes == len(wire.data) <= max_bytes
    if finite and mx.issubdtype(array.dtype, mx.inexact):
        assert bool(mx.all(mx.isfinite(array)).item())
    # and it round-trips bit for bit
    again = codec.encode(array)
    assert again.dtype == wire.dtype and again.data == wire.data


def test_codec_rejects_non_finite_hidden_states_of_every_float_dtype():
    for name in ("float16", "bfloat16", "float32", "float64", "complex64"):
        np_dtype = codec._DTYPES[name][1]
        if name == "bfloat16":
            raw = np.array([0x7FC0], dtype="<u2").tobytes()  # a bfloat16 NaN
        else:
            raw = np.array([np.nan], dtype=np_dtype).tobytes()
        try:
            codec.decode(pb.Tensor(dtype=name, shape=[1], data=raw), require_finite=True)
        except codec.TensorDecodeError:
            continue
        raise AssertionError(f"NaN accepted as {name}")


# --------------------------------------------------------------------------- TXT records

SECRET = b"s" * 40
CID = cluster_id("fuzz")
NOW = 1_800_000_000.0
GOOD = advert_codec.Advert(node_id="n1", protocol_version=PROTOCOL_VERSION, grpc_port=7100, api_port=8000,
                        cluster_id=CID, incarnation="0a1b2c3d", started_at_ms=1_700_000_000_000)


def txt_wire(props: dict[bytes, bytes]) -> bytes:
    out = b""
    for k, v in props.items():
        item = k + b"=" + v
        out += bytes([len(item)]) + item
    return out


@st.composite
def txt_records(draw) -> bytes:
    kind = draw(st.sampled_from(["random", "entries", "mutated"]))
    if kind == "random":
        return draw(st.binary(max_size=1500))
    if kind == "entries":
        items = draw(st.lists(st.binary(max_size=80), max_size=24))
        return b"".join(bytes([min(len(i), 255)]) + i[:255] for i in items)
    wire = bytearray(txt_wire(advert_codec.encode_txt(GOOD, draw(st.sampled_from([None, SECRET])), now=NOW)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "cut", "insert"]))
        pos = draw(st.integers(0, max(0, len(wire) - 1)))
        if op == "flip" and wire:
            wire[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "cut":
            del wire[pos:pos + draw(st.integers(1, 8))]
        else:
            wire[pos:pos] = draw(st.binary(min_size=1, max_size=16))
    return bytes(wire)


@FUZZ
@given(raw=txt_records(), secret=st.sampled_from([None, SECRET]))
def test_txt_wire_bytes_raise_only_advert_error(raw, secret):
    # zeroconf's own unpacking of a received TXT record (bytes given as properties are the raw record)
    info = ServiceInfo(advert_codec.SERVICE_TYPE, f"n1-0a1b2c3d.{advert_codec.SERVICE_TYPE}", properties=raw)
    try:
        advert = advert_codec.parse_txt(info.properties, secret=secret, cluster_id=CID, now=NOW,
                                     txt_bytes=len(info.text or b""))
    except advert_codec.AdvertError as exc:
        assert exc.reason and str(exc)
        return
    assert 1 <= advert.grpc_port <= 65535 and advert.cluster_id == CID
    if secret is not None:
        assert advert.signature is not None


def test_the_txt_fuzzer_reaches_acceptance():
    """The mutation strategy starts from valid records: unmutated ones are accepted."""
    info = ServiceInfo(advert_codec.SERVICE_TYPE, f"n1-0a1b2c3d.{advert_codec.SERVICE_TYPE}",
                       properties=txt_wire(advert_codec.encode_txt(GOOD, SECRET, now=NOW)))
    assert advert_codec.parse_txt(info.properties, secret=SECRET, cluster_id=CID, now=NOW).node_id == "n1"


# --------------------------------------------------------------------------- tokens and secrets

VERIFIER = auth.TokenVerifier(SECRET, window_s=60)
SIGNER = auth.TokenSigner(SECRET, "n1")


@st.composite
def tokens(draw) -> str | bytes:
    good = SIGNER.token("/ringlet.v1.Ring/Echo", now=time.time())
    return draw(st.one_of(
        st.text(max_size=300), st.binary(max_size=300),
        st.builds(lambda i, c: good[:i] + c + good[i + 1:], st.integers(0, len(good) - 1),
                  st.characters(codec="ascii")),
        st.just(good),
    ))


@settings(max_examples=500, deadline=None)
@given(token=tokens(), method=st.one_of(st.just("/ringlet.v1.Ring/Echo"), st.text(max_size=60)))
def test_token_verifier_raises_only_auth_error(token, method):
    try:
        VERIFIER.verify(method, token)
    except auth.AuthError as exc:
        assert exc.reason in {"missing", "malformed", "bad_mac", "stale", "replay", "cache_full"}


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=200))
def test_secret_text_raises_only_secret_error(text):
    try:
        secret = auth.check_secret_text(text)
    except auth.SecretError:
        return
    assert len(secret) >= auth.MIN_SECRET_CHARS and secret == text.strip().encode()


def test_a_huge_top_k_does_not_break_sampling_for_later_requests():
    """Regression (found by schemathesis): mlx-lm's apply_top_k raised inside compiled code
    for top_k >= vocabulary, and every later sampler of the process failed."""
    from ringlet.daemon.engine.sampling import RequestSampler, SamplingParams

    logits = mx.random.normal((1000,))
    hostile = RequestSampler(SamplingParams(temperature=1.0, top_k=28_717_445, seed=1))
    assert 0 <= hostile(logits) < 1000
    later = RequestSampler(SamplingParams(temperature=1.0))  # an unseeded sampler draws from MLX's state
    assert 0 <= later(logits) < 1000


def test_a_zero_size_tensor_of_an_unindexable_shape_is_refused():
    """Hypothesis found it: a 0 dimension makes the payload 0 bytes, but numpy cannot
    reshape to the other dimensions' product (over 2**62 bytes)."""
    message = pb.Tensor(dtype="bfloat16", shape=[0, 3, 5174, 17232764, 17240788], data=b"")
    with pytest.raises(codec.TensorDecodeError, match="in its non-zero dimensions"):
        codec.decode(message)
