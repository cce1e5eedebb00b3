"""The machine's cache of dequantized GGUF weights, on the bundled model (Q4_1 -> float32).

Expected values: a stage read from the cache must hold exactly the parameters the same
stage holds when dequantized from the GGUF file with the cache off (that path is checked
against transformers in test_reference); the budget arithmetic is the files' sizes on disk.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from ringlet.daemon.engine import dequant_cache
from ringlet.daemon.engine.stage import load_stage


@pytest.fixture()
def cache_home(tmp_path, monkeypatch) -> Path:
    """A machine cache of this test's own (``$XDG_CACHE_HOME``), budget at its default."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(dequant_cache.ENV, raising=False)
    return tmp_path / "ringlet" / "dequant"


def params(stage) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in tree_flatten(stage.model.parameters())}


def files(root: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in root.glob("*/*/*.safetensors")}


def test_a_stage_read_from_the_cache_equals_one_dequantized_from_the_file(cache_home, default_location, monkeypatch):
    first = load_stage(default_location, 0, 10, dtype="float32")  # writes blk.0-9 and token_embd
    written = files(cache_home)
    assert set(written) == {f"blk.{i}.safetensors" for i in range(10)} | {"token_embd.safetensors"}
    # every file holds its tensors in float32: 4 bytes a weight, plus a small header
    nbytes = {k: v.nbytes for k, v in tree_flatten(first.model.parameters())}
    layer0 = sum(n for k, n in nbytes.items() if k.startswith("model.layers.0."))
    assert layer0 <= written["blk.0.safetensors"] < layer0 + 64 * 1024

    cached = load_stage(default_location, 0, 10, dtype="float32")
    monkeypatch.setenv(dequant_cache.ENV, "0")  # the cache off: dequantized from the GGUF file again
    fresh = load_stage(default_location, 0, 10, dtype="float32")
    want = params(fresh)
    got = params(cached)
    assert set(got) == set(want)
    for name in want:
        assert got[name].dtype == want[name].dtype == np.float32
        assert np.array_equal(got[name], want[name]), name


def test_a_hit_is_only_a_read_and_a_broken_file_is_made_again(cache_home, default_location):
    load_stage(default_location, 0, 2, dtype="float32")
    folder = next(cache_home.glob("*/*"))
    # a hit reads the file: a layer file replaced by zeros of the same names and shapes is what loads
    arrays = mx.load(str(folder / "blk.1.safetensors"))
    mx.save_safetensors(str(folder / "blk.1.safetensors"), {k: mx.zeros_like(v) for k, v in arrays.items()})
    stage = load_stage(default_location, 1, 2, dtype="float32")
    assert all(not np.any(v) for k, v in params(stage).items() if k.startswith("model.layers.0.")), \
        "layer 1 was not read from its cache file"
    # a file cut short is ignored: the layer is dequantized again, equal, and written again whole
    (folder / "blk.1.safetensors").write_bytes(b"\x00" * 100)
    again = load_stage(default_location, 1, 2, dtype="float32")
    assert any(np.any(v) for k, v in params(again).items() if k.startswith("model.layers.0."))
    assert len(mx.load(str(folder / "blk.1.safetensors"))) == len(arrays)


def test_the_cache_keeps_to_its_budget_and_zero_writes_nothing(cache_home, default_location, monkeypatch):
    monkeypatch.setenv(dequant_cache.ENV, "0")
    load_stage(default_location, 0, 3, dtype="float32")
    assert files(cache_home) == {}
    # a budget of 2.5 layers' files: the least recently used go first
    monkeypatch.delenv(dequant_cache.ENV)
    load_stage(default_location, 5, 6, dtype="float32")
    layer = files(cache_home)["blk.5.safetensors"]
    monkeypatch.setenv(dequant_cache.ENV, str(int(2.5 * layer)))
    load_stage(default_location, 6, 9, dtype="float32")
    held = files(cache_home)
    assert sum(held.values()) <= 2.5 * layer
    assert set(held) == {"blk.7.safetensors", "blk.8.safetensors"}, held
    # weights kept quantized are not cached at all
    monkeypatch.delenv(dequant_cache.ENV)
    load_stage(default_location, 20, 21, dtype=None)
    assert "blk.20.safetensors" not in files(cache_home)


def test_the_weights_of_a_replaced_or_deleted_file_are_removed(cache_home, default_location, tmp_path):
    """A reinstalled model package (same path, new mtime) or a deleted copy leaves a key
    nobody can hit: writing the next key removes it. Expected folders by hand: one per
    live file."""
    import os
    import shutil

    from ringlet.daemon.engine.sources import ModelLocation

    copy = tmp_path / "models" / "copy.gguf"
    copy.parent.mkdir()
    shutil.copyfile(default_location.path, copy)
    at_copy = ModelLocation(name="copy", kind="gguf", path=copy)
    load_stage(at_copy, 0, 1, dtype="float32")
    (first,) = list(cache_home.iterdir())
    record = json.loads((first / dequant_cache.SOURCE).read_text())
    assert record == {"path": str(copy.resolve()), "size": copy.stat().st_size, "mtime_ns": copy.stat().st_mtime_ns}

    st = copy.stat()
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # "reinstalled": same path, newer file
    load_stage(at_copy, 0, 1, dtype="float32")
    (second,) = list(cache_home.iterdir())  # the first key's folder is gone
    assert second != first and (second / "v1-float32" / "blk.0.safetensors").is_file()

    copy.unlink()  # the copy deleted; the bundled file's first write sweeps its key
    load_stage(default_location, 0, 1, dtype="float32")
    (third,) = list(cache_home.iterdir())
    assert json.loads((third / dequant_cache.SOURCE).read_text())["path"] == str(Path(default_location.path).resolve())
