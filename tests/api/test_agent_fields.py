"""The field policy agents need (issue #32), against a real daemon with a cluster secret:
the bodies Claude Code and Codex send are served and their hints named in the
``ringlet-ignored`` header (and logged once); Claude Code's billing-header block never
reaches the prompt; ``prompt_cache_key`` scopes the prefix cache; Responses namespace,
custom (Lark grammar) and hosted tools; reasoning sealed with the cluster's key goes
out and comes back, and forged or edited reasoning is a 400 naming the field.

The request bodies are the fields the agents' current releases sent (captured from
``@anthropic-ai/claude-code`` 2.1.332 and ``@openai/codex`` 0.171.0), trimmed to short
prompts."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from ringlet.daemon.api.anthropic_api import _Blocks
from ringlet.daemon.api.request import ReasoningDelta, TextDelta
from ringlet.daemon.api.responses_api import OutputBuilder
from ringlet.daemon.api.seal import Sealer, SealError
from ringlet.daemon.ops.demo import LocalCluster
from ringlet.daemon.wire.auth import load_secret, write_secret

MODEL = "smollm2-135m"
BILLING = "x-anthropic-billing-header: cc_version=2.1.332.1c9; cc_entrypoint=sdk-cli; cch={};"
#: Claude Code 2.1.332's first request (``claude --bare -p``), with its own fields
CLAUDE = {
    "model": MODEL, "max_tokens": 8, "temperature": 0, "stream": False,
    "messages": [{"role": "user", "content": [{"type": "text", "text": "Say hello",
                                                "cache_control": {"type": "ephemeral"}}]}],
    "system": [{"type": "text", "text": BILLING.format("0a1b2")},
               {"type": "text", "text": "You are a Claude agent, built on Anthropic's Claude Agent SDK.",
                "cache_control": {"type": "ephemeral"}},
               {"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}],
    "tools": [], "metadata": {"user_id": '{"device_id":"b6e9","account_uuid":"","session_id":"22f6"}'},
    "thinking": {"type": "adaptive", "display": "omitted"},
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    "output_config": {"effort": "medium"},
}
CLAUDE_HEADERS = {"anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,"
                                    "context-management-2025-06-27", "anthropic-version": "2023-06-01"}
EXEC = {"type": "function", "name": "exec_command", "description": "Runs a command in a PTY.", "strict": False,
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"],
                       "additionalProperties": False}}
AGENTS = {"type": "namespace", "name": "multi_agent_v1", "description": "Tools for spawning and managing sub-agents.",
          "tools": [{"type": "function", "name": "close_agent", "description": "Close an agent.", "strict": False,
                     "parameters": {"type": "object", "properties": {"id": {"type": "string", "enum": ["a1", "a2"]}},
                                    "required": ["id"], "additionalProperties": False}}]}
#: Codex 0.171.0's request fields, with a short developer message in place of its ~10k-token one
CODEX = {
    "model": MODEL, "stream": False, "temperature": 0, "max_output_tokens": 8,
    "input": [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
              {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Say hello"}]}],
    "tools": [EXEC, AGENTS, {"type": "web_search", "external_web_access": False}],
    "tool_choice": "auto", "parallel_tool_calls": True, "reasoning": {"summary": "auto"}, "store": False,
    "include": ["reasoning.encrypted_content"], "prompt_cache_key": "01a23c14-9ddc-7a52-8fa5-1826e127edb1",
    "client_metadata": {"x-codex-turn-metadata": '{"session_id":"01a23c14"}'},
}
#: a custom (free-form) tool whose input a Lark grammar fixes; the same language as a Python regex
ADD = {"type": "custom", "name": "adder", "description": "Adds two numbers.",
       "format": {"type": "grammar", "syntax": "lark",
                  "definition": 'start: "add " NUM "+" NUM\nNUM: /[0-9]{1,3}/'}}
ADD_LANGUAGE = re.compile(r"add [0-9]{1,3}\+[0-9]{1,3}")


@pytest.fixture(scope="module")
def secret(tmp_path_factory) -> Path:
    """A cluster secret file (``ringlet secret new``'s writer)."""
    return write_secret(tmp_path_factory.mktemp("secret") / "cluster.secret")


@pytest.fixture(scope="module")
def cluster(secret):
    c = LocalCluster(1, dtype="float32", extra_args=["--secret-file", str(secret)]).start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def http(cluster):
    with httpx.Client(base_url=cluster.api_urls[0], timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def sealer(secret) -> Sealer:
    """The cluster's sealer, from the same secret file the daemon read."""
    return Sealer(load_secret(secret), MODEL)


def ignored(response: httpx.Response) -> set[str]:
    header = response.headers.get("ringlet-ignored", "")
    return {name.strip() for name in header.split(",") if name.strip()}


def test_claude_codes_request_is_served_and_its_hints_named(cluster, http):
    r = http.post("/v1/messages?beta=true", json=CLAUDE, headers=CLAUDE_HEADERS)
    assert r.status_code == 200, r.text
    assert r.json()["content"][0]["type"] == "text"
    # the list of hints Claude Code sends; thinking.display "omitted" is honoured, not a hint
    assert ignored(r) == {"metadata", "context_management", "output_config.effort", "cache_control",
                          "system.x-anthropic-billing-header", "anthropic-beta"}
    again = http.post("/v1/messages?beta=true", json=CLAUDE, headers=CLAUDE_HEADERS)
    assert again.status_code == 200
    log = cluster.log_path(0).read_text()
    assert log.count("messages: accepted context_management as a hint") == 1, "logged once per node"


def test_a_context_edit_that_drops_context_is_refused(http):
    body = {**CLAUDE, "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}}
    r = http.post("/v1/messages", json=body)
    assert r.status_code == 400
    assert "context_management.edits.0" in r.json()["error"]["message"]


def test_the_billing_header_never_reaches_the_prompt_or_the_cache_key(http):
    counted = []
    for system in ([{"type": "text", "text": BILLING.format("aaaaa")}, *CLAUDE["system"][1:]],
                   [{"type": "text", "text": BILLING.format("bbbbb")}, *CLAUDE["system"][1:]],
                   CLAUDE["system"][1:]):
        r = http.post("/v1/messages/count_tokens", json={"model": MODEL, "system": system,
                                                         "messages": CLAUDE["messages"]})
        assert r.status_code == 200, r.text
        counted.append(r.json()["input_tokens"])
    assert counted[0] == counted[1] == counted[2]
    first = http.post("/v1/messages", json={**CLAUDE, "system": [{"type": "text", "text": BILLING.format("n1")},
                                                                 *CLAUDE["system"][1:]]}).json()["usage"]
    second = http.post("/v1/messages", json={**CLAUDE, "system": [{"type": "text", "text": BILLING.format("n2")},
                                                                  *CLAUDE["system"][1:]]}).json()["usage"]
    prompt = second["input_tokens"] + second["cache_read_input_tokens"]
    assert prompt == first["input_tokens"] + first["cache_read_input_tokens"]
    assert second["cache_read_input_tokens"] >= 0.95 * prompt, second


def thinking_history(block: dict) -> dict:
    return {"model": MODEL, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "What is 2+2?"},
                         {"role": "assistant", "content": [block, {"type": "text", "text": "4"}]},
                         {"role": "user", "content": "And 3+3?"}]}


def test_thinking_comes_back_only_with_the_signature_the_cluster_sealed(http, sealer, tmp_path):
    thought = "Two plus two is four."
    signature = sealer.seal("thinking", thought)
    ok = http.post("/v1/messages", json=thinking_history({"type": "thinking", "thinking": thought,
                                                          "signature": signature}))
    assert ok.status_code == 200, ok.text
    omitted = http.post("/v1/messages", json=thinking_history({"type": "thinking", "thinking": "",
                                                               "signature": signature}))
    assert omitted.status_code == 200, omitted.text
    other = Sealer(load_secret(write_secret(tmp_path / "other.secret")), MODEL).seal("thinking", thought)
    for block, field in (({"thinking": "Two plus two is five.", "signature": signature}, "thinking"),
                         ({"thinking": thought, "signature": other}, "signature"),
                         ({"thinking": thought, "signature": ""}, "signature")):
        r = http.post("/v1/messages", json=thinking_history({"type": "thinking", **block}))
        assert r.status_code == 400, r.text
        assert f"messages.1.content.0.{field}" in r.json()["error"]["message"]


def test_thinking_blocks_carry_their_text_sealed_and_omitted_display_sends_none(sealer):
    for omit in (False, True):
        blocks = _Blocks(sealer, omit_thinking=omit)
        frames = [*blocks.add(ReasoningDelta("Paris is ")), *blocks.add(ReasoningDelta("the capital.")),
                  *blocks.add(TextDelta("Paris."))]
        deltas = [f["delta"] for f in frames if f["type"] == "content_block_delta"]
        shown = "".join(d.get("thinking", "") for d in deltas if d["type"] == "thinking_delta")
        assert shown == ("" if omit else "Paris is the capital.")
        signature = next(d["signature"] for d in deltas if d["type"] == "signature_delta")
        assert blocks.blocks[0]["signature"] == signature
        assert sealer.open("thinking", signature) == "Paris is the capital."
        with pytest.raises(SealError):
            sealer.open("reasoning", signature)  # sealed for thinking blocks only


def test_codexs_request_is_served_and_its_hints_named(http):
    r = http.post("/v1/responses", json=CODEX)
    assert r.status_code == 200, r.text
    assert r.json()["status"] in ("completed", "incomplete")
    assert ignored(r) == {"client_metadata", "store", "reasoning.summary", "tools.web_search"}


def test_prompt_cache_key_scopes_the_prefix_cache(http):
    body = {"model": MODEL, "input": "Name three colours of the rainbow, please.", "max_output_tokens": 2,
            "temperature": 0}

    def cached(key: str) -> int:
        r = http.post("/v1/responses", json={**body, "prompt_cache_key": key})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["input_tokens_details"]["cached_tokens"]

    assert cached("k-one") == 0
    assert cached("k-one") > 0
    assert cached("k-two") == 0, "another key shares no entries"


def test_a_namespace_function_is_called_back_with_its_namespace(http):
    body = {**CODEX, "max_output_tokens": 100, "include": [],
            "tool_choice": {"type": "function", "namespace": "multi_agent_v1", "name": "close_agent"}}
    r = http.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    call = next(item for item in r.json()["output"] if item["type"] == "function_call")
    assert (call["namespace"], call["name"]) == ("multi_agent_v1", "close_agent")
    followup = {**CODEX, "input": [*CODEX["input"], {k: call[k] for k in ("type", "call_id", "name", "namespace",
                                                                           "arguments")},
                                   {"type": "function_call_output", "call_id": call["call_id"], "output": "closed"}]}
    assert http.post("/v1/responses", json=followup).status_code == 200


def test_a_forced_custom_tool_call_follows_its_lark_grammar(http):
    body = {"model": MODEL, "temperature": 0, "max_output_tokens": 40, "tools": [ADD],
            "input": "Add 12 and 30.", "tool_choice": {"type": "custom", "name": "adder"}}
    r = http.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    call = next(item for item in r.json()["output"] if item["type"] == "custom_tool_call")
    assert call["name"] == "adder" and ADD_LANGUAGE.fullmatch(call["input"]), call
    followup = {**body, "tool_choice": "auto",
                "input": [{"role": "user", "content": "Add 12 and 30."},
                          {k: call[k] for k in ("type", "call_id", "name", "input")},
                          {"type": "custom_tool_call_output", "call_id": call["call_id"], "output": "42"}]}
    assert http.post("/v1/responses", json=followup).status_code == 200


def test_a_custom_tool_grammar_that_does_not_compile_is_a_400(http):
    bad = {**ADD, "format": {"type": "grammar", "syntax": "lark", "definition": "start: ( unclosed"}}
    r = http.post("/v1/responses", json={"model": MODEL, "input": "Hi", "tools": [bad]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].format.definition"


def test_reasoning_items_carry_sealed_text_that_comes_back(http, sealer):
    out = OutputBuilder(seal=sealer)
    for event in (ReasoningDelta("The user "), ReasoningDelta("greets me."), TextDelta("Hello!")):
        out.feed(event)
    out.finish("stop")
    reasoning = out.items[0]
    assert reasoning["type"] == "reasoning"
    assert sealer.open("reasoning", reasoning["encrypted_content"]) == "The user greets me."
    item = {"type": "reasoning", "id": reasoning["id"], "summary": [],
            "encrypted_content": reasoning["encrypted_content"]}
    body = {"model": MODEL, "max_output_tokens": 4, "temperature": 0,
            "input": [{"role": "user", "content": "Hi"}, item, {"role": "assistant", "content": "Hello!"},
                      {"role": "user", "content": "Bye"}]}
    assert http.post("/v1/responses", json=body).status_code == 200
    item["encrypted_content"] = item["encrypted_content"][:-4] + "AAAA"
    r = http.post("/v1/responses", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[1].encrypted_content"


def test_chat_completions_hints_are_named_and_store_true_refused(http):
    body = {"model": MODEL, "max_tokens": 3, "temperature": 0, "messages": [{"role": "user", "content": "Hi"}],
            "user": "u1", "metadata": {"k": "v"}, "service_tier": "auto", "safety_identifier": "s1",
            "store": False, "prediction": {"type": "content", "content": "Hello"}, "verbosity": "low",
            "prompt_cache_key": "chat-1", "stream_options": {"include_usage": True, "include_obfuscation": False},
            "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        text = "".join(r.iter_text())
    assert "data: [DONE]" in text
    assert ignored(r) == {"user", "metadata", "service_tier", "safety_identifier", "store",
                          "verbosity", "stream_options.include_obfuscation"}  # prediction is honoured (drafts)
    refused = http.post("/v1/chat/completions", json={**body, "stream": False, "store": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "store"
    for bad in ({"type": "text", "content": "Hello"}, {"type": "content", "content": 3}):
        refused = http.post("/v1/chat/completions", json={**body, "stream": False, "prediction": bad})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "prediction"


def test_no_hints_no_header(http):
    r = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2,
                                                "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200 and "ringlet-ignored" not in r.headers


def test_the_seal_rejects_what_it_did_not_make():
    a, b = Sealer(b"k" * 32, MODEL), Sealer(b"k" * 32, "another-model")
    sealed = a.seal("reasoning", "héllo ✓")
    assert a.open("reasoning", sealed) == "héllo ✓"
    for bad in (sealed[:-2] + ("A" if sealed[-2] != "A" else "B") + sealed[-1], "", "!!", "AAAA"):
        with pytest.raises(SealError):
            a.open("reasoning", bad)
    with pytest.raises(SealError):
        b.open("reasoning", sealed)  # bound to the model


def count(http, **body) -> int:
    r = http.post("/v1/messages/count_tokens", json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return r.json()["input_tokens"]


def test_claude_codes_beta_shapes_a_system_message_a_deferred_tool_and_display_modes(http):
    """What Claude Code 2.1.332 sends with its default prompt and stream-json output: a
    system message inside the conversation (with an ``output_config``), a tool with
    ``defer_loading``, ``thinking.display: "updates"``."""
    user = [{"role": "user", "content": "Say hello"}]
    mid = [*user, {"role": "system", "content": [], "output_config": {"effort": "medium"}}]
    r = http.post("/v1/messages", json={**CLAUDE, "messages": mid, "thinking": {"type": "adaptive",
                                                                                "display": "updates"}})
    assert r.status_code == 200, r.text
    assert {"messages.output_config", "thinking.display"} <= ignored(r)
    said = [*user, {"role": "system", "content": [{"type": "text", "text": "Answer in French."}]}]
    assert count(http, messages=said) > count(http, messages=mid) == count(http, messages=user)
    tool = {"name": "Read", "description": "Read a file", "input_schema": {"type": "object", "properties": {
        "path": {"type": "string"}}}}
    assert count(http, messages=user, tools=[{**tool, "defer_loading": True}]) == count(http, messages=user)
    assert count(http, messages=user, tools=[tool]) > count(http, messages=user)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/responses"])
@pytest.mark.parametrize("problem", ["duplicate", "too many"])
def test_a_tool_list_with_a_repeated_name_or_over_128_tools_is_a_400(http, path, problem):
    names = ["same", "same"] if problem == "duplicate" else [f"t{i}" for i in range(129)]
    schema = {"type": "object", "properties": {}}
    tools = {"/v1/chat/completions": [{"type": "function", "function": {"name": n, "parameters": schema}}
                                      for n in names],
             "/v1/messages": [{"name": n, "input_schema": schema} for n in names],
             "/v1/responses": [{"type": "function", "name": n, "parameters": schema} for n in names]}[path]
    body = ({"input": "hi", "max_output_tokens": 1} if path == "/v1/responses"
            else {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    r = http.post(path, json={"model": "smollm2-135m", "tools": tools, **body})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert ("unique" in message) if problem == "duplicate" else ("at most 128 tools" in message)
