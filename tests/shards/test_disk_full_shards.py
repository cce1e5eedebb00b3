"""Shards onto a real, tiny, full filesystem (a tmpfs of a few MB, its free space taken
by a filler file; in this process): a download from a Hub served on this machine
(:mod:`hub_server`) and a peer's shard written by the receiver.

The disk fills *during* the write (another program took the space after the free-space
check, which is stood in for here by skipping that check): the error names the file,
the bytes still needed and the bytes free; nothing partly written becomes a file of the
cache; once space is back the same call resumes and the result equals the source's
bytes.
"""

from __future__ import annotations

import hashlib
import os
import re

import pytest
from hub_server import FakeHub, point_hub_client
from tiny_models import sharded_model_files, stage_file_names
from tinyfs import fill, tiny_fs, unfill

from ringlet.daemon.engine.hub import parse_ref, resolve_hub
from ringlet.daemon.errors import DiskFull
from ringlet.daemon.shards import hub_fetch
from ringlet.daemon.shards.layout import Region
from ringlet.daemon.shards.local import LocalShard
from ringlet.daemon.shards.receiver import Receiver, TransferProgress

REPO = "test-org/tiny"


def test_a_download_that_fills_the_disk_names_it_and_resumes_once_there_is_room(tmp_path, monkeypatch):
    files = sharded_model_files()
    with FakeHub() as server, tiny_fs(tmp_path / "fs", "4m") as fs:
        server.add_commit(REPO, files)
        point_hub_client(monkeypatch, server.endpoint("t"), str(fs / "hf"))
        model = resolve_hub(parse_ref(REPO))
        name = max(stage_file_names(1, 2), key=lambda n: len(files[n]))
        data = files[name]
        partial = model.storage / ".ringlet" / "partial" / hashlib.sha256(data).hexdigest()
        free = fill(fs, leave=len(data) // 2)
        assert 0 < free < len(data)
        monkeypatch.setattr(hub_fetch, "check_disk", lambda *a: None)  # the space went after the check
        with pytest.raises(DiskFull) as err:
            hub_fetch.download(model, [name])
        written = partial.stat().st_size
        assert 0 < written < len(data)
        assert re.fullmatch(rf"disk full: cannot write {re.escape(str(partial))} \(downloading {REPO}/{name}\): "
                            rf"needs {hub_fetch.human_bytes(len(data) - written)}, \d+ bytes free there; .*",
                            str(err.value))
        assert not model.cached(name) and not (model.storage / "blobs" / partial.name).exists()
        assert data.startswith(partial.read_bytes())  # what arrived is kept, to resume from
        unfill(fs)
        hub_fetch.download(model, [name])
        assert [e.range for e in server.downloads("t") if e.file == name][-1] == f"bytes={written}-"
        assert (model.snapshot / name).read_bytes() == data


def test_a_peer_shard_that_fills_the_disk_names_it_and_nothing_unchecked_is_verified(tmp_path):
    data = os.urandom(600_000)
    regions = [Region("header", 0, 100_000), Region("blk.0", 100_000, 500_000)]
    expected = {r.name: hashlib.sha256(data[r.offset:r.end]).digest() for r in regions}
    chunks = [(o, data[o:o + 65536], hashlib.sha256(data[o:o + 65536]).digest()) for o in range(0, len(data), 65536)]

    def receive(shard: LocalShard, todo) -> Receiver:
        fd = os.open(shard.path, os.O_RDWR)
        receiver = Receiver(shard, fd, regions, expected, TransferProgress(False, ""))
        receiver.start_call([(0, len(data))])
        try:
            receiver.absorb(todo)
        finally:
            receiver.syncer.close()
            os.close(fd)
        return receiver

    with tiny_fs(tmp_path / "fs", "2m") as fs:
        shard = LocalShard.open(fs / "cache", "m.gguf", len(data), expected["header"])
        shard.save()
        free = fill(fs, leave=300_000)
        with pytest.raises(DiskFull) as err:
            receive(shard, chunks)
        message = str(err.value)
        assert re.fullmatch(rf"disk full: cannot write {re.escape(str(shard.path))} \(a shard from a peer, "
                            r"m\.gguf\): needs \d+\.\d kB, \d+ bytes free there; .*", message)
        needed = float(re.search(r"needs (\S+) kB", message).group(1)) * 1000
        assert free < len(data) and len(data) - free - 65536 <= needed <= len(data) - free + 65536
        assert "blk.0" not in shard.verified and shard.is_verified(regions[0])  # the header came whole
        written = sum(c[1] for c in shard.chunks)
        unfill(fs)
        shard.save()
        again = LocalShard.open(fs / "cache", "m.gguf", len(data), expected["header"])
        assert sum(c[1] for c in again.chunks) == written  # resumes from the chunks that were written
        missing = {a for a, _ in again.missing(regions[1])}
        receive(again, [c for c in chunks if c[0] + len(c[1]) > min(missing)])
        assert again.is_verified(regions[1]) and again.path.read_bytes() == data
