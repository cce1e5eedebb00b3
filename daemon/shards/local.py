"""The receiver's sparse shard cache: a local copy of one model file holding only some regions.

**Receiver side** (:class:`LocalShard`): the receiver writes what it fetches into a
*sparse* copy of the file at the original offsets (the file's apparent size is the
source's; regions never fetched are holes that use no disk blocks). The existing
loaders work unchanged on it because they read only the tensors of their stage
(:func:`ringlet.daemon.engine.gguf.load_tensor` seeks to the tensor's offset). A JSON state
file beside it (``<file>.shard.json``) records which regions are verified (with
their sha256) and which chunks of unfinished regions are on disk, so a transfer
resumes where it stopped and later runs (another layer range, a restart) fetch only
what is missing.

No networking here (that is :mod:`ringlet.daemon.shards.transfer`); everything is
plain file I/O and JSON.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path

from ringlet.daemon.shards.fileio import atomic_write_json, sha256_range
from ringlet.daemon.shards.layout import STATE_SUFFIX, Region, ShardError

log = logging.getLogger(__name__)

#: Version of the state file format (a state of another version is discarded).
STATE_FORMAT = 2


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
        atomic_write_json(self.state_path, snapshot if snapshot is not None else self.snapshot())

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
