"""Download a stage's weight files from the Hugging Face Hub into the standard cache:
only the safetensors files that hold the stage's tensors (from the checkpoint's
``weight_map``), resumable across restarts and verified.

Per file (:func:`download`):

1. a file already in the snapshot is not fetched again (a re-shard downloads only the
   files of its newly assigned layers);
2. ``huggingface_hub.get_hf_file_metadata`` (HEAD) gives the ETag, size and URL;
3. the bytes go to ``<cache>/models--ORG--NAME/.ringlet/partial/<etag>`` with
   ``huggingface_hub.file_download.http_get``, resuming from what that file already
   holds (``Range: bytes=N-``): a process killed half way starts again where it
   stopped. (``hf_hub_download`` itself downloads to a process-unique temporary file
   that nothing resumes after a kill.) One process per file at a time (a lock);
4. the file is checked against the Hub's ETag: the sha256 of an LFS file, the git
   blob id of another, else its size; a mismatch deletes it;
5. it becomes the cache's blob (``blobs/<etag>``) and ``hf_hub_download`` links it
   into the snapshot, as if it had downloaded it.

Before any byte, :func:`check_disk` compares what is missing with the free space.
:class:`DownloadProgress` counts bytes for the rich bar, ``/v1/cluster``, ``status``
and the dashboard.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import re
import shutil
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

from ringlet.daemon.engine.hub import RINGLET_DIR, HubModel, SilentBar
from ringlet.daemon.engine.stage_tensors import stage_files
from ringlet.daemon.errors import RingletError, disk_full, human_bytes
from ringlet.daemon.shards.layout import ShardError

log = logging.getLogger(__name__)


def stage_weight_files(hub: HubModel, start: int, end: int) -> list[str]:
    """The weight files the stage ``[start, end)`` needs (every file when the checkpoint
    has no known ``weight_map``), sorted.

    Raises:
        PlanError: a layer range outside the model.
    """
    if not hub.weight_map:
        return hub.weight_files
    return stage_files(hub.weight_map, hub.num_layers, start, end)


class DownloadProgress:
    """Bytes of one download of several files, thread-safe: what the progress bar and
    ``/v1/cluster`` show (:meth:`to_dict`)."""

    def __init__(self, what: str, total_bytes: int, files: int):
        self.what = what
        self.total_bytes = total_bytes
        self.done_bytes = 0
        self.files_total = files
        self.files_done = 0
        self.file = ""
        self.started = time.monotonic()
        self._fetched = 0  # bytes received by this process (the rate's numerator)
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        """Count ``n`` bytes received (negative: a server that ignored a range; they are
        received again)."""
        with self._lock:
            self.done_bytes += n
            self._fetched += n

    def skip(self, n: int) -> None:
        """Count ``n`` bytes that were already on disk."""
        with self._lock:
            self.done_bytes += n

    def to_dict(self) -> dict:
        """``what``, ``file``, ``files_done``/``files_total``, ``bytes_done``/``bytes_total``,
        ``rate_bytes_per_s`` and ``eta_s`` (``None`` until bytes flow)."""
        with self._lock:
            elapsed = max(1e-6, time.monotonic() - self.started)
            rate = self._fetched / elapsed if self._fetched > 0 else None
            left = max(0, self.total_bytes - self.done_bytes)
            return {"what": self.what, "file": self.file, "files_done": self.files_done,
                    "files_total": self.files_total, "bytes_done": self.done_bytes, "bytes_total": self.total_bytes,
                    "rate_bytes_per_s": rate, "eta_s": left / rate if rate else None}

    def bar_class(self):
        """A progress-bar class for ``huggingface_hub``'s ``http_get`` that counts here."""
        progress = self

        class _Count(SilentBar):
            def update(self, n: int = 1) -> None:
                progress.add(n)

        return _Count


def _partial(hub: HubModel, etag: str) -> Path:
    return hub.storage / RINGLET_DIR / "partial" / etag


def _partial_bytes(hub: HubModel, name: str) -> int:
    sha = hub.files.get(name).sha256 if name in hub.files else None
    if not sha:
        return 0
    try:
        return _partial(hub, sha).stat().st_size
    except OSError:
        return 0


def missing_bytes(hub: HubModel, names: list[str]) -> int:
    """Bytes still to download of ``names`` (sizes from the Hub, less partial downloads)."""
    return sum(max(0, (hub.files[n].size or 0) - _partial_bytes(hub, n)) for n in names
               if not hub.cached(n) and n in hub.files)


def total_bytes(hub: HubModel, names: list[str]) -> int:
    """Bytes of the files ``names`` that the snapshot lacks (sizes from the Hub)."""
    return sum(hub.files[n].size or 0 for n in names if not hub.cached(n) and n in hub.files)


def check_disk(hub: HubModel, names: list[str], what: str) -> None:
    """Check the cache's disk can take what is missing of ``names``.

    Raises:
        RingletError: not enough free space; the message names the need, the free space,
            the shortfall and the directory.
    """
    need = missing_bytes(hub, names)
    if need <= 0:
        return
    where = hub.storage
    probe = where
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if need > free:
        raise RingletError(f"not enough disk space for {what}: {human_bytes(need)} to download into {where}, "
                           f"{human_bytes(free)} free (short by {human_bytes(need - free)}); free some space or "
                           "point HF_HUB_CACHE at a larger disk")


@contextmanager
def _file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # another process downloading the same file: wait for it
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _verify(path: Path, etag: str, size: int | None, name: str) -> None:
    """Check a downloaded file against the Hub's ETag (sha256 or git blob id) and size.

    Raises:
        ShardError: a mismatch (the file is deleted).
    """
    actual = path.stat().st_size
    problem = None
    if size is not None and actual != size:
        problem = f"{actual} bytes, the Hub says {size}"
    elif re.fullmatch(r"[0-9a-f]{64}", etag) or re.fullmatch(r"[0-9a-f]{40}", etag):
        digest = hashlib.sha256() if len(etag) == 64 else hashlib.sha1(b"blob %d\0" % actual, usedforsecurity=False)
        with open(path, "rb") as fh:
            while chunk := fh.read(8 * 1024 * 1024):
                digest.update(chunk)
        if digest.hexdigest() != etag:
            problem = f"{'sha256' if len(etag) == 64 else 'git blob id'} {digest.hexdigest()[:16]}…, the Hub's " \
                      f"is {etag[:16]}…"
    if problem:
        path.unlink(missing_ok=True)
        raise ShardError(f"{name}: the download does not match the Hub ({problem}); it was deleted, run again")


def _left(partial: Path, size: int | None) -> int:
    """Bytes of a ``size``-byte file still to write into ``partial`` (0 when unknown)."""
    try:
        return max(0, (size or 0) - partial.stat().st_size)
    except OSError:
        return size or 0


def _download_one(hub: HubModel, name: str, progress: DownloadProgress) -> int:
    """Download one file into the cache (see the module docstring); returns bytes received.

    Raises:
        DiskFull: the disk filled up while the file was written (the bytes received stay
            in the partial file, never in the cache, and the next run resumes from them).
        ShardError: the file does not match the Hub's ETag (deleted).
    """
    from huggingface_hub import hf_hub_download
    from huggingface_hub.file_download import get_hf_file_metadata, hf_hub_url, http_get
    from huggingface_hub.utils import build_hf_headers

    url = hf_hub_url(hub.repo, name, revision=hub.revision, endpoint=hub.endpoint)
    meta = get_hf_file_metadata(url)
    etag, size = meta.etag, meta.size
    if not etag or not re.fullmatch(r"[0-9A-Za-z_.-]{1,128}", etag) or etag.startswith("."):
        raise ShardError(f"{hub.repo}/{name}: the Hub gave no usable ETag ({etag!r}); cannot verify the download")
    expected = hub.files[name].sha256 if name in hub.files else None
    if expected and etag != expected:
        raise ShardError(f"{hub.repo}/{name}: the Hub's ETag {etag[:16]}… is not the sha256 it listed "
                         f"({expected[:16]}…)")
    blob = hub.storage / "blobs" / etag
    received = 0
    if not blob.exists():
        partial = _partial(hub, etag)
        with _file_lock(partial.with_name(partial.name + ".lock")):
            if not blob.exists():
                have = partial.stat().st_size if partial.exists() else 0
                if size is not None and have > size:
                    partial.unlink()
                    have = 0
                progress.skip(have)
                headers = build_hf_headers()
                if urlsplit(meta.location).netloc != urlsplit(url).netloc:
                    headers.pop("authorization", None)  # a CDN: the token stays with the Hub
                before = progress.done_bytes
                try:
                    with open(partial, "ab") as fh:
                        if size is None or have < size:
                            http_get(meta.location, fh, resume_size=have, headers=headers, expected_size=size,
                                     displayed_filename=name, tqdm_class=progress.bar_class())
                except OSError as exc:  # a full disk: what arrived stays in the partial file, to resume
                    full = disk_full(exc, partial, _left(partial, size), f"downloading {hub.repo}/{name}")
                    if full is None:
                        raise
                    raise full from None
                received = progress.done_bytes - before
                _verify(partial, etag, size, f"{hub.repo}/{name}")
                blob.parent.mkdir(parents=True, exist_ok=True)
                os.replace(partial, blob)
    elif size:
        progress.skip(size)
    # the snapshot's entry, by the library (it finds the blob and only links it)
    hf_hub_download(hub.repo, name, revision=hub.revision, cache_dir=hub.cache_dir, endpoint=hub.endpoint)
    return received


def download(hub: HubModel, names: list[str], progress: DownloadProgress | None = None,
             cancel: threading.Event | None = None) -> int:
    """Download the files ``names`` of ``hub``'s commit that the snapshot lacks; blocking.

    Returns the bytes received. ``cancel`` set: stop before the next file.

    Raises:
        RingletError: not enough disk space (checked first); :class:`DiskFull` when it ran
            out during the download (another program took the space).
        ShardError: a download failed its check.
        huggingface_hub / OSError errors: the Hub cannot be reached (the caller decides).
    """
    todo = [n for n in names if not hub.cached(n)]
    progress = progress or DownloadProgress(hub.repo, total_bytes(hub, todo), len(todo))
    check_disk(hub, todo, f"{hub.repo} ({len(todo)} file(s))")
    received = 0
    for name in todo:
        if cancel is not None and cancel.is_set():
            break
        progress.file = name
        received += _download_one(hub, name, progress)
        progress.files_done += 1
    progress.file = ""
    if todo:
        log.info("%s: downloaded %d file(s), %.1f MB", hub.ident, len(todo), received / 1e6)
    return received
