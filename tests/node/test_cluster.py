"""Three real daemon processes on 127.0.0.1 serving the real default model.

Covers: split equality against the one-process reference path (``ringlet
generate``), any node taking requests, the official ``openai`` client (streamed and
not), stop sequences, bad requests (4xx, daemon keeps serving), a malformed tensor
on the wire (gRPC INVALID_ARGUMENT, daemon keeps serving), and per-stage memory.
"""

from __future__ import annotations

import json
import time

import grpc
import httpx
import openai
import pytest
from conftest import REFERENCE, ringlet
from smollm2 import EMBED_BYTES, FULL_BYTES, HIDDEN, LAYER_BYTES, VOCAB

from ringlet.daemon.ops.demo import LocalCluster
from ringlet.daemon.wire.rpc import ringlet_pb2 as pb
from ringlet.daemon.wire.rpc import ringlet_pb2_grpc as pb_grpc

CHAT = next(c for c in REFERENCE if "messages" in c)
RAW = next(c for c in REFERENCE if "raw" in c)



@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(3, dtype="float32") as c:
        yield c


def complete(url: str, prompt, max_tokens: int, **extra) -> dict:
    resp = httpx.post(f"{url}/v1/completions", timeout=300, json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True, **extra})
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_three_daemons_equal_one_process(cluster):
    proc = ringlet("generate", "--dtype", "float32", "--json", "--max-tokens", "24", RAW["raw"])
    assert proc.returncode == 0, proc.stderr
    one_process = json.loads(proc.stdout)
    body = complete(cluster.api_urls[0], RAW["raw"], 24)
    choice = body["choices"][0]
    assert choice["prompt_token_ids"] == one_process["prompt_ids"]
    assert choice["token_ids"] == one_process["completion_ids"]
    # and against the independent reference (float32)
    assert choice["token_ids"][:20] == RAW["completion_ids"][:20]
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 24, "total_tokens": 28,
                             "prompt_tokens_details": {"cached_tokens": 0}}  # a cold cluster
    assert choice["finish_reason"] == "length"


def test_the_quantized_path_across_daemons_equals_one_process():
    """--dtype native keeps the GGUF's Q4_1 weights (what memory-bound nodes run): two
    daemons give the tokens one process gives on the same path."""
    proc = ringlet("generate", "--dtype", "native", "--json", "--max-tokens", "8", RAW["raw"])
    assert proc.returncode == 0, proc.stderr
    one_process = json.loads(proc.stdout)
    with LocalCluster(2, dtype="native") as c:
        info = httpx.get(f"{c.api_urls[0]}/v1/cluster", timeout=5).json()
        assert info["dtype"]["requested"] == "native" and info["dtype"]["loaded"] == "native"
        body = complete(c.api_urls[1], RAW["raw"], 8)
    assert body["choices"][0]["token_ids"] == one_process["completion_ids"]


def _maps(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


def test_a_node_builds_its_tokenizer_on_its_first_api_request():
    """A node that took no API request has not built its tokenizer: the ``tokenizers``
    extension (which transformers and the tokenizer load) is not mapped in the process,
    also after /healthz, /v1/models and /v1/cluster. Its first completion builds it and
    equals the reference."""
    with LocalCluster(1, dtype="float32") as c:
        pid = c.procs[0].pid
        for path in ("/healthz", "/v1/models", "/v1/cluster"):
            assert httpx.get(c.api_urls[0] + path, timeout=10).status_code == 200
        assert "tokenizers.abi3" not in _maps(pid)
        body = complete(c.api_urls[0], RAW["raw"], 8)
        assert body["choices"][0]["token_ids"] == RAW["completion_ids"][:8]
        assert "tokenizers.abi3" in _maps(pid)


def test_any_node_takes_requests(cluster):
    for url in cluster.api_urls[1:]:
        body = complete(url, RAW["prompt_ids"], 8)
        assert body["choices"][0]["token_ids"] == RAW["completion_ids"][:8]


def test_plan_is_reported_by_every_node(cluster):
    plans = [httpx.get(f"{u}/v1/cluster").json() for u in cluster.api_urls]
    ranges = [p["layer_range"] for p in plans]
    assert ranges == [[0, 10], [10, 20], [20, 30]]
    assert all(p["plan"] == plans[0]["plan"] for p in plans)
    assert all(p["state"] in ("ready", "serving") for p in plans)


def test_openai_client_chat(cluster):
    client = openai.OpenAI(base_url=f"{cluster.api_urls[1]}/v1", api_key="unused")
    messages = CHAT["messages"]
    resp = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=30, temperature=0)
    assert resp.choices[0].message.content == CHAT["completion_text"]
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.prompt_tokens == CHAT["prompt_tokens"]
    assert resp.usage.completion_tokens == len(CHAT["completion_ids"])

    stream = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=30,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == CHAT["completion_text"]
    assert finish == "stop"
    assert usage.completion_tokens == len(CHAT["completion_ids"])

    models = client.models.list()
    assert [m.id for m in models.data] == ["smollm2-135m"]


def test_stop_sequence_and_length(cluster):
    url = cluster.api_urls[0]
    resp = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "messages": CHAT["messages"], "max_tokens": 30, "temperature": 0, "stop": [" Paris"]}).json()
    assert resp["choices"][0]["message"]["content"] == "The capital of France is"
    assert resp["choices"][0]["finish_reason"] == "stop"
    resp = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "messages": CHAT["messages"], "max_tokens": 3, "temperature": 0}).json()
    assert resp["choices"][0]["message"]["content"] == "The capital of"
    assert resp["choices"][0]["finish_reason"] == "length"
    # streamed stop sequence: the text never includes any part of the stop string
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=120, json={
            "messages": CHAT["messages"], "max_tokens": 30, "temperature": 0, "stop": "France is",
            "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == "The capital of "
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_seeded_sampling_is_reproducible(cluster):
    url = cluster.api_urls[0]

    def sample(seed, **kw):
        return complete(url, RAW["raw"], 12, temperature=1.0, seed=seed, **kw)["choices"][0]["token_ids"]

    assert sample(7) == sample(7)
    assert sample(7) != sample(8) or sample(7) != sample(9)
    # top_p small enough keeps only the most likely token: greedy
    assert sample(7, top_p=1e-6) == RAW["completion_ids"][:12]


BAD_BODIES = [
    ({"messages": []}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": "lots"}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": 7}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": ["x"] * 100}, "stop"),
    ({"messages": [{"role": "user", "content": "x"}], "model": "gpt-9"}, "gpt-9"),
]


@pytest.mark.parametrize(("body", "mentions"), BAD_BODIES)
def test_bad_requests_get_4xx_json(cluster, body, mentions):
    resp = httpx.post(f"{cluster.api_urls[2]}/v1/chat/completions", json=body, timeout=30)
    assert 400 <= resp.status_code < 500, resp.text
    error = resp.json()["error"]
    assert mentions in error["message"] or mentions == error.get("param")


def test_malformed_json_and_huge_prompt(cluster):
    url = cluster.api_urls[0]
    resp = httpx.post(f"{url}/v1/chat/completions", content=b"{not json", timeout=30,
                      headers={"content-type": "application/json"})
    assert resp.status_code == 400
    error = resp.json()["error"]  # the offset of the first bad character is 1, by hand
    assert "not valid JSON" in error["message"] and "at character 1" in error["message"], error
    assert not error["param"], error  # a position in the body, not a field
    resp = httpx.post(f"{url}/v1/completions", json={"prompt": [1] * 9000, "max_tokens": 1}, timeout=30)
    assert resp.status_code == 400 and "context" in resp.json()["error"]["message"]
    resp = httpx.post(f"{url}/v1/completions", json={"prompt": [10**9], "max_tokens": 1}, timeout=30)
    assert resp.status_code == 400
    assert httpx.get(f"{url}/healthz").json()["status"] == "ok"


def test_malformed_tensor_gets_invalid_argument_and_node_keeps_serving(cluster):
    target = f"127.0.0.1:{cluster.grpc_ports[1]}"
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.RingStub(channel)
        bad = pb.Activation(request_id="evil", step=0, offset=0,
                            hidden=pb.Tensor(dtype="float32", shape=[1, 1, 576], data=b"\0" * 7))
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Hop(iter([bad]), timeout=10))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "needs 2304" in info.value.details()
        for dtype in ("float99", "bfloat16"):
            bad = pb.Activation(request_id="evil2", step=0, hidden=pb.Tensor(dtype=dtype, shape=[2], data=b"\0"))
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Hop(iter([bad]), timeout=10))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    body = complete(cluster.api_urls[0], RAW["prompt_ids"], 6)
    assert body["choices"][0]["token_ids"] == RAW["completion_ids"][:6]


def test_generate_rpc_checks_the_prompt_and_the_node_keeps_serving(cluster):
    """A member's Generate call with ids past the 49152-entry vocabulary (the embedding lookup
    would read outside its table: MLX does not check, the process would crash), an empty
    prompt or one as long as the context: INVALID_ARGUMENT naming the problem."""
    head = cluster.cluster_info(0)
    with grpc.insecure_channel(f"127.0.0.1:{cluster.grpc_ports[0]}") as channel:
        stub = pb_grpc.RingStub(channel)
        cases = [
            ([1, VOCAB], 4, f"prompt token id {VOCAB} is outside the vocabulary [0, {VOCAB})"),
            ([], 4, "the prompt is empty"),
            ([1] * 8192, 4, "the prompt has 8192 tokens; the model's context is 8192"),
        ]
        for prompt, max_tokens, why in cases:
            request = pb.GenerateRequest(request_id="evil", prompt=prompt, max_tokens=max_tokens, epoch=head["epoch"])
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(request, timeout=30))
            assert (info.value.code(), info.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, why)
    body = complete(cluster.api_urls[0], RAW["prompt_ids"], 6)
    assert body["choices"][0]["token_ids"] == RAW["completion_ids"][:6]


def test_each_stage_holds_only_its_shard(cluster):
    """float32, 3 stages: MLX active memory after loading is within 10 % of the stage's
    own bytes (hand-computed above), and the peak RSS while loading grew by less than the
    stage's own bytes plus half of the other stages' (a node that read the whole model
    would grow by all of it). Half of the full weights was the bound before: stage 0 holds
    the embedding, 47 % of the model, and its load peaks 4 MB under that, over it when
    the machine is busy (CI)."""
    expected = [10 * LAYER_BYTES + EMBED_BYTES, 10 * LAYER_BYTES, 10 * LAYER_BYTES + 4 * HIDDEN + EMBED_BYTES]
    for url, want in zip(cluster.api_urls, expected, strict=True):
        mem = httpx.get(f"{url}/v1/cluster").json()["memory"]
        first = mem["first_load"]
        assert mem["weights_bytes"] == first["weights_bytes"] == want
        assert abs(first["mlx_active_after_bytes"] - want) <= 0.10 * want, mem
        assert first["peak_rss_after_bytes"] - first["rss_before_bytes"] < want + (FULL_BYTES - want) / 2, mem


def test_release_frees_every_stage_cache(cluster):
    complete(cluster.api_urls[0], RAW["prompt_ids"], 3)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if all(not httpx.get(f"{u}/v1/cluster").json()["kv_caches"] for u in cluster.api_urls):
            return
        time.sleep(0.1)
    pytest.fail("a stage kept a finished request's KV cache")


def test_a_reply_cut_mid_character_ends_with_whole_characters(cluster):
    """Greedy SmolLM2 continues this prompt with emojis, each a 4-byte UTF-8 character
    written as 3 byte-level tokens. ``max_tokens`` 2 or 4 cuts one in the middle: the
    text, streamed and not, holds those bytes back (no U+FFFD; OpenAI never returns a
    partial character) while ``completion_tokens`` counts every token."""
    client = openai.OpenAI(base_url=f"{cluster.api_urls[0]}/v1", api_key="unused")
    prompt = "Here are some happy emojis: 😀 😃"

    def texts(max_tokens: int) -> tuple[str, str, int]:
        whole = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=max_tokens, temperature=0)
        chunks = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True)
        streamed = "".join(c.choices[0].text for c in chunks if c.choices)
        assert whole.choices[0].finish_reason == "length"
        return whole.choices[0].text, streamed, whole.usage.completion_tokens

    first, first_streamed, n3 = texts(3)
    assert n3 == 3
    assert first == first_streamed and len(first) == 1 and len(first.encode("utf-8")) == 4, first  # one whole emoji
    for max_tokens, expected in ((2, ""), (4, first)):
        text, streamed, count = texts(max_tokens)
        assert count == max_tokens
        assert text == streamed == expected, (max_tokens, text, streamed)
        assert "\ufffd" not in text


def test_every_node_says_its_release_and_protocol(cluster):
    """Issue #42's "versions everywhere": ``ringlet --version``, every node's ``/healthz`` and
    ``/v1/cluster`` and ``ringlet status`` (each member's: test_resharding's 3-node cluster) give the release that
    pyproject.toml names and wire protocol 1."""
    import tomllib
    from pathlib import Path

    release = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]["version"]
    version = ringlet("--version")
    assert version.returncode == 0 and version.stdout.startswith(f"ringlet {release} (wire protocol 1; "), version
    assert "drafts" in version.stdout
    for url in cluster.api_urls:
        health = httpx.get(f"{url}/healthz", timeout=10).json()
        assert (health["release"], health["protocol_version"]) == (release, 1)
        info = httpx.get(f"{url}/v1/cluster", timeout=10).json()
        assert (info["release"], info["protocol_version"]) == (release, 1) and "drafts" in info["capabilities"]
    status = ringlet("status", "--api", cluster.api_urls[0])
    rows = [line.split() for line in status.stdout.splitlines() if line[:1].isdigit()]
    assert rows[0][2] == f"{release}/p1", status.stdout  # a static plan: status reaches the node it asks
