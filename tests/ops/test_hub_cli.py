"""``ringlet models`` and ``ringlet run --model ORG/NAME`` as a user runs them: real
processes, the real ``huggingface_hub`` client, a Hub served on this machine
(:mod:`hub_server`, ``HF_ENDPOINT``) and a fresh ``HF_HUB_CACHE``.

* a pull killed with SIGKILL half way through a file resumes from the bytes it had
  written (the server's log shows the second request's ``Range``), and the cache ends
  with the Hub's bytes;
* ``list`` reports the layers present, ``rm`` empties the cache;
* ``HF_HUB_OFFLINE=1`` (or an unreachable Hub) with nothing cached: one ``error:`` line
  naming the repository, the cache path and how to download by hand; exit status 2.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from hub_server import FakeHub
from tiny_models import CONFIGS, sharded_model_files

#: One layer of 28 MB (float32, hidden 512): ``huggingface_hub``'s ``http_get`` writes in
#: chunks of 10 MiB (``constants.DOWNLOAD_CHUNK_SIZE``), so a kill can leave 10 or 20 MiB.
BIG = {**CONFIGS["llama"], "hidden_size": 512, "intermediate_size": 4096, "num_hidden_layers": 1,
       "num_attention_heads": 8, "num_key_value_heads": 4}


def ringlet(env: dict, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ringlet.daemon.ops.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **env})


@pytest.fixture
def hub():
    with FakeHub() as server:
        yield server


def test_a_pull_killed_half_way_resumes_where_it_stopped(hub, tmp_path):
    files = sharded_model_files(config=BIG)
    sha = hub.add_commit("test-org/big", files)
    env = {"HF_ENDPOINT": hub.endpoint("pull"), "HF_HUB_CACHE": str(tmp_path / "hf")}
    layer = "model-00002-of-00003.safetensors"
    size = len(files[layer])
    assert size > 25_000_000
    partial = tmp_path / "hf" / "models--test-org--big" / ".ringlet" / "partial" / hashlib.sha256(
        files[layer]).hexdigest()
    hub.rate_bytes_per_s = 4_000_000
    proc = subprocess.Popen([sys.executable, "-m", "ringlet.daemon.ops.cli", "models", "pull", "test-org/big"],  # noqa: S603
                            env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (partial.exists() and partial.stat().st_size > 0):
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGKILL)  # as soon as the first bytes of the layer are on disk
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    (first,) = [e for e in hub.downloads("pull") if e.file == layer]
    assert first.range is None and first.sent < size  # killed in the middle of a whole-file GET
    kept = partial.stat().st_size
    assert 0 < kept <= first.sent and kept < size
    hub.rate_bytes_per_s = None
    done = ringlet(env, "models", "pull", "test-org/big")
    assert done.returncode == 0, done.stderr
    again = [e for e in hub.downloads("pull") if e.file == first.file][1:]
    assert [(e.range, e.sent) for e in again] == [(f"bytes={kept}-", size - kept)]  # not from the start
    snapshot = tmp_path / "hf" / "models--test-org--big" / "snapshots" / sha
    for name, data in files.items():
        assert (snapshot / name).read_bytes() == data, name
    assert not partial.exists()


def test_list_pull_layers_and_rm(hub, tmp_path):
    files = sharded_model_files()
    sha = hub.add_commit("test-org/tiny", files)
    env = {"HF_ENDPOINT": hub.endpoint("cli"), "HF_HUB_CACHE": str(tmp_path / "hf")}
    pulled = ringlet(env, "models", "pull", "test-org/tiny", "--layers", "1:3")
    assert pulled.returncode == 0, pulled.stderr
    assert f"test-org/tiny@{sha[:12]}: 2 file(s)" in pulled.stdout
    listed = json.loads(ringlet(env, "models", "list", "--json").stdout)
    (row,) = listed["models"]
    assert (row["repo"], row["revision"], row["refs"], row["layers"], row["num_layers"]) == \
        ("test-org/tiny", sha, ["main"], [1, 2], 4)
    assert "[1, 3) of 4" in ringlet(env, "models", "list").stdout
    bad = ringlet(env, "models", "pull", "test-org/tiny", "--layers", "2:9")
    assert bad.returncode == 2 and bad.stderr.startswith("error: layer range [2, 9)") and "Traceback" not in bad.stderr
    removed = ringlet(env, "models", "rm", "test-org/tiny")
    assert removed.returncode == 0 and "1 revision(s)" in removed.stdout, removed.stderr
    assert json.loads(ringlet(env, "models", "list", "--json").stdout)["models"] == []
    assert not (tmp_path / "hf" / "models--test-org--tiny" / ".ringlet").exists()
    gone = ringlet(env, "models", "rm", "test-org/tiny")
    assert gone.returncode == 2 and "is not in the Hugging Face cache" in gone.stderr


@pytest.mark.parametrize("why", ["offline", "unreachable"])
def test_run_without_hub_or_cache_is_one_clear_error(hub, tmp_path, why):
    cache = tmp_path / "hf"
    if why == "offline":
        env = {"HF_HUB_OFFLINE": "1", "HF_ENDPOINT": hub.endpoint("off")}
    else:
        env = {"HF_ENDPOINT": "http://127.0.0.1:9"}  # nothing listens on the discard port
    env["HF_HUB_CACHE"] = str(cache)
    proc = ringlet(env, "run", "--model", "test-org/tiny", "--no-mdns", "--no-dashboard", "--port", "0",
                   "--api-port", "0", "--data-dir", str(tmp_path / "data"))
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if not line[:8].count(":") == 2]  # log lines have a time
    assert len(lines) == 1 and lines[0].startswith("error: model test-org/tiny is not in the Hugging Face cache"), \
        proc.stderr
    for part in (str(cache / "models--test-org--tiny"), "ringlet models pull test-org/tiny",
                 "hf download test-org/tiny", "--peers"):
        assert part in lines[0], part
    assert ("HF_HUB_OFFLINE" in lines[0]) == (why == "offline")
    assert "Traceback" not in proc.stderr
    assert hub.requests("off") == []


def test_generate_and_plan_take_a_hub_name(hub, tmp_path):
    """``generate`` downloads the whole model and answers as mlx-lm does on a local copy;
    ``plan`` reads the config and headers only (no weight is downloaded)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    local = tmp_path / "local"
    hub.add_commit("test-org/tiny", sharded_model_files(directory=local))
    env = {"HF_ENDPOINT": hub.endpoint("plan"), "HF_HUB_CACHE": str(tmp_path / "hf-plan")}
    nodes = tmp_path / "nodes.json"
    nodes.write_text(json.dumps({"nodes": [{"node_id": n, "memory": "8 GiB", "bandwidth": "100 GB/s",
                                            "flops": "1 TFLOPS"} for n in ("a", "b")]}))
    planned = ringlet(env, "plan", "--nodes", str(nodes), "--model", "test-org/tiny", "--json")
    assert planned.returncode == 0, planned.stderr
    plan = json.loads(planned.stdout)
    assert (plan["model"]["name"], plan["model"]["num_layers"]) == ("test-org/tiny", 4)
    assert [(s["start"], s["end"]) for s in plan["stages"]][0][0] == 0 and plan["stages"][-1]["end"] == 4
    assert [e.file for e in hub.downloads("plan") if e.file.endswith(".safetensors")] == []

    env = {"HF_ENDPOINT": hub.endpoint("gen"), "HF_HUB_CACHE": str(tmp_path / "hf-gen")}
    out = ringlet(env, "generate", "--json", "--max-tokens", "12", "--model", "test-org/tiny", "Hello")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    model, _ = load_model(local)
    want = [int(t) for t, _ in generate_step(mx.array(got["prompt_ids"]), model, max_tokens=12,
                                             sampler=lambda x: mx.argmax(x, axis=-1))]
    assert got["completion_ids"] == want[:len(got["completion_ids"])] and got["completion_ids"]
