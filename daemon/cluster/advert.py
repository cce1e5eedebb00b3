"""The mDNS advert codec: the TXT record of a ringlet service instance, its signature, its errors.

Service type ``_ringlet._tcp.local.`` (:data:`SERVICE_TYPE`); one service
instance per daemon, named ``<node_id>-<incarnation>._ringlet._tcp.local.``
(:attr:`Advert.instance_name`). Registering and browsing are
:class:`~ringlet.daemon.cluster.discovery.Discovery`'s.

The TXT record carries only what is needed to connect (issue 4, DESIGN.md):

====== ===================================================== =================
key    value                                                 example
====== ===================================================== =================
``v``  protocol version, decimal (:data:`PROTOCOL_VERSION`)   ``1``
``id`` node id (:data:`~ringlet.daemon.cluster.identity.NODE_ID_RE`)  ``3f9c0a17b2e45d68``
``in`` incarnation, 8 hex, random per process                 ``a1b2c3d4``
``st`` process start, unix milliseconds (decides clones)      ``1733000000123``
``g``  gRPC port, 1..65535 (also the SRV port)                ``50051``
``a``  HTTP API port, 1..65535                                ``8080``
``c``  cluster id (:func:`~ringlet.daemon.cluster.identity.cluster_id`) ``9e107d9d372bb682``
``ts`` with a secret only: signing time, unix seconds        ``1733000000``
``sig`` with a secret only: HMAC-SHA256, 64 hex chars         ...
====== ===================================================== =================

Addresses come from the A records of the service, not from TXT. Everything
else about a peer comes over gRPC.

Signatures (issue 7). With a cluster secret, ``sig`` is HMAC-SHA256 keyed with
``HMAC(secret, "ringlet/mdns-advert/v1")`` (a key of its own, so the RPC layer
can derive others from the same secret) over every TXT key/value except
``sig``, sorted by key, each length-prefixed (see :func:`canonical_txt`). A
receiver with the secret rejects an advert without a valid signature, or whose
``ts`` is more than :data:`SIGNATURE_WINDOW_S` away from its own clock; the
advertiser re-signs every :data:`~ringlet.daemon.cluster.advertiser.RESIGN_INTERVAL_S`
so that cached adverts stay fresh. This needs clocks within a few minutes of
each other (NTP). What the signature does not do: it does not cover the
addresses (A records), and an advert captured on the link can be replayed
within the window. Both only make a node try to connect somewhere; the
authenticated gRPC handshake decides membership, so the worst case is a wasted
connection attempt.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ringlet.daemon.cluster.identity import (
    INCARNATION_RE,
    NODE_ID_RE,
    PROTOCOL_VERSION,
    validate_node_id,
)

__all__ = [
    "MAX_TXT_BYTES",
    "MAX_TXT_KEYS",
    "MAX_TXT_KEY_BYTES",
    "MAX_TXT_VALUE_BYTES",
    "SERVICE_TYPE",
    "SIGNATURE_WINDOW_S",
    "Advert",
    "AdvertError",
    "BadSignature",
    "IncompatibleVersion",
    "OtherCluster",
    "OversizedAdvert",
    "StaleSignature",
    "canonical_txt",
    "check_port",
    "check_secret",
    "encode_txt",
    "parse_txt",
]

#: The DNS-SD service type of ringlet.
SERVICE_TYPE = "_ringlet._tcp.local."

#: Largest TXT record accepted, in wire bytes (each entry: 1 length byte +
#: ``key=value``). RFC 6763 section 6.2: a TXT record SHOULD fit, with the
#: rest of the reply, in one 1500-byte Ethernet packet, "about 1300 bytes".
#: Ours is about 110 bytes, or 190 signed.
MAX_TXT_BYTES = 1300
#: Largest TXT value accepted, in bytes (the longest we send is ``sig``, 64).
MAX_TXT_VALUE_BYTES = 64
#: Longest TXT key accepted: RFC 6763 section 6.4 says keys SHOULD be at most 9 chars.
MAX_TXT_KEY_BYTES = 9
#: Most TXT entries accepted (we send 7, or 9 signed).
MAX_TXT_KEYS = 16
#: A signed advert's ``ts`` may differ from the receiver's clock by at most this, seconds.
SIGNATURE_WINDOW_S = 300

_SIG_CONTEXT = b"ringlet/mdns-advert/v1"
_CANON_PREFIX = b"ringlet-advert-v1\0"

_RE_UINT = re.compile(rb"0|[1-9][0-9]{0,14}")
_RE_PORT = re.compile(rb"[1-9][0-9]{0,4}")
_RE_HEX16 = re.compile(rb"[0-9a-f]{16}")
_RE_HEX64 = re.compile(rb"[0-9a-f]{64}")
_RE_NODE_ID = re.compile(NODE_ID_RE.pattern.encode())
_RE_INCARNATION = re.compile(INCARNATION_RE.pattern.encode())


# --------------------------------------------------------------------------- errors


class AdvertError(ValueError):
    """An mDNS advert was rejected. ``reason`` is a short stable code for logs and metrics."""

    reason = "malformed"


class OversizedAdvert(AdvertError):
    """The TXT record exceeds :data:`MAX_TXT_BYTES`, :data:`MAX_TXT_KEYS` or a per-entry limit."""

    reason = "oversized"


class IncompatibleVersion(AdvertError):
    """The peer speaks another protocol version; ``peer_version`` holds it (int), and
    ``node_id`` and ``cluster_id`` the advert's when valid (else ``""``): the node is
    not accepted, but the handshake that keeps it out with the reason may be dialled
    (:mod:`ringlet.daemon.cluster.incompatible`)."""

    reason = "incompatible_version"

    def __init__(self, message: str, peer_version: int, node_id: str = "", cluster_id: str = "") -> None:
        super().__init__(message)
        self.peer_version = peer_version
        self.node_id = node_id
        self.cluster_id = cluster_id


class OtherCluster(AdvertError):
    """The advert belongs to another cluster (its cluster id differs)."""

    reason = "other_cluster"


class BadSignature(AdvertError):
    """With a secret: the signature is missing, malformed or does not verify."""

    reason = "bad_signature"


class StaleSignature(BadSignature):
    """With a secret: the signature verifies but ``ts`` is outside :data:`SIGNATURE_WINDOW_S`."""

    reason = "stale_signature"


# --------------------------------------------------------------------------- advert


@dataclass(frozen=True)
class Advert:
    """What one node advertises: enough to open a gRPC connection to it.

    Attributes:
        node_id: the node's id.
        protocol_version: its protocol version.
        grpc_port: its gRPC port (1..65535).
        api_port: its OpenAI-compatible HTTP API port (1..65535).
        cluster_id: hash of its cluster name (:func:`~ringlet.daemon.cluster.identity.cluster_id`).
        incarnation: 8 hex chars, random per process start.
        started_at_ms: when its process started, unix milliseconds.
        addresses: its IPv4 addresses from the service's A records, sorted
            numerically (empty in an advert built for :func:`encode_txt`).
        signed_at: unix seconds of the verified signature, when a secret was used.
        signature: the verified signature (hex), when a secret was used.
    """

    node_id: str
    protocol_version: int
    grpc_port: int
    api_port: int
    cluster_id: str
    incarnation: str
    started_at_ms: int
    addresses: tuple[str, ...] = ()
    signed_at: int | None = None
    signature: str | None = None

    @property
    def instance_name(self) -> str:
        """The mDNS service instance name: ``<node_id>-<incarnation>._ringlet._tcp.local.``."""
        return f"{self.node_id}-{self.incarnation}.{SERVICE_TYPE}"

    def same_endpoint(self, other: Advert) -> bool:
        """True if ``other`` describes the same process reachable the same way (ignores signing)."""
        return dataclasses.replace(self, signed_at=None, signature=None) == dataclasses.replace(
            other, signed_at=None, signature=None
        )


def _advert_key(secret: bytes) -> bytes:
    return hmac.new(secret, _SIG_CONTEXT, hashlib.sha256).digest()


def check_secret(secret: object) -> None:
    if secret is not None and (not isinstance(secret, bytes | bytearray) or not secret):
        raise ValueError("secret must be non-empty bytes or None")


def canonical_txt(txt: Mapping[bytes, bytes]) -> bytes:
    """Return the bytes that ``sig`` signs: every entry but ``sig``, sorted by key.

    Layout: ``b"ringlet-advert-v1\\0"`` then, per entry, 1 byte key length,
    key, 2 bytes big-endian value length, value. Length prefixes make the
    encoding unambiguous whatever bytes the values hold. Keys must be at most
    255 bytes and values at most 65535 (callers enforce far smaller caps).
    """
    parts = [_CANON_PREFIX]
    for key in sorted(k for k in txt if k != b"sig"):
        value = txt[key]
        parts.append(len(key).to_bytes(1, "big") + key + len(value).to_bytes(2, "big") + value)
    return b"".join(parts)


def _sign(secret: bytes, txt: Mapping[bytes, bytes]) -> str:
    return hmac.new(_advert_key(bytes(secret)), canonical_txt(txt), hashlib.sha256).hexdigest()


def check_port(name: str, port: object) -> int:
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        raise ValueError(f"{name} must be an int in 1..65535, got {port!r}")
    return port


def encode_txt(advert: Advert, secret: bytes | None, *, now: float | None = None) -> dict[bytes, bytes]:
    """Return the TXT properties for ``advert`` (its ``addresses`` and signature fields are not used).

    With ``secret``, adds ``ts`` (``now``, default ``time.time()``, unix
    seconds) and ``sig``. Raises ``ValueError`` if a field is out of range.
    """
    check_secret(secret)
    validate_node_id(advert.node_id)
    if not INCARNATION_RE.fullmatch(advert.incarnation):
        raise ValueError(f"invalid incarnation {advert.incarnation!r}")
    if not _RE_HEX16.fullmatch(advert.cluster_id.encode()):
        raise ValueError(f"invalid cluster id {advert.cluster_id!r}: want 16 lowercase hex chars")
    for name, value in (
        ("protocol_version", advert.protocol_version),
        ("started_at_ms", advert.started_at_ms),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 10**15:
            raise ValueError(f"{name} must be an int in 0..10**15-1, got {value!r}")
    txt = {
        b"v": str(advert.protocol_version).encode(),
        b"id": advert.node_id.encode(),
        b"in": advert.incarnation.encode(),
        b"st": str(advert.started_at_ms).encode(),
        b"g": str(check_port("grpc_port", advert.grpc_port)).encode(),
        b"a": str(check_port("api_port", advert.api_port)).encode(),
        b"c": advert.cluster_id.encode(),
    }
    if secret is not None:
        txt[b"ts"] = str(int(time.time() if now is None else now)).encode()
        txt[b"sig"] = _sign(bytes(secret), txt).encode()
    return txt


def _field(txt: Mapping[bytes, bytes], key: bytes, pattern: re.Pattern[bytes], what: str) -> bytes:
    value = txt.get(key)
    if value is None:
        raise AdvertError(f"missing TXT field {key.decode()!r} ({what})")
    if not pattern.fullmatch(value):
        raise AdvertError(f"TXT field {key.decode()!r} is not {what}: {value[:MAX_TXT_VALUE_BYTES]!r}")
    return value


def _port(txt: Mapping[bytes, bytes], key: bytes, what: str) -> int:
    port = int(_field(txt, key, _RE_PORT, f"a {what} in 1..65535"))
    if port > 65535:
        raise AdvertError(f"TXT field {key.decode()!r}: {what} {port} is not in 1..65535")
    return port


def parse_txt(
    properties: Mapping[bytes, bytes | None],
    *,
    secret: bytes | None,
    cluster_id: str | None = None,
    addresses: Sequence[str] = (),
    now: float | None = None,
    txt_bytes: int | None = None,
) -> Advert:
    """Validate TXT properties (as ``ServiceInfo.properties`` gives them) and return the :class:`Advert`.

    Args:
        properties: key bytes to value bytes (``None`` for a key without ``=``).
        secret: the cluster secret; when set, a valid ``sig`` over a ``ts``
            within :data:`SIGNATURE_WINDOW_S` of ``now`` is required.
        cluster_id: when set, adverts of another cluster id are rejected.
        addresses: IPv4 addresses to put in the advert (from the A records).
        now: unix seconds for the signature window (default ``time.time()``).
        txt_bytes: wire size of the whole TXT record (``len(ServiceInfo.text)``),
            checked against :data:`MAX_TXT_BYTES`. The per-entry caps bound a
            parsed mapping to 1200 bytes, but the raw record may hold more
            (repeated keys, which the mapping collapses).

    Checks, in order: shape and size (:class:`OversizedAdvert`), protocol
    version (:class:`IncompatibleVersion`, before the other fields, whose
    format a future version may change), every field's format (ports must be
    decimal 1..65535, no sign, no leading zero), cluster (:class:`OtherCluster`),
    then signature (:class:`BadSignature`, :class:`StaleSignature`). Unknown
    keys are allowed (they count toward the size caps and are signed).

    Raises:
        AdvertError: on any problem, never another exception, whatever the input.
    """
    if secret is not None and (not isinstance(secret, bytes | bytearray) or not secret):
        raise AdvertError("bad secret argument: want non-empty bytes or None")
    if txt_bytes is not None and (not isinstance(txt_bytes, int) or txt_bytes > MAX_TXT_BYTES):
        raise OversizedAdvert(f"TXT record is {txt_bytes} bytes, more than {MAX_TXT_BYTES}")
    if not isinstance(properties, Mapping):
        raise AdvertError(f"TXT properties must be a mapping, got {type(properties).__name__}")
    try:
        n_keys = len(properties)
        items = list(properties.items()) if n_keys <= MAX_TXT_KEYS else []
    except Exception as e:  # a hostile Mapping implementation
        raise AdvertError(f"unreadable TXT properties: {type(e).__name__}") from None
    if n_keys > MAX_TXT_KEYS:
        raise OversizedAdvert(f"TXT has {n_keys} entries, more than {MAX_TXT_KEYS}")
    txt: dict[bytes, bytes] = {}
    size = 0
    for key, value in items:
        if not isinstance(key, bytes) or not 1 <= len(key) <= MAX_TXT_KEY_BYTES or b"=" in key:
            shown = key[:16] if isinstance(key, bytes | str) else type(key).__name__
            if isinstance(key, bytes) and len(key) > MAX_TXT_KEY_BYTES:
                raise OversizedAdvert(f"TXT key {shown!r}... longer than {MAX_TXT_KEY_BYTES} bytes")
            raise AdvertError(f"bad TXT key {shown!r}")
        if value is None:
            raise AdvertError(f"TXT key {key!r} has no value")
        if not isinstance(value, bytes):
            raise AdvertError(f"TXT value of {key!r} is {type(value).__name__}, not bytes")
        if len(value) > MAX_TXT_VALUE_BYTES:
            raise OversizedAdvert(f"TXT value of {key!r} is {len(value)} bytes, more than {MAX_TXT_VALUE_BYTES}")
        size += 2 + len(key) + len(value)
        txt[key] = value
    if size > MAX_TXT_BYTES:
        raise OversizedAdvert(f"TXT is {size} bytes, more than {MAX_TXT_BYTES}")

    version = int(_field(txt, b"v", _RE_UINT, "a decimal protocol version"))
    if version != PROTOCOL_VERSION:
        raw_id, raw_cluster = txt.get(b"id") or b"", txt.get(b"c") or b""
        raise IncompatibleVersion(
            f"incompatible protocol version {version} (this node speaks {PROTOCOL_VERSION})", version,
            raw_id.decode() if _RE_NODE_ID.fullmatch(raw_id) else "",
            raw_cluster.decode() if _RE_HEX16.fullmatch(raw_cluster) else "",
        )
    node_id = _field(txt, b"id", _RE_NODE_ID, "a node id").decode()
    incarnation = _field(txt, b"in", _RE_INCARNATION, "an incarnation (8 hex chars)").decode()
    started_at_ms = int(_field(txt, b"st", _RE_UINT, "a start time in unix ms"))
    grpc_port = _port(txt, b"g", "gRPC port")
    api_port = _port(txt, b"a", "API port")
    peer_cluster = _field(txt, b"c", _RE_HEX16, "a cluster id (16 hex chars)").decode()
    if cluster_id is not None and not hmac.compare_digest(peer_cluster, cluster_id):
        raise OtherCluster(f"other cluster id {peer_cluster} (ours {cluster_id})")

    signed_at: int | None = None
    signature: str | None = None
    if secret is not None:
        sig = txt.get(b"sig")
        ts = txt.get(b"ts")
        if sig is None or ts is None:
            raise BadSignature("unsigned advert, but this node has a cluster secret")
        if not _RE_HEX64.fullmatch(sig) or not _RE_UINT.fullmatch(ts):
            raise BadSignature("malformed signature or timestamp")
        if not hmac.compare_digest(_sign(bytes(secret), txt).encode(), sig):
            raise BadSignature("signature does not verify (wrong secret or altered advert)")
        signed_at = int(ts)
        clock = time.time() if now is None else now
        skew = clock - signed_at
        if abs(skew) > SIGNATURE_WINDOW_S:
            direction = "old" if skew > 0 else "in the future"
            raise StaleSignature(
                f"signature timestamp is {abs(skew):.0f} s {direction} (window {SIGNATURE_WINDOW_S} s)"
            )
        signature = sig.decode()

    return Advert(
        node_id=node_id,
        protocol_version=version,
        grpc_port=grpc_port,
        api_port=api_port,
        cluster_id=peer_cluster,
        incarnation=incarnation,
        started_at_ms=started_at_ms,
        addresses=tuple(addresses),
        signed_at=signed_at,
        signature=signature,
    )
