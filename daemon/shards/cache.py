"""Byte layouts of model files, the source's digest cache and the receiver's sparse shard cache.

No networking here (that is :mod:`ringlet.daemon.shards.transfer`); everything is
plain file I/O and JSON.

**Regions.** A model file is described as named byte ranges ("regions"):

* ``__header__``: the bytes before the first tensor's data. For a GGUF file that is
  the fixed header, the metadata key/values (config, tokenizer, chat template), the
  tensor infos and the padding up to ``general.alignment`` (GGUF spec:
  ``docs/gguf.md`` in ggml/llama.cpp; parsed by :func:`parse_gguf_header`, which
  finds the same offsets as the ``gguf`` package's ``GGUFReader``). For a
  ``.safetensors`` file it is the 8-byte little-endian header length N plus the N
  bytes of JSON (safetensors spec); tensor ``data_offsets`` are relative to 8 + N.
* one region per tensor, named as in the file;
* ``__file__``: a small file copied whole (``config.json``, tokenizer files).

**Source side** (:class:`DigestCache`): sha256 of a region is computed the first time
a peer asks for it and kept in a small JSON file per model, keyed by each file's
size and mtime (a changed file invalidates its digests). Chunks are served on a fixed
grid of file offsets, and the digest of each grid piece is kept too once computed,
so a source hashes each byte at most once per purpose.

**Receiver side** (:class:`LocalShard`): the receiver writes what it fetches into a
*sparse* copy of the file at the original offsets (the file's apparent size is the
source's; regions never fetched are holes that use no disk blocks). The existing
loaders work unchanged on it because they read only the tensors of their stage
(:func:`ringlet.daemon.engine.gguf.load_tensor` seeks to the tensor's offset). A JSON state
file beside it (``<file>.shard.json``) records which regions are verified (with
their sha256) and which chunks of unfinished regions are on disk, so a transfer
resumes where it stopped and later runs (another layer range, a restart) fetch only
what is missing.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import mmap
import os
import struct
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ringlet.daemon.engine.sources import ModelLocation, read_safetensors_header
from ringlet.daemon.errors import ModelFormatError, RingletError

log = logging.getLogger(__name__)

HEADER = "__header__"
WHOLE = "__file__"
#: Default chunk size of a transfer, bytes (also the piece size of the digest cache). Measured
#: on loopback: gRPC's Python receive path costs the least CPU per byte at 0.5-1 MiB
#: messages (2 MiB and more cost twice as much).
DEFAULT_CHUNK_BYTES = 1024 * 1024
#: Files of a model directory that are copied whole (besides ``*.safetensors``).
WHOLE_FILE_SUFFIXES = (".json", ".txt", ".model", ".tiktoken", ".jinja", ".py")
#: Suffix of the receiver's state file, beside the sparse data file.
STATE_SUFFIX = ".shard.json"
STATE_FORMAT = 2


class ShardError(RingletError):
    """A shard cannot be fetched, served or trusted; the message says which file and why."""


@dataclass(frozen=True)
class Region:
    """A named byte range of a file: ``[offset, offset + size)``, bytes."""

    name: str
    offset: int
    size: int

    @property
    def end(self) -> int:
        return self.offset + self.size


@dataclass(frozen=True)
class FileLayout:
    """One model file as regions.

    Attributes:
        rel: path relative to the model (a GGUF: its file name), ``/``-separated.
        path: the file on this machine.
        size: apparent size, bytes.
        format: ``"gguf"``, ``"safetensors"`` or ``"whole"``.
        header_bytes: bytes before the first tensor's data (0 for ``"whole"``).
        regions: header (or whole-file) region first, then tensors by offset.
        mtime_ns: the file's mtime when described (part of the digest cache key).
    """

    rel: str
    path: Path
    size: int
    format: str
    header_bytes: int
    regions: tuple[Region, ...]
    mtime_ns: int

    def region(self, name: str) -> Region:
        """The region called ``name``. Raises ``KeyError``."""
        for r in self.regions:
            if r.name == name:
                return r
        raise KeyError(name)

    @property
    def by_name(self) -> dict[str, Region]:
        return {r.name: r for r in self.regions}


#: Byte size of the scalar GGUF value types (GGUF spec, ``GGUFValueType`` in the gguf package).
_GGUF_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class GGUFHeader:
    """What :func:`parse_gguf_header` reads: tensor regions and the few metadata values a
    transfer needs.

    Attributes:
        header_bytes: where the data section starts (bytes; aligned to ``general.alignment``).
        tensors: ``(name, offset, n_bytes)`` by offset, offsets absolute in the file.
        block_count: ``<arch>.block_count`` (decoder layers), or ``None``.
        architecture: ``general.architecture``.
    """

    header_bytes: int
    tensors: tuple[tuple[str, int, int], ...]
    block_count: int | None
    architecture: str | None


def _skip(view: memoryview, kind: int, pos: int, keep: bool) -> tuple[int, object]:
    """Step over one GGUF value of type ``kind`` at ``pos``: ``(next pos, value if keep)``."""
    unpack = struct.unpack_from
    if kind in _GGUF_SCALARS:
        size = _GGUF_SCALARS[kind]
        value = unpack({1: "<B", 2: "<H", 4: "<I", 8: "<Q"}[size], view, pos)[0] if keep else None
        return pos + size, value
    if kind == _GGUF_STRING:
        (n,) = unpack("<Q", view, pos)
        value = bytes(view[pos + 8: pos + 8 + n]).decode("utf-8", "replace") if keep else None
        return pos + 8 + n, value
    if kind == _GGUF_ARRAY:
        sub, count = unpack("<IQ", view, pos)
        pos += 12
        if sub in _GGUF_SCALARS:
            return pos + count * _GGUF_SCALARS[sub], None
        if sub == _GGUF_STRING:  # the tokenizer's vocabulary and merges: the hot loop
            length = _U64.unpack_from
            for _ in range(count):
                pos += 8 + length(view, pos)[0]
            return pos, None
        for _ in range(count):
            pos, _value = _skip(view, sub, pos, False)
        return pos, None
    raise ModelFormatError(f"unknown GGUF value type {kind}")


def parse_gguf_header(buf) -> GGUFHeader:
    """Parse a GGUF header (versions 2 and 3) from ``buf`` (bytes, mmap or memoryview of the
    file's first bytes), skipping metadata values it does not need.

    Layout (GGUF spec, ggml ``docs/gguf.md``; as the gguf package's ``GGUFReader`` reads
    it): magic ``GGUF``, uint32 version, uint64 tensor count, uint64 key/value count; each
    key/value: string key, uint32 type, value (strings: uint64 length + UTF-8; arrays:
    uint32 element type, uint64 count, elements); each tensor info: string name, uint32
    n_dims, uint64 dims[n_dims], uint32 ggml type, uint64 offset relative to the data
    section; then zero padding to ``general.alignment`` (default 32). A tensor's bytes are
    ``elements / block_size * type_size`` (``gguf.constants.GGML_QUANT_SIZES``).

    This is ~100x faster than ``GGUFReader`` on a file with a large vocabulary, which
    decodes every tokenizer string into its own array.

    Raises:
        ModelFormatError: not GGUF, an unsupported version or type, or ``buf`` too short.
    """
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    view = memoryview(buf)
    unpack = struct.unpack_from
    try:
        if bytes(view[:4]) != b"GGUF":
            raise ModelFormatError("not a GGUF file (bad magic)")
        version, n_tensors, n_kv = unpack("<IQQ", view, 4)
        if version not in (2, 3):
            raise ModelFormatError(f"GGUF version {version} is not supported")
        pos = 24
        meta: dict[str, object] = {}

        for _ in range(n_kv):
            (n,) = unpack("<Q", view, pos)
            key = bytes(view[pos + 8: pos + 8 + n]).decode("utf-8", "replace")
            pos += 8 + n
            (kind,) = unpack("<I", view, pos)
            keep = key in ("general.architecture", "general.alignment") or key.endswith(".block_count")
            pos, value = _skip(view, kind, pos + 4, keep)
            if keep:
                meta[key] = value
        infos = []
        for _ in range(n_tensors):
            (n,) = unpack("<Q", view, pos)
            name = bytes(view[pos + 8: pos + 8 + n]).decode("utf-8")
            pos += 8 + n
            (n_dims,) = unpack("<I", view, pos)
            dims = unpack(f"<{n_dims}Q", view, pos + 4)
            pos += 4 + 8 * n_dims
            ggml_type, rel = unpack("<IQ", view, pos)
            pos += 12
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
            elements = 1
            for d in dims:
                elements *= d
            infos.append((name, rel, elements // block * type_size))
    except (struct.error, ValueError, KeyError) as exc:
        raise ModelFormatError(f"malformed or truncated GGUF header ({type(exc).__name__}: {exc})") from None
    finally:
        view.release()
    alignment = int(meta.get("general.alignment") or 32)
    data_start = pos + (-pos % alignment)
    arch = meta.get("general.architecture")
    blocks = meta.get(f"{arch}.block_count")
    tensors = tuple(sorted(((name, data_start + rel, size) for name, rel, size in infos), key=lambda t: t[1]))
    return GGUFHeader(data_start if tensors else len(view), tensors, int(blocks) if blocks is not None else None,
                      arch if isinstance(arch, str) else None)


def read_gguf_header(path: Path) -> GGUFHeader:
    """:func:`parse_gguf_header` on a file (memory-mapped; only the header pages are read).

    Raises:
        ModelFormatError: not a readable GGUF file (the message names it).
    """
    try:
        with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            try:
                return parse_gguf_header(mm)
            except ModelFormatError as exc:
                raise ModelFormatError(f"{path}: {exc}") from None
    except (OSError, ValueError) as exc:
        raise ModelFormatError(f"{path}: cannot read: {exc}") from None


def gguf_layout(path: Path, rel: str | None = None) -> FileLayout:
    """Regions of a GGUF file: ``__header__`` = ``[0, data section start)`` and every tensor.

    Raises:
        ModelFormatError: not a readable GGUF file, or a tensor beyond the end of the file.
    """
    st = path.stat()
    header = read_gguf_header(path)
    regions = [Region(HEADER, 0, header.header_bytes)]
    for name, offset, size in header.tensors:
        r = Region(name, offset, size)
        if r.end > st.st_size:
            raise ModelFormatError(f"{path}: truncated GGUF file: tensor {name} needs bytes up to {r.end}, "
                                   f"file has {st.st_size}")
        regions.append(r)
    return FileLayout(rel or path.name, path, st.st_size, "gguf", header.header_bytes, tuple(regions), st.st_mtime_ns)


def safetensors_layout(path: Path, rel: str) -> FileLayout:
    """Regions of a ``.safetensors`` file (header, then tensors by offset).

    Raises:
        ModelFormatError: malformed header, or a tensor beyond the end of the file.
    """
    st = path.stat()
    header_bytes, header = read_safetensors_header(path)
    regions = [Region(HEADER, 0, header_bytes)]
    tensors = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(v) for v in meta["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ModelFormatError(f"{path}: tensor {name!r} has no data_offsets") from None
        r = Region(name, header_bytes + begin, end - begin)
        if begin > end or r.end > st.st_size:
            raise ModelFormatError(f"{path}: truncated safetensors file: tensor {name!r}")
        tensors.append(r)
    regions.extend(sorted(tensors, key=lambda r: r.offset))
    return FileLayout(rel, path, st.st_size, "safetensors", header_bytes, tuple(regions), st.st_mtime_ns)


def whole_layout(path: Path, rel: str) -> FileLayout:
    """A small file copied whole: one region ``__file__``."""
    st = path.stat()
    return FileLayout(rel, path, st.st_size, "whole", 0, (Region(WHOLE, 0, st.st_size),), st.st_mtime_ns)


_layouts: dict[tuple[str, int, int], FileLayout] = {}
_layouts_lock = threading.Lock()


def _cached(path: Path, rel: str, build) -> FileLayout:
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    with _layouts_lock:
        hit = _layouts.get(key)
    if hit is not None and hit.rel == rel:
        return hit
    layout = build(path, rel)
    with _layouts_lock:
        _layouts[key] = layout
    return layout


def model_files(location: ModelLocation) -> list[FileLayout]:
    """The files a peer needs to run any stage of the model at ``location``, as layouts.

    A GGUF model is one file. An MLX/Hugging Face directory contributes its
    ``*.safetensors`` files (as header + tensors) and its small files copied whole
    (suffixes in :data:`WHOLE_FILE_SUFFIXES`, top level only; hidden files and this
    module's state files excluded). Layouts are cached per (path, size, mtime).

    Raises:
        ModelFormatError: a malformed model file.
        OSError: the files cannot be listed or read.
    """
    path = Path(location.path)
    if location.kind == "gguf":
        return [_cached(path, path.name, gguf_layout)]
    out = []
    for f in sorted(path.iterdir()):
        if not f.is_file() or f.name.startswith(".") or f.name.endswith(STATE_SUFFIX):
            continue
        if f.suffix == ".safetensors":
            out.append(_cached(f, f.name, safetensors_layout))
        elif f.suffix in WHOLE_FILE_SUFFIXES:
            out.append(_cached(f, f.name, whole_layout))
    return out


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


def _atomic_write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(data, separators=(",", ":")))
    os.replace(tmp, path)


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
            _atomic_write_json(jp, snapshot)
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


def safe_rel(rel: str) -> str:
    """Check a file path sent by a peer: relative, ``/``-separated, no ``..``, no hidden
    parts. Returns it unchanged.

    Raises:
        ShardError: anything else (a peer must not make us write outside the cache).
    """
    parts = rel.split("/")
    if (not rel or rel.startswith("/") or "\\" in rel or "\0" in rel
            or any(p in ("", ".", "..") or p.startswith(".") for p in parts)):
        raise ShardError(f"refusing the file path {rel!r} from a peer (must be a plain relative path)")
    return rel


def merge_spans(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, merged ``(start, end)`` intervals (touching intervals merge)."""
    out: list[list[int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def overlap(a0: int, a1: int, b0: int, b1: int) -> int:
    """Bytes in common between ``[a0, a1)`` and ``[b0, b1)``."""
    return max(0, min(a1, b1) - max(a0, b0))


class LocalShard:
    """Receiver side: a sparse local copy of one model file and its state.

    State (``<file>.shard.json``, JSON)::

        {"format": 2, "file": rel, "size": bytes, "header_sha256": hex,
         "verified": {region: [offset, size, sha256 hex]},
         "expected": {region: [offset, size, sha256 hex]},
         "chunks": [[offset, length, sha256 hex], ...]}

    ``verified`` regions were checked against the source's sha256 of the whole region.
    ``chunks`` are the chunks written to disk that still matter (they overlap a region
    not verified yet), each with the sha256 the source sent with it; ``expected`` holds
    the digests those unfinished regions must have (a source with other content for
    them makes their chunks worthless). The state is written atomically (temporary file
    + rename) and always after the data it describes, so a killed process resumes from
    a state that never claims bytes it did not write. (A power loss can drop page-cache
    data a saved state already claims unless the data was fsynced first, as
    :func:`ringlet.daemon.shards.transfer.fetch_shard` does before its final save;
    :meth:`reverify` re-hashes every verified region.)

    Not thread-safe: one transfer at a time per file (the transfer holds a lock file).
    """

    def __init__(self, path: Path, rel: str, size: int, header_sha256: bytes):
        self.path = Path(path)
        self.state_path = self.path.with_name(self.path.name + STATE_SUFFIX)
        self.rel = rel
        self.size = size
        self.header_sha256 = header_sha256
        self.verified: dict[str, tuple[int, int, str]] = {}
        self.expected: dict[str, tuple[int, int, str]] = {}
        self.chunks: list[list] = []  # [offset, length, sha256 hex]
        self.was_reset = False

    def _load_state(self, state: dict) -> None:
        self.verified = {str(k): (int(v[0]), int(v[1]), str(v[2])) for k, v in state["verified"].items()}
        self.expected = {str(k): (int(v[0]), int(v[1]), str(v[2])) for k, v in state.get("expected", {}).items()}
        self.chunks = [[int(c[0]), int(c[1]), str(c[2])] for c in state.get("chunks", [])]

    @classmethod
    def open(cls, directory: Path, rel: str, size: int, header_sha256: bytes) -> LocalShard:
        """Open (or create) the sparse copy of ``rel`` under ``directory``.

        A copy made from another version of the file (different size or header sha256)
        is discarded: its data file is emptied and its state reset.

        Raises:
            ShardError: an unsafe ``rel``.
            OSError: the directory is not writable.
        """
        safe_rel(rel)
        shard = cls(Path(directory) / rel, rel, size, header_sha256)
        shard.path.parent.mkdir(parents=True, exist_ok=True)
        state = None
        if shard.state_path.is_file():
            try:
                state = json.loads(shard.state_path.read_text())
            except (OSError, ValueError):
                log.warning("%s unreadable; starting this shard afresh", shard.state_path)
        reuse = (isinstance(state, dict) and state.get("format") == STATE_FORMAT and state.get("size") == size
                 and state.get("header_sha256") == header_sha256.hex() and shard.path.is_file())
        if reuse:
            try:
                shard._load_state(state)
            except (KeyError, TypeError, ValueError, IndexError, AttributeError):
                reuse = False
        if not reuse:
            if shard.path.exists() or state is not None:
                log.info("shard cache %s is from another version of the file; starting afresh", shard.path)
                shard.was_reset = True
            shard.verified, shard.expected, shard.chunks = {}, {}, []
            with open(shard.path, "wb"):
                pass
        # Apparent size = the source's; a fresh file is all holes.
        if shard.path.stat().st_size != size:
            os.truncate(shard.path, size)
        return shard

    @classmethod
    def load(cls, path: Path) -> LocalShard | None:
        """The shard whose data file is ``path`` from its saved state, or ``None`` if
        ``path`` has no (readable) state beside it."""
        path = Path(path)
        sp = path.with_name(path.name + STATE_SUFFIX)
        try:
            state = json.loads(sp.read_text())
            if state.get("format") != STATE_FORMAT:
                return None
            shard = cls(path, state["file"], int(state["size"]), bytes.fromhex(state["header_sha256"]))
            shard._load_state(state)
        except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
            return None
        return shard

    def snapshot(self) -> dict:
        """The state as JSON-ready data (a copy)."""
        return {
            "format": STATE_FORMAT, "file": self.rel, "size": self.size,
            "header_sha256": self.header_sha256.hex(),
            "verified": {k: list(v) for k, v in self.verified.items()},
            "expected": {k: list(v) for k, v in self.expected.items()},
            "chunks": [list(c) for c in self.chunks],
        }

    def save(self, snapshot: dict | None = None) -> None:
        """Write the state (or an earlier :meth:`snapshot` of it) atomically."""
        _atomic_write_json(self.state_path, snapshot if snapshot is not None else self.snapshot())

    def is_verified(self, region: Region, sha256: bytes | None = None) -> bool:
        """True when ``region`` (same offset and size, and digest when given) is verified."""
        v = self.verified.get(region.name)
        return (v is not None and v[0] == region.offset and v[1] == region.size
                and (sha256 is None or v[2] == sha256.hex()))

    def expect(self, region: Region, sha256: bytes) -> None:
        """Record the digest ``region`` must have; chunks written for another digest of it
        are dropped (the source's content changed)."""
        if self.is_verified(region, sha256):
            return
        if region.name in self.verified:
            del self.verified[region.name]
        new = (region.offset, region.size, sha256.hex())
        old = self.expected.get(region.name)
        if old is not None and old != new:
            self.drop_chunks(min(old[0], region.offset), max(old[0] + old[1], region.end))
        self.expected[region.name] = new

    def drop_chunks(self, start: int, end: int) -> list[list]:
        """Forget the chunks overlapping ``[start, end)``; returns them."""
        gone = [c for c in self.chunks if overlap(c[0], c[0] + c[1], start, end)]
        if gone:
            self.chunks = [c for c in self.chunks if not overlap(c[0], c[0] + c[1], start, end)]
        return gone

    def covered(self, start: int, end: int) -> list[tuple[int, int]]:
        """Merged ``(start, end)`` spans of ``[start, end)`` covered by recorded chunks."""
        return merge_spans((max(c[0], start), min(c[0] + c[1], end)) for c in self.chunks
                           if overlap(c[0], c[0] + c[1], start, end))

    def missing(self, region: Region) -> list[tuple[int, int]]:
        """``(offset, length)`` ranges of ``region`` still to fetch (none when verified)."""
        if region.name in self.verified:
            return []
        out, pos = [], region.offset
        for a, b in self.covered(region.offset, region.end):
            if a > pos:
                out.append((pos, a - pos))
            pos = max(pos, b)
        if pos < region.end:
            out.append((pos, region.end - pos))
        return out

    def present_bytes(self, region: Region) -> int:
        """Bytes of ``region`` on disk (verified, or written in recorded chunks)."""
        if region.name in self.verified:
            return region.size
        return sum(b - a for a, b in self.covered(region.offset, region.end))

    def mark_verified(self, region: Region, sha256: bytes) -> None:
        """Record ``region`` as verified with ``sha256``."""
        self.verified[region.name] = (region.offset, region.size, sha256.hex())
        self.expected.pop(region.name, None)

    def prune(self) -> None:
        """Forget chunks that overlap no region still expected (their bytes are either in
        verified regions or in padding)."""
        if not self.chunks:
            return
        spans = merge_spans((e[0], e[0] + e[1]) for e in self.expected.values())
        if not spans:
            self.chunks = []
            return
        starts = [a for a, _ in spans]
        keep = []
        for c in self.chunks:
            i = bisect.bisect_right(starts, c[0] + c[1] - 1) - 1
            # keep when the chunk overlaps any pending span (check the nearest ones)
            if any(overlap(c[0], c[0] + c[1], *spans[j]) for j in range(max(0, i - 1), min(len(spans), i + 2))):
                keep.append(c)
        self.chunks = keep

    def reverify(self) -> list[str]:
        """Re-hash every verified region from disk; regions that no longer match are
        forgotten (to be fetched again). Returns their names. Blocking."""
        bad = []
        for name, (offset, size, hexd) in list(self.verified.items()):
            digest = sha256_range(self.path, offset, size)
            if digest.hex() != hexd:
                bad.append(name)
                del self.verified[name]
        if bad:
            self.save()
        return bad

    def allocated_bytes(self) -> int:
        """Disk space the sparse data file really uses (``st_blocks * 512``), bytes."""
        return self.path.stat().st_blocks * 512
