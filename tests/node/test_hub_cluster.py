"""Clusters of real ``ringlet run`` daemons on ``--model test-org/tiny``, a Hub model
served on this machine (:mod:`hub_server`), each daemon with its own empty
``HF_HUB_CACHE`` and its own ``HF_ENDPOINT`` tag, so the server's log says which node
asked for what.

Expected values are independent of the code under test: which files a layer range
needs comes from how the test wrote the repository (:func:`tiny_models.stage_file_names`),
greedy tokens from mlx-lm's own loader and ``generate_step`` on a local copy of the
same files.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import mlx.core as mx
from hub_server import FakeHub, node_env
from tiny_models import sharded_model_files, stage_file_names

from ringlet.daemon.ops.demo import LocalCluster

REPO = "test-org/tiny"
SMALL = {"config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors.index.json"}
PROMPT = "Hello, ring"
TOKENS = 24


def mlx_lm_greedy(directory: Path, prompt_ids: list[int], n: int) -> list[int]:
    """Greedy tokens of the model in ``directory`` by mlx-lm alone (its loader, its loop)."""
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    model, _ = load_model(directory)
    return [int(t) for t, _ in generate_step(mx.array(prompt_ids), model, max_tokens=n,
                                             sampler=lambda x: mx.argmax(x, axis=-1))]


def completion(url: str) -> tuple[list[int], list[int]]:
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": REPO, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, "return_token_ids": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["prompt_token_ids"], choice["token_ids"]


def assert_mlx_lm_output(url: str, local: Path) -> None:
    prompt_ids, ids = completion(url)
    reference = mlx_lm_greedy(local, prompt_ids, TOKENS)
    assert ids == reference[:len(ids)] and (len(ids) == TOKENS or ids[-1] == 2), (ids, reference)


@contextlib.contextmanager
def first_member(tmp_path: Path) -> Iterator[tuple[FakeHub, LocalCluster, Path, dict[str, bytes], str]]:
    """The tiny model's commit on a local Hub, and a 1-node cluster that serves it from the
    Hub (``n0``), plan committed: ``(hub, cluster, local copy, files, commit)``."""
    local = tmp_path / "local"
    files = sharded_model_files(directory=local)
    with FakeHub() as hub:
        sha = hub.add_commit(REPO, files)
        with LocalCluster(1, model=REPO, dynamic=True, per_node_env=[node_env(hub, tmp_path, 0)]) as c:
            c.wait_plan(stages=1)
            yield hub, c, local, files, sha


def weight_gets(hub: FakeHub, tag: str, since: int = 0) -> list[str]:
    return [e.file for e in hub.downloads(tag)[since:] if e.file.endswith(".safetensors")]


def test_three_empty_nodes_fetch_only_their_files_and_serve_mlx_lms_output(tmp_path):
    local = tmp_path / "local"
    files = sharded_model_files(directory=local)
    with FakeHub() as hub:
        sha = hub.add_commit(REPO, files)
        envs = [node_env(hub, tmp_path, i) for i in range(3)]
        with LocalCluster(3, model=REPO, dynamic=True, per_node_env=envs) as c:
            c.wait_plan(stages=3)
            ranges = {i: tuple(c.cluster_info(i)["layer_range"]) for i in range(3)}
            infos = [c.cluster_info(i) for i in range(3)]
            assert {(info["model"], info["model_revision"]) for info in infos} == {(REPO, sha)}
            for i, (start, end) in ranges.items():
                # every file of its range once, nothing else; the small files once each
                assert sorted(weight_gets(hub, f"n{i}")) == sorted(stage_file_names(start, end)), (i, ranges)
                assert sorted(e.file for e in hub.downloads(f"n{i}") if e.file in SMALL) == sorted(SMALL)
                snapshot = tmp_path / f"hf{i}" / "models--test-org--tiny" / "snapshots" / sha
                held = {p.name for p in snapshot.glob("*.safetensors")}
                assert held == stage_file_names(start, end)
                assert all((snapshot / n).read_bytes() == files[n] for n in held)
                events = [e["message"] for e in c.cluster_info(i)["events"] if e["kind"] == "download"]
                assert any(f"layers [{start}, {end}): {len(held)} file(s)" in m and "from the Hub" in m
                           for m in events), events
            assert_mlx_lm_output(c.api_urls[0], local)

            # a re-shard: one node leaves; the others download only the files they lack
            leaver = next(i for i, (s, _) in ranges.items() if s > 0)
            before = {i: len(hub.downloads(f"n{i}")) for i in range(3)}
            c.kill(leaver, signal.SIGTERM)
            survivors = [i for i in range(3) if i != leaver]
            c.wait_plan(stages=2, nodes=survivors, timeout_s=90)
            for i in survivors:
                new = tuple(c.cluster_info(i)["layer_range"])
                gained = stage_file_names(*new) - stage_file_names(*ranges[i])
                assert sorted(weight_gets(hub, f"n{i}", before[i])) == sorted(gained), (i, ranges[i], new)
            assert_mlx_lm_output(c.api_urls[survivors[0]], local)


def test_a_member_of_another_revision_is_named_and_kept_out(tmp_path):
    local = tmp_path / "local"
    files = sharded_model_files(directory=local)
    with FakeHub() as hub:
        old = hub.add_commit(REPO, sharded_model_files(seed=1), ref="v1")
        sha = hub.add_commit(REPO, files)
        envs = [node_env(hub, tmp_path, i) for i in range(2)]
        with LocalCluster(2, model=REPO, dynamic=True, per_node_env=envs) as c:
            c.wait_plan(stages=2)
            odd = c.add_node(model=f"{REPO}@v1", env=node_env(hub, tmp_path, 2))
            odd_id = c.cluster_info(odd)["node_id"]
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                said = [e["message"] for e in c.cluster_info(0)["events"] if e["kind"] == "kept-out"]
                mine = c.cluster_info(odd)
                if said and mine["negotiation"]["kept_out_reason"]:
                    break
                time.sleep(0.2)
            assert said and odd_id[:8] in said[0] and f"{REPO}@{old}" in said[0] and f"{REPO}@{sha}" in said[0], said
            reason = mine["negotiation"]["kept_out_reason"]
            assert [e["message"] for e in mine["events"] if e["kind"] == "kept-out"] == [reason]
            assert reason.startswith(f"this node serves {REPO}@{old}, the cluster {REPO}@{sha}")
            assert f"--model {REPO}@{sha}" in reason
            assert c.cluster_info(0)["negotiation"]["kept_out"] == {odd_id: f"{REPO}@{old}"}
            time.sleep(2.0)  # whatever the proposer did after the join has settled
            view = c.wait_plan(stages=2, nodes=[0, 1])
            assert odd_id not in {s["node_id"] for s in view["plan"]}
            assert mine["layer_range"] is None and weight_gets(hub, "n2") == []
            r = httpx.post(f"{c.api_urls[odd]}/v1/completions", timeout=30,
                           json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0})
            assert r.status_code == 503 and f"{REPO}@{sha}" in r.text, r.text
            assert_mlx_lm_output(c.api_urls[0], local)


def test_a_node_without_the_hub_pulls_from_a_member(tmp_path):
    with first_member(tmp_path) as (hub, c, local, _, sha):
        first = c.cluster_info(0)["node_id"]
        k = c.add_node(env=node_env(hub, tmp_path, 1, HF_HUB_OFFLINE="1"))
        c.wait_plan(stages=2, timeout_s=90)
        assert hub.requests("n1") == []  # it never asked the Hub
        info = c.cluster_info(k)
        assert info["model"] == REPO
        fetched = [e["message"] for e in info["events"] if e["kind"] == "fetch"]
        assert fetched and all(first[:8] in m or "127.0.0.1" in m for m in fetched), fetched
        assert_mlx_lm_output(c.api_urls[k], local)
        assert not (tmp_path / "hf1" / "models--test-org--tiny" / "snapshots" / sha).exists()


def test_when_the_hub_fails_a_download_a_member_sends_the_files(tmp_path):
    with first_member(tmp_path) as (hub, c, local, files, sha):
        first = c.cluster_info(0)["node_id"]
        hub.fail_downloads = True
        k = c.add_node(env=node_env(hub, tmp_path, 1))
        c.wait_plan(stages=2, timeout_s=90)
        start, end = c.cluster_info(k)["layer_range"]
        failed = [e for e in hub.downloads("n1") if e.file.endswith(".safetensors")]
        assert failed and {e.status for e in failed} == {503}
        events = [e["message"] for e in c.cluster_info(k)["events"] if e["kind"] == "download"]
        assert any(f"from member(s) {first[:8]}" in m for m in events), events
        snapshot = tmp_path / "hf1" / "models--test-org--tiny" / "snapshots" / sha
        assert {p.name for p in snapshot.glob("*.safetensors")} == stage_file_names(start, end)
        assert all((snapshot / n).read_bytes() == files[n] for n in stage_file_names(start, end))
        assert_mlx_lm_output(c.api_urls[k], local)



def test_a_node_without_the_hub_waits_for_a_member_that_is_still_starting(tmp_path):
    """The member a node bootstraps from may come up after it (machines booted together):
    the node keeps trying it, instead of giving up at the first refused connection."""
    with first_member(tmp_path) as (hub, c, local, _, _):
        member = f"127.0.0.1:{c.grpc_ports[0]}"
        c.procs[0].send_signal(signal.SIGTERM)
        c.procs[0].wait(timeout=30)
        k = c.add_node(env=node_env(hub, tmp_path, 1, HF_HUB_OFFLINE="1"), extra_args=["--peers", member],
                       wait=False)
        time.sleep(4.0)  # it finds nobody at `member` for a while
        assert c.procs[k].poll() is None, c.tail(k)
        c.restart(0)
        c.wait_plan(stages=2, timeout_s=90)
        fetched = [e["message"] for e in c.cluster_info(k)["events"] if e["kind"] == "fetch"]
        assert any(f"from {member}" in m for m in fetched), fetched
        assert hub.requests("n1") == []
        assert_mlx_lm_output(c.api_urls[k], local)
