"""Receiving side of a shard transfer, on disk: write the chunks a peer streams into the
sparse local copy (:class:`ringlet.daemon.shards.local.LocalShard`), check every region,
and keep the state durable while the transfer runs.

Checks:

* **per region** (header and every tensor): the sha256 of the region as written
  must equal the source's digest from ``ShardManifest``. Each region is hashed as its
  bytes arrive, so each byte is hashed once when nothing goes wrong.
* **per chunk**: when a region does not match, every chunk overlapping it is re-read
  from disk and compared with the sha256 that came with it; the bytes of the chunks
  that differ are requested again (only those, and only where they belong to regions
  not verified yet). If every chunk matches its own digest but the region does not,
  the source's bytes contradict its manifest: the region is fetched once more, then
  the transfer fails with :class:`ringlet.daemon.shards.layout.ShardError`.

Durable: the chunks received are recorded in a state file beside the data (saved by a
background thread after an ``fdatasync`` of the data it describes, and at the end of
every call), so a saved state never claims bytes a crash could lose.

The network side of receiving is :mod:`ringlet.daemon.shards.fetch`.
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import os
import sys
import threading
import time

from ringlet.daemon.errors import disk_full
from ringlet.daemon.shards.fileio import sha256_range
from ringlet.daemon.shards.layout import Region, ShardError
from ringlet.daemon.shards.local import LocalShard, overlap

log = logging.getLogger(__name__)

#: A receiver saves its state (after an fdatasync of the data it describes, in a background
#: thread) at least this often during a transfer, seconds, and after every SYNC_BYTES written.
CHECKPOINT_S = 0.5
SYNC_BYTES = 32 * 1024 * 1024


class TransferProgress:
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


def commit(shard: LocalShard, fd: int) -> None:
    """Make the data durable, then save the state that describes it (blocking)."""
    os.fdatasync(fd)
    shard.prune()
    shard.save()


class Receiver:
    """Writes chunks into the sparse file and checks regions; all its methods run in one
    worker thread (the event loop only hands it batches of chunks).

    A chunk may span several regions (small tensors travel together) and the padding
    between them; each region is hashed as its bytes arrive, in order, so a region
    received whole in one call is hashed exactly once.
    """

    def __init__(self, shard: LocalShard, fd: int, regions: list[Region], expected: dict[str, bytes],
                 progress: TransferProgress):
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
        commit(self.shard, self.fd)

    def absorb(self, chunks) -> None:
        """Write and account a batch of ``(offset, data, sha256)`` chunks; save the state
        now and then.

        Raises:
            DiskFull: the disk is full (names the file, the bytes still to receive, and the
                space free); the chunks written before are kept, the rest fetched next time.
            ShardError: a chunk nobody asked for, or a region the peer keeps getting wrong.
        """
        for offset, data, sha in chunks:
            self._absorb(offset, data, sha)
        if self._unsynced >= SYNC_BYTES or time.monotonic() - self._saved_at > CHECKPOINT_S:
            self.shard.prune()
            if self.syncer is not None:
                self.syncer.submit(self.shard.snapshot())
            self._saved_at = time.monotonic()
            self._unsynced = 0

    def left(self) -> int:
        """Bytes of this transfer's regions not on disk yet."""
        return sum(max(0, r.size - self.present[r.name]) for r in self.regions)

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
        try:
            while done < n:
                done += os.pwrite(self.fd, view[done:], offset + done)
        except OSError as exc:  # a full disk: the chunk is not recorded, so it is fetched again
            full = disk_full(exc, self.shard.path, self.left(), f"a shard from a peer, {self.shard.rel}")
            raise (full or exc) from None
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
