"""The source's digest cache: sha256 of regions and of chunks, computed lazily and cached.

**Source side** (:class:`DigestCache`): sha256 of a region is computed the first time
a peer asks for it and kept in a small JSON file per model, keyed by each file's
size and mtime (a changed file invalidates its digests). Chunks are served on a fixed
grid of file offsets, and the digest of each grid piece is kept too once computed,
so a source hashes each byte at most once per purpose.

No networking here (that is :mod:`ringlet.daemon.shards.serve`); everything is plain
file I/O and JSON.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections.abc import Iterable
from pathlib import Path

from ringlet.daemon.shards.fileio import atomic_write_json, sha256_range
from ringlet.daemon.shards.layout import DEFAULT_CHUNK_BYTES, FileLayout, Region

log = logging.getLogger(__name__)

class DigestCache:
    """Source side: sha256 of regions and of chunks, computed lazily and cached.

    One JSON file per model directory/file under ``directory`` (named by a hash of
    the model's absolute path), holding for each file its size and mtime and the hex
    digests computed so far; a file whose size or mtime changed starts afresh. With
    ``directory=None`` digests are kept in memory only.

    * region digests (:meth:`digests`): hashed when a peer first asks (``ShardManifest``);
    * chunk digests (:meth:`chunk_digest`, :meth:`remember_chunk`): a server sends chunks
      on a grid of ``piece_bytes`` (absolute file offsets, multiples of ``piece_bytes``),
      so the digest of a whole grid piece, once computed while serving it, serves every
      later transfer of those bytes whatever layer range asked for them.

    Thread-safe; :meth:`digests` blocks while hashing (call it in a worker thread).
    """

    def __init__(self, directory: Path | None, piece_bytes: int = DEFAULT_CHUNK_BYTES):
        self.directory = Path(directory) if directory is not None else None
        self.piece_bytes = piece_bytes
        self._lock = threading.Lock()
        self._mem: dict[str, dict] = {}  # model path -> {"files": {rel: entry}}
        self._dirty: set[str] = set()
        #: bytes hashed for region digests so far (for tests and logs).
        self.hashed_bytes = 0

    def _json_path(self, model_path: Path) -> Path | None:
        if self.directory is None:
            return None
        key = hashlib.sha256(str(Path(model_path).resolve()).encode()).hexdigest()[:20]
        return self.directory / f"{key}.json"

    def _entry(self, model_path: Path, layout: FileLayout) -> dict:
        """The (size, mtime)-checked cache entry of one file; caller holds the lock."""
        key = str(model_path)
        doc = self._mem.get(key)
        if doc is None:
            doc = {"model": key, "files": {}}
            jp = self._json_path(model_path)
            if jp is not None and jp.is_file():
                try:
                    loaded = json.loads(jp.read_text())
                    if isinstance(loaded, dict) and isinstance(loaded.get("files"), dict):
                        doc = loaded
                except (OSError, ValueError):
                    log.warning("shard digest cache %s unreadable; recomputing", jp)
            self._mem[key] = doc
        entry = doc["files"].get(layout.rel)
        if (not isinstance(entry, dict) or entry.get("size") != layout.size
                or entry.get("mtime_ns") != layout.mtime_ns or entry.get("piece_bytes") != self.piece_bytes
                or not isinstance(entry.get("regions"), dict) or not isinstance(entry.get("grid"), dict)):
            entry = {"size": layout.size, "mtime_ns": layout.mtime_ns, "piece_bytes": self.piece_bytes,
                     "regions": {}, "grid": {}}
            doc["files"][layout.rel] = entry
        return entry

    def flush(self, model_path: Path) -> None:
        """Write the JSON file of ``model_path`` if anything was added since the last write."""
        key = str(model_path)
        jp = self._json_path(model_path)
        with self._lock:
            if key not in self._dirty:
                return
            self._dirty.discard(key)
            snapshot = json.loads(json.dumps(self._mem[key]))
        if jp is None:
            return
        try:
            jp.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(jp, snapshot)
        except OSError as exc:
            log.warning("cannot write the shard digest cache %s: %s (digests stay in memory)", jp, exc)

    def digests(self, model_path: Path, layout: FileLayout, names: Iterable[str]) -> dict[str, bytes]:
        """sha256 (32 raw bytes) of the named regions of ``layout``, hashing only the
        ones not cached yet (blocking).

        Raises:
            KeyError: a name that is not a region of the file.
            ShardError: the file is shorter than its layout says.
        """
        regions = layout.by_name
        wanted = [regions[n] for n in dict.fromkeys(names)]  # KeyError for unknown names
        with self._lock:
            entry = self._entry(model_path, layout)
            todo = [r for r in wanted if r.name not in entry["regions"]]
        if todo:
            computed = {}
            for r in todo:
                computed[r.name] = sha256_range(layout.path, r.offset, r.size).hex()
                self.hashed_bytes += r.size
            with self._lock:
                entry = self._entry(model_path, layout)
                entry["regions"].update(computed)
                self._dirty.add(str(model_path))
            self.flush(model_path)
        with self._lock:
            entry = self._entry(model_path, layout)
            return {r.name: bytes.fromhex(entry["regions"][r.name]) for r in wanted}

    def _grid_key(self, layout: FileLayout, offset: int, length: int) -> str | None:
        if offset % self.piece_bytes or length != min(self.piece_bytes, layout.size - offset):
            return None
        return str(offset // self.piece_bytes)

    def chunk_digest(self, model_path: Path, layout: FileLayout, offset: int, length: int,
                     region: Region | None = None) -> bytes | None:
        """The cached sha256 of bytes ``[offset, offset + length)``: a whole grid piece, or
        exactly ``region`` (when given); ``None`` when not cached."""
        key = self._grid_key(layout, offset, length)
        with self._lock:
            entry = self._entry(model_path, layout)
            hexd = entry["grid"].get(key) if key is not None else None
            if hexd is None and region is not None and (offset, length) == (region.offset, region.size):
                hexd = entry["regions"].get(region.name)
        return bytes.fromhex(hexd) if hexd else None

    def remember_chunk(self, model_path: Path, layout: FileLayout, offset: int, length: int, digest: bytes) -> None:
        """Cache the digest of a chunk if it is a whole grid piece (kept on :meth:`flush`)."""
        key = self._grid_key(layout, offset, length)
        if key is None:
            return
        with self._lock:
            entry = self._entry(model_path, layout)
            if key not in entry["grid"]:
                entry["grid"][key] = digest.hex()
                self._dirty.add(str(model_path))
