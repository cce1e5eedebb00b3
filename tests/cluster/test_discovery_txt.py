"""TXT encoding/parsing of adverts (hostile input included), --peers, interface selection. No network."""

from __future__ import annotations

import socket
from collections import namedtuple

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ringlet.daemon.cluster.addresses import interface_addresses
from ringlet.daemon.cluster.advert import (
    MAX_TXT_BYTES,
    SIGNATURE_WINDOW_S,
    Advert,
    AdvertError,
    BadSignature,
    IncompatibleVersion,
    OtherCluster,
    OversizedAdvert,
    StaleSignature,
    canonical_txt,
    encode_txt,
    parse_txt,
)
from ringlet.daemon.cluster.identity import PROTOCOL_VERSION, cluster_id
from ringlet.daemon.cluster.static_peers import parse_peers

CID = cluster_id("test-cluster")
SECRET = b"s3cret-s3cret-s3cret"
NOW = 1_733_000_000.0
ADVERT = Advert(
    node_id="3f9c0a17b2e45d68",
    protocol_version=PROTOCOL_VERSION,
    grpc_port=50051,
    api_port=8080,
    cluster_id=CID,
    incarnation="a1b2c3d4",
    started_at_ms=1_733_000_000_123,
)


def good_txt(secret: bytes | None = None, **overrides: bytes) -> dict[bytes, bytes]:
    txt = encode_txt(ADVERT, secret, now=NOW)
    for k, v in overrides.items():
        txt[k.encode()] = v
    return txt


def test_roundtrip_unsigned() -> None:
    txt = good_txt()
    assert txt == {
        b"v": b"1",
        b"id": b"3f9c0a17b2e45d68",
        b"in": b"a1b2c3d4",
        b"st": b"1733000000123",
        b"g": b"50051",
        b"a": b"8080",
        b"c": CID.encode(),
    }
    got = parse_txt(txt, secret=None, cluster_id=CID, addresses=["127.0.0.1"])
    assert got == Advert(**{**ADVERT.__dict__, "addresses": ("127.0.0.1",)})
    assert got.instance_name == "3f9c0a17b2e45d68-a1b2c3d4._ringlet._tcp.local."


def test_roundtrip_signed_and_size() -> None:
    txt = good_txt(SECRET)
    assert txt[b"ts"] == b"1733000000" and len(txt[b"sig"]) == 64
    got = parse_txt(txt, secret=SECRET, cluster_id=CID, now=NOW + 10)
    assert got.signed_at == 1_733_000_000 and got.signature == txt[b"sig"].decode()
    assert sum(2 + len(k) + len(v) for k, v in txt.items()) < 200  # only what is needed to connect


def test_signature_rejections() -> None:
    with pytest.raises(BadSignature, match="unsigned"):
        parse_txt(good_txt(), secret=SECRET, now=NOW)
    with pytest.raises(BadSignature, match="does not verify"):
        parse_txt(good_txt(b"wrong-secret"), secret=SECRET, now=NOW)
    tampered = good_txt(SECRET)
    tampered[b"g"] = b"50052"
    with pytest.raises(BadSignature, match="does not verify"):
        parse_txt(tampered, secret=SECRET, now=NOW)
    extra = good_txt(SECRET)
    extra[b"x"] = b"1"  # unknown keys are signed too
    with pytest.raises(BadSignature):
        parse_txt(extra, secret=SECRET, now=NOW)
    with pytest.raises(BadSignature, match="malformed"):
        parse_txt(good_txt(SECRET, sig=b"zz" * 32), secret=SECRET, now=NOW)
    with pytest.raises(StaleSignature, match="old"):
        parse_txt(good_txt(SECRET), secret=SECRET, now=NOW + SIGNATURE_WINDOW_S + 1)
    with pytest.raises(StaleSignature, match="future"):
        parse_txt(good_txt(SECRET), secret=SECRET, now=NOW - SIGNATURE_WINDOW_S - 1)
    # at the edge of the window it still verifies
    parse_txt(good_txt(SECRET), secret=SECRET, now=NOW + SIGNATURE_WINDOW_S)
    # a node without a secret accepts signed adverts (the RPC layer will refuse it anyway)
    assert parse_txt(good_txt(SECRET), secret=None).signed_at is None


def test_canonical_form_is_unambiguous() -> None:
    a = canonical_txt({b"a": b"1", b"b": b"2"})
    b = canonical_txt({b"a": b"1\x01b\x00\x012"})
    assert a != b
    assert canonical_txt({b"b": b"2", b"a": b"1", b"sig": b"x"}) == a


def test_wrong_version_is_a_distinct_error_checked_first() -> None:
    with pytest.raises(IncompatibleVersion, match="incompatible protocol version 2") as e:
        # other fields of a future version may look different: still "incompatible", not "malformed"
        parse_txt({b"v": b"2", b"id": b"NEW-FORMAT"}, secret=None)
    assert e.value.peer_version == 2 and e.value.reason == "incompatible_version"


def test_other_cluster() -> None:
    with pytest.raises(OtherCluster, match="other cluster"):
        parse_txt(good_txt(), secret=None, cluster_id=cluster_id("elsewhere"))


@pytest.mark.parametrize(
    ("txt", "match"),
    [
        ({b"v": b"1"}, "missing TXT field 'id'"),
        (good_txt(g=b"0"), "gRPC port"),
        (good_txt(g=b"65536"), "not in 1..65535"),
        (good_txt(g=b"99999"), "not in 1..65535"),
        (good_txt(a=b"-1"), "API port"),
        (good_txt(a=b"080"), "API port"),
        (good_txt(a=b"+80"), "API port"),
        (good_txt(a=b" 80"), "API port"),
        (good_txt(a=b"\xd9\xa3"), "API port"),  # arabic-indic digit: int() would accept it
        (good_txt(g=b"1_000"), "gRPC port"),
        (good_txt(v=b"one"), "protocol version"),
        (good_txt(v=b""), "protocol version"),
        (good_txt(id=b"UPPER"), "node id"),
        (good_txt(id=b"a.b"), "node id"),
        (good_txt(**{"in": b"xyz"}), "incarnation"),
        (good_txt(st=b"-5"), "start time"),
        (good_txt(c=b"nothex"), "cluster id"),
        ({**good_txt(), b"id": None}, "no value"),
        ({**good_txt(), "id": b"x"}, "bad TXT key"),
        ({**good_txt(), b"x": 5}, "not bytes"),
        ({**good_txt(), b"": b"x"}, "bad TXT key"),
        ([(b"v", b"1")], "mapping"),
        (None, "mapping"),
    ],
)
def test_malformed(txt: object, match: str) -> None:
    with pytest.raises(AdvertError, match=match) as e:
        parse_txt(txt, secret=None)  # type: ignore[arg-type]
    assert e.value.reason == "malformed"


@pytest.mark.parametrize(
    "txt",
    [
        {**good_txt(), **{f"k{i}".encode(): b"x" for i in range(20)}},  # too many keys
        {**good_txt(), b"k": b"x" * 65},  # one value too long
        {**good_txt(), b"verylongkey": b"x"},  # key over 9 bytes
    ],
)
def test_oversized(txt: dict[bytes, bytes]) -> None:
    with pytest.raises(OversizedAdvert):
        parse_txt(txt, secret=None)


def test_oversized_raw_record() -> None:
    # the raw record may be bigger than the mapping (repeated keys collapse into one)
    with pytest.raises(OversizedAdvert, match="1301 bytes"):
        parse_txt(good_txt(), secret=None, txt_bytes=MAX_TXT_BYTES + 1)
    parse_txt(good_txt(), secret=None, txt_bytes=MAX_TXT_BYTES)


def test_largest_acceptable_mapping() -> None:
    # 16 entries at the per-entry caps are still accepted (unknown keys are allowed)
    fill = {f"k{i}".encode(): b"x" * 64 for i in range(9)}
    assert parse_txt({**good_txt(), **fill}, secret=None).node_id == ADVERT.node_id


def test_encode_rejects_bad_adverts() -> None:
    for bad in (
        {"grpc_port": 0},
        {"api_port": 70000},
        {"node_id": "Bad"},
        {"incarnation": "x"},
        {"cluster_id": "short"},
        {"grpc_port": True},
    ):
        with pytest.raises(ValueError):
            encode_txt(Advert(**{**ADVERT.__dict__, **bad}), None)
    with pytest.raises(ValueError):
        encode_txt(ADVERT, b"")


# -- fuzzing: whatever the bytes, only AdvertError escapes ------------------------------------------

KEYS = st.sampled_from([b"v", b"id", b"in", b"st", b"g", b"a", b"c", b"ts", b"sig"])
VALUES = st.one_of(
    st.binary(max_size=80),
    st.none(),
    st.sampled_from([b"1", b"0", b"65535", b"65536", b"99999999999999999999", b"-1", b"\xff", b"1e3"]),
    st.text(max_size=20).map(str.encode),
)
ANY_TXT = st.one_of(
    st.dictionaries(st.one_of(KEYS, st.binary(max_size=12)), VALUES, max_size=20),
    st.dictionaries(st.one_of(st.text(max_size=5), st.integers()), st.one_of(VALUES, st.integers()), max_size=4),
    st.lists(st.binary(), max_size=3),
    st.none(),
    st.integers(),
)


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(txt=ANY_TXT, secret=st.one_of(st.none(), st.just(SECRET)))
def test_fuzz_parse_txt_raises_only_advert_error(txt: object, secret: bytes | None) -> None:
    try:
        advert = parse_txt(txt, secret=secret, cluster_id=CID, now=NOW)  # type: ignore[arg-type]
    except AdvertError as e:
        assert str(e) and e.reason
    else:
        assert 1 <= advert.grpc_port <= 65535 and 1 <= advert.api_port <= 65535


@settings(max_examples=300, deadline=None)
@given(key=KEYS, value=VALUES, drop=st.booleans(), signed=st.booleans())
def test_fuzz_mutated_valid_advert(key: bytes, value: bytes | None, drop: bool, signed: bool) -> None:
    secret = SECRET if signed else None
    txt: dict[bytes, bytes | None] = dict(good_txt(secret))
    if drop:
        txt.pop(key, None)
    else:
        txt[key] = value
    try:
        advert = parse_txt(txt, secret=secret, cluster_id=CID, now=NOW)
    except AdvertError:
        return
    # accepted only if nothing signed changed (or unsigned and still well-formed)
    if signed:
        assert advert == parse_txt(good_txt(secret), secret=secret, cluster_id=CID, now=NOW)


# -- --peers ---------------------------------------------------------------------------------------


def test_parse_peers_ok() -> None:
    assert parse_peers("") == []
    assert parse_peers("  ") == []
    assert parse_peers("10.0.0.2:50051, mac-studio.local:50052,[fe80::1%en0]:7,10.0.0.2:50051") == [
        ("10.0.0.2", 50051),
        ("mac-studio.local", 50052),
        ("fe80::1%en0", 7),
    ]


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("a:1,", "entry 2 is empty"),
        ("host", "missing ':port'"),
        (":50051", "missing host"),
        ("host:0", "not a number in 1..65535"),
        ("host:65536", "not a number in 1..65535"),
        ("host:abc", "not a number"),
        ("host:-1", "not a number"),
        ("host:", "not a number"),
        ("::1:50051", "need brackets"),
        ("[::1]50051", r"\[ipv6\]:port"),
        ("[nope]:1", "not an IPv6"),
        ("bad_host:1", "not a valid host"),
        ("-bad:1", "not a valid host"),
    ],
)
def test_parse_peers_errors(spec: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_peers(spec)


# -- interface selection (fake psutil data: nothing is bound or sent) ------------------------------

Addr = namedtuple("Addr", "family address netmask broadcast ptp")
Stats = namedtuple("Stats", "isup duplex speed mtu flags")
IF_ADDRS = {
    "lo": [Addr(socket.AF_INET, "127.0.0.1", None, None, None)],
    "en0": [
        Addr(socket.AF_INET, "192.0.2.10", None, None, None),
        Addr(socket.AF_INET6, "fe80::1", None, None, None),
    ],
    "bridge0": [Addr(socket.AF_INET, "169.254.3.4", None, None, None)],
    "down0": [Addr(socket.AF_INET, "198.51.100.1", None, None, None)],
    "nomcast": [Addr(socket.AF_INET, "198.51.100.2", None, None, None)],
}
IF_STATS = {
    "lo": Stats(True, 0, 0, 65536, "up,loopback,running"),
    "en0": Stats(True, 2, 1000, 1500, "up,broadcast,running,multicast"),
    "bridge0": Stats(True, 2, 0, 1500, "up,broadcast,running,multicast"),
    "down0": Stats(False, 2, 0, 1500, "broadcast,multicast"),
    "nomcast": Stats(True, 2, 0, 1500, "up,pointopoint,running"),
}


def test_interface_addresses_default_is_multicast_non_loopback_ipv4() -> None:
    got = interface_addresses(None, if_addrs=IF_ADDRS, if_stats=IF_STATS)
    assert got == ["192.0.2.10", "169.254.3.4"]


def test_interface_addresses_explicit() -> None:
    assert interface_addresses(["127.0.0.1"]) == ["127.0.0.1"]
    assert interface_addresses(["lo", "127.0.0.1", "en0", "missing"], if_addrs=IF_ADDRS) == [
        "127.0.0.1",
        "192.0.2.10",
    ]
    for bad in (["::1"], [""], [5]):
        with pytest.raises(ValueError):
            interface_addresses(bad)  # type: ignore[arg-type]
