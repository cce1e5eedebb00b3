"""The node's disk caches on a real, tiny, full filesystem (a tmpfs of a few MB, its
free space taken by a filler file; in this process, no daemons): the prefix store's
disk tier and the dequantized-weights cache.

A write refused for want of space turns the tier off with a message naming the path,
the bytes needed and the bytes free; nothing half written is left or read back; what
was written before keeps serving, with the contents it was written with (checked
against the values :func:`test_prefix_store.filled` writes, not against what the store
returned before).
"""

from __future__ import annotations

import re
import types

import mlx.core as mx
import numpy as np
import pytest
from test_prefix_store import TOKEN_LAYER_BYTES, expect_contents, filled
from tinyfs import fill, tiny_fs, unfill

from ringlet.daemon.engine import dequant_cache
from ringlet.daemon.engine.prefix_disk import PrefixDisk
from ringlet.daemon.engine.prefix_store import PrefixStore

KEY = "0123456789abcdef"
N = 200  # tokens an entry: 200 x 2 layers x 128 bytes = 51.2 kB of KV, + 0.8 kB of token ids


def test_a_full_disk_turns_the_prefix_tier_off_and_what_it_holds_keeps_serving(tmp_path):
    with tiny_fs(tmp_path / "fs", "1m") as fs:
        told = []
        s = PrefixStore(N * 2 * TOKEN_LAYER_BYTES, 0, 2, disk=PrefixDisk(fs, 1 << 30, KEY))
        s.disk.on_off = told.append
        assert s.insert("", list(range(N)), filled(N, tag=1))
        assert s.insert("", list(range(1000, 1000 + N)), filled(N, tag=2))  # tag 1 spills to disk
        assert len(s.disk) == 1 and s.disk.info()["state"] == "on"
        free = fill(fs)
        assert free < 4096
        # tag 2 is evicted for room: its file cannot be written; the request path never raises
        assert s.insert("", list(range(2000, 2000 + N)), filled(N, tag=3))
        reason = s.disk.off
        assert reason is not None and told == [reason]
        assert re.fullmatch(rf"disk full: cannot write {re.escape(str(s.disk.dir))}/\S+\.safetensors "
                            r"\(the prefix cache's disk tier\): needs 52\.0 kB, \d+ bytes free there; .*", reason)
        assert s.info()["disk"]["state"] == f"off ({reason})"
        assert [p.name for p in s.disk.dir.iterdir() if not p.name.endswith(".safetensors")] == []  # no .tmp left
        assert len(s.disk) == 1  # only tag 1's file, whole
        # off: later spills are not tried (one event, not one per eviction)
        assert s.insert("", list(range(3000, 3000 + N)), filled(N, tag=4))
        assert told == [reason] and s.disk.writes == 1
        # what was written before serves, equal to what was written
        expect_contents(s.take("", list(range(N // 2))), N // 2, start=0, tag=1)
        unfill(fs)
        # a restart over the same files finds nothing damaged, and writes again
        again = PrefixStore(N * 2 * TOKEN_LAYER_BYTES, 0, 2, disk=PrefixDisk(fs, 1 << 30, KEY))
        assert again.disk.ignored == 0 and again.disk.off is None
        assert again.insert("", list(range(N)), filled(N, tag=5))
        assert again.insert("", list(range(1000, 1000 + N)), filled(N, tag=6))
        assert again.disk.writes == 1 and again.disk.info()["state"] == "on"


@pytest.fixture()
def cache_on(tmp_path, monkeypatch):
    """The machine cache (``$XDG_CACHE_HOME``) on a 4 MB tmpfs; the cache's off-state reset."""
    with tiny_fs(tmp_path / "fs", "4m") as fs:
        monkeypatch.setenv("XDG_CACHE_HOME", str(fs))
        monkeypatch.delenv(dequant_cache.ENV, raising=False)
        monkeypatch.setattr(dequant_cache, "_off", None)
        monkeypatch.setattr(dequant_cache, "on_off", [])
        yield fs


def test_a_full_disk_turns_the_weights_cache_off_and_the_load_goes_on(cache_on, tmp_path, monkeypatch):
    gguf = tmp_path / "model.gguf"  # the cache is keyed by the file's path, size and mtime only
    gguf.write_bytes(b"GGUF")
    cache = dequant_cache.DequantCache(gguf, mx.float32)
    blk0 = {"blk.0.w": mx.arange(50_000, dtype=mx.float32)}  # 200 kB
    cache.store("blk.0", blk0)
    assert np.array_equal(np.array(cache.load("blk.0", ["blk.0.w"])["blk.0.w"]), np.arange(50_000))
    told = []
    dequant_cache.on_off.append(told.append)
    fill(cache_on)
    # the store's own check sees room (another program takes the space right after it)
    plenty = types.SimpleNamespace(disk_usage=lambda p: types.SimpleNamespace(free=1 << 40),
                                   rmtree=dequant_cache.shutil.rmtree)
    monkeypatch.setattr(dequant_cache, "shutil", plenty)
    cache.store("blk.1", {"blk.1.w": mx.ones(50_000, dtype=mx.float32)})  # never raises
    reason = dequant_cache.off_reason()
    assert reason is not None and told == [reason]
    assert re.fullmatch(rf"disk full: cannot write {re.escape(str(cache.folder))}/blk\.1\.safetensors \(the "
                        r"dequantized-weights cache\): needs 200\.0 kB, \d+ bytes free there; .*", reason)
    assert dequant_cache.state()["state"] == f"off ({reason})"
    assert sorted(p.name for p in cache.folder.iterdir()) == ["blk.0.safetensors"]  # nothing half written
    assert cache.load("blk.1", ["blk.1.w"]) is None
    assert np.array_equal(np.array(cache.load("blk.0", ["blk.0.w"])["blk.0.w"]), np.arange(50_000))
    unfill(cache_on)
    cache.store("blk.2", {"blk.2.w": mx.ones(10, dtype=mx.float32)})  # off until the process restarts
    assert "blk.2" not in cache.held() and told == [reason]


def test_a_cache_file_shorter_than_its_header_is_never_read_as_whole(tmp_path):
    path = tmp_path / "blk.0.safetensors"
    with open(path, "wb") as f:
        mx.save_safetensors(f, {"w": mx.arange(1000, dtype=mx.float32)})
    assert dequant_cache.whole_safetensors(path)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 1)
    assert not dequant_cache.whole_safetensors(path)
