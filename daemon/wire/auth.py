"""The cluster secret and per-call RPC authentication (HMAC tokens with replay protection).

Secret file
    One line of printable ASCII, at least :data:`MIN_SECRET_CHARS` characters,
    no whitespace inside (surrounding whitespace and the line ending are
    ignored, so a CRLF copy works too). ``ringlet secret new`` writes 64 hex
    characters (256 random bits) with mode 0600. The secret *bytes* are the
    line's characters as they are: the same bytes on every node give the same
    keys, whatever tool wrote the file (``openssl rand -hex 32`` works).
    :func:`load_secret` refuses a file that group or others may read.

Keys
    Nothing is ever keyed with the secret directly except through a
    purpose-specific derivation, so the keys of the mDNS signatures, the RPC
    tokens and the TLS certificate authority are independent:

    ============================ ==============================================
    purpose                      key
    ============================ ==============================================
    mDNS advert signatures       ``HMAC-SHA256(secret, "ringlet/mdns-advert/v1")`` (advert.py)
    RPC tokens (this module)     ``HKDF-SHA256(secret, info="ringlet/rpc-token/v1")``
    TLS CA key (tls.py)          ``HKDF-SHA256(secret, info="ringlet/tls-ca-key/v1")``
    log fingerprint              ``HKDF-SHA256(secret, info="ringlet/fingerprint/v1")``, 4 bytes
    ============================ ==============================================

RPC token
    Every call carries the metadata entry ``x-ringlet-auth``::

        v1;<caller>;<unix ms>;<nonce: 32 hex>;<mac: 64 hex>

    with ``mac = HMAC-SHA256(K_rpc, "ringlet-rpc-v1\\0" method "\\0" caller "\\0"
    ms "\\0" nonce)``, ``method`` the full gRPC method (``/ringlet.v1.Ring/Hop``).
    The server (:class:`TokenVerifier`) accepts a token once: the MAC must
    verify for *this* method, the time must be within ``window_s`` of its own
    clock, and the nonce must not have been seen within the window (the
    replay cache keeps each nonce until its token has expired, so a replay is
    rejected either as a repeat or as stale). Tokens travel inside TLS
    (tls.py), which also protects the request bodies they do not cover.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import os
import re
import secrets
import stat
import threading
import time
from pathlib import Path

from ringlet.daemon.errors import RingletError

#: Fewest characters a secret may have (32 hex chars = 128 bits; ``secret new`` writes 64).
MIN_SECRET_CHARS = 32
#: Longest secret file accepted, bytes.
MAX_SECRET_FILE_BYTES = 4096
#: gRPC metadata key carrying the per-call token.
AUTH_METADATA_KEY = "x-ringlet-auth"
#: Default: a token is valid this many seconds either side of the server's clock.
DEFAULT_WINDOW_S = 60.0
#: Default size of the replay cache (nonces of valid tokens still inside the window).
DEFAULT_REPLAY_CACHE_SIZE = 100_000

_SECRET_RE = re.compile(r"[\x21-\x7e]+")
_CALLER_RE = re.compile(r"[A-Za-z0-9._:\[\]-]{0,64}")
_TOKEN_RE = re.compile(r"v1;([A-Za-z0-9._:\[\]-]{0,64});([0-9]{1,15});([0-9a-f]{32});([0-9a-f]{64})")
_METHOD_RE = re.compile(r"/[A-Za-z0-9_.]{1,200}/[A-Za-z0-9_]{1,200}")
_HKDF_SALT = b"ringlet/hkdf-salt/v1"


class SecretError(RingletError):
    """The secret file is missing, unreadable, too open, or not a valid secret."""


class AuthError(Exception):
    """A call failed authentication. ``reason`` is a short stable code for logs:
    ``missing``, ``malformed``, ``bad_mac``, ``stale``, ``replay``, ``cache_full``."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


# --------------------------------------------------------------------------- secret file


def new_secret() -> str:
    """A fresh secret: 64 lowercase hex characters (256 bits from :mod:`secrets`)."""
    return secrets.token_hex(32)


def check_secret_text(text: str) -> bytes:
    """Validate the contents of a secret file and return the secret bytes.

    Raises:
        SecretError: too short, too long, or not one word of printable ASCII.
    """
    word = text.strip()
    if not word:
        raise SecretError("the secret file is empty; make one with `ringlet secret new`")
    if not _SECRET_RE.fullmatch(word):
        raise SecretError("the secret must be one word of printable ASCII (no spaces or control characters)")
    if len(word) < MIN_SECRET_CHARS:
        raise SecretError(f"the secret has {len(word)} characters; at least {MIN_SECRET_CHARS} are needed "
                          "(make one with `ringlet secret new`)")
    return word.encode("ascii")


def _read_private_file(p: Path, limit: int, what: str) -> bytes:
    """Read at most ``limit + 1`` bytes of a file that only its owner may access (the
    caller rejects anything longer than ``limit``).

    Raises:
        SecretError: not a regular file, readable or writable by group or others
            (POSIX), or unreadable; ``what`` names the file's role in the message.
    """
    try:
        with open(p, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise SecretError(f"{p} is not a regular file")
            if os.name == "posix" and st.st_mode & 0o077:
                raise SecretError(f"{p} is accessible by group or others (mode {stat.S_IMODE(st.st_mode):04o}); "
                                  f"run: chmod 600 {p}")
            return f.read(limit + 1)
    except OSError as exc:
        raise SecretError(f"cannot read the {what} {p}: {exc.strerror or exc}") from None


def load_secret(path: str | os.PathLike[str]) -> bytes:
    """Read a secret file (see the module doc) and return the secret bytes.

    Raises:
        SecretError: the file is missing or unreadable, not a regular file, larger
            than :data:`MAX_SECRET_FILE_BYTES`, readable or writable by group or
            others (POSIX), or its content is not a valid secret. The message names
            the file and the fix; it never contains the secret.
    """
    p = Path(path)
    raw = _read_private_file(p, MAX_SECRET_FILE_BYTES, "secret file")
    if len(raw) > MAX_SECRET_FILE_BYTES:
        raise SecretError(f"{p} is larger than {MAX_SECRET_FILE_BYTES} bytes; it is not a ringlet secret")
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        raise SecretError(f"{p} holds non-ASCII bytes; it is not a ringlet secret") from None
    try:
        return check_secret_text(text)
    except SecretError as exc:
        raise SecretError(f"{p}: {exc}") from None


def write_secret(path: str | os.PathLike[str], *, force: bool = False) -> Path:
    """Write a new secret to ``path`` with mode 0600 (parent directories made 0700).

    The file is created exclusively; with ``force`` an existing file is replaced
    atomically (a 0600 temporary file renamed over it).

    Raises:
        SecretError: the file exists (without ``force``) or cannot be written.
    """
    p = Path(path)
    text = new_secret() + "\n"
    try:
        p.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        if not force:
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
            _write_fd(fd, text)
            return p
        tmp = p.with_name(f".{p.name}.{secrets.token_hex(4)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            _write_fd(fd, text)
            os.replace(tmp, p)
        finally:
            if tmp.exists():
                tmp.unlink()
        return p
    except FileExistsError:
        raise SecretError(f"{p} already exists; pass --force to replace it (every node then needs the new one)") \
            from None
    except OSError as exc:
        raise SecretError(f"cannot write {p}: {exc.strerror or exc}") from None


def _write_fd(fd: int, text: str) -> None:
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        os.write(fd, text.encode("ascii"))
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- key derivation


def hkdf_sha256(ikm: bytes, info: bytes, length: int = 32, salt: bytes = _HKDF_SALT) -> bytes:
    """HKDF-SHA256 (RFC 5869): extract with ``salt``, expand to ``length`` bytes for ``info``."""
    if not 0 < length <= 255 * 32:
        raise ValueError("HKDF length must be within 1..8160 bytes")
    prk = hmac.new(salt, ikm, hashlib.sha256).digest()
    out, block, counter = b"", b"", 1
    while len(out) < length:
        block = hmac.new(prk, block + info + bytes([counter]), hashlib.sha256).digest()
        out += block
        counter += 1
    return out[:length]


def derive_key(secret: bytes, purpose: str, length: int = 32) -> bytes:
    """The key for ``purpose`` (e.g. ``"rpc-token"``): ``HKDF(secret, info="ringlet/<purpose>/v1")``."""
    if not isinstance(secret, bytes | bytearray) or not secret:
        raise ValueError("secret must be non-empty bytes")
    return hkdf_sha256(bytes(secret), f"ringlet/{purpose}/v1".encode(), length)


def fingerprint(secret: bytes) -> str:
    """8 hex chars that identify a secret in logs (equal on nodes that share it; reveals nothing useful)."""
    return derive_key(secret, "fingerprint", 4).hex()


# --------------------------------------------------------------------------- tokens


def _mac(key: bytes, method: str, caller: str, ms: str, nonce: str) -> str:
    msg = b"\0".join((b"ringlet-rpc-v1", method.encode(), caller.encode(), ms.encode(), nonce.encode()))
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def caller_label(node_id: str) -> str:
    """``node_id`` reduced to the characters a token may carry (at most 64)."""
    return re.sub(r"[^A-Za-z0-9._:\[\]-]", "_", node_id)[:64]


class TokenSigner:
    """Makes the ``x-ringlet-auth`` token of one outgoing call.

    Args:
        secret: the cluster secret.
        caller: this node's id, carried (and MAC'ed) for the server's logs and
            per-peer limits.
    """

    def __init__(self, secret: bytes, caller: str = ""):
        self._key = derive_key(secret, "rpc-token")
        self.caller = caller_label(caller)

    def token(self, method: str, *, now: float | None = None, nonce: str | None = None) -> str:
        """The token for a call of ``method`` (``/package.Service/Method``) at ``now`` (unix s)."""
        ms = str(int((time.time() if now is None else now) * 1000))
        nonce = nonce or secrets.token_hex(16)
        return f"v1;{self.caller};{ms};{nonce};{_mac(self._key, method, self.caller, ms, nonce)}"


class ReplayCache:
    """Nonces of accepted tokens, each kept until its token expires. Thread-safe.

    Full (``max_entries`` live nonces) means new tokens are refused
    (``cache_full``), never that an old nonce is forgotten early: forgetting
    would let a replay through.
    """

    def __init__(self, max_entries: int = DEFAULT_REPLAY_CACHE_SIZE):
        self.max_entries = max_entries
        self._expiry: dict[str, float] = {}
        self._heap: list[tuple[float, str]] = []
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._expiry)

    def add(self, nonce: str, expires_at: float, now: float) -> bool:
        """Remember ``nonce`` until ``expires_at``. False if it is already known (a replay).

        Raises:
            AuthError: ``cache_full``.
        """
        with self._lock:
            while self._heap and self._heap[0][0] <= now:
                _, old = heapq.heappop(self._heap)
                if self._expiry.get(old, float("inf")) <= now:
                    del self._expiry[old]
            if nonce in self._expiry:
                return False
            if len(self._expiry) >= self.max_entries:
                raise AuthError("cache_full", f"{self.max_entries} tokens in the replay window")
            self._expiry[nonce] = expires_at
            heapq.heappush(self._heap, (expires_at, nonce))
            return True


class TokenVerifier:
    """Checks the tokens of incoming calls (server side).

    Args:
        secret: the cluster secret.
        window_s: a token's time may differ from this clock by at most this, seconds.
        cache_size: largest number of nonces remembered (see :class:`ReplayCache`).
    """

    def __init__(self, secret: bytes, window_s: float = DEFAULT_WINDOW_S,
                 cache_size: int = DEFAULT_REPLAY_CACHE_SIZE):
        if window_s <= 0:
            raise ValueError("window_s must be positive")
        self._key = derive_key(secret, "rpc-token")
        self.window_s = float(window_s)
        self.cache = ReplayCache(cache_size)

    def verify(self, method: str, token: str | bytes | None, *, now: float | None = None) -> str:
        """Accept ``token`` for a call of ``method`` and return the caller label.

        The checks run in this order: shape, MAC (constant time), time window,
        then the replay cache (a nonce is recorded only for a token that passed
        every other check, so junk cannot fill the cache).

        Raises:
            AuthError: with ``reason`` ``missing``, ``malformed``, ``bad_mac``,
                ``stale``, ``replay`` or ``cache_full``.
        """
        if token is None or token in ("", b""):
            raise AuthError("missing")
        if isinstance(token, bytes):
            try:
                token = token.decode("ascii")
            except UnicodeDecodeError:
                raise AuthError("malformed", "not ASCII") from None
        m = _TOKEN_RE.fullmatch(token) if isinstance(token, str) and len(token) <= 256 else None
        if m is None or not _METHOD_RE.fullmatch(method or ""):
            raise AuthError("malformed")
        caller, ms, nonce, mac = m.groups()
        if not hmac.compare_digest(_mac(self._key, method, caller, ms, nonce), mac):
            raise AuthError("bad_mac", "wrong secret, or a token made for another method")
        clock = time.time() if now is None else now
        skew = clock - int(ms) / 1000
        if abs(skew) > self.window_s:
            raise AuthError("stale", f"token time is {abs(skew):.1f} s {'old' if skew > 0 else 'ahead'} "
                                     f"(window {self.window_s:g} s; are the clocks in sync?)")
        if not self.cache.add(nonce, int(ms) / 1000 + self.window_s, clock):
            raise AuthError("replay", "this token was already used")
        return caller


# --------------------------------------------------------------------------- API keys

#: Fewest characters an API key may have.
MIN_API_KEY_CHARS = 16


def load_api_keys(path: str | os.PathLike[str]) -> tuple[bytes, ...]:
    """Read an API key file: one key per line (several keys allow rotation without
    downtime), blank lines and lines starting with ``#`` ignored. Each key is one
    word of printable ASCII of at least :data:`MIN_API_KEY_CHARS` characters. The
    file must not be accessible by group or others (POSIX).

    Returns the SHA-256 digests of the keys (the keys themselves are not kept).

    Raises:
        SecretError: unreadable, too open, no key, or a malformed key (the message
            gives the line number, never the key).
    """
    return tuple(hashlib.sha256(k.encode()).digest() for k in _read_api_keys(path))


#: Environment variable a client command reads its API key from (``ringlet chat``,
#: ``status``, ``dashboard``), when no ``--api-key-file`` is given.
API_KEY_ENV = "RINGLET_API_KEY"


def client_api_key(path: str | os.PathLike[str] | None = None) -> str | None:
    """The key a client sends as ``Authorization: Bearer``: the first key of ``path``
    (an API key file, read as the daemon reads it), else ``$RINGLET_API_KEY``, else
    ``None`` (no header).

    Raises:
        SecretError: ``path`` is unreadable, too open, or holds no well-formed key.
    """
    if path:
        return _read_api_keys(path)[0]
    return os.environ.get(API_KEY_ENV, "").strip() or None


def _read_api_keys(path: str | os.PathLike[str]) -> list[str]:
    """The keys of an API key file (see :func:`load_api_keys`), in order."""
    p = Path(path)
    raw = _read_private_file(p, 1024 * 1024, "API key file")
    if len(raw) > 1024 * 1024:
        raise SecretError(f"{p} is larger than 1 MiB")
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        raise SecretError(f"{p} holds non-ASCII bytes") from None
    keys = []
    for n, line in enumerate(text.splitlines(), start=1):
        word = line.strip()
        if not word or word.startswith("#"):
            continue
        if not _SECRET_RE.fullmatch(word) or len(word) < MIN_API_KEY_CHARS:
            raise SecretError(f"{p} line {n}: an API key must be one word of at least {MIN_API_KEY_CHARS} "
                              "printable ASCII characters")
        keys.append(word)
    if not keys:
        raise SecretError(f"{p} holds no API key")
    return keys


def check_api_key(presented: str | None, digests: tuple[bytes, ...]) -> bool:
    """True if ``presented`` is one of the keys; compares every digest in constant time."""
    if presented is None:
        return False
    probe = hashlib.sha256(presented.encode("utf-8", "surrogateescape")).digest()
    ok = False
    for d in digests:
        ok |= hmac.compare_digest(probe, d)
    return ok
