"""Plain file I/O both sides of a shard transfer use: the sha256 of a byte range of a
file (read in pieces) and atomic JSON writes (temporary file + rename)."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path

from ringlet.daemon.errors import disk_full
from ringlet.daemon.shards.layout import DEFAULT_CHUNK_BYTES, ShardError


def sha256_range(path: Path, offset: int, size: int) -> bytes:
    """sha256 (32 raw bytes) of ``size`` bytes of ``path`` from ``offset``, read in
    :data:`DEFAULT_CHUNK_BYTES` pieces.

    Raises:
        ShardError: the file is shorter than the range.
    """
    whole = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < size:
            n = min(DEFAULT_CHUNK_BYTES, size - done)
            buf = os.pread(fd, n, offset + done)
            if len(buf) != n:
                raise ShardError(f"{path}: bytes {offset + done}..{offset + done + n} are beyond the end of the file")
            whole.update(buf)
            done += n
    finally:
        os.close(fd)
    return whole.digest()


def atomic_write_json(path: Path, data: dict) -> None:
    """Write ``data`` as compact JSON to ``path`` atomically (temporary file beside it +
    rename): a reader sees the old content or the new, never part of it.

    Raises:
        DiskFull: no space for it (the old file is left as it was).
        OSError: another write error.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    text = json.dumps(data, separators=(",", ":"))
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as exc:  # a full disk: the old state stays; no half-written temporary is left
        tmp.unlink(missing_ok=True)
        raise (disk_full(exc, path, len(text), "a shard's state") or exc) from None
