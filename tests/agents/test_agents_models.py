"""Claude Code (pinned, 2.1.332) against a cluster serving two models (issue #45): its main
model is the bundled SmolLM2-135M, its small fast model a second model served beside it
(``smollm2-fast``: the bundled GGUF under another name, so the same 8,192-token context),
asked for by an alias (``--model-alias claude-haiku-fast=smollm2-fast``). One ``claude -p``
session sends requests to both, and each goes to its own model's lane.

What makes Claude Code call its small fast model in ``-p`` mode: a ``prompt`` hook
(settings ``hooks``, ``"type": "prompt"``; not under ``--bare``, which skips hooks) is
judged by the small fast model unless the hook names a model. The session below has a
``Stop`` hook: once the main model has answered, Claude Code sends the transcript and the
hook's condition to the small fast model with a JSON schema (``output_config.format``:
``ok``, ``reason``), which ringlet's grammar enforces. ``ANTHROPIC_DEFAULT_HAIKU_MODEL``
names the small fast model (``ANTHROPIC_SMALL_FAST_MODEL``, when set, wins); with neither,
those requests go to ``--model``. docs/agents.md says more.

Evidence: the capture proxy's exchanges: each model's requests, their 200s, and the model
each stream names in its ``message_start`` (the lane's own id, ``smollm2-fast`` for the
alias). A lane's request counters are not read: ``GET /v1/cluster`` on the node shows each
lane's ``requests_in_flight`` as of its last poll (about once a second), and a sampler of
it every 0.2 s missed requests of a second or two.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
from agent_harness import MODEL, CaptureProxy, Sandbox, claude, claude_env, missing_clients

from ringlet.daemon.engine.sources import resolve
from ringlet.daemon.ops.demo import LocalCluster

#: the second model's name (its file's stem) and the alias Claude Code asks for
FAST = "smollm2-fast"
ALIAS = "claude-haiku-fast"
#: a Stop hook of the ``prompt`` type: judged by the small fast model
STOP_HOOK = {"hooks": {"Stop": [{"hooks": [{"type": "prompt", "prompt": "The assistant answered."}]}]}}
#: every request's extra fields: greedy, and an answer ends with its first sentence or line.
#: Without ``--bare`` (which would skip the hook) Claude Code adds its environment block
#: after the question, and SmolLM2-135M answers that block, at times in sentences that
#: repeat to the output cap, which Claude Code meets with "Output token limit hit. Resume
#: directly" and, the third time, an error. (A stop inside the hook's JSON leaves it cut:
#: Claude Code reports the hook's error and goes on, as when the JSON is cut at the cap.)
EXTRA_BODY = {"temperature": 0, "stop_sequences": ["\n", ". "]}


def wait_serving(cluster: LocalCluster, keys: tuple[str, ...], stages: int, timeout_s: float = 120.0) -> None:
    """Until every node shows each lane of ``keys`` serving over ``stages`` stages."""
    deadline = time.monotonic() + timeout_s
    views: list = []
    while time.monotonic() < deadline:
        try:
            views = [cluster.cluster_info(i) for i in range(cluster.n)]
        except (httpx.HTTPError, ValueError):
            time.sleep(0.5)
            continue
        lanes = [{m["key"]: m for m in v.get("models") or []} for v in views]
        if all(k in by_key and by_key[k]["state"] == "serving" and len(by_key[k]["plan"] or []) == stages
               for by_key in lanes for k in keys):
            return
        time.sleep(0.5)
    summary = [[(m["key"], m["state"], len(m["plan"] or []), m["infeasible"]) for m in v.get("models") or []]
               for v in views]
    raise AssertionError(f"{keys} not serving over {stages} stages in {timeout_s:.0f} s: {summary}")


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    """Two float32 daemons, each serving the bundled model (first) and ``smollm2-fast``
    (second, alias ``claude-haiku-fast``), one lane per model."""
    if reason := missing_clients():
        pytest.skip(reason)
    fast = tmp_path_factory.mktemp("models") / f"{FAST}.gguf"
    fast.symlink_to(resolve(MODEL).path)
    cluster = LocalCluster(2, dtype="float32", dynamic=True,
                           extra_args=["--model", MODEL, "--model", str(fast), "--model-alias", f"{ALIAS}={FAST}"])
    cluster.start()
    try:
        wait_serving(cluster, (MODEL, FAST), stages=2)
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def proxy(two_models):
    p = CaptureProxy(two_models.api_urls[0]).start()
    try:
        yield p
    finally:
        p.stop()


def streamed_model(exchange) -> str | None:
    """The ``model`` of a streamed Anthropic response's ``message_start``."""
    for line in exchange.response.splitlines():
        if line.startswith("data:") and '"message_start"' in line:
            return json.loads(line[5:])["message"]["model"]
    return None


def test_claude_code_sends_its_small_fast_model_requests_to_the_second_model(two_models, proxy, tmp_path):
    ids = {m["id"]: m for m in httpx.get(f"{two_models.api_urls[0]}/v1/models", timeout=10).json()["data"]}
    assert ids[ALIAS]["ringlet"]["alias_of"] == FAST and {MODEL, FAST} <= set(ids), ids
    sandbox = Sandbox(tmp_path)
    env = {**claude_env(proxy.url, EXTRA_BODY), "ANTHROPIC_DEFAULT_HAIKU_MODEL": ALIAS}
    mark = proxy.mark()
    run = sandbox.run(claude("--settings", json.dumps(STOP_HOOK), "--system-prompt", "You are terse.",
                             "--tools", "", "--output-format", "json", "What is the capital of France?"),
                      env, timeout=300)
    assert run.returncode == 0, str(run)
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["type"] == "result" and not result["is_error"] and result["subtype"] == "success", str(run)

    sent = proxy.since(mark, "/v1/messages")
    by_model: dict[str, list] = {}
    for e in sent:
        by_model.setdefault(e.body["model"], []).append(e)
    assert set(by_model) == {MODEL, ALIAS}, [(e.body["model"], e.status) for e in sent]
    for asked, served in ((MODEL, MODEL), (ALIAS, FAST)):
        for e in by_model[asked]:
            assert e.status == 200, (asked, e.status, e.response[:500])
            assert streamed_model(e) == served, (asked, e.response[:500])
    # the main model answers first; the hook's request to the small one carries that
    # answer in its transcript and the hook's JSON schema, which the grammar kept
    assert sent[0].body["model"] == MODEL, [e.body["model"] for e in sent]
    answer = sent[0].text().strip()
    for e in by_model[ALIAS]:
        assert e.body["output_config"]["format"]["type"] == "json_schema", e.body.get("output_config")
        said = [b["text"] for m in e.body["messages"] if m["role"] == "assistant" and isinstance(m["content"], list)
                for b in m["content"] if b.get("type") == "text"]
        assert answer in [s.strip() for s in said], (answer, said)
        assert e.text().startswith("{"), e.text()
    print(f"main model: {len(by_model[MODEL])} request(s), small fast model: {len(by_model[ALIAS])}; "
          f"session {run.seconds:.1f} s")
