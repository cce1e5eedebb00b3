"""Serving side of peer-to-peer shard transfer: a member holding the model files answers
the manifest and streams the bytes a peer asks for.

Wire (``proto/ringlet.proto``, service ``Ring``):

* ``ShardManifest(ManifestRequest) -> Manifest``: the model's files; for one file its
  regions (header, tensors; :mod:`ringlet.daemon.shards.layout`) with offsets, sizes and,
  for the regions asked for, sha256 (computed lazily by the source and cached,
  :mod:`ringlet.daemon.shards.digests`).
* ``FetchShard(ShardRequest) -> stream ShardChunk``: the bytes of the requested ranges
  in chunks of at most ``chunk_bytes``, each with the sha256 the source computed
  (or cached) before sending it. The server cuts the ranges into chunks on a fixed grid
  of file offsets (1 MiB by default), so the same bytes always travel in the same chunks.

A node whose model file is itself a fetched sparse copy serves the regions it has
verified (and flags the others ``missing`` in its manifest), so any member holding a
range can pass it on.

A test hook (:class:`ChunkCorrupter`, or ``RINGLET_TEST_CORRUPT_CHUNK=N`` in the serving
process's environment) flips a byte of the N-th chunk served, after its digest was taken.

The receiving side is :mod:`ringlet.daemon.shards.transfer`.
"""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc

from ringlet.daemon.engine.sources import ModelLocation
from ringlet.daemon.shards.digests import DigestCache
from ringlet.daemon.shards.layout import FileLayout, ShardError, model_files
from ringlet.daemon.shards.local import LocalShard
from ringlet.daemon.wire.rpc import ringlet_pb2 as pb

log = logging.getLogger(__name__)

#: Largest chunk a server sends, bytes (a request asking for more gets this).
MAX_CHUNK_BYTES = 16 * 1024 * 1024
MIN_CHUNK_BYTES = 4096
#: Environment variable of the serving process: corrupt the N-th chunk it serves (1-based), once.
CORRUPT_ENV = "RINGLET_TEST_CORRUPT_CHUNK"


# ------------------------------------------------------------------------------------------
# test hook

class ChunkCorrupter:
    """Test hook for the serving side: flips one byte of the ``nth`` chunk served (1-based,
    counted over all calls that share this object), ``times`` times in all, *after* the
    chunk's sha256 was taken, as a fault on the wire would."""

    def __init__(self, nth: int, times: int = 1):
        if nth < 1:
            raise ValueError("nth counts from 1")
        self.nth = nth
        self.times = times
        self.served = 0
        self.corrupted: list[int] = []  # file offsets of the chunks corrupted
        self._lock = threading.Lock()

    def __call__(self, offset: int, data: bytes) -> bytes:
        with self._lock:
            self.served += 1
            hit = self.served >= self.nth and len(self.corrupted) < self.times and data
            if hit:
                self.corrupted.append(offset)
        if not hit:
            return data
        flipped = bytearray(data)
        flipped[len(flipped) // 2] ^= 0xFF
        return bytes(flipped)


_env_corrupter: ChunkCorrupter | None = None
_env_lock = threading.Lock()


def _corrupter_from_env() -> ChunkCorrupter | None:
    global _env_corrupter
    value = os.environ.get(CORRUPT_ENV)
    if not value:
        return None
    with _env_lock:
        if _env_corrupter is None:
            _env_corrupter = ChunkCorrupter(int(value))
            log.warning("test hook %s=%s: chunk %s served by this process will be corrupted once",
                        CORRUPT_ENV, value, value)
        return _env_corrupter


# ------------------------------------------------------------------------------------------
# serving side

_default_digests: DigestCache | None = None


def default_digest_cache() -> DigestCache:
    """The process-wide digest cache in ``<default data dir>/shard-digests`` (see
    :func:`ringlet.daemon.paths.default_data_dir`); a node with its own data dir should
    pass ``DigestCache(data_dir / "shard-digests")`` instead."""
    global _default_digests
    if _default_digests is None:
        from ringlet.daemon.paths import default_data_dir

        _default_digests = DigestCache(default_data_dir() / "shard-digests")
    return _default_digests


@dataclass(frozen=True)
class _Source:
    location: ModelLocation
    files: dict[str, FileLayout]
    #: rel -> names of the regions this node really holds; None = all (a complete copy)
    held: dict[str, frozenset[str] | None]


def _describe_source(location: ModelLocation) -> _Source:
    """Layouts of the files this node serves. A node whose files are themselves a fetched
    sparse copy (a ``.shard.json`` state beside them) holds only its verified regions."""
    files, held = {}, {}
    for layout in model_files(location):
        files[layout.rel] = layout
        state = LocalShard.load(layout.path)
        held[layout.rel] = None if state is None else frozenset(state.verified)
    return _Source(location, files, held)


async def _source(context, location: ModelLocation, model: str) -> _Source:
    if model and model not in (location.name, location.ident):  # a Hub model: by name, or name@commit
        await context.abort(grpc.StatusCode.NOT_FOUND, f"this node serves the model {location.ident!r}, not {model!r}")
    try:
        return await asyncio.to_thread(_describe_source, location)
    except Exception as exc:  # noqa: BLE001 - OSError, ModelFormatError...: reported to the peer
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"cannot read the model files: {exc}")
    raise AssertionError("unreachable")  # context.abort raises


async def serve_manifest(request: pb.ManifestRequest, context: grpc.aio.ServicerContext, location: ModelLocation,
                         *, digests: DigestCache | None = None) -> pb.Manifest:
    """Answer ``ShardManifest`` for the model at ``location``.

    Without ``request.file``: the files (path, size, format, header bytes). With it: that
    file's regions; the header's sha256 and those of the regions named in
    ``request.digests`` are filled in (hashed in a worker thread the first time, then
    cached in ``digests``, default :func:`default_digest_cache`). A node holding only a
    fetched part of the model lists every region but flags those it lacks ``missing``
    (and refuses their digests).

    Aborts the call with NOT_FOUND (another model, an unknown file or region) or
    FAILED_PRECONDITION (the model files are unreadable).
    """
    digests = digests or default_digest_cache()
    source = await _source(context, location, request.model)
    out = pb.Manifest(model=location.ident, kind=location.kind)
    if not request.file:
        for layout in source.files.values():
            out.files.add(path=layout.rel, size=layout.size, format=layout.format, header_bytes=layout.header_bytes)
        return out
    layout = source.files.get(request.file)
    if layout is None:
        await context.abort(grpc.StatusCode.NOT_FOUND, f"the model {location.name!r} has no file {request.file!r}")
    held = source.held[layout.rel]
    regions = layout.by_name
    unknown = [n for n in request.digests if n not in regions]
    if unknown:
        await context.abort(grpc.StatusCode.NOT_FOUND,
                            f"{request.file}: no region {unknown[0]!r} ({len(unknown)} unknown)")
    lacking = [n for n in request.digests if held is not None and n not in held]
    if lacking:
        await context.abort(grpc.StatusCode.NOT_FOUND,
                            f"{request.file}: this node holds only part of the model; it lacks {lacking[0]}"
                            + (f" and {len(lacking) - 1} more" if len(lacking) > 1 else ""))
    first = layout.regions[0].name if layout.regions and (held is None or layout.regions[0].name in held) else None
    wanted = list(dict.fromkeys(([first] if first else []) + list(request.digests)))
    try:
        got = await asyncio.to_thread(digests.digests, Path(location.path), layout, wanted)
    except (OSError, ShardError) as exc:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{request.file}: cannot hash: {exc}")
    f = out.files.add(path=layout.rel, size=layout.size, format=layout.format, header_bytes=layout.header_bytes)
    for r in layout.regions:
        f.regions.add(name=r.name, offset=r.offset, size=r.size, sha256=got.get(r.name, b""),
                      missing=held is not None and r.name not in held)
    return out


def _chunks(ranges, resume_offset: int, chunk_bytes: int):
    """``(offset, length)`` chunks of the requested ranges, in order: each range is cut at
    the multiples of ``chunk_bytes`` (absolute file offsets), so the same bytes always
    travel in the same chunks and their digests can be cached."""
    for br in ranges:
        pos, end = max(int(br.offset), resume_offset), int(br.offset) + int(br.length)
        while pos < end:
            n = min(end, (pos // chunk_bytes + 1) * chunk_bytes) - pos
            yield pos, n
            pos += n


async def serve_fetch(request: pb.ShardRequest, context: grpc.aio.ServicerContext, location: ModelLocation,
                      *, digests: DigestCache | None = None, corrupt: ChunkCorrupter | None = None):
    """Answer ``FetchShard``: yield ``ShardChunk`` messages for the requested ranges (an
    async generator).

    Chunks are at most ``request.chunk_bytes`` (0: the digest cache's piece size,
    :data:`~ringlet.daemon.shards.layout.DEFAULT_CHUNK_BYTES`; clamped to [4 KiB, :data:`MAX_CHUNK_BYTES`]), never span
    two ranges and end at multiples of the chunk size; bytes below
    ``request.resume_offset`` are skipped. Each chunk is read (``os.pread``) and hashed
    in a worker thread, one chunk ahead of the one being sent; with the default chunk
    size its sha256 comes from ``digests`` once computed (whole grid pieces). A node
    holding only part of the model serves only ranges inside regions it has verified.
    ``corrupt`` (default: from ``RINGLET_TEST_CORRUPT_CHUNK``) is the test hook.

    Aborts the call with NOT_FOUND (another model, unknown file), OUT_OF_RANGE (a range
    beyond the end of the file) or FAILED_PRECONDITION (bytes this node does not hold,
    or unreadable files).
    """
    digests = digests or default_digest_cache()
    corrupt = corrupt or _corrupter_from_env()
    source = await _source(context, location, request.model)
    layout = source.files.get(request.file)
    if layout is None:
        await context.abort(grpc.StatusCode.NOT_FOUND, f"the model {location.name!r} has no file {request.file!r}")
    held = source.held[layout.rel]
    all_starts = [r.offset for r in layout.regions]
    for br in request.ranges:
        if br.offset + br.length > layout.size:
            await context.abort(grpc.StatusCode.OUT_OF_RANGE,
                                f"{layout.rel}: range {br.offset}+{br.length} is beyond the end ({layout.size} bytes)")
        if held is not None and br.length:
            # a partial copy serves the regions it verified and the padding between regions
            k = max(0, bisect.bisect_right(all_starts, br.offset) - 1)
            while k < len(layout.regions) and layout.regions[k].offset < br.offset + br.length:
                r = layout.regions[k]
                if r.end > br.offset and r.size and r.name not in held:
                    await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                        f"{layout.rel}: this node holds only part of the model, not {r.name}")
                k += 1
    chunk_bytes = min(max(request.chunk_bytes or digests.piece_bytes, MIN_CHUNK_BYTES), MAX_CHUNK_BYTES)
    all_regions = layout.regions
    model_path = Path(location.path)
    cacheable = chunk_bytes == digests.piece_bytes
    fd = os.open(layout.path, os.O_RDONLY)

    def read(offset: int, length: int) -> pb.ShardChunk:
        data = os.pread(fd, length, offset)
        if len(data) != length:
            raise ShardError(f"{layout.path}: short read at {offset} ({len(data)} of {length} bytes)")
        i = bisect.bisect_right(all_starts, offset) - 1
        region = all_regions[i] if i >= 0 else None
        digest = digests.chunk_digest(model_path, layout, offset, length, region) if cacheable else None
        if digest is None:
            digest = hashlib.sha256(data).digest()
            if cacheable:
                digests.remember_chunk(model_path, layout, offset, length, digest)
        if corrupt is not None:
            data = corrupt(offset, data)
        return pb.ShardChunk(offset=offset, data=data, sha256=digest)

    loop = asyncio.get_running_loop()
    pending: asyncio.Future | None = None
    try:
        plan = _chunks(request.ranges, request.resume_offset, chunk_bytes)
        nxt = next(plan, None)
        if nxt is not None:
            pending = loop.run_in_executor(None, read, *nxt)
        while pending is not None:
            try:
                chunk = await pending
            except (OSError, ShardError) as exc:
                pending = None
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"cannot read {layout.rel}: {exc}")
            nxt = next(plan, None)
            pending = loop.run_in_executor(None, read, *nxt) if nxt is not None else None
            yield chunk
    finally:
        if pending is not None:
            try:
                await pending  # never close the fd under a running read
            except Exception:  # noqa: BLE001, S110 - the call is over anyway
                pass
        os.close(fd)
        await asyncio.to_thread(digests.flush, model_path)
