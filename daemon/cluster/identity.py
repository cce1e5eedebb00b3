"""Node identity: a stable node id persisted in the data dir, and the cluster id.

A node id names one daemon for its whole life, across restarts, so that a
restart never leaves a ghost node behind (issue 4, "Identity"). It is created
on first start and stored in ``<data_dir>/node.json``::

    {"node_id": "3f9c0a17b2e45d68", "created_at": 1733000000.123, "history": [...]}

- ``node_id``: 16 lowercase hex chars (64 random bits from :mod:`secrets`).
- ``created_at``: unix seconds at which this id was created (kept for the
  operator; a cloned disk copies it, so it cannot tell a clone apart).
- ``history``: the ids this data dir had before, each with when and why it was
  replaced (see :meth:`NodeIdentity.regenerate`).

Besides the persisted fields, each process gets a fresh *incarnation*
(8 random hex chars) and its *start time*. They are advertised over mDNS and
decide which of two live nodes claiming the same id must yield; see
:func:`should_yield`.

The data dir is locked (``fcntl.flock`` on ``<data_dir>/node.lock``) while a
:class:`NodeIdentity` is open, so two daemons can never share one data dir and
thereby one id: every daemon on a machine needs its own ``--data-dir``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import secrets
import tempfile
import time
from pathlib import Path
from typing import Any

from ringlet.daemon.paths import default_data_dir
from ringlet.daemon.wire import versions

log = logging.getLogger(__name__)

#: The wire protocol version (one figure for the whole wire: :mod:`ringlet.daemon.wire.versions`).
#: Peers advertising another version are kept out with a reason.
PROTOCOL_VERSION: int = versions.PROTOCOL_VERSION

#: Name of the identity file inside the data dir.
NODE_FILE = "node.json"
#: Name of the lock file inside the data dir.
LOCK_FILE = "node.lock"

#: What a node id may look like. Ids made here are 16 lowercase hex chars; the
#: wider pattern lets tests and tools use readable ids. It keeps ids safe in a
#: DNS label (the mDNS instance name is ``<node_id>-<incarnation>``, at most
#: 41 of the 63 bytes a label may hold), in file names and in logs.
NODE_ID_RE = re.compile(r"[0-9a-z][0-9a-z_-]{0,31}")
#: What an incarnation looks like: 8 lowercase hex chars.
INCARNATION_RE = re.compile(r"[0-9a-f]{8}")
#: Length of a cluster id (hex chars of a SHA-256 digest).
CLUSTER_ID_LEN = 16

_MAX_HISTORY = 20


class IdentityError(RuntimeError):
    """The identity could not be loaded or stored (I/O, permissions, lock)."""


class DataDirLocked(IdentityError):
    """Another live process holds this data dir (and so this node id)."""


def new_node_id() -> str:
    """Return a fresh node id: 16 lowercase hex chars, 64 bits from :mod:`secrets`."""
    return secrets.token_hex(8)


def new_incarnation() -> str:
    """Return a fresh per-process incarnation: 8 lowercase hex chars."""
    return secrets.token_hex(4)


def validate_node_id(node_id: object) -> str:
    """Return ``node_id`` if it matches :data:`NODE_ID_RE`, else raise ``ValueError``."""
    if not isinstance(node_id, str) or not NODE_ID_RE.fullmatch(node_id):
        raise ValueError(f"invalid node id {node_id!r}: want 1-32 chars of [0-9a-z_-], starting alnum")
    return node_id


def cluster_id(cluster_name: str) -> str:
    """Return the cluster id of ``cluster_name``: SHA-256 hex, first 16 chars.

    The name is hashed with a ``ringlet-cluster\\0`` prefix (domain separation)
    so that the id carried in mDNS adverts does not reveal the name directly.
    It is not a secret: a guessable name can be found by hashing guesses; use a
    cluster secret to keep strangers out. Raises ``ValueError`` on an empty or
    non-string name.
    """
    if not isinstance(cluster_name, str) or not cluster_name:
        raise ValueError("cluster name must be a non-empty string")
    digest = hashlib.sha256(b"ringlet-cluster\0" + cluster_name.encode("utf-8")).hexdigest()
    return digest[:CLUSTER_ID_LEN]


def should_yield(
    own_started_at_ms: int, own_incarnation: str, other_started_at_ms: int, other_incarnation: str
) -> bool:
    """Decide which of two live nodes with the same node id takes a fresh id.

    The rule: the *newer* node yields, where newer means the process that
    started later (larger ``started_at_ms``, unix milliseconds, as advertised);
    on equal start times the larger incarnation string yields. Both nodes see
    both pairs in each other's adverts, so they reach opposite answers and
    exactly one yields, whatever the clock skew between them.

    Why start time and not ``created_at``: a cloned disk or VM image copies
    ``node.json`` including ``created_at``, so the two are equal; the clone is
    normally the one booted while the original was already running. If the
    original restarts while its clone runs, the original is the newer one and
    yields instead: ids are labels, either outcome removes the duplicate.

    Returns True when the *own* node must regenerate its id. Raises
    ``ValueError`` when both pairs are identical (that is the same process).
    """
    own = (int(own_started_at_ms), own_incarnation)
    other = (int(other_started_at_ms), other_incarnation)
    if own == other:
        raise ValueError("same start time and incarnation: this is the node itself, not a clone")
    return own > other


def _write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically with mode 0600 (temp file, fsync, rename, fsync dir)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o600)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class NodeIdentity:
    """The identity of this daemon: persisted node id plus per-process incarnation.

    Use :meth:`load_or_create`; call :meth:`close` (or use it as a context
    manager) at shutdown to release the data-dir lock.

    Attributes:
        node_id: the persisted node id (see :data:`NODE_ID_RE`).
        created_at: unix seconds when ``node_id`` was created.
        data_dir: the data dir holding ``node.json``.
        started_at: unix seconds when this process loaded the identity.
        incarnation: 8 hex chars, random per process.
        history: earlier ids of this data dir, oldest first, each a dict
            ``{"node_id", "created_at", "replaced_at", "reason"}``.
    """

    def __init__(
        self,
        node_id: str,
        created_at: float,
        data_dir: Path,
        *,
        started_at: float,
        incarnation: str,
        history: list[dict[str, Any]] | None = None,
        lock_fd: int | None = None,
    ) -> None:
        self.node_id = validate_node_id(node_id)
        self.created_at = float(created_at)
        self.data_dir = Path(data_dir)
        self.started_at = float(started_at)
        if not INCARNATION_RE.fullmatch(incarnation):
            raise ValueError(f"invalid incarnation {incarnation!r}: want 8 lowercase hex chars")
        self.incarnation = incarnation
        self.history = list(history or [])
        self._lock_fd = lock_fd

    # -- loading -----------------------------------------------------------------

    @classmethod
    def load_or_create(
        cls, data_dir: str | os.PathLike[str] | None = None, *, lock: bool = True, now: float | None = None
    ) -> NodeIdentity:
        """Load ``<data_dir>/node.json``, creating it (and the dir, mode 0700) on first start.

        Args:
            data_dir: the data dir; ``None`` means :func:`default_data_dir`.
            lock: hold an exclusive lock on the data dir until :meth:`close`
                (the daemon wants this; a reader such as ``ringlet status``
                passes False).
            now: unix seconds to use as start time (tests); default ``time.time()``.

        A ``node.json`` that cannot be parsed or holds an invalid id is moved
        aside to ``node.json.corrupt-<unix seconds>`` and a fresh identity is
        created, with a warning: a node that cannot start is worse than one
        ghost entry that heartbeats remove within seconds.

        Raises:
            DataDirLocked: another live process holds the data dir.
            IdentityError: the dir or file cannot be created or read.
        """
        directory = Path(data_dir) if data_dir is not None else default_data_dir()
        started = time.time() if now is None else float(now)
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            raise IdentityError(f"cannot create data dir {directory}: {e}") from e
        lock_fd = cls._acquire_lock(directory) if lock else None
        try:
            ident = cls._load(directory, started, lock_fd)
        except BaseException:
            if lock_fd is not None:
                os.close(lock_fd)
            raise
        return ident

    @staticmethod
    def _acquire_lock(directory: Path) -> int:
        path = directory / LOCK_FILE
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            raise IdentityError(f"cannot open lock file {path}: {e}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            raise DataDirLocked(
                f"data dir {directory} is in use by another ringlet process; "
                "give each daemon on this machine its own --data-dir"
            ) from e
        return fd

    @classmethod
    def _load(cls, directory: Path, started: float, lock_fd: int | None) -> NodeIdentity:
        path = directory / NODE_FILE
        incarnation = new_incarnation()
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raw = None
        except OSError as e:
            raise IdentityError(f"cannot read {path}: {e}") from e
        if raw is not None:
            try:
                doc = json.loads(raw)
                if not isinstance(doc, dict):
                    raise ValueError("not a JSON object")
                node_id = validate_node_id(doc.get("node_id"))
                created_at = doc.get("created_at")
                if not isinstance(created_at, int | float) or isinstance(created_at, bool):
                    raise ValueError("created_at is not a number")
                history = doc.get("history", [])
                if not isinstance(history, list):
                    raise ValueError("history is not a list")
            except ValueError as e:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
                aside = path.with_name(f"{NODE_FILE}.corrupt-{int(started)}")
                log.warning("%s is unusable (%s); moved it to %s and creating a fresh node id", path, e, aside)
                with contextlib.suppress(OSError):
                    os.replace(path, aside)
            else:
                return cls(
                    node_id,
                    created_at,
                    directory,
                    started_at=started,
                    incarnation=incarnation,
                    history=history,
                    lock_fd=lock_fd,
                )
        ident = cls(new_node_id(), started, directory, started_at=started, incarnation=incarnation, lock_fd=lock_fd)
        ident.save()
        log.info("created node id %s in %s", ident.node_id, path)
        return ident

    # -- state -------------------------------------------------------------------

    @property
    def path(self) -> Path:
        """Path of ``node.json``."""
        return self.data_dir / NODE_FILE

    @property
    def started_at_ms(self) -> int:
        """Start time of this process in unix milliseconds, as advertised over mDNS."""
        return int(self.started_at * 1000)

    def to_json(self) -> dict[str, Any]:
        """Return the persisted fields as a JSON-ready dict."""
        return {"node_id": self.node_id, "created_at": self.created_at, "history": self.history}

    def save(self) -> None:
        """Write ``node.json`` atomically with mode 0600. Raises :class:`IdentityError`."""
        data = (json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n").encode()
        try:
            _write_atomic(self.path, data)
        except OSError as e:
            raise IdentityError(f"cannot write {self.path}: {e}") from e

    def should_yield_to(self, other_started_at_ms: int, other_incarnation: str) -> bool:
        """Apply :func:`should_yield` with this process's start time and incarnation."""
        return should_yield(self.started_at_ms, self.incarnation, other_started_at_ms, other_incarnation)

    def regenerate(self, reason: str, *, now: float | None = None) -> str:
        """Take a fresh node id, persist it, log a warning with ``reason``, return the new id.

        For the clone case: another live node has the same id and this one is
        the newer (:func:`should_yield`). The old id goes into ``history``
        (last 20 kept). The incarnation and start time stay: this is still the
        same process. After this, restart discovery under the new id
        (``Discovery.set_node_id``).
        """
        when = time.time() if now is None else float(now)
        old = self.node_id
        self.history.append({"node_id": old, "created_at": self.created_at, "replaced_at": when, "reason": str(reason)})
        del self.history[:-_MAX_HISTORY]
        new = new_node_id()
        while new == old:  # pragma: no cover - 2**-64
            new = new_node_id()
        self.node_id = new
        self.created_at = when
        self.save()
        log.warning("node id %s replaced by %s: %s", old, new, reason)
        return new

    def close(self) -> None:
        """Release the data-dir lock (idempotent)."""
        if self._lock_fd is not None:
            fd, self._lock_fd = self._lock_fd, None
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def __enter__(self) -> NodeIdentity:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"NodeIdentity(node_id={self.node_id!r}, incarnation={self.incarnation!r}, data_dir={str(self.data_dir)!r})"
        )
