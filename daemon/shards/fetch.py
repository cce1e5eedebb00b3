"""Receiving side of a shard transfer, on the wire: bring the sparse copy of one file up to
its :class:`ringlet.daemon.shards.plan.FilePlan` with ``FetchShard`` calls.

All missing bytes are asked for in one call (neighbouring tensors merged into shared
ranges, :func:`_request_ranges`); the chunks are written and checked by
:class:`ringlet.daemon.shards.receiver.Receiver`, then one more call per round of
re-sent chunks. Resumable: a transfer that stops (peer gone, process killed, task
cancelled) fetches only the missing bytes next time, a broken stream is resumed
automatically, and a warm cache fetches nothing. One transfer per file at a time (a
lock file beside it).
"""

from __future__ import annotations

import asyncio
import bisect
import fcntl
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc

from ringlet.daemon.engine import gguf as gguf_source
from ringlet.daemon.engine.sources import ModelLocation
from ringlet.daemon.shards.layout import DEFAULT_CHUNK_BYTES, Region, ShardError
from ringlet.daemon.shards.local import LocalShard, merge_spans, overlap
from ringlet.daemon.shards.plan import FilePlan
from ringlet.daemon.shards.receiver import Receiver, TransferProgress, commit
from ringlet.daemon.wire.rpc import ringlet_pb2 as pb

log = logging.getLogger(__name__)

#: gRPC codes after which a transfer is resumed on the same stub (up to ``retries`` times).
RETRIABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                       grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED,
                       grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED})
#: Missing ranges closer than this (bytes) are asked for as one range (see _request_ranges).
MERGE_GAP = 64 * 1024


@dataclass
class FetchResult:
    """What :func:`ringlet.daemon.shards.transfer.fetch_shard_detailed` did.

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


async def _transfer(stub, request_base: dict, receiver: Receiver, ranges: list[tuple[int, int]],
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
                         expected: dict[str, bytes], bar: TransferProgress, executor: ThreadPoolExecutor,
                         chunk_bytes: int, retries: int, max_rounds: int, result: FetchResult) -> None:
    """Fetch until every region of ``needed`` is verified: one ``FetchShard`` call for all
    missing bytes, then one per round of re-sent chunks; broken streams are resumed."""
    for region in needed:
        shard.expect(region, expected[region.name])
    receiver = Receiver(shard, fd, needed, expected, bar)
    need_bytes = sum(r.size for r in needed)
    missing = sum(n for r in needed for _, n in shard.missing(r))
    result.bytes_needed += need_bytes
    result.bytes_reused += need_bytes - missing
    bar.add_total(missing)
    unchecked = [r for r in needed if r.name not in shard.verified and shard.present_bytes(r) >= r.size]
    for region in unchecked:  # all on disk but never checked (stopped right before)
        await _in_thread(executor, receiver.finish, region)
    if unchecked:
        await _in_thread(executor, commit, shard, fd)
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


async def fetch_file(stub, model: str, directory: Path, plan: FilePlan, bar: TransferProgress, chunk_bytes: int,
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


async def _in_thread(executor: ThreadPoolExecutor, fn, *args):
    """Run ``fn(*args)`` in ``executor`` from the event loop."""
    return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)
