"""TLS for the gRPC plane: a certificate authority derived from the cluster secret.

Every member derives the same CA key pair from the secret (HKDF, see
:mod:`ringlet.daemon.wire.auth`), so members need to exchange nothing but the secret
file. Each process then makes a fresh leaf key pair and has it signed by the
CA; its server presents ``leaf + CA``, and its clients trust exactly that CA
(nothing from the system trust store). A client therefore talks only to a
server that holds the secret (server authentication), and all gRPC traffic is
encrypted with TLS 1.2+/1.3 and forward-secret ECDHE key exchange.

Clients do not present certificates: gRPC's Python API can only *require* and
verify client certificates at the handshake, and a failed handshake gives the
caller ``UNAVAILABLE`` with no log on the server side. Client authentication is
instead the per-call HMAC token (auth.py) checked by the server interceptor,
which answers ``UNAUTHENTICATED``, logs the reason, and binds each call to
its method, time and nonce.

The CA certificate is public (any TLS client that connects receives it); its
key is not, and cannot be computed without the secret. All members use the
same CA certificate, so an observer can tell that two nodes belong to the same
cluster (mDNS's cluster id tells as much).

Requires the ``cryptography`` package (imported on first use only, so a daemon
without a secret does not need it).
"""

from __future__ import annotations

import datetime
import hashlib
import threading
from dataclasses import dataclass

from ringlet.daemon.errors import RingletError
from ringlet.daemon.wire.auth import derive_key, fingerprint

#: Name in every leaf certificate (SAN) and the name clients check (gRPC ``ssl_target_name_override``).
TLS_SERVER_NAME = "ringlet.cluster"

# Fixed validity of the derived CA: the same on every node and long enough to
# never expire under a running cluster; leaves carry the same bounds (they live
# as long as their process; clocks far off would otherwise break TLS).
_NOT_BEFORE = datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC)
_NOT_AFTER = datetime.datetime(2200, 1, 1, tzinfo=datetime.UTC)
# Order of the NIST P-256 group.
_P256_N = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551


@dataclass(frozen=True)
class ClusterTLS:
    """PEM material of one process for one secret.

    Attributes:
        ca_pem: the cluster CA certificate (clients' only trust root).
        key_pem: this process's leaf private key (PKCS#8).
        chain_pem: this process's leaf certificate followed by the CA certificate.
        ca_fingerprint: SHA-256 of the CA public key (hex), equal on every member.
    """

    ca_pem: bytes
    key_pem: bytes
    chain_pem: bytes
    ca_fingerprint: str


_cache: dict[bytes, ClusterTLS] = {}
_lock = threading.Lock()


def cluster_tls(secret: bytes) -> ClusterTLS:
    """The TLS material for ``secret`` (made once per process and secret).

    Raises:
        RingletError: the ``cryptography`` package is not installed.
    """
    key = hashlib.sha256(b"ringlet-tls-cache\0" + bytes(secret)).digest()
    with _lock:
        material = _cache.get(key)
        if material is None:
            material = _cache[key] = _make(bytes(secret))
        return material


def _make(secret: bytes) -> ClusterTLS:
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError:
        raise RingletError("a cluster secret needs the 'cryptography' package for TLS: "
                           "pip install cryptography") from None

    # 48 bytes reduced mod (n - 1), plus 1: a scalar in [1, n-1] with negligible bias.
    scalar = int.from_bytes(derive_key(secret, "tls-ca-key", 48), "big") % (_P256_N - 1) + 1
    ca_key = ec.derive_private_key(scalar, ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"ringlet cluster CA {fingerprint(secret)}")])
    no_usage = dict(digital_signature=False, content_commitment=False, key_encipherment=False,
                    data_encipherment=False, key_agreement=False, encipher_only=False, decipher_only=False)
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(int.from_bytes(derive_key(secret, "tls-ca-serial", 16), "big") >> 1 or 1)
        .not_valid_before(_NOT_BEFORE).not_valid_after(_NOT_AFTER)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(key_cert_sign=True, crl_sign=True, **no_usage), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    leaf_key = ec.generate_private_key(ec.SECP256R1())
    leaf_cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ringlet node")]))
        .issuer_name(ca_name).public_key(leaf_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_NOT_BEFORE).not_valid_after(_NOT_AFTER)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(TLS_SERVER_NAME)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(**{**no_usage, "digital_signature": True}, key_cert_sign=False,
                                     crl_sign=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                       critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    ca_pem = ca_cert.public_bytes(pem)
    spki = ca_key.public_key().public_bytes(serialization.Encoding.DER,
                                            serialization.PublicFormat.SubjectPublicKeyInfo)
    return ClusterTLS(
        ca_pem=ca_pem,
        key_pem=leaf_key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
        chain_pem=leaf_cert.public_bytes(pem) + ca_pem,
        ca_fingerprint=hashlib.sha256(spki).hexdigest(),
    )
