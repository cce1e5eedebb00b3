"""The disk tier of a stage's prefix store: entries evicted from memory, kept as
safetensors files in the node's data dir, bounded in bytes, least recently used
deleted first (``--prefix-cache-disk-bytes``; off by default).

An entry is spilled when the memory store evicts it for room, reloaded on a hit (it
moves back to memory and its file goes), and found again after a restart: the index
is rebuilt from the files' headers, which carry everything but the tensors.

* **Format.** One ``<n>.safetensors`` per entry, written with ``mx.save_safetensors``
  (``tokens`` and ``layer.<i>.keys`` / ``.values`` as
  :meth:`~ringlet.daemon.engine.prefix_store.PrefixStore.export_entry` makes them)
  under a temporary name and renamed into place, so a crash never leaves half a file
  that looks whole. The header's metadata holds the format version, the model key,
  the scope, the layer range and the token ids (JSON).
* **Stale files.** Files live in a directory per model key (a digest of the model's
  files and the dtype loaded: :func:`model_key`); a file whose header names another
  key or format is ignored, and deleted. A file for an older plan's layer range is
  served only when its range covers this stage's; it ages out by LRU otherwise.
* **A full disk.** A write refused for want of space (ENOSPC, EDQUOT) turns the tier
  off for writing (:attr:`PrefixDisk.off` says why, naming the path, the bytes needed and
  free; ``info()["state"]`` is ``"off (…)"``, and :attr:`PrefixDisk.on_off` is told once,
  so the node logs an event); the files already written keep serving, and a request
  never fails for it: an entry that cannot be spilled is simply dropped. Nothing half
  written is ever indexed: a file is renamed into place only once whole, and a file
  whose safetensors header promises more bytes than it holds is ignored on a scan.
* **Threads.** All methods run on the engine's MLX worker thread, as the store's do.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from safetensors import safe_open

from ringlet.daemon.engine.token_index import TokenIndex
from ringlet.daemon.errors import disk_full
from ringlet.daemon.paths import write_atomically

log = logging.getLogger(__name__)

#: Version of the files' layout; a file of another version is ignored.
FORMAT = "1"
SUFFIX = ".safetensors"


def model_key(paths: list[Path], dtype: str) -> str:
    """A digest naming the weights a KV cache was computed with: every model file's
    name, size and modification time, and the dtype the stages load (``float32``,
    ``native``, …). Re-downloaded or converted weights, or another dtype, get another
    key, so their caches are never mixed (sha256, 16 hex digits)."""
    h = hashlib.sha256(f"ringlet prefix cache\0{dtype}".encode())
    for path in sorted(paths):
        with contextlib.suppress(OSError):
            st = path.stat()
            h.update(f"\0{path.name}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


@dataclass
class DiskEntry:
    """One file of the tier: ``tokens`` of ``scope`` for layers ``[start, end)``."""

    id: int
    path: Path
    scope: str
    tokens: list[int]
    start: int
    end: int
    nbytes: int


class PrefixDisk(TokenIndex):
    """The disk tier under ``directory / key``, holding at most ``budget_bytes``.

    Args:
        directory: the node's prefix cache directory (created if missing).
        budget_bytes: the most bytes of files kept (0: the tier holds nothing).
        key: the model key (:func:`model_key`).

    Raises:
        OSError: ``directory`` cannot be created.
    """

    def __init__(self, directory: Path, budget_bytes: int, key: str):
        self.dir = Path(directory) / key
        self.dir.mkdir(parents=True, exist_ok=True)
        self.key = key
        super().__init__(budget_bytes)
        self.hits = self.writes = self.evictions = self.ignored = 0
        #: why the tier stopped writing (a full disk's message), or ``None`` while it writes
        self.off: str | None = None
        #: called once, with :attr:`off`, when the tier turns itself off (the node's event log)
        self.on_off: Callable[[str], None] | None = None
        self._scan()

    # --- index ---------------------------------------------------------------------------

    def _scan(self) -> None:
        """Index the files left by an earlier run, oldest first (by modification time);
        delete temporary leftovers and files of another format or model."""
        for tmp in self.dir.glob("*.tmp"):
            tmp.unlink(missing_ok=True)
        files = sorted(self.dir.glob(f"*{SUFFIX}"), key=lambda p: p.stat().st_mtime_ns)
        for path in files:
            meta = _read_metadata(path)
            if meta is None or meta.get("format") != FORMAT or meta.get("model_key") != self.key:
                log.info("prefix cache: ignoring %s (another model, format or a damaged file)", path.name)
                self.ignored += 1
                path.unlink(missing_ok=True)
                continue
            entry = DiskEntry(next(self._ids), path, meta["scope"], json.loads(meta["tokens"]), int(meta["start"]),
                              int(meta["end"]), path.stat().st_size)
            self._add(entry)
        self._evict_to(self.budget_bytes)

    def _discard(self, entry: DiskEntry) -> None:
        entry.path.unlink(missing_ok=True)

    def _evict(self, entry: DiskEntry) -> None:
        self._forget(entry)
        self.evictions += 1

    # --- lookup ----------------------------------------------------------------------------

    def _search(self, scope: str, tokens: list[int], start: int, end: int) -> tuple[DiskEntry | None, int]:
        """The file sharing the longest prefix with ``tokens`` among those covering
        ``[start, end)``, and that prefix's length."""
        covering = [(e, n) for e, n in self._candidates(scope, tokens) if e.start <= start and e.end >= end]
        return max(covering, key=lambda c: c[1], default=(None, 0))

    def longest(self, scope: str, tokens: list[int], start: int, end: int) -> int:
        """How many leading tokens of ``tokens`` a file covering ``[start, end)`` holds."""
        return self._search(scope, tokens, start, end)[1]

    def take(self, scope: str, tokens: list[int], start: int, end: int
             ) -> tuple[dict[str, mx.array], dict[str, str]] | None:
        """Load the file holding at least ``tokens`` (all of them) for ``[start, end)``, as
        :meth:`~ringlet.daemon.engine.prefix_store.PrefixStore.import_entry` takes it, and
        delete it (the entry moves back to memory). ``None`` when no file serves that many
        or the file cannot be read (it is dropped)."""
        entry, n = self._search(scope, tokens, start, end)
        if entry is None or n < len(tokens):
            return None
        try:
            arrays, meta = mx.load(str(entry.path), return_metadata=True)
        except Exception as exc:  # a damaged or vanished file: forget it, never fail the request
            log.warning("prefix cache: cannot read %s (%s); dropping it", entry.path.name, exc)
            self._forget(entry)
            return None
        self._forget(entry)
        self.hits += 1
        return arrays, meta

    # --- spill -----------------------------------------------------------------------------

    def put(self, arrays: dict[str, mx.array], meta: dict[str, str]) -> bool:
        """Write one entry evicted from memory (:meth:`PrefixStore.export_entry`'s form).
        Files it extends are deleted; the least recently used go until the budget holds.
        Returns whether it was kept (not when it alone is over the budget, or on a
        write error, which is logged)."""
        nbytes = sum(a.nbytes for a in arrays.values())
        if self.off is not None or self.budget_bytes <= 0 or nbytes > self.budget_bytes:
            return False
        tokens = [int(t) for t in arrays["tokens"].tolist()]
        scope = meta.get("scope", "")
        self._drop_covered(scope, tokens, int(meta["start"]), int(meta["end"]))
        self._evict_to(self.budget_bytes - nbytes)
        ident = next(self._ids)
        path = self.dir / f"{os.getpid()}-{ident}{SUFFIX}"
        header = {**meta, "format": FORMAT, "model_key": self.key, "tokens": json.dumps(tokens)}

        def save(tmp: str) -> None:
            # mx.save_safetensors appends ".safetensors" to a name without it: write
            # through a file object to the temporary name
            with open(tmp, "wb") as f:
                mx.save_safetensors(f, arrays, metadata=header)

        try:
            error = write_atomically(path, save)
        except Exception as exc:  # MLX's own errors: the entry is simply not kept
            error = exc
        if error is not None:  # a read-only disk, MLX's own errors; a full disk turns the tier off
            full = disk_full(error, path, nbytes, "the prefix cache's disk tier")
            if full is not None:
                self.turn_off(str(full))
            else:
                log.warning("prefix cache: cannot write %s (%s)", path.name, error)
            return False
        self._add(DiskEntry(ident, path, scope, tokens, int(meta["start"]), int(meta["end"]), path.stat().st_size))
        self.writes += 1
        return True

    def turn_off(self, reason: str) -> None:
        """Stop writing (the files held keep serving), log ``reason`` and tell :attr:`on_off`."""
        if self.off is not None:
            return
        self.off = reason
        log.warning("prefix cache: disk tier off: %s", reason)
        if self.on_off is not None:
            self.on_off(reason)

    def _drop_covered(self, scope: str, tokens: list[int], start: int, end: int) -> None:
        """Delete files whose tokens are a prefix of ``tokens`` over the same or fewer
        layers (the new file serves every lookup they did)."""
        for entry in list(self._entries.values()):
            if (entry.scope == scope and len(entry.tokens) <= len(tokens) and tokens[:len(entry.tokens)] == entry.tokens
                    and start <= entry.start and end >= entry.end):
                self._forget(entry)

    def info(self) -> dict[str, Any]:
        """JSON-safe figures for ``/v1/cluster``'s ``prefix_cache.disk``; ``state`` is
        ``"on"``, or ``"off (<why>)"`` once a full disk turned the tier off."""
        return {"state": "on" if self.off is None else f"off ({self.off})", "off": self.off,
                "budget_bytes": self.budget_bytes, "bytes": self.nbytes, "entries": len(self._entries),
                "hits": self.hits, "writes": self.writes, "evictions": self.evictions,
                "ignored_files": self.ignored, "directory": str(self.dir)}


def _read_metadata(path: Path) -> dict[str, str] | None:
    """The safetensors header's metadata of ``path`` (no tensor is read), or ``None``
    when the file is not a readable safetensors file."""
    try:
        with safe_open(str(path), framework="numpy") as f:
            return dict(f.metadata() or {})
    except Exception:  # noqa: BLE001 - a damaged file of any kind is ignored
        return None
