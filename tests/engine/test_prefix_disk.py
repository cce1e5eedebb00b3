"""The prefix store's disk tier on its own (MLX in this process, real files, no daemons).

Caches follow test_prefix_store's rule (the key at layer L, position p of a cache tagged
t is ``t * 100_000 + L * 1_000 + p``), so what a hit loads back from disk is checked
against values written from that rule, not against what the store returned before.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from test_prefix_store import TOKEN_LAYER_BYTES, expect_contents, filled

from ringlet.daemon.engine.prefix_disk import PrefixDisk, model_key
from ringlet.daemon.engine.prefix_store import PrefixStore

KEY = "0123456789abcdef"


def store(tmp_path, memory_tokens: int, disk_bytes: int = 1 << 30, start: int = 0, end: int = 2,
          key: str = KEY) -> PrefixStore:
    """A store holding ``memory_tokens`` tokens of ``[start, end)`` in memory, spilling to ``tmp_path``."""
    budget = memory_tokens * TOKEN_LAYER_BYTES * (end - start)
    return PrefixStore(budget, start, end, disk=PrefixDisk(tmp_path, disk_bytes, key))


def test_an_entry_evicted_for_room_spills_and_a_hit_loads_it_back(tmp_path):
    s = store(tmp_path, memory_tokens=10)
    assert s.insert("", list(range(8)), filled(8, tag=1))
    assert s.insert("", list(range(100, 108)), filled(8, tag=2))  # evicts tag 1 to disk
    assert len(s) == 1 and len(s.disk) == 1
    assert s.disk.nbytes >= 8 * 2 * TOKEN_LAYER_BYTES  # two layers of 8 tokens, plus the header
    assert s.longest("", list(range(8)) + [999]) == 8  # the disk tier answers lookups
    caches = s.take("", list(range(6)))  # a shorter prefix of the spilled entry
    expect_contents(caches, 6, start=0, tag=1)
    assert s.stats.hits == 1 and s.disk.hits == 1
    assert len(s.disk) == 1 and s.longest("", list(range(100, 108))) == 8  # tag 2 went to disk for room
    info = s.info()["disk"]
    assert info["entries"] == 1 and info["writes"] == 2 and info["hits"] == 1


def test_the_files_survive_a_restart_and_serve_equal_contents(tmp_path):
    s = store(tmp_path, memory_tokens=10)
    s.insert("scope-a", list(range(8)), filled(8, tag=3))
    s.insert("scope-a", list(range(50, 58)), filled(8, tag=4))
    again = store(tmp_path, memory_tokens=10)  # a new process: the index comes from the files
    assert len(again) == 0 and len(again.disk) == 1
    assert again.longest("scope-b", list(range(8))) == 0  # scopes stay apart on disk too
    expect_contents(again.take("scope-a", list(range(8))), 8, start=0, tag=3)


def test_another_model_or_a_damaged_file_is_ignored(tmp_path):
    s = store(tmp_path, memory_tokens=10)
    s.insert("", list(range(8)), filled(8, tag=1))
    s.insert("", list(range(20, 28)), filled(8, tag=2))
    (only,) = list((tmp_path / KEY).glob("*.safetensors"))
    other = tmp_path / "fedcba9876543210"
    other.mkdir()
    (other / only.name).write_bytes(only.read_bytes())  # a file written for another model key
    (tmp_path / KEY / "1-99.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{bad json")
    mismatched = PrefixDisk(tmp_path, 1 << 30, "fedcba9876543210")
    assert len(mismatched) == 0 and mismatched.ignored == 1  # its header names KEY, not this key
    again = PrefixDisk(tmp_path, 1 << 30, KEY)
    assert len(again) == 1 and again.ignored == 1  # the damaged file is dropped, the good one kept
    assert not (tmp_path / KEY / "1-99.safetensors").exists()


def test_a_file_for_other_layers_is_not_served(tmp_path):
    s = store(tmp_path, memory_tokens=10, start=0, end=2)
    s.insert("", list(range(8)), filled(8, start=0, end=2, tag=1))
    s.insert("", list(range(20, 28)), filled(8, start=0, end=2, tag=2))
    wider = store(tmp_path, memory_tokens=10, start=0, end=3)  # a re-plan gave this stage layer 2 too
    assert wider.longest("", list(range(8))) == 0 and wider.take("", list(range(8))) is None
    narrower = store(tmp_path, memory_tokens=10, start=1, end=2)  # a subset of the file's layers
    expect_contents(narrower.take("", list(range(8))), 8, start=1, tag=1)


def test_the_tier_keeps_to_its_budget_least_recently_used_first(tmp_path):
    s = store(tmp_path, memory_tokens=8)
    s.insert("", [1000 + i for i in range(8)], filled(8, tag=1))
    s.insert("", [2000 + i for i in range(8)], filled(8, tag=2))  # tag 1 spills
    file_bytes = s.disk.nbytes  # one entry's file: its tensors and header
    assert file_bytes >= 8 * 2 * TOKEN_LAYER_BYTES
    s.disk.set_budget(int(2.5 * file_bytes))  # room for two such files
    for tag in range(3, 6):
        s.insert("", [tag * 1000 + i for i in range(8)], filled(8, tag=tag))
        assert s.disk.nbytes <= s.disk.budget_bytes
        assert sum(p.stat().st_size for p in s.disk.dir.glob("*.safetensors")) == s.disk.nbytes
    assert len(s.disk) == 2 and s.disk.evictions == 2  # tags 1 and 2 went, 3 and 4 stay
    assert s.longest("", [3000 + i for i in range(8)]) == 8 and s.longest("", [2000 + i for i in range(8)]) == 0
    s.disk.set_budget(0)
    assert len(s.disk) == 0 and not list(s.disk.dir.glob("*.safetensors"))


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_half_precision_caches_round_trip(tmp_path, dtype):
    caches = filled(4, tag=0)
    for c in caches:
        c.keys, c.values = c.keys.astype(dtype), c.values.astype(dtype)
    s = PrefixStore(1, 0, 2, disk=PrefixDisk(tmp_path, 1 << 30, KEY))  # memory too small: straight to disk
    assert not s.insert("", [1, 2, 3, 4], caches)  # alone over the memory budget: not kept at all
    s.set_budget(1 << 20)
    assert s.insert("", [1, 2, 3, 4], caches)
    s.set_budget(0)  # evicted for room: spilled
    assert len(s.disk) == 1
    s.set_budget(1 << 20)
    back = s.take("", [1, 2, 3, 4])
    for got, want in zip(back, caches, strict=True):
        assert got.keys.dtype == dtype
        assert mx.array_equal(got.keys, want.keys[..., :4, :]) and mx.array_equal(got.values, want.values[..., :4, :])


def test_the_model_key_follows_the_files_and_the_dtype(tmp_path):
    weights = tmp_path / "model.gguf"
    weights.write_bytes(b"weights")
    a = model_key([weights], "float32")
    assert model_key([weights], "float32") == a and model_key([weights], "native") != a
    weights.write_bytes(b"other weights")  # re-downloaded or converted: another size and mtime
    assert model_key([weights], "float32") != a
