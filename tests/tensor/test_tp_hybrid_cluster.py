"""Hybrid plans from ``ringlet run --mode hybrid``: tensor groups chained as pipeline stages,
with real daemons (mDNS on loopback, negotiation), real rank processes started by each
member's own daemon (MLX's ring backend over loopback) and a tiny random llama model
(4 heads, 2 key/value heads, 4 layers: groups of 2).

- 4 daemons, float32: the committed plan is hybrid, 2 groups of 2 over ring, layers [0, 2)
  and [2, 4); the plan's stages are the groups' leaders; greedy completions through a node
  that leads no group equal mlx-lm's single-process greedy ids (the independent reference),
  decoding speculatively (drafts on every step here: verifying steps through both groups,
  rejected drafts trimmed from every rank's cache);
- 4 concurrent requests: each group batches their decode steps, and every request gets its
  own prompt's reference ids;
- kill -9 a rank process (its daemon lives): its group restarts on the same members, the
  request resumes on the same plan (its KV caches were lost) with the same ids;
- kill -9 a member's daemon mid-stream: 3 members cannot make equal groups, the cluster
  re-plans a pipeline (saying why), the request completes with the same ids, and no rank
  process of the cluster is left;
- the second group's leader is not the proposer: when its group keeps crashing it gives up,
  and the proposer re-plans the same members on the pipeline, saying why;
- the default model on 6 daemons (9 heads: 2 groups of 3), float32: the greedy chat
  completion through the last node equals the independent reference
  (tests/smollm2_135m_instruct_greedy.json, first 20 tokens), and ``ringlet status`` shows
  the groups.

More ranks than cores use the poll shim (tests/tp_support.py) in the rank processes.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest
from conftest import REFERENCE, ringlet
from streaming import Streamed, read_events
from test_tp_cluster import rank_workers, stop_and_check, tp_env
from tp_support import alive, make_model, mlx_greedy, wait_dead

from ringlet.daemon.node.config import SPEC_ALWAYS_ENV
from ringlet.daemon.ops.demo import LocalCluster

pytestmark = pytest.mark.timeout(400)

PROMPT = "Hello, world! The sky is"
TOKENS = 24


def stream(url: str, on_token=None) -> Streamed:
    body = {"prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, "stream": True, "return_token_ids": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        return read_events(r.iter_lines(), Streamed(), on_token)


def wait_groups_ready(c: LocalCluster, leaders: list[int], timeout_s: float = 120) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        groups = [c.cluster_info(i)["tp"].get("group", {}) for i in leaders]
        if all(g.get("state") == "ready" for g in groups):
            return groups
        time.sleep(0.2)
    raise AssertionError(f"groups not ready: {groups}\n" + "\n".join(c.tail(i) for i in leaders))


@pytest.fixture(scope="module")
def quad(tmp_path_factory):
    # seed 4: no near-tie in the first 24 greedy tokens of PROMPT (smallest top-2 margin 3.4e-3)
    path = make_model("llama", tmp_path_factory.mktemp("hybrid") / "llama", seed=4)
    # drafts on every decode step (not only where measured to pay): every request here also
    # checks speculative decoding through the groups
    c = LocalCluster(4, model=str(path), dtype="float32", dynamic=True, extra_args=["--mode", "hybrid"],
                     env={**tp_env(), SPEC_ALWAYS_ENV: "1"})
    c.start(stages=2)  # a hybrid plan's stages are its 2 groups
    try:
        yield c, path
    finally:
        stop_and_check(c)


def test_four_daemons_serve_two_tensor_groups_as_pipeline_stages(quad):
    c, path = quad
    ids = {c.cluster_info(i)["node_id"]: i for i in range(4)}
    groups = c.cluster_info(0)["tp"]["groups"]  # which pairs: by the measured links' bandwidth
    assert sorted(n for g in groups for n in g) == sorted(ids) and [len(g) for g in groups] == [2, 2]
    assert groups[0][0] == min(ids)  # the proposer (lowest id) leads the first group
    for i in range(4):
        view = c.cluster_info(i)
        tp = view["tp"]
        assert (view["mode"], tp["mode"], tp["backend"], tp["requested"]) == ("hybrid", "hybrid", "ring", "hybrid")
        assert (tp["groups"], tp["group_backends"], tp["layer_ranges"]) == (groups, ["ring", "ring"],
                                                                             [[0, 2], [2, 4]])
        assert tp["reason"] == "--mode hybrid: 2 groups of 2 over ring/ring"
        assert view["plan_id"].startswith("hybrid:")
        assert [(s["node_id"], s["start"], s["end"]) for s in view["plan"]] == [
            (groups[0][0], 0, 2), (groups[1][0], 2, 4)]
    leaders = [ids[g[0]] for g in groups]
    for g, info in zip(groups, wait_groups_ready(c, leaders), strict=True):
        assert (info["size"], info["ranks"]) == (2, g)
    assert [c.cluster_info(i)["tp"]["group"]["layers"] for i in leaders] == [[0, 2], [2, 4]]
    for rank, node_id in [(r, n) for g in groups for r, n in enumerate(g)]:  # each member runs its own rank
        (local,) = c.cluster_info(ids[node_id])["tp"]["local_ranks"]
        assert local["rank"] == rank and local["rss_bytes"] > 0

    api = ids[groups[1][1]]  # leads nothing: the request goes to stage 0 over Generate
    r = httpx.post(f"{c.api_urls[api]}/v1/completions", timeout=300, json={
        "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, "return_token_ids": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    want, margin = mlx_greedy(path, choice["prompt_token_ids"], TOKENS)
    assert margin > 1e-3  # no near-tie: float32 sums in another order cannot flip a token
    assert choice["finish_reason"] == "length"  # no end-of-sequence token among them
    assert choice["token_ids"] == want
    spec = c.cluster_info(leaders[0])["speculation"]  # stage 0 drafted from the output's own repeats
    assert spec["trips"] > 0 and spec["accepted"] > 0 and spec["off"] == {}, spec
    got = stream(c.api_urls[ids[groups[0][1]]])
    assert (got.ids, got.finish, got.error) == (want, "length", None)


def test_a_later_prompt_reuses_the_kv_the_groups_ranks_kept(quad):
    """The prefix cache of a hybrid plan: each group's leader keeps the index and its ranks
    their shards of the KV. A second prompt that starts with the first reuses the first
    request's cached tokens on both groups (trimmed from its longer entry) and still
    equals mlx-lm's single-process greedy ids for its own tokens."""
    c, path = quad
    groups = c.cluster_info(0)["tp"]["groups"]
    ids = {c.cluster_info(i)["node_id"]: i for i in range(4)}
    leaders = [ids[g[0]] for g in groups]
    wait_groups_ready(c, leaders)
    api = c.api_urls[ids[groups[1][1]]]
    first = httpx.post(f"{api}/v1/completions", timeout=300, json={
        "prompt": "A prompt of its own:", "max_tokens": 8, "temperature": 0, "return_token_ids": True}).json()
    # what the stages kept: the prompt and 7 of the 8 answer tokens (the last was never fed)
    kept = first["choices"][0]["prompt_token_ids"] + first["choices"][0]["token_ids"][:7]
    r = httpx.post(f"{api}/v1/completions", timeout=300, json={
        "prompt": "A prompt of its own: and more", "max_tokens": 8, "temperature": 0, "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    prompt = body["choices"][0]["prompt_token_ids"]
    want, margin = mlx_greedy(path, prompt, 8)
    assert margin > 1e-3
    assert body["choices"][0]["token_ids"] == want
    shared = next((k for k, (a, b) in enumerate(zip(kept, prompt, strict=False)) if a != b), min(len(kept),
                                                                                                len(prompt)))
    assert shared >= len(first["choices"][0]["prompt_token_ids"])
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == min(shared, len(prompt) - 1)
    for i in leaders:
        store = c.cluster_info(i)["prefix_cache"]
        assert store["ranks"] == 2 and store["hits"] >= 1 and store["entries"] >= 1, store


def test_concurrent_requests_are_batched_in_the_groups_and_each_equals_its_reference(quad):
    """4 requests at once through a node that leads nothing: the groups' leaders batch their
    decode steps (one batched step per group, the ranks merging the KV caches), and every
    request gets mlx-lm's single-process greedy ids for its own prompt."""
    from concurrent.futures import ThreadPoolExecutor

    c, path = quad
    view = c.cluster_info(0)
    groups = view["tp"]["groups"]
    ids = {c.cluster_info(i)["node_id"]: i for i in range(4)}
    leaders = [ids[g[0]] for g in groups]
    wait_groups_ready(c, leaders)
    before = [c.cluster_info(i)["batching"]["histogram"] for i in leaders]
    prompts = [PROMPT, "Once upon a time", "The cat sat on", "abc def ghi"]  # top-2 margins >= 3.4e-3

    def one(prompt: str) -> dict:
        r = httpx.post(f"{c.api_urls[ids[groups[1][1]]]}/v1/completions", timeout=300, json={
            "prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "return_token_ids": True})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    with ThreadPoolExecutor(len(prompts)) as pool:
        choices = list(pool.map(one, prompts))
    for choice in choices:
        want, margin = mlx_greedy(path, choice["prompt_token_ids"], TOKENS)
        assert margin > 1e-3 and choice["token_ids"] == want
    for i, old in zip(leaders, before, strict=True):
        new = c.cluster_info(i)["batching"]["histogram"]
        batched = sum(v - old.get(k, 0) for k, v in new.items() if int(k) > 1)
        assert batched > 0, (i, old, new)  # decode steps of several requests ran as one


def kill_after(n: int, kill) -> tuple[threading.Event, callable]:
    done = threading.Event()

    def on_token(k: int) -> None:
        if k == n and not done.is_set():
            done.set()
            kill()

    return done, on_token


def test_a_crashed_rank_restarts_its_group_and_the_request_resumes_on_the_same_plan(quad):
    c, path = quad
    view = c.cluster_info(0)
    groups = view["tp"]["groups"]
    ids = {c.cluster_info(i)["node_id"]: i for i in range(4)}
    epoch = view["epoch"]
    before = wait_groups_ready(c, [ids[groups[1][0]]])[0]
    (victim,) = rank_workers([c.procs[ids[groups[1][1]]].pid])  # rank 1 of the second group (stage 1)
    want = stream(c.api_urls[0]).ids
    killed, on_token = kill_after(5, lambda: os.kill(victim, signal.SIGKILL))
    got = stream(c.api_urls[ids[groups[0][0]]], on_token)
    assert killed.is_set()
    assert (got.ids, got.finish, got.error) == (want, "length", None)
    after = wait_groups_ready(c, [ids[groups[1][0]]])[0]
    assert after["epoch"] > before["epoch"] and after["ranks"] == groups[1] and after["restarts"] >= 1
    assert all(c.cluster_info(i)["epoch"] == epoch for i in range(4))  # no re-plan
    resumes = [e["message"] for e in c.cluster_info(ids[groups[0][0]])["events"] if e["kind"] == "resume"]
    assert any("KV cache is gone" in m for m in resumes), resumes  # it did lose its caches mid-stream
    assert not alive(victim)


def test_losing_a_member_re_plans_a_pipeline_and_the_request_completes(quad):
    c, path = quad
    view = c.cluster_info(0)
    groups = view["tp"]["groups"]
    ids = {c.cluster_info(i)["node_id"]: i for i in range(4)}
    wait_groups_ready(c, [ids[g[0]] for g in groups])
    want = stream(c.api_urls[0]).ids
    victim = ids[groups[1][1]]
    old_ranks = rank_workers([p.pid for p in c.procs])
    killed, on_token = kill_after(5, lambda: c.kill(victim))
    got = stream(c.api_urls[ids[groups[0][0]]], on_token)
    assert killed.is_set()
    assert (got.ids, got.finish, got.error) == (want, "length", None)
    survivors = [i for i in range(4) if i != victim]
    after = c.wait_plan(stages=3, nodes=survivors, timeout_s=60)
    assert (after["mode"], after["tp"]["mode"]) == ("pipeline", "pipeline")
    assert after["tp"]["refused"].startswith("hybrid mode refused: no split of 3 members into equal tensor groups")
    # the groups' KV lived in their ranks and went with them: the fallback is counted where the request runs
    migration = c.cluster_info(ids[groups[0][0]])["kv_migration"]
    assert migration["resumed"] >= 1 and migration["full_reprefills"] >= 1, migration
    assert wait_dead(old_ranks, 15) == [], "rank processes of the hybrid plan are still running"


def test_a_later_stage_group_that_keeps_crashing_gives_way_to_the_pipeline(tmp_path):
    """The second group's leader is not the proposer: when its group gives up (a rank killed
    each time it restarts), it says so in its membership record, and the proposer re-plans the
    same members on the pipeline, saying why; requests are served again."""
    path = make_model("llama", tmp_path / "llama", seed=4)
    # drafts on every decode step (not only where measured to pay): every request here also
    # checks speculative decoding through the groups
    c = LocalCluster(4, model=str(path), dtype="float32", dynamic=True, extra_args=["--mode", "hybrid"],
                     env={**tp_env(), SPEC_ALWAYS_ENV: "1"})
    c.start(stages=2)
    try:
        groups = c.cluster_info(0)["tp"]["groups"]
        ids = {c.cluster_info(i)["node_id"]: i for i in range(4)}
        leader, member = ids[groups[1][0]], ids[groups[1][1]]
        epoch = c.cluster_info(0)["epoch"]
        want = stream(c.api_urls[0]).ids
        deadline = time.monotonic() + 120
        kills = 0
        while c.cluster_info(0)["epoch"] == epoch and time.monotonic() < deadline:
            group = c.cluster_info(leader)["tp"].get("group", {})
            workers = rank_workers([c.procs[member].pid])
            if group.get("state") == "ready" and len(workers) == 1:
                os.kill(workers.pop(), signal.SIGKILL)
                kills += 1
                time.sleep(1.0)
            time.sleep(0.2)
        after = c.wait_plan(stages=4, timeout_s=30)
        assert kills >= 3  # two restarts on the same members, then it gives up
        assert (after["mode"], after["tp"]["requested"]) == ("pipeline", "hybrid")
        assert after["tp"]["refused"].startswith(f"{groups[1][0][:8]}: tensor group failed: ")
        got = stream(c.api_urls[member])
        assert (got.ids, got.finish, got.error) == (want, "length", None)
    finally:
        stop_and_check(c)


def test_the_default_model_in_two_groups_of_three_equals_the_reference():
    chat = next(x for x in REFERENCE if x["name"] == "chat_capital")
    c = LocalCluster(6, dtype="float32", dynamic=True, extra_args=["--mode", "hybrid"], env=tp_env())
    c.start(stages=2, timeout_s=300)
    try:
        view = c.cluster_info(5)
        tp = view["tp"]
        assert (tp["mode"], tp["reason"], tp["layer_ranges"]) == (
            "hybrid", "--mode hybrid: 2 groups of 3 over ring/ring", [[0, 15], [15, 30]])
        assert [len(g) for g in tp["groups"]] == [3, 3]
        r = httpx.post(f"{c.api_urls[5]}/v1/chat/completions", timeout=600, json={
            "messages": chat["messages"], "max_tokens": 20, "temperature": 0, "return_token_ids": True})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["prompt_token_ids"] == chat["prompt_ids"]
        assert choice["token_ids"] == chat["completion_ids"][:20]
        assert choice["message"]["content"] == chat["completion_text"]
        status = ringlet("status", "--api", c.api_urls[0], timeout=60)
        assert status.returncode == 0, status.stdout + status.stderr
        lines = status.stdout.splitlines()
        assert lines[1].startswith("mode hybrid · backend ring · groups [0,15) 0 ") and " | [15,30) 0 " in lines[1]
        assert lines[1].endswith(" · group ready")
    finally:
        stop_and_check(c)
