"""Peer-to-peer shard transfer: a node without the model files pulls its stage's bytes from a member.

Wire (``proto/ringlet.proto``, service ``Ring``):

* ``ShardManifest(ManifestRequest) -> Manifest``: the model's files; for one file its
  regions (header, tensors; :mod:`ringlet.daemon.shards.cache`) with offsets, sizes and,
  for the regions asked for, sha256 (computed lazily by the source and cached).
* ``FetchShard(ShardRequest) -> stream ShardChunk``: the bytes of the requested ranges
  in chunks of at most ``chunk_bytes``, each with the sha256 the source computed
  (or cached) before sending it.

The receiver (:func:`fetch_shard`) builds a sparse copy of the file (the header plus the
tensors of its layer range, at their original offsets) under
``<cache_dir>/<model>/<file>``; the loaders in :mod:`ringlet.daemon.engine.stage` read it
unchanged. It asks for all missing bytes in one call (neighbouring tensors merged into
shared ranges); the server cuts them into chunks on a fixed grid of file offsets
(1 MiB by default). Checks:

* **per region** (header and every tensor): the sha256 of the region as written
  must equal the source's digest from ``ShardManifest``. Each region is hashed as its
  bytes arrive, so each byte is hashed once when nothing goes wrong.
* **per chunk**: when a region does not match, every chunk overlapping it is re-read
  from disk and compared with the sha256 that came with it; the bytes of the chunks
  that differ are requested again (only those, and only where they belong to regions
  not verified yet). If every chunk matches its own digest but the region does not,
  the source's bytes contradict its manifest: the region is fetched once more, then
  the transfer fails with :class:`ShardError`.

Resumable and durable: the chunks received are recorded in a state file beside the data
(saved by a background thread after an ``fdatasync`` of the data it describes, and at
the end of every call); a transfer that stops (peer gone, process killed, task
cancelled) fetches only the missing bytes next time, a broken stream is resumed
automatically, and a warm cache fetches nothing. A test hook (:class:`ChunkCorrupter`,
or ``RINGLET_TEST_CORRUPT_CHUNK=N`` in the serving process's environment) flips a byte of
the N-th chunk served, after its digest was taken.

A node whose model file is itself a fetched sparse copy serves the regions it has
verified (and flags the others ``missing`` in its manifest), so any member holding a
range can pass it on.

An MLX/Hugging Face directory is fetched as its small files whole (config, tokenizer,
chat template) plus, for each ``*.safetensors`` file, its header and the stage's tensors
(sparse, like a GGUF file); ``mlx-lm``'s lazy loading reads only those.
"""

from __future__ import annotations

import asyncio
import bisect
import fcntl
import hashlib
import json
import logging
import os
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc

from ringlet.daemon.engine import gguf as gguf_source
from ringlet.daemon.engine.sources import ModelLocation
from ringlet.daemon.shards.cache import (
    DEFAULT_CHUNK_BYTES,
    HEADER,
    STATE_SUFFIX,
    WHOLE,
    DigestCache,
    FileLayout,
    LocalShard,
    Region,
    ShardError,
    merge_spans,
    model_files,
    overlap,
    read_gguf_header,
    safe_rel,
    safetensors_layout,
    sha256_range,
)
from ringlet.daemon.wire.rpc import ringlet_pb2 as pb

log = logging.getLogger(__name__)

#: Largest chunk a server sends, bytes (a request asking for more gets this).
MAX_CHUNK_BYTES = 16 * 1024 * 1024
MIN_CHUNK_BYTES = 4096
#: Environment variable of the serving process: corrupt the N-th chunk it serves (1-based), once.
CORRUPT_ENV = "RINGLET_TEST_CORRUPT_CHUNK"
#: gRPC codes after which a transfer is resumed on the same stub (up to ``retries`` times).
RETRIABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                       grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED,
                       grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED})
#: Missing ranges closer than this (bytes) are asked for as one range (see _request_ranges).
MERGE_GAP = 64 * 1024
#: A receiver saves its state (after an fdatasync of the data it describes, in a background
#: thread) at least this often during a transfer, seconds, and after every SYNC_BYTES written.
CHECKPOINT_S = 0.5
SYNC_BYTES = 32 * 1024 * 1024


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
    if model and model != location.name:
        await context.abort(grpc.StatusCode.NOT_FOUND, f"this node serves the model {location.name!r}, not {model!r}")
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
    out = pb.Manifest(model=location.name, kind=location.kind)
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
    :data:`DEFAULT_CHUNK_BYTES`; clamped to [4 KiB, :data:`MAX_CHUNK_BYTES`]), never span
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


# ------------------------------------------------------------------------------------------
# receiving side

@dataclass
class FetchResult:
    """What :func:`fetch_shard_detailed` did.

    Attributes:
        location: the local sparse model (``kind="gguf"``, ``path`` = the sparse file).
        layer_range: the half-open layer range covered.
        regions: regions (header + tensors) the range needs.
        bytes_needed: bytes of those regions.
        bytes_reused: of those, bytes already on disk before this call.
        bytes_fetched: chunk payload bytes received (re-sent chunks included).
        chunks_resent: chunks that failed their check and were fetched again.
        calls: ``FetchShard`` calls made.
        seconds: wall time of the whole call.
        allocated_bytes: disk blocks the sparse file uses (``st_blocks * 512``).
    """

    location: ModelLocation
    layer_range: tuple[int, int]
    regions: int
    bytes_needed: int
    bytes_reused: int
    bytes_fetched: int
    chunks_resent: int
    calls: int
    seconds: float
    allocated_bytes: int


class _Progress:
    """A rich progress bar (bytes, speed, ETA) on stderr; a no-op when disabled or when
    stderr is not a terminal."""

    def __init__(self, enabled: bool, description: str):
        self._bar = None
        if enabled and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self._bar = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                 TransferSpeedColumn(), TimeRemainingColumn(), console=Console(stderr=True))
            self._task = self._bar.add_task(description, total=0)

    def start(self) -> None:
        if self._bar is not None:
            self._bar.start()

    def stop(self) -> None:
        if self._bar is not None:
            self._bar.stop()

    def add_total(self, n: int) -> None:
        if self._bar is not None:
            total = self._bar.tasks[0].total or 0
            self._bar.update(self._task, total=total + n)

    def advance(self, n: int) -> None:
        if self._bar is not None:
            self._bar.advance(self._task, n)


class _Syncer:
    """Background durability: ``fdatasync`` the data file, then save the state snapshot
    taken before it, so a saved state never claims bytes a crash could lose, and the
    disk writes overlap the transfer instead of all waiting for the end."""

    def __init__(self, shard: LocalShard, fd: int):
        self.shard = shard
        self.fd = fd
        self._pending: dict | None = None
        self._cond = threading.Condition()
        self._stop = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="shard-sync", daemon=True)
        self._thread.start()

    def submit(self, snapshot: dict) -> None:
        """Sync and save ``snapshot`` soon (a newer snapshot replaces one not saved yet)."""
        with self._cond:
            self._pending = snapshot
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._stop:
                    self._cond.wait()
                snapshot, self._pending = self._pending, None
                if snapshot is None:
                    return
            try:
                os.fdatasync(self.fd)
                self.shard.save(snapshot)
            except OSError as exc:  # reported by close(); the final commit retries
                self._error = exc

    def close(self) -> None:
        """Finish the pending save and stop the thread."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join()
        if self._error is not None:
            log.warning("%s: background sync failed: %s", self.shard.path, self._error)


def _commit(shard: LocalShard, fd: int) -> None:
    """Make the data durable, then save the state that describes it (blocking)."""
    os.fdatasync(fd)
    shard.prune()
    shard.save()


class _Receiver:
    """Writes chunks into the sparse file and checks regions; all its methods run in one
    worker thread (the event loop only hands it batches of chunks).

    A chunk may span several regions (small tensors travel together) and the padding
    between them; each region is hashed as its bytes arrive, in order, so a region
    received whole in one call is hashed exactly once.
    """

    def __init__(self, shard: LocalShard, fd: int, regions: list[Region], expected: dict[str, bytes],
                 progress: _Progress):
        self.shard = shard
        self.fd = fd
        self.regions = sorted(regions, key=lambda r: r.offset)
        self.starts = [r.offset for r in self.regions]
        self.expected = expected
        self.progress = progress
        self.present = {r.name: shard.present_bytes(r) for r in self.regions}
        self.hashers: dict[str, list | None] = {}
        self.strikes: dict[str, int] = {}
        self.bytes_fetched = 0
        self.chunks_resent = 0
        self.requested: list[tuple[int, int]] = []
        self._req_starts: list[int] = []
        self._saved_at = time.monotonic()
        self._unsynced = 0
        self.syncer: _Syncer | None = None

    def start_call(self, ranges: list[tuple[int, int]]) -> None:
        """A ``FetchShard`` call for these ``(offset, length)`` ranges begins."""
        self.requested = sorted(ranges)
        self._req_starts = [a for a, _ in self.requested]
        self.syncer = _Syncer(self.shard, self.fd)

    def end_call(self) -> None:
        """The call is over (whatever its outcome): stop background syncing, then make the
        data durable and save the state."""
        if self.syncer is not None:
            self.syncer.close()
            self.syncer = None
        _commit(self.shard, self.fd)

    def absorb(self, chunks) -> None:
        """Write and account a batch of ``(offset, data, sha256)`` chunks; save the state
        now and then."""
        for offset, data, sha in chunks:
            self._absorb(offset, data, sha)
        if self._unsynced >= SYNC_BYTES or time.monotonic() - self._saved_at > CHECKPOINT_S:
            self.shard.prune()
            if self.syncer is not None:
                self.syncer.submit(self.shard.snapshot())
            self._saved_at = time.monotonic()
            self._unsynced = 0

    def _overlapping(self, start: int, end: int):
        k = max(0, bisect.bisect_right(self.starts, start) - 1)
        while k < len(self.regions) and self.regions[k].offset < end:
            r = self.regions[k]
            if r.end > start:
                yield r
            k += 1

    def _absorb(self, offset: int, data: bytes, sha: bytes) -> None:
        n = len(data)
        end = offset + n
        i = bisect.bisect_right(self._req_starts, offset) - 1
        if n == 0 or i < 0 or end > sum(self.requested[i]) or len(sha) != 32:
            raise ShardError(f"{self.shard.rel}: the peer sent {n} bytes at {offset}, which were not asked for")
        view = memoryview(data)
        done = 0
        while done < n:
            done += os.pwrite(self.fd, view[done:], offset + done)
        self.shard.chunks.append([offset, n, sha.hex()])
        complete = []
        for r in self._overlapping(offset, end):
            if r.name in self.shard.verified:
                continue
            a, b = max(r.offset, offset), min(r.end, end)
            # One pass: hash the region as it streams in, in order, from its first byte.
            h = self.hashers.get(r.name)
            if a == r.offset and self.present[r.name] == 0:
                h = self.hashers[r.name] = [hashlib.sha256(), a]
            if h is not None and h[1] == a:
                h[0].update(view[a - offset: b - offset])
                h[1] = b
            else:
                self.hashers[r.name] = None
            self.present[r.name] += b - a
            if self.present[r.name] >= r.size:
                complete.append(r)
        # Checked once the whole chunk is accounted: a failed check drops the chunk for
        # every region it overlaps.
        for r in complete:
            if r.name not in self.shard.verified and self.present[r.name] >= r.size:
                self.finish(r)
        self.bytes_fetched += n
        self._unsynced += n
        self.progress.advance(n)

    def finish(self, region: Region) -> None:
        """Check a region whose bytes are all on disk: mark it verified, or drop the chunks
        that fail their own sha256 (to be fetched again)."""
        h = self.hashers.pop(region.name, None)
        if h is not None and h[1] == region.end:
            digest = h[0].digest()
        else:  # resumed, or after a re-sent chunk: hash what is on disk
            digest = sha256_range(self.shard.path, region.offset, region.size)
        expected = self.expected[region.name]
        if digest == expected:
            self.shard.mark_verified(region, expected)
            return
        mine = [c for c in self.shard.chunks if overlap(c[0], c[0] + c[1], region.offset, region.end)]
        bad = [c for c in mine if hashlib.sha256(os.pread(self.fd, c[1], c[0])).hexdigest() != c[2]]
        if bad:
            log.warning("%s: %d chunk(s) at %s failed their sha256 (in %s); fetching them again",
                        self.shard.rel, len(bad), ", ".join(str(c[0]) for c in bad), region.name)
            self.chunks_resent += len(bad)
        else:
            strikes = self.strikes[region.name] = self.strikes.get(region.name, 0) + 1
            if strikes > 1:
                raise ShardError(f"{self.shard.rel}: the peer's bytes of {region.name} do not match the sha256 of "
                                 "its own manifest (twice); its model file may be changing or damaged")
            log.warning("%s: %s does not match the manifest's sha256; fetching it again", self.shard.rel, region.name)
            bad = mine
        lost = 0
        for c in bad:
            self.shard.chunks.remove(c)
            for r in self._overlapping(c[0], c[0] + c[1]):
                if r.name not in self.shard.verified:
                    k = overlap(c[0], c[0] + c[1], r.offset, r.end)
                    self.present[r.name] -= k
                    lost += k
                    if r is not region:
                        self.hashers[r.name] = None
        self.progress.add_total(lost)


@contextmanager
def _locked(shard_path: Path):
    """An exclusive lock on ``<file>.shard.lock`` (one transfer per file at a time, across
    processes). Raises ShardError when another transfer holds it."""
    lock_path = shard_path.with_name(shard_path.name + ".shard.lock")
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    fh = open(lock_path, "a+b")  # noqa: SIM115 - closed in finally
    try:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ShardError(f"another transfer is writing {shard_path}") from None
        yield
    finally:
        fh.close()


def _select(regions: dict[str, Region], block_count: int, start: int, end: int) -> list[str]:
    """GGUF tensor names the stage ``[start, end)`` needs, with the selection rule of
    :func:`ringlet.daemon.engine.gguf.stage_tensor_names` (blocks in range; the embedding on the
    first stage; the final norm and the head on the last, the embedding when tied).

    Raises:
        PlanError: a layer range outside the model.
    """
    from types import SimpleNamespace

    from ringlet.daemon.engine.stage import validate_range

    validate_range(start, end, block_count)
    view = SimpleNamespace(tensors=regions, config={"tie_word_embeddings": "output.weight" not in regions})
    return gguf_source.stage_tensor_names(view, start, end, start == 0, end == block_count)


def _block_count(names) -> int:
    """Decoder layers of a GGUF model from its tensor names (``blk.N.*``)."""
    blocks = [int(m.group(1)) for m in map(gguf_source._BLK.match, names) if m]
    return 1 + max(blocks) if blocks else 0


def _stage_names(path: Path, start: int, end: int) -> tuple[list[str], dict[str, Region], int]:
    """``(names, tensor regions, block_count)`` of the stage ``[start, end)`` from the (sparse)
    GGUF file's own header.

    Raises:
        ModelFormatError: an unreadable header or one without ``block_count``.
        PlanError: a layer range outside the model.
    """
    from ringlet.daemon.errors import ModelFormatError

    header = read_gguf_header(path)
    if header.block_count is None:
        raise ModelFormatError(f"{path}: GGUF metadata lacks {header.architecture}.block_count")
    regions = {name: Region(name, offset, size) for name, offset, size in header.tensors}
    return _select(regions, header.block_count, start, end), regions, header.block_count


def _manifest_regions(f: pb.ShardFile) -> tuple[dict[str, Region], dict[str, bytes]]:
    regions, digests = {}, {}
    for r in f.regions:
        if r.offset + r.size > f.size:
            raise ShardError(f"{f.path}: the peer's manifest puts {r.name} beyond the end of the file")
        regions[r.name] = Region(r.name, int(r.offset), int(r.size))
        if r.sha256:
            if len(r.sha256) != 32:
                raise ShardError(f"{f.path}: the peer's sha256 of {r.name} is not 32 bytes")
            digests[r.name] = bytes(r.sha256)
    return regions, digests


def _safe_model_dir(name: str) -> str:
    if not name or "/" in name:
        raise ShardError(f"refusing the model name {name!r} as a cache directory")
    return safe_rel(name)


async def _rpc(call, request, what: str, attempts: int = 5):
    """``await call(request)``, retried (up to ``attempts`` times) when the peer's control-RPC
    rate limit answers RESOURCE_EXHAUSTED, after the ``retry-after-ms`` it names.

    Raises:
        ShardError: the call failed (naming ``what`` and the gRPC status).
    """
    for attempt in range(attempts):
        try:
            return await call(request)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or attempt == attempts - 1:
                raise ShardError(f"{what}: {exc.code().name}: {exc.details()}") from None
            wait_ms = next((v for k, v in (exc.trailing_metadata() or ()) if k == "retry-after-ms"), "100")
            await asyncio.sleep(min(2.0, int(wait_ms) / 1000 if str(wait_ms).isdigit() else 0.1))
    raise AssertionError("unreachable")


async def _transfer(stub, request_base: dict, receiver: _Receiver, ranges: list[tuple[int, int]],
                    chunk_bytes: int, executor: ThreadPoolExecutor) -> None:
    """One ``FetchShard`` call for ``ranges``; chunks are handed to the receiver's worker
    thread in batches (whatever arrived while it was busy), so receiving, writing and
    hashing overlap."""
    receiver.start_call(ranges)
    loop = asyncio.get_running_loop()
    call = stub.FetchShard(pb.ShardRequest(ranges=[pb.ByteRange(offset=a, length=n) for a, n in ranges],
                                           chunk_bytes=chunk_bytes, **request_base))
    fut: asyncio.Future | None = None
    batch: list = []
    batch_bytes = 0
    limit = 4 * max(chunk_bytes, DEFAULT_CHUNK_BYTES)

    async def wait_worker() -> None:
        nonlocal fut
        if fut is not None:
            f, fut = fut, None
            await asyncio.shield(f)

    try:
        async for chunk in call:
            batch.append((chunk.offset, chunk.data, chunk.sha256))
            batch_bytes += len(chunk.data)
            if fut is not None and (fut.done() or batch_bytes >= limit):
                await wait_worker()
            if fut is None:
                fut = loop.run_in_executor(executor, receiver.absorb, batch)
                batch, batch_bytes = [], 0
    except BaseException:
        call.cancel()
        raise
    finally:
        await wait_worker()
        if batch:  # chunks already received are kept even when the stream broke
            await asyncio.shield(loop.run_in_executor(executor, receiver.absorb, batch))


def _request_ranges(shard: LocalShard, needed: list[Region], layout: list[Region]) -> list[tuple[int, int]]:
    """The ``(offset, length)`` ranges to ask for: the missing bytes of ``needed``, with
    neighbours merged across gaps of at most :data:`MERGE_GAP` bytes that lie in no region
    of the file's ``layout`` (alignment padding), so adjacent small tensors travel in
    shared chunks while nothing else is fetched or overwritten."""
    spans = sorted((a, a + n) for r in needed for a, n in shard.missing(r))
    if not spans:
        return []
    occupied = merge_spans((r.offset, r.end) for r in layout if r.size)
    starts = [a for a, _ in occupied]
    out = [list(spans[0])]
    for a, b in spans[1:]:
        gap0, gap1 = out[-1][1], a
        k = bisect.bisect_right(starts, gap1 - 1) - 1
        padding_only = gap1 <= gap0 or not (k >= 0 and overlap(gap0, gap1, *occupied[k]))
        if gap1 - gap0 <= MERGE_GAP and padding_only:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b - a) for a, b in out]


async def _fetch_regions(stub, base: dict, shard: LocalShard, fd: int, needed: list[Region], layout: list[Region],
                         expected: dict[str, bytes], bar: _Progress, executor: ThreadPoolExecutor, chunk_bytes: int,
                         retries: int, max_rounds: int, result: FetchResult) -> None:
    """Fetch until every region of ``needed`` is verified: one ``FetchShard`` call for all
    missing bytes, then one per round of re-sent chunks; broken streams are resumed."""
    for region in needed:
        shard.expect(region, expected[region.name])
    receiver = _Receiver(shard, fd, needed, expected, bar)
    need_bytes = sum(r.size for r in needed)
    missing = sum(n for r in needed for _, n in shard.missing(r))
    result.bytes_needed += need_bytes
    result.bytes_reused += need_bytes - missing
    bar.add_total(missing)
    unchecked = [r for r in needed if r.name not in shard.verified and shard.present_bytes(r) >= r.size]
    for region in unchecked:  # all on disk but never checked (stopped right before)
        await _in_thread(executor, receiver.finish, region)
    if unchecked:
        await _in_thread(executor, _commit, shard, fd)
    rounds = failures = 0
    while True:
        todo = _request_ranges(shard, needed, layout)
        if not todo:
            return
        rounds += 1
        if rounds > max_rounds + failures:
            raise ShardError(f"{shard.rel}: still missing {sum(n for _, n in todo)} bytes after {rounds - 1} calls")
        result.calls += 1
        try:
            await _transfer(stub, base, receiver, todo, chunk_bytes, executor)
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in RETRIABLE or failures >= retries:
                raise ShardError(f"{shard.rel}: FetchShard: {exc.code().name}: {exc.details()}") from None
            failures += 1
            log.warning("%s: transfer broke (%s); resuming (%d/%d)", shard.rel, exc.code().name, failures, retries)
            await asyncio.sleep(min(2.0, 0.2 * failures))
        finally:
            result.bytes_fetched += receiver.bytes_fetched
            result.chunks_resent += receiver.chunks_resent
            receiver.bytes_fetched = receiver.chunks_resent = 0
            await asyncio.shield(_in_thread(executor, receiver.end_call))


async def fetch_shard_detailed(stub, model_name: str, layer_range: tuple[int, int], cache_dir: Path | str,
                               progress: bool = True, *, chunk_bytes: int = 0, retries: int = 3,
                               max_rounds: int = 8) -> FetchResult:
    """Fetch, verify and cache the shard of ``layer_range`` from the peer behind ``stub``.

    Args:
        stub: a ``ringlet_pb2_grpc.RingStub`` on a channel from
            :func:`ringlet.daemon.wire.transport.make_channel` to a member holding the model.
        model_name: the model's name as the member serves it (``ModelLocation.name``,
            ``NodeInfo.model``).
        layer_range: half-open ``(start, end)``; the first stage also gets the
            embedding, the last the final norm and the head (the embedding when tied).
        cache_dir: the copy goes to ``<cache_dir>/<model name>/`` (a GGUF: its one file;
            an MLX directory: its files), each file with its state ``<file>.shard.json``
            beside it; reused and extended by later calls.
        progress: show a rich progress bar on stderr (only when it is a terminal).
        chunk_bytes: chunk size to ask for, bytes (0 = the server's default, 1 MiB, whose
            chunk digests the server caches).
        retries: how many times a broken stream (peer restarted, network glitch) is
            resumed before giving up.
        max_rounds: most ``FetchShard`` calls for re-sent chunks before giving up.

    Returns:
        :class:`FetchResult`; ``result.location`` (``kind`` ``"gguf"``: the sparse file;
        ``"mlx"``: the directory) loads with :func:`ringlet.daemon.engine.stage.load_stage` for
        any range within ``layer_range``, and its tokenizer with
        :func:`ringlet.daemon.engine.model_info.load_tokenizer`.

    Raises:
        ShardError: the peer does not serve the model or lacks the bytes, an RPC failed
            (after ``retries``), data failed verification repeatedly, or another
            transfer is writing the same file.
        PlanError: a layer range outside the model.
        ModelFormatError: the peer's files are not a usable GGUF / safetensors layout.
        OSError: the cache directory is not writable.
    """
    t0 = time.perf_counter()
    start, end = int(layer_range[0]), int(layer_range[1])
    files = await _rpc(stub.ShardManifest, pb.ManifestRequest(model=model_name), "ShardManifest")
    model = files.model
    directory = Path(cache_dir) / _safe_model_dir(model)
    bar = _Progress(progress, f"{model} [{start}, {end})")
    result = FetchResult(location=ModelLocation(model, files.kind, directory), layer_range=(start, end), regions=0,
                         bytes_needed=0, bytes_reused=0, bytes_fetched=0, chunks_resent=0, calls=0, seconds=0.0,
                         allocated_bytes=0)

    async def get(plan: _FilePlan) -> LocalShard:
        result.regions += len(plan.needed)
        return await _fetch_file(stub, model, directory, plan, bar, chunk_bytes, retries, max_rounds, result)

    bar.start()
    try:
        if files.kind == "gguf" and len(files.files) == 1:
            plan = await _plan_gguf(stub, model, safe_rel(files.files[0].path), start, end)
            shard = await get(plan)
            # The verified header must describe the tensors as the manifest did.
            local_names, local, _ = _stage_names(shard.path, start, end)
            if local_names != [r.name for r in plan.needed[1:]] or any(local[r.name] != r for r in plan.needed[1:]):
                raise ShardError(f"{plan.rel}: the peer's manifest does not describe the tensors of [{start}, {end}) "
                                 "as the file's own header does")
            result.location = ModelLocation(model, "gguf", shard.path)
            shards = [shard]
        elif files.kind == "mlx":
            shards = await _fetch_mlx(stub, model, files, directory, start, end, get)
        else:
            raise ShardError(f"the peer serves {model!r} as {files.kind!r} with {len(files.files)} files; "
                             "ringlet fetches GGUF files and MLX directories")
    finally:
        bar.stop()
    result.allocated_bytes = sum(s.allocated_bytes() for s in shards)
    result.seconds = time.perf_counter() - t0
    log.info("shard %s [%d, %d): %d bytes fetched, %d reused, %d chunk(s) re-sent, %.2f s", model, start,
             end, result.bytes_fetched, result.bytes_reused, result.chunks_resent, result.seconds)
    return result


@dataclass
class _FilePlan:
    """What to fetch of one file: its identity (size, sha256 of its first region: the
    header, or the whole small file), the regions needed and their digests."""

    rel: str
    size: int
    version: bytes
    regions: dict[str, Region]
    needed: list[Region]
    expected: dict[str, bytes]


async def _describe(stub, model: str, rel: str, digests: list[str] | None = None):
    """``(ShardFile, regions by name, digests by name)`` of one file from the peer."""
    desc = await _rpc(stub.ShardManifest, pb.ManifestRequest(model=model, file=rel, digests=digests or []),
                      "ShardManifest")
    if len(desc.files) != 1 or desc.files[0].path != rel:
        raise ShardError(f"{rel}: the peer's manifest describes another file")
    f = desc.files[0]
    regions, got = _manifest_regions(f)
    first = f.regions[0] if f.regions else None
    if first is None or first.offset != 0 or first.name not in got:
        raise ShardError(f"{rel}: the peer's manifest has no first region with a sha256")
    return f, regions, got


async def _plan(stub, model: str, rel: str, names: list[str], described=None) -> _FilePlan:
    """The plan for ``rel``: its first region (header / whole file) and the regions ``names``,
    with their digests from the peer.

    Raises:
        ShardError: the peer lacks some of them (a partial copy) or sent no digest.
    """
    f, regions, got = described or await _describe(stub, model, rel)
    first = f.regions[0].name
    lacking = [r.name for r in f.regions if r.missing and (r.name in names or r.name == first)]
    if lacking:
        raise ShardError(f"the peer holds only part of {model!r}; it lacks {lacking[0]}"
                         + (f" and {len(lacking) - 1} more" if len(lacking) > 1 else "") + f" (in {rel})")
    expected = {first: got[first]}
    if names:
        _, _, more = await _describe(stub, model, rel, names)
        if any(n not in more for n in names):
            raise ShardError(f"{rel}: the peer sent no sha256 for some of the regions asked for")
        expected.update(more)
    needed = [regions[first]] + [regions[n] for n in names if n != first]
    return _FilePlan(rel, int(f.size), got[first], regions, needed, expected)


async def _plan_gguf(stub, model: str, rel: str, start: int, end: int) -> _FilePlan:
    described = await _describe(stub, model, rel)
    _, regions, _ = described
    tensors = {n: r for n, r in regions.items() if n != HEADER}
    return await _plan(stub, model, rel, _select(tensors, _block_count(tensors), start, end), described)


async def _fetch_file(stub, model: str, directory: Path, plan: _FilePlan, bar: _Progress, chunk_bytes: int,
                      retries: int, max_rounds: int, result: FetchResult) -> LocalShard:
    """Bring the sparse copy of one file up to ``plan`` (under a lock on it)."""
    base = {"model": model, "file": plan.rel}
    with _locked(directory / plan.rel):  # taken before the state is read
        shard = LocalShard.open(directory, plan.rel, plan.size, plan.version)
        if shard.was_reset:
            gguf_source.open_gguf.cache_clear()  # a cached reader may describe the old file
        fd = os.open(shard.path, os.O_RDWR)
        executor = ThreadPoolExecutor(1, thread_name_prefix="shard-write")
        try:
            await _fetch_regions(stub, base, shard, fd, plan.needed, list(plan.regions.values()), plan.expected,
                                 bar, executor, chunk_bytes, retries, max_rounds, result)
        finally:
            executor.shutdown(wait=True)  # (even when cancelled) no write may outlive the fd
            os.close(fd)
    return shard


#: ``layers.N.`` anywhere in an MLX/Hugging Face tensor name (``model.layers.3.mlp...``).
_MLX_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
#: Files of a fetched MLX directory, beside it (hidden: never served or loaded as a model file).
MLX_FILE_LIST = ".shard-files.json"


def _select_mlx(names, num_layers: int, start: int, end: int) -> list[str]:
    """Tensors of an MLX/Hugging Face checkpoint the stage ``[start, end)`` needs: the
    ``layers.N.`` tensors of its layers; the embedding (``embed_tokens``) on the first
    stage and, when the head is tied (no ``lm_head``), on the last; the head and any other
    ``norm`` outside the layers on the last; every other tensor outside the layers on
    every stage (the stage loader drops what it does not use before reading).

    Raises:
        PlanError: a layer range outside the model.
    """
    from ringlet.daemon.engine.stage import validate_range

    validate_range(start, end, num_layers)
    first, last = start == 0, end == num_layers
    tied = not any("lm_head" in n for n in names)
    out = []
    for name in names:
        m = _MLX_LAYER.search(name)
        if m:
            keep = start <= int(m.group(1)) < end
        elif "embed_tokens" in name:
            keep = first or (last and tied)
        elif "lm_head" in name or "norm" in name:
            keep = last
        else:
            keep = True
        if keep:
            out.append(name)
    return out


async def _fetch_mlx(stub, model: str, files: pb.Manifest, directory: Path, start: int, end: int, get):
    """Fetch an MLX directory's small files whole, then the stage's tensors of each
    safetensors file (its header + tensors, sparse). Returns the local shards."""
    shards = []
    for f in files.files:
        safe_rel(f.path)
        if f.format not in ("whole", "safetensors"):
            raise ShardError(f"{f.path}: unknown file format {f.format!r} from the peer")
    for f in files.files:  # config.json first: it says how many layers there are
        if f.format == "whole":
            shards.append(await get(await _plan(stub, model, f.path, [])))
    try:
        config = json.loads((directory / "config.json").read_text())
        config = config.get("text_config", config)
        num_layers = int(config["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise ShardError(f"{model}: the peer's config.json has no num_hidden_layers") from None
    described = {f.path: await _describe(stub, model, f.path) for f in files.files if f.format == "safetensors"}
    if not described:
        raise ShardError(f"{model}: the peer lists no safetensors files")
    every = [n for _, regions, _ in described.values() for n in regions if n != HEADER]
    wanted = set(_select_mlx(every, num_layers, start, end))
    for rel, d in described.items():
        names = [n for n in d[1] if n in wanted]
        shard = await get(await _plan(stub, model, rel, names, d))
        local = safetensors_layout(shard.path, rel).by_name
        if any(local.get(n) != d[1][n] for n in names):
            raise ShardError(f"{rel}: the peer's manifest does not describe the tensors as the file's own header "
                             "does")
        shards.append(shard)
    (directory / MLX_FILE_LIST).write_text(json.dumps({"files": [f.path for f in files.files]}))
    return shards


async def _in_thread(executor: ThreadPoolExecutor, fn, *args):
    """Run ``fn(*args)`` in ``executor`` from the event loop."""
    return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)


async def fetch_shard(stub, model_name: str, layer_range: tuple[int, int], cache_dir: Path | str,
                      progress: bool = True, **kwargs) -> ModelLocation:
    """Fetch the shard of ``layer_range`` into ``cache_dir`` and return its local location;
    see :func:`fetch_shard_detailed` for the arguments and errors."""
    return (await fetch_shard_detailed(stub, model_name, layer_range, cache_dir, progress, **kwargs)).location


def cached_shard(cache_dir: Path | str, model_name: str, layer_range: tuple[int, int]) -> ModelLocation | None:
    """The local sparse copy of ``model_name`` under ``cache_dir`` if it already holds every
    verified region the stage ``layer_range`` needs, else ``None``. No network: reads the
    state files and the local headers (milliseconds)."""
    start, end = int(layer_range[0]), int(layer_range[1])
    directory = Path(cache_dir) / model_name
    if not directory.is_dir():
        return None
    try:
        listing = json.loads((directory / MLX_FILE_LIST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        listing = None
    try:
        if listing is not None:  # an MLX directory
            shards = {rel: LocalShard.load(directory / safe_rel(rel)) for rel in listing}
            if any(s is None or s.rel != rel for rel, s in shards.items()):
                return None
            config = json.loads((directory / "config.json").read_text())
            num_layers = int(config.get("text_config", config)["num_hidden_layers"])
            layouts = {rel: safetensors_layout(s.path, rel).by_name for rel, s in shards.items()
                       if rel.endswith(".safetensors")}
            wanted = set(_select_mlx([n for lay in layouts.values() for n in lay if n != HEADER], num_layers,
                                     start, end))
            for rel, shard in shards.items():
                if rel in layouts:
                    regions = layouts[rel]
                    names = [HEADER] + [n for n in regions if n in wanted]
                else:  # a small file fetched whole: one region, the size of the file
                    regions = {WHOLE: Region(WHOLE, 0, shard.size)}
                    names = [WHOLE]
                if not all(shard.is_verified(regions[n]) for n in names):
                    return None
            return ModelLocation(model_name, "mlx", directory)
        for state in sorted(directory.glob("*.gguf" + STATE_SUFFIX)):
            shard = LocalShard.load(state.with_name(state.name[: -len(STATE_SUFFIX)]))
            if shard is None or HEADER not in shard.verified or not shard.path.is_file():
                continue
            names, local, _ = _stage_names(shard.path, start, end)
            if all(shard.is_verified(local[n]) for n in names):
                return ModelLocation(model_name, "gguf", shard.path)
    except Exception as exc:  # noqa: BLE001 - an unusable cache is just not a hit
        log.debug("shard cache %s unusable: %s", directory, exc)
    return None
