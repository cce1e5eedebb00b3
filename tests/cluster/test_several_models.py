"""Several models on one cluster (#45), through real daemons: each node runs one lane per
``--model`` (daemon/ops/lanes.py) and its API sends each request to the lane of the model
it names (daemon/api/front.py).

Expected values: the bundled model's greedy continuation computed by transformers
(tests/smollm2_135m_instruct_greedy.json, the float32 path), and mlx-lm's whole second
model alone (``tiny_models.whole_model_greedy``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import httpx
from conftest import keyed_cluster, ringlet
from tiny_models import CONFIGS, make_chat_model, whole_model_greedy

from ringlet.daemon.ops.demo import LocalCluster

SECOND = {**CONFIGS["llama"], "vocab_size": 98}
SMALL_PROMPT = [5, 17, 42, 90, 8, 50, 3]
SMALL_TOKENS = 8


def wait_models(c: LocalCluster, nodes: list[int], states: dict[str, str], stages: dict[str, int] | None = None,
                timeout_s: float = 120.0) -> list[dict]:
    """Wait until every node in ``nodes`` shows each model key of ``states`` in that state
    (with that many stages in its ring, when ``stages`` names it); returns the last views."""
    deadline = time.monotonic() + timeout_s
    views: list = []
    while time.monotonic() < deadline:
        try:
            views = [c.cluster_info(i) for i in nodes]
        except (httpx.HTTPError, ValueError):
            time.sleep(0.5)
            continue
        ok = True
        for v in views:
            by_key = {m["key"]: m for m in v.get("models") or []}
            for key, state in states.items():
                m = by_key.get(key)
                if m is None or m["state"] != state or (stages and key in stages
                                                         and len(m["plan"] or []) != stages[key]):
                    ok = False
        if ok:
            return views
        time.sleep(0.5)
    summary = [[(m["key"], m["state"], len(m["plan"] or []), m["infeasible"]) for m in v.get("models") or []]
               for v in views]
    raise AssertionError(f"models not {states} (stages {stages}) in {timeout_s:.0f} s: {summary}")


def complete(url: str, model: str, prompt: list[int], tokens: int, why=lambda: "") -> list[int]:
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "return_token_ids": True})
    assert r.status_code == 200, (r.text, why())
    body = r.json()
    return body["choices"][0]["token_ids"]


@contextlib.contextmanager
def steady_client(url: str, model: str, prompt: list[int], tokens: int):
    """A client that asks ``model`` through ``url`` without a pause while the block runs;
    yields the list of its answers (token ids, or the exception a request raised)."""
    answers: list = []
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            try:
                answers.append(complete(url, model, prompt, tokens))
            except BaseException as exc:  # noqa: BLE001 - the caller asserts on it
                answers.append(exc)

    client = threading.Thread(target=loop)
    client.start()
    try:
        yield answers
    finally:
        stop.set()
        client.join(300)


def test_three_daemons_serve_two_models_through_every_node_at_once(tmp_path, reference):
    small = make_chat_model("llama", tmp_path / "tiny-llama", SECOND)
    want_small = whole_model_greedy(small, SMALL_PROMPT, SMALL_TOKENS)
    ref = reference[0]  # "Once upon a time", 40 tokens, transformers fp32
    big_prompt, want_big = ref["prompt_ids"], list(ref["completion_ids"])[:16]
    args = ["--model", "smollm2-135m", "--model", str(small), "--model-alias", "claude-haiku=tiny-llama",
            "--context", "512", "--model-context", "tiny-llama=192"]
    with LocalCluster(3, dtype="float32", dynamic=True, extra_args=args) as c:
        views = wait_models(c, [0, 1, 2], {"smollm2-135m": "serving", "tiny-llama": "serving"},
                            {"smollm2-135m": 3, "tiny-llama": 3})
        for v in views:  # each model its own ring over the three machines, in priority order
            assert [m["key"] for m in v["models"]] == ["smollm2-135m", "tiny-llama"]
            assert [m["priority"] for m in v["models"]] == [0, 1]
            # each model's KV planned at its own context: --model-context for one, --context for the other
            assert [m["context_tokens"] for m in v["models"]] == [512, 192]
        for url in c.api_urls:
            ids = {m["id"]: m for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]}
            assert set(ids) == {"smollm2-135m", "tiny-llama", "claude-haiku"}
            assert ids["claude-haiku"]["ringlet"]["alias_of"] == "tiny-llama"
            assert all(m["ringlet"]["state"] == "serving" for m in ids.values())

        # both models through every node at once, by name and by alias
        results: dict[tuple[int, str], list[int] | BaseException] = {}

        def ask(i: int, model: str) -> None:
            try:
                if model == "smollm2-135m":
                    results[(i, model)] = complete(c.api_urls[i], model, big_prompt, len(want_big))
                else:
                    results[(i, model)] = complete(c.api_urls[i], model, SMALL_PROMPT, SMALL_TOKENS)
            except BaseException as exc:  # noqa: BLE001 - reported below
                results[(i, model)] = exc

        threads = [threading.Thread(target=ask, args=(i, m)) for i in range(3)
                   for m in ("smollm2-135m", "tiny-llama", "claude-haiku")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        for (_, model), got in sorted(results.items()):
            assert got == (want_big if model == "smollm2-135m" else want_small), (model, got)
        assert len(results) == 9

        # the other surfaces route by model too: Ollama (raw text, against transformers' text), Anthropic
        r = httpx.post(f"{c.api_urls[1]}/api/generate", timeout=120, json={
            "model": "smollm2-135m", "prompt": ref["raw"], "raw": True, "stream": False,
            "options": {"temperature": 0, "num_predict": ref["max_tokens"]}})
        assert r.status_code == 200, r.text
        assert r.json()["response"] == ref["completion_text"]
        tags = {m["name"] for m in httpx.get(f"{c.api_urls[2]}/api/tags", timeout=10).json()["models"]}
        assert {"smollm2-135m:latest", "tiny-llama:latest"} <= tags
        r = httpx.post(f"{c.api_urls[2]}/v1/messages", timeout=120, json={
            "model": "claude-haiku", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and r.json()["model"] == "tiny-llama", r.text
        # a model no node serves: the surface's own 404, naming what is served
        r = httpx.post(f"{c.api_urls[0]}/v1/messages", timeout=10, json={
            "model": "claude-opus", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 404 and r.json()["type"] == "error", r.text
        assert "smollm2-135m" in r.json()["error"]["message"] and "claude-haiku" in r.json()["error"]["message"]


#: a second model of ~720 MB in float32: 16 layers of ~45 MB (hidden 1024, MLP 2816)
LARGER = {**SECOND, "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 16,
          "num_attention_heads": 16, "num_key_value_heads": 4, "max_position_embeddings": 2048}
#: each node's --memory-limit. By hand, from the models' sizes (stores off, context 512):
#: the bundled model's footprint per node is its runtime (~125 MB) + tokenizer (72 MB) + work
#: space (~25 MB) + its stage: 30 layers of ~20 MB (+ the 113 MB embedding on stage 0) over 3
#: nodes ~280 MB at most, over 2 ~420 MB. The second model gets what that leaves: over 3 nodes
#: ~890 - 500 = 390 MB each, 1,170 MB in all for its ~730 MB: it fits; over 2 nodes about
#: 890 - 640 = 250 MB each, 500 MB for 730: it does not, while the bundled one still does.
LIMIT = "890MB"


def test_a_lost_node_leaves_the_lower_model_out_and_the_higher_keeps_serving(tmp_path, reference):
    larger = make_chat_model("llama", tmp_path / "larger-llama", LARGER)
    want_larger = whole_model_greedy(larger, SMALL_PROMPT, SMALL_TOKENS)
    ref = reference[0]
    big_prompt, want_big = ref["prompt_ids"], list(ref["completion_ids"])[:8]
    args = ["--model", "smollm2-135m", "--model", str(larger), "--context", "512", "--memory-limit", LIMIT,
            "--boundary-cache-bytes", "0", "--prefix-cache-bytes", "0"]
    with LocalCluster(3, dtype="float32", dynamic=True, extra_args=args) as c:
        wait_models(c, [0, 1, 2], {"smollm2-135m": "serving", "larger-llama": "serving"},
                    {"smollm2-135m": 3, "larger-llama": 3})
        assert complete(c.api_urls[0], "larger-llama", SMALL_PROMPT, SMALL_TOKENS) == want_larger

        # a steady client of the higher model on node 0 while node 2 leaves
        with steady_client(c.api_urls[0], "smollm2-135m", big_prompt, len(want_big)) as answers:
            time.sleep(1.0)
            c.kill(2, signal.SIGTERM)
            views = wait_models(c, [0, 1], {"smollm2-135m": "serving", "larger-llama": "left out"},
                                {"smollm2-135m": 2}, timeout_s=90)
            for v in views:
                larger_view = next(m for m in v["models"] if m["key"] == "larger-llama")
                assert "does not fit" in larger_view["infeasible"] or "memory" in larger_view["infeasible"], larger_view
            r = httpx.post(f"{c.api_urls[1]}/v1/completions", timeout=30, json={
                "model": "larger-llama", "prompt": SMALL_PROMPT, "max_tokens": 2})
            assert r.status_code == 503, r.text
            assert larger_view["infeasible"].split(":")[0] in r.json()["error"]["message"], r.text
            time.sleep(2.0)  # more requests of the higher model on the new plan
        assert answers and all(a == want_big for a in answers), [a for a in answers if a != want_big][:3]
        print(f"\n{len(answers)} requests of the higher model while a node left, none lost")

        # the node comes back: both models serve again, answers equal
        c.restart(2)
        wait_models(c, [0, 1, 2], {"smollm2-135m": "serving", "larger-llama": "serving"},
                    {"smollm2-135m": 3, "larger-llama": 3}, timeout_s=120)
        for i in range(3):
            got = complete(c.api_urls[i], "larger-llama", SMALL_PROMPT, SMALL_TOKENS, lambda: c.tail(2, 80))
            assert got == want_larger
            assert complete(c.api_urls[i], "smollm2-135m", big_prompt, len(want_big)) == want_big


def test_models_load_and_unload_at_run_time_under_a_steady_client(tmp_path, reference):
    small = make_chat_model("llama", tmp_path / "tiny-llama", SECOND)
    want_small = whole_model_greedy(small, SMALL_PROMPT, SMALL_TOKENS)
    ref = reference[0]
    big_prompt, want_big = ref["prompt_ids"], list(ref["completion_ids"])[:6]
    args = ["--model", "smollm2-135m", "--model-alias", "chat=smollm2-135m", "--context", "512"]
    with LocalCluster(2, dtype="float32", dynamic=True, extra_args=args) as c:
        wait_models(c, [0, 1], {"smollm2-135m": "serving"}, {"smollm2-135m": 2})
        # the other model's client, through node 1, all along
        with steady_client(c.api_urls[1], "chat", big_prompt, len(want_big)) as answers:
            bad = ringlet("models", "load", str(tmp_path / "no-such-model"), "--api", c.api_urls[0])
            assert bad.returncode != 0 and "cannot load" in bad.stderr and "no-such-model" in bad.stderr, bad
            loaded = ringlet("models", "load", str(small), "--alias", "fast", "--api", c.api_urls[0])
            assert loaded.returncode == 0, loaded.stderr
            assert "tiny-llama: loading on this node" in loaded.stdout and ": ok" in loaded.stdout, loaded.stdout
            wait_models(c, [0, 1], {"smollm2-135m": "serving", "tiny-llama": "serving"}, {"tiny-llama": 2})
            for url in c.api_urls:  # loaded on both nodes, by the one command
                assert complete(url, "fast", SMALL_PROMPT, SMALL_TOKENS) == want_small
                assert "tiny-llama" in {m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]}
            # a model's process that dies is restarted by its node; the other model serves on
            lane = next(m for m in c.cluster_info(1)["models"] if m["key"] == "tiny-llama")
            os.kill(lane["pid"], signal.SIGKILL)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                restarted = next(m for m in c.cluster_info(1)["models"] if m["key"] == "tiny-llama")
                if restarted["restarts"] == 1 and restarted["state"] == "serving" and restarted["layer_range"]:
                    break
                time.sleep(0.5)
            assert restarted["restarts"] == 1 and restarted["pid"] != lane["pid"], restarted
            wait_models(c, [0, 1], {"smollm2-135m": "serving", "tiny-llama": "serving"}, {"tiny-llama": 2})
            assert complete(c.api_urls[1], "fast", SMALL_PROMPT, SMALL_TOKENS) == want_small
            chat = ringlet("chat", "--model", "fast", "--api", c.api_urls[0], "--max-tokens", "4", "hi")
            assert chat.returncode == 0 and chat.stdout.strip(), chat
            first = ringlet("models", "unload", "chat", "--api", c.api_urls[0])  # the node itself: refused
            assert first.returncode != 0 and "first model" in first.stderr, first
            unloaded = ringlet("models", "unload", "fast", "--api", c.api_urls[1])
            assert unloaded.returncode == 0, unloaded.stderr
            assert ": ok" in unloaded.stdout and "404" not in unloaded.stdout, unloaded.stdout
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and any(
                    "tiny-llama" in {m["id"] for m in httpx.get(f"{u}/v1/models", timeout=10).json()["data"]}
                    for u in c.api_urls):
                time.sleep(0.5)
            for url in c.api_urls:
                r = httpx.post(f"{url}/v1/completions", timeout=10, json={"model": "fast", "prompt": [5]})
                assert r.status_code == 404, r.text
            time.sleep(1.0)
        assert len(answers) >= 3 and all(a == want_big for a in answers), [a for a in answers if a != want_big][:3]


def test_a_keyed_node_wants_the_key_for_every_model_and_for_loads(tmp_path):
    small = make_chat_model("llama", tmp_path / "tiny-llama", SECOND)
    want_small = whole_model_greedy(small, SMALL_PROMPT, SMALL_TOKENS)
    key = "models-test-key-" + "m" * 24
    models = ["--model", "smollm2-135m", "--model", str(small), "--model-alias", "fast=tiny-llama",
              "--max-body-bytes", "65536"]
    with keyed_cluster(tmp_path, key, dynamic=True, per_node_args=[models]) as c:
        wait_models(c, [0], {"smollm2-135m": "serving", "tiny-llama": "serving"})
        url, auth = c.api_urls[0], c.api_headers
        for method, path, body in (("GET", "/v1/models", None), ("GET", "/v1/cluster", None),
                                   ("GET", "/api/tags", None), ("POST", "/v1/models/load", {"model": str(small)}),
                                   ("POST", "/v1/completions", {"model": "fast", "prompt": [5], "max_tokens": 1})):
            r = httpx.request(method, url + path, json=body, timeout=30)
            assert r.status_code == 401, (path, r.status_code, r.text)
        r = httpx.post(f"{url}/v1/completions", headers=auth, timeout=60, json={
            "model": "fast", "prompt": SMALL_PROMPT, "max_tokens": SMALL_TOKENS, "temperature": 0,
            "return_token_ids": True})
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == want_small, r.text
        assert {m["id"] for m in httpx.get(f"{url}/v1/models", headers=auth, timeout=10).json()["data"]} == {
            "smollm2-135m", "tiny-llama", "fast"}
        # the node's body limit holds in front of every model (a 413 before the body is read whole)
        r = httpx.post(f"{url}/v1/completions", headers=auth, timeout=30, json={
            "model": "fast", "prompt": "x" * 100_000, "max_tokens": 1})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text


def test_a_node_restarted_with_a_second_model_stays_in_the_first_models_ring(tmp_path, reference):
    """Upgrading one machine at a time to several models: its first model is the node it was
    (cluster, data dir, node id), so it shares that model's ring with single-model nodes."""
    small = make_chat_model("llama", tmp_path / "tiny-llama", SECOND)
    ref = reference[0]
    big_prompt, want_big = ref["prompt_ids"], list(ref["completion_ids"])[:8]
    with LocalCluster(2, dtype="float32", dynamic=True) as c:
        before = c.cluster_info(1)["node_id"]
        c.kill(1, signal.SIGTERM)
        c.per_node_args[1] = ["--model", "smollm2-135m", "--model", str(small)]
        c.restart(1)
        c.wait_plan(stages=2)
        views = wait_models(c, [1], {"smollm2-135m": "serving", "tiny-llama": "serving"})
        assert views[0]["node_id"] == before  # the same member of the first model's ring
        assert {s["node_id"] for s in views[0]["plan"]} == {before, c.cluster_info(0)["node_id"]}
        for url in c.api_urls:
            assert complete(url, "smollm2-135m", big_prompt, len(want_big)) == want_big
        assert complete(c.api_urls[1], "tiny-llama", SMALL_PROMPT, SMALL_TOKENS) == whole_model_greedy(
            small, SMALL_PROMPT, SMALL_TOKENS)
        # node 0, not yet restarted, serves one model: a load there is one 400 saying how to start
        # a node that can (the "clear error naming the problem and the fix")
        r = httpx.post(f"{c.api_urls[0]}/v1/models/load", json={"model": str(small)}, timeout=30)
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert "serves one model (smollm2-135m)" in message and "service install --model" in message, message
