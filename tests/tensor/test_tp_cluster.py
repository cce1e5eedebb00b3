"""Tensor parallelism reached from ``ringlet run --mode tensor``: real daemons, the real default
model, MLX's ring backend over loopback, each rank started by its own member's daemon.

- 3 daemons, float32: the negotiated plan is tensor over ring with ranks = the three node ids
  (rank 0 = the lowest id, the proposer); greedy completions through a node that is not rank 0
  equal the independent reference (tests/smollm2_135m_instruct_greedy.json, first 20 tokens);
- kill -9 a daemon that is not rank 0 mid-stream: the stream completes with the reference
  tokens (the cluster re-plans a pipeline on the two survivors: 9 heads do not divide by 2),
  and no rank process of the cluster is left;
- 2 daemons with ``--mode tensor``: tensor is refused with the reason in /v1/cluster and the
  cluster serves the pipeline (``--mode tensor`` falls back rather than refusing requests).

3 ranks on this 2-core machine use the poll shim (tests/tp_support.py) in the rank processes.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import httpx
import psutil
import pytest
from conftest import REFERENCE
from streaming import Streamed, completion_body, read_events
from tp_support import alive, poll_shim, wait_dead

from ringlet.daemon.ops.demo import LocalCluster
from ringlet.daemon.wire.rpc import ringlet_pb2 as pb
from ringlet.daemon.wire.rpc import ringlet_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(300)

FIRST = 20
RAW = next(c for c in REFERENCE if c["name"] == "raw_once")
CHAT = next(c for c in REFERENCE if c["name"] == "chat_capital")


def tp_env() -> dict[str, str]:
    shim = poll_shim()
    return {"RINGLET_TP_LD_PRELOAD": shim} if shim else {}


def rank_workers(pids: list[int]) -> set[int]:
    """Running tp_worker processes that are children of the daemons ``pids``."""
    found = set()
    for pid in pids:
        try:
            for child in psutil.Process(pid).children(recursive=True):
                if "ringlet.daemon.tensor.worker" in " ".join(child.cmdline()) and child.status() != "zombie":
                    found.add(child.pid)
        except psutil.Error:
            continue
    return found


def stop_and_check(c: LocalCluster) -> None:
    """Stop every daemon of ``c`` and assert that no rank process they started is left."""
    pids = [p.pid for p in c.procs]
    c.stop()
    left = rank_workers(pids)
    assert not left, f"rank processes left after the daemons stopped: {left}"


def restart_the_dead(c: LocalCluster) -> dict:
    """Start again every daemon of ``c`` that is not running and wait for the plan they make
    (a newer epoch, with all three in it); returns it."""
    for i in range(len(c.procs)):
        if c.procs[i].poll() is not None:
            c.restart(i)
    epoch = max(c.cluster_info(i)["epoch"] for i in c.alive())
    return c.wait_plan(stages=3, min_epoch=epoch + 1, timeout_s=60)


def wait_group_ready(c: LocalCluster, leader: int, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        tp = c.cluster_info(leader)["tp"]
        if tp.get("group", {}).get("state") == "ready":
            return tp
        time.sleep(0.2)
    raise AssertionError(f"tensor group not ready: {c.cluster_info(leader)['tp']}\n{c.tail(leader)}")


def stream_ids(url: str, max_tokens: int, on_token=None) -> tuple[list[int], str | None, str | None]:
    """A streamed greedy completion of the raw reference prompt: (ids, finish_reason, error)."""
    with httpx.stream("POST", f"{url}/v1/completions", json=completion_body(RAW["raw"], max_tokens),
                      timeout=300) as r:
        assert r.status_code == 200, r.read()
        got = read_events(r.iter_lines(), Streamed(), on_token)
    return got.ids, got.finish, got.error


def assert_stream_survives(url: str, kill) -> None:
    """Stream the reference prompt through ``url``, call ``kill()`` after the 5th token,
    and assert the stream still ends with the reference ids and no error."""
    killed = threading.Event()

    def on_token(n: int) -> None:
        if n == 5 and not killed.is_set():
            killed.set()
            kill()

    got, finish, error = stream_ids(url, FIRST, on_token)
    assert killed.is_set()
    assert error is None, error
    assert (got, finish) == (RAW["completion_ids"][:FIRST], "length")


@pytest.fixture(scope="module")
def trio():
    """3 daemons, --mode tensor, float32; yields (cluster, index of rank 0's node, ranks)."""
    c = LocalCluster(3, dtype="float32", dynamic=True, extra_args=["--mode", "tensor"], env=tp_env())
    c.start()
    try:
        info = c.wait_plan(stages=3)
        ids = {c.cluster_info(i)["node_id"]: i for i in range(3)}
        ranks = info["tp"]["ranks"]
        yield c, ids[ranks[0]], ranks, ids
    finally:
        stop_and_check(c)


def test_three_daemons_serve_tensor_parallel_through_any_node(trio):
    c, leader, ranks, ids = trio
    assert sorted(ranks) == sorted(ids) and ranks[0] == min(ids)  # rank 0 = the proposer (lowest id)
    for i in range(3):  # every node shows the same committed decision
        view = c.cluster_info(i)
        assert (view["mode"], view["tp"]["mode"], view["tp"]["backend"], view["tp"]["ranks"]) == (
            "tensor", "tensor", "ring", ranks)
        assert view["tp"]["requested"] == "tensor"
        assert view["plan_id"].startswith("tensor:")
        assert [s["node_id"] for s in view["plan"]] == ranks
    assert c.cluster_info(leader)["tp"]["reason"] == (
        f"--mode tensor: 3 ranks over ring: loopback links form a ring {ranks[0]} -> {ranks[1]} -> {ranks[2]} "
        f"-> {ranks[0]}")
    api = ids[ranks[1]]  # not rank 0: the request travels to the leader over Generate
    r = httpx.post(f"{c.api_urls[api]}/v1/chat/completions", timeout=300, json={
        "messages": CHAT["messages"], "max_tokens": FIRST, "temperature": 0, "return_token_ids": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["prompt_token_ids"] == CHAT["prompt_ids"]
    assert choice["token_ids"] == CHAT["completion_ids"][:FIRST]
    assert choice["message"]["content"] == CHAT["completion_text"]
    group = wait_group_ready(c, leader)["group"]
    assert (group["state"], group["size"], group["ranks"]) == ("ready", 3, ranks)
    for rank, node_id in enumerate(ranks):  # each node reports the rank process it runs, and its memory
        (local,) = c.cluster_info(ids[node_id])["tp"]["local_ranks"]
        assert local["rank"] == rank and local["rss_bytes"] > 0
    # each rank runs under its own member's daemon
    for rank, node_id in enumerate(ranks):
        daemon = psutil.Process(c.procs[ids[node_id]].pid)
        workers = [p for p in daemon.children() if "ringlet.daemon.tensor.worker" in " ".join(p.cmdline())]
        assert len(workers) == 1 and f"--rank {rank} " in " ".join(workers[0].cmdline()), rank
    ids_raw, finish, error = stream_ids(c.api_urls[ids[ranks[2]]], FIRST)
    assert error is None and finish == "length"
    assert ids_raw == RAW["completion_ids"][:FIRST]
    # the same chat again: the group's prefix cache serves all of its prompt but the last token
    r = httpx.post(f"{c.api_urls[api]}/v1/chat/completions", timeout=300, json={
        "messages": CHAT["messages"], "max_tokens": FIRST, "temperature": 0, "return_token_ids": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == CHAT["completion_ids"][:FIRST]
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == len(CHAT["prompt_ids"]) - 1
    deadline = time.monotonic() + 10  # rank 0 reports its figures with the request's end, just after its last token
    while (store := c.cluster_info(leader)["prefix_cache"])["hits"] < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert (store["ranks"], store["hits"], store["hit_tokens"]) == (3, 1, len(CHAT["prompt_ids"]) - 1), store
    # with the expected answer as the prediction, rank 0 decodes speculatively: the same tokens
    r = httpx.post(f"{c.api_urls[api]}/v1/chat/completions", timeout=300, json={
        "messages": CHAT["messages"], "max_tokens": FIRST, "temperature": 0, "return_token_ids": True,
        "prediction": {"type": "content", "content": CHAT["completion_text"]}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == CHAT["completion_ids"][:FIRST]
    details = r.json()["usage"]["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] >= 4, details
    spec = c.cluster_info(leader)["speculation"]
    assert spec["trips"] >= 1 and spec["accepted"] == details["accepted_prediction_tokens"], spec


def test_a_tensor_group_applies_a_grammar_and_reports_logprobs(trio):
    """Rank 0 samples for the group: a json_schema request's output validates and its
    logprobs come back through the group's control channel, one for every token of a
    verifying step's answer too."""
    import json

    import jsonschema

    c, leader, ranks, ids = trio
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    r = httpx.post(f"{c.api_urls[ids[ranks[1]]]}/v1/chat/completions", timeout=300, json={
        "messages": [{"role": "user", "content": "Describe a person."}], "max_tokens": 40, "temperature": 0,
        "logprobs": True, "top_logprobs": 2,  # drafts of a prediction, verified under the grammar
        "prediction": {"type": "content", "content": '{"name": "John Smith", "age": 30}'},
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)
    content = choice["logprobs"]["content"]
    assert len(content) == r.json()["usage"]["completion_tokens"] - 1  # all but the end token
    assert all(t["logprob"] <= 0 and len(t["top_logprobs"]) == 2 for t in content)


def test_a_rank_is_started_only_for_the_leader_of_the_committed_plan(trio):
    """RunRank refuses whatever does not match the committed tensor plan; nothing is started."""
    c, leader, ranks, ids = trio
    member = ids[ranks[1]]
    epoch = c.cluster_info(member)["epoch"]
    before = rank_workers([p.pid for p in c.procs])
    good = {"leader_id": ranks[0], "plan_epoch": epoch, "group_epoch": 9, "rank": 1, "size": 3, "backend": "ring",
            "control": "127.0.0.1:1", "token": "x" * 32, "dtype": "float32", "hb_interval": 0.2,
            "prefill_chunk": 512, "side_host": "127.0.0.1"}
    cases = [
        ({"leader_id": ranks[2]}, "the caller does not lead this plan's tensor group"),
        ({"rank": 2}, "this node is not rank 2 of 3"),
        ({"plan_epoch": epoch - 1}, f"this node serves epoch {epoch}, not {epoch - 1}"),
        ({"control": "10.9.9.9:4000"}, "the control address is not on the leader's host"),
        ({"env": {"LD_PRELOAD": "/tmp/x.so"}}, "only MLX's own variables and host files may be set"),
        ({"files": {"../../etc/passwd": "x"}}, "only MLX's own variables and host files may be set"),
    ]
    with grpc.insecure_channel(f"127.0.0.1:{c.grpc_ports[member]}") as channel:
        stub = pb_grpc.RingStub(channel)
        for change, why in cases:
            events = list(stub.RunRank(pb.RankStart(**{**good, **change}), timeout=30))
            assert [e.error for e in events] == [why], change
    assert rank_workers([p.pid for p in c.procs]) == before


def test_a_crashed_rank_process_restarts_the_group_on_the_same_members(trio):
    """kill -9 of a rank process (its daemon lives): the group restarts on the same ranks, the
    request resumes inside it with the same tokens, and the plan does not change."""
    c, leader, ranks, ids = trio
    group = wait_group_ready(c, leader)["group"]
    member = ids[ranks[1]]
    epoch = c.cluster_info(member)["epoch"]
    old = rank_workers([p.pid for p in c.procs])
    (victim,) = rank_workers([c.procs[member].pid])
    assert_stream_survives(c.api_urls[ids[ranks[2]]], lambda: os.kill(victim, signal.SIGKILL))
    after = wait_group_ready(c, leader)["group"]
    assert after["epoch"] > group["epoch"] and after["ranks"] == ranks and after["restarts"] >= 1
    assert all(c.cluster_info(i)["epoch"] == epoch for i in range(3))  # no re-plan
    new = rank_workers([p.pid for p in c.procs])
    assert len(new) == 3 and not any(alive(p) for p in old)


def test_kill_a_rank_daemon_mid_stream_resumes_on_the_pipeline(trio):
    c, leader, ranks, ids = trio
    wait_group_ready(c, leader)
    victim, api = ids[ranks[2]], ids[ranks[1]]
    daemons = [p.pid for p in c.procs]
    workers = rank_workers(daemons)
    assert len(workers) == 3
    epoch = c.cluster_info(api)["epoch"]
    assert_stream_survives(c.api_urls[api], lambda: c.kill(victim))
    survivors = [i for i in range(3) if i != victim]
    after = c.wait_plan(stages=2, nodes=survivors, timeout_s=30)
    assert after["epoch"] > epoch
    assert after["mode"] == "pipeline" and after["tp"]["refused"] == (
        "tensor mode refused: smollm2-135m: 9 attention heads and 3 key/value heads do not divide by 2 ranks; "
        "group sizes that work: 3")
    resumed = [e for e in c.cluster_info(api)["events"] if e["kind"] == "resume"]
    assert resumed, "the request was not resumed"
    # a tensor group's KV lives in its ranks and went with the group: the fallback is counted
    migration = c.cluster_info(api)["kv_migration"]
    assert migration["resumed"] >= 1 and migration["full_reprefills"] >= 1, migration
    left = wait_dead(workers, 15)
    assert not left, f"rank processes left: {left}"
    assert not rank_workers([c.procs[i].pid for i in survivors])


def test_tensor_on_two_daemons_is_refused_and_the_pipeline_serves():
    with LocalCluster(2, dtype="float32", dynamic=True, extra_args=["--mode", "tensor"]) as c:
        info = c.wait_plan(stages=2)
        want = ("tensor mode refused: smollm2-135m: 9 attention heads and 3 key/value heads do not divide by 2 "
                "ranks; group sizes that work: 3")
        for i in range(2):
            tp = c.cluster_info(i)["tp"]
            assert (tp["mode"], tp["backend"], tp["ranks"], tp["requested"]) == ("pipeline", "none", [], "tensor")
            assert tp["refused"] == want and tp["reason"] == f"{want}; serving the pipeline"
        assert info["mode"] == "pipeline" and not info["plan_id"].startswith("tensor:")
        assert any(e["kind"] == "mode" and e["message"].startswith(want) for e in info["events"])
        r = httpx.post(f"{c.api_urls[1]}/v1/chat/completions", timeout=300, json={
            "messages": CHAT["messages"], "max_tokens": FIRST, "temperature": 0, "return_token_ids": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == CHAT["completion_ids"][:FIRST]
        assert not rank_workers([p.pid for p in c.procs])


def test_a_rejoin_forms_a_new_group_and_losing_rank_0_resumes(trio):
    """The killed daemon comes back: the cluster returns to tensor mode with a new group; then rank 0's
    daemon itself dies mid-stream and the request finishes on the survivors' pipeline."""
    c, _, ranks, ids = trio
    info = restart_the_dead(c)
    assert (info["mode"], info["tp"]["backend"], info["tp"]["ranks"]) == ("tensor", "ring", ranks)
    leader, api = ids[ranks[0]], ids[ranks[2]]
    wait_group_ready(c, leader)
    workers = rank_workers([p.pid for p in c.procs])
    assert len(workers) == 3
    assert_stream_survives(c.api_urls[api], lambda: c.kill(leader))
    after = c.wait_plan(stages=2, nodes=[i for i in range(3) if i != leader], timeout_s=30)
    assert after["mode"] == "pipeline"
    left = wait_dead(workers, 15)
    assert not left, f"rank processes left: {left}"


def test_a_group_that_keeps_crashing_gives_way_to_the_pipeline(trio):
    """Rank 0's daemon is back (tensor again); then a member's rank process dies every time it
    starts: after the group's restarts it gives up, and the leader re-plans the same members on
    the pipeline, saying why."""
    c, _, ranks, ids = trio
    info = restart_the_dead(c)
    assert info["mode"] == "tensor"
    leader, member = ids[ranks[0]], ids[ranks[1]]
    wait_group_ready(c, leader)
    killed: set[int] = set()
    deadline = time.monotonic() + 60
    while c.cluster_info(leader)["mode"] != "pipeline":
        assert time.monotonic() < deadline, c.cluster_info(leader)["tp"]
        for pid in rank_workers([c.procs[member].pid]) - killed:
            os.kill(pid, signal.SIGKILL)
            killed.add(pid)
        time.sleep(0.1)
    assert len(killed) == 3  # the first group, then 2 restarts (max_restarts)
    after = c.wait_plan(stages=3, min_epoch=info["epoch"] + 1)
    tp = after["tp"]
    assert (after["mode"], tp["mode"], tp["requested"]) == ("pipeline", "pipeline", "tensor")
    assert tp["refused"].startswith(f"tensor group failed: rank 1 ({ranks[1]}) ")
    assert tp["refused"].endswith("; 2 restarts failed") and tp["reason"] == f"{tp['refused']}; serving the pipeline"
    got, finish, error = stream_ids(c.api_urls[member], FIRST)
    assert (got, finish, error) == (RAW["completion_ids"][:FIRST], "length", None)
    assert not rank_workers([p.pid for p in c.procs])
