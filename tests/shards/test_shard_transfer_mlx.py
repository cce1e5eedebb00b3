"""Shard transfer of an MLX directory over real gRPC on 127.0.0.1: small files whole, the
stage's tensors of each safetensors file sparse; the fetched stage computes exactly what
the original directory does."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import mlx.core as mx
import pytest
from test_shard_transfer import Servicer, serving
from tiny_models import CONFIGS, make_tiny_model

from ringlet.daemon.engine.model_info import load_tokenizer
from ringlet.daemon.engine.sources import resolve
from ringlet.daemon.engine.stage import load_stage
from ringlet.daemon.shards import transfer as shard_transfer
from ringlet.daemon.shards.digests import DigestCache
from ringlet.daemon.shards.layout import safetensors_layout


def split_checkpoint(directory: Path) -> None:
    """Re-save ``model.safetensors`` as two files with an index, as large checkpoints are."""
    weights = mx.load(str(directory / "model.safetensors"))
    parts: list[dict] = [{}, {}]
    for name, value in weights.items():
        late = any(f"layers.{i}." in name for i in (2, 3)) or not name.startswith("model.layers.") and (
            "norm" in name or "lm_head" in name)
        parts[int(late)][name] = value
    index = {"metadata": {}, "weight_map": {}}
    for i, part in enumerate(parts):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        mx.save_safetensors(str(directory / fname), part)
        index["weight_map"].update(dict.fromkeys(part, fname))
    (directory / "model.safetensors").unlink()
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def source(request, tmp_path_factory):
    directory = make_tiny_model(request.param, tmp_path_factory.mktemp("src") / f"tiny-{request.param}")
    split_checkpoint(directory)
    return resolve(str(directory))


def fetch(location, layers, cache):
    async def main():
        async with serving(Servicer(location, DigestCache(None))) as (stub, _):
            return await shard_transfer.fetch_shard_detailed(stub, location.name, layers, cache, progress=False)

    return asyncio.run(main())


def run_stage(location, start, end, x):
    stage = load_stage(location, start, end, dtype="float32")
    y = stage(x, stage.make_cache())
    mx.eval(y)
    return y


@pytest.mark.parametrize("layers", [(1, 3), (0, 1), (3, 4)])
def test_fetched_mlx_stage_equals_the_original(source, layers, tmp_path):
    result = fetch(source, layers, tmp_path)
    fetched = result.location
    assert fetched.kind == "mlx" and fetched.path == tmp_path / source.name
    assert result.bytes_fetched == result.bytes_needed and result.chunks_resent == 0
    total = sum(p.stat().st_size for p in source.path.iterdir())
    assert result.bytes_needed < 0.8 * total  # not the whole model

    hidden = CONFIGS[json.loads((source.path / "config.json").read_text())["model_type"]]["hidden_size"]
    start, end = layers
    x = (mx.array([[5, 17, 42, 7]]) if start == 0
         else mx.random.normal((1, 4, hidden), key=mx.random.key(1)).astype(mx.float32))
    assert mx.array_equal(run_stage(source, start, end, x), run_stage(fetched, start, end, x)).item()

    # only this stage's layers are on disk
    for f in fetched.path.glob("*.safetensors"):
        layout = safetensors_layout(f, f.name).by_name
        state = json.loads(f.with_name(f.name + ".shard.json").read_text())
        held = {n for n in state["verified"] if n.startswith("model.layers.")}
        assert {int(n.split(".")[2]) for n in held} <= set(range(start, end))
        assert held == {n for n in layout if n.startswith("model.layers.") and start <= int(n.split(".")[2]) < end}

    assert load_tokenizer(fetched).encode("Once upon") == load_tokenizer(source).encode("Once upon")
    assert shard_transfer.cached_shard(tmp_path, source.name, layers) == fetched
    assert shard_transfer.cached_shard(tmp_path, source.name, (0, 4)) is None
    again = fetch(source, layers, tmp_path)
    assert again.bytes_fetched == 0 and again.calls == 0
