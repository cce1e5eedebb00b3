"""The real coding-agent CLIs against a real ring (issue #32, point 6): Claude Code
2.1.332 (Anthropic messages), Codex 0.171.0 (OpenAI Responses) and opencode 1.18.33
(OpenAI chat completions), each configured as docs/agents.md says for the bundled
model's 8,192-token context. For each client:

* a 5-turn session (the client's own continue/resume): the client exits 0 and prints a
  non-empty answer every turn, the first the one the node streamed, and from turn 2 on the
  prefix cache serves >= 95 % of the previous turn's prompt, read from the client's own
  usage figures;
* a tool round trip: the client sends a tool call and its result back and gets an answer
  (Claude Code runs its Read tool on a call ringlet forces; the others' histories hold a
  hand-written call: the bundled SmolLM2-135M does not call tools unforced);
* the client's full default prompt does not fit the context: the node's 400 ("the
  prompt has N tokens; the model's context is 8192", ``context_length_exceeded``)
  reaches the user.

All tests share one 2-daemon ring (the fixtures below: a conftest.py here would shadow
tests/conftest.py, which other test modules import by name); every client run is in a sandbox with
its own home and project, a hard timeout, and talks only to 127.0.0.1.
"""

from __future__ import annotations

import json
import re
import uuid

import pytest
from agent_harness import (
    CONTEXT,
    OPENCODE_ENV,
    CaptureProxy,
    Sandbox,
    claude,
    claude_env,
    codex,
    codex_home,
    missing_clients,
    opencode,
    opencode_config,
)

from ringlet.daemon.ops.demo import LocalCluster


@pytest.fixture(scope="session")
def ring():
    """A float32 ring of two daemons, started once for every agent test."""
    if reason := missing_clients():
        pytest.skip(reason)
    cluster = LocalCluster(2, dtype="float32").start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def proxy(ring):
    """The capture proxy the clients talk to, in front of the ring's first node."""
    p = CaptureProxy(ring.api_urls[0]).start()
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture
def sandbox(tmp_path):
    """An isolated home and project for one test's client runs."""
    return Sandbox(tmp_path)


QUESTIONS = ["What is the capital of France?", "And of Italy?", "And of Spain?", "And of Germany?",
             "And of Portugal?"]
#: the over-context error ringlet returns (issue #32)
OVER_CONTEXT = re.compile(r"the prompt has (\d+) tokens; the model's context is 8192")
#: the share of the previous turn's prompt the prefix cache must serve from turn 2 on
CACHED_SHARE = 0.95
#: an answer's length bound for Codex, which sends neither temperature nor an output cap
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "minLength": 1, "maxLength": 60}},
                 "required": ["answer"], "additionalProperties": False}


def assert_cached(turns: list[tuple[int, int]], client: str) -> None:
    """``turns``: (prompt tokens, cached prompt tokens) per turn, as the client reported."""
    for n in range(1, len(turns)):
        prompt, cached = turns[n]
        previous = turns[n - 1][0]
        assert prompt > previous, f"{client}: turn {n + 1} has no more prompt than turn {n}: {turns}"
        assert cached >= CACHED_SHARE * previous, (
            f"{client}: turn {n + 1} read {cached} cached tokens, under {CACHED_SHARE:.0%} of turn {n}'s "
            f"{previous}-token prompt (prompt, cached per turn: {turns})")
    print(f"{client}: (prompt, cached) per turn: {turns}")


def assert_over_context(text: str) -> None:
    m = OVER_CONTEXT.search(text)
    assert m, f"no over-context message in:\n{text[-3000:]}"
    assert int(m.group(1)) > CONTEXT


def node_400(exchanges) -> dict:
    """The node's over-context 400 among ``exchanges``."""
    refused = [e for e in exchanges if e.status == 400]
    assert refused, [(e.path, e.status) for e in exchanges]
    body = refused[-1].response_json()
    error = body["error"]
    assert_over_context(error["message"])
    return error


# --- Claude Code (Anthropic messages) ------------------------------------------------------

SMALL_CLAUDE = ("--bare", "--system-prompt", "You are terse.", "--tools", "")


def claude_result(run) -> dict:
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["type"] == "result", run
    return result


def test_claude_code_answers_a_session_of_5_turns_that_reads_the_prefix_cache(ring, proxy, sandbox):
    """Each turn answers (the first with the very text the API streamed), ``-c`` continues
    the session, and later turns read the prefix cache."""
    turns, session = [], None
    for n, question in enumerate(QUESTIONS):
        mark = proxy.mark()
        run = sandbox.run(claude(*SMALL_CLAUDE, *(("-c",) if n else ()), "--output-format", "json", question),
                          claude_env(proxy.url))
        assert run.returncode == 0, run
        result = claude_result(run)
        assert not result["is_error"] and result["result"].strip() and result["num_turns"] == 1, run
        if n == 0:
            streamed = [e for e in proxy.since(mark, "/v1/messages") if e.status == 200]
            assert streamed and streamed[-1].text().strip() == result["result"].strip(), run
        assert session in (None, result["session_id"]), "-c did not continue the session"
        session = result["session_id"]
        u = result["usage"]
        turns.append((u["input_tokens"] + u["cache_read_input_tokens"] + u["cache_creation_input_tokens"],
                      u["cache_read_input_tokens"]))
    assert_cached(turns, "claude code")


def test_claude_code_runs_a_tool_and_sends_its_result_back(ring, proxy, sandbox):
    secret = uuid.uuid4().hex[:12]
    (sandbox.project / "notes.txt").write_text(f"The secret word is {secret}.\n")
    small = ("--bare", "--system-prompt", "You are a coding agent.", "--tools", "Read")
    # leg 1: ringlet forces a Read call (tool_choice through CLAUDE_CODE_EXTRA_BODY); Claude
    # Code runs it and, its one turn spent, stops
    forced = claude_env(proxy.url, {"temperature": 0, "tool_choice": {"type": "tool", "name": "Read"}}, 64)
    run = sandbox.run(claude(*small, "--max-turns", "1", "--output-format", "stream-json", "--verbose",
                             'Read {"file_path": "notes.txt"}'), forced)
    events = run.events()
    calls = [c for e in events if e["type"] == "assistant" for c in e["message"]["content"] if c["type"] == "tool_use"]
    assert calls and calls[0]["name"] == "Read", run
    results = [c for e in events if e["type"] == "user" for c in e["message"]["content"]
               if c.get("type") == "tool_result" and c["tool_use_id"] == calls[0]["id"]]
    assert results and secret in json.dumps(results[0]["content"]), f"the Read tool did not read notes.txt:\n{run}"
    # leg 2: the session continues, the tool result goes back to the node, an answer comes
    mark = proxy.mark()
    run = sandbox.run(claude(*small, "-c", "--output-format", "json", "What is the secret word?"),
                      claude_env(proxy.url, max_output=64))
    assert run.returncode == 0 and claude_result(run)["result"].strip(), run
    sent = proxy.since(mark, "/v1/messages")[0].body
    returned = [b for m in sent["messages"] if isinstance(m["content"], list) for b in m["content"]
                if b.get("type") == "tool_result" and b["tool_use_id"] == calls[0]["id"]]
    assert returned and secret in json.dumps(returned[0]["content"]), sent["messages"]


def test_claude_codes_default_prompt_gets_the_over_context_error(ring, proxy, sandbox):
    mark = proxy.mark()
    run = sandbox.run(claude("--output-format", "json", QUESTIONS[0]), claude_env(proxy.url))
    assert run.returncode == 1, run
    result = claude_result(run)
    assert result["is_error"] and result["api_error_status"] == 400, run
    assert_over_context(result["result"])
    assert node_400(proxy.since(mark, "/v1/messages"))["type"] == "invalid_request_error"


# --- Codex (OpenAI Responses) --------------------------------------------------------------


def codex_exec(sandbox, env, prompt: str, resume: bool = False, schema: bool = True):
    args = ["exec", *(("resume", "--last") if resume else ()), "--skip-git-repo-check", "--json"]
    if schema:
        path = sandbox.root / "answer.schema.json"
        path.write_text(json.dumps(ANSWER_SCHEMA))
        args += ["--output-schema", str(path)]
    return sandbox.run(codex(*args, prompt), env)


def codex_answer(run) -> str:
    events = run.events()
    assert any(e["type"] == "turn.completed" for e in events), run
    answers = [e["item"]["text"] for e in events if e["type"] == "item.completed"
               and e["item"]["type"] == "agent_message"]
    assert answers, run
    return answers[-1]


def test_codex_answers_a_session_of_5_turns_that_reads_the_prefix_cache(ring, proxy, sandbox):
    """Each turn answers (the first in the ``--output-schema`` shape ringlet enforces, with
    the very text the API streamed), ``resume`` continues the thread, and later turns read
    the prefix cache."""
    env = codex_home(sandbox, proxy.url)
    totals = []
    for n, question in enumerate(QUESTIONS):
        mark = proxy.mark()
        run = codex_exec(sandbox, env, question, resume=n > 0)
        assert run.returncode == 0 and codex_answer(run), run
        if n == 0:
            answer = codex_answer(run)
            assert json.loads(answer)["answer"], run
            streamed = [e for e in proxy.since(mark, "/v1/responses") if e.status == 200]
            assert streamed and streamed[-1].text() == answer, run
        u = next(e["usage"] for e in run.events() if e["type"] == "turn.completed")
        totals.append((u["input_tokens"], u["cached_input_tokens"]))
    # a resumed thread's turn.completed usage is the thread's running total: one request
    # per turn here, so a turn's own figures are the difference
    turns = [totals[0]] + [(b[0] - a[0], b[1] - a[1]) for a, b in zip(totals, totals[1:], strict=False)]
    assert_cached(turns, "codex")


def test_codex_sends_a_tool_result_back(ring, proxy, sandbox):
    secret = uuid.uuid4().hex[:12]
    env = codex_home(sandbox, proxy.url, shell=True)
    run = codex_exec(sandbox, env, "Hello")
    assert run.returncode == 0, run
    # the thread's history gains a hand-written exec_command call and its output
    rollout = next((sandbox.root / "codex" / "sessions").rglob("rollout-*.jsonl"))
    last = json.loads(rollout.read_text().splitlines()[-1])
    call = {"type": "function_call", "name": "exec_command", "arguments": json.dumps({"cmd": "cat notes.txt"}),
            "call_id": "call_handwritten_1"}
    output = {"type": "function_call_output", "call_id": "call_handwritten_1",
              "output": f"The secret word is {secret}.\n"}
    with rollout.open("a") as f:
        for i, item in enumerate((call, output), 1):
            f.write(json.dumps({"timestamp": last["timestamp"], "ordinal": last["ordinal"] + i,
                                "type": "response_item", "payload": item}) + "\n")
    mark = proxy.mark()
    run = codex_exec(sandbox, env, "What is the secret word?", resume=True)
    assert run.returncode == 0 and codex_answer(run), run
    sent = proxy.since(mark, "/v1/responses")[0].body
    items = {(i["type"], i.get("call_id")): i for i in sent["input"]}
    assert items[("function_call", "call_handwritten_1")]["name"] == "exec_command", sent["input"]
    assert secret in items[("function_call_output", "call_handwritten_1")]["output"], sent["input"]
    assert any(t.get("name") == "exec_command" for t in sent["tools"]), sent["tools"]


def test_codexs_default_prompt_gets_the_over_context_error(ring, proxy, sandbox):
    env = codex_home(sandbox, proxy.url, small=False)
    mark = proxy.mark()
    run = codex_exec(sandbox, env, QUESTIONS[0], schema=False)
    assert run.returncode == 1, run
    # Codex shows its own words for the error code, not the node's message
    failed = [e for e in run.events() if e["type"] == "turn.failed"]
    assert failed and "ran out of room in the model's context window" in failed[0]["error"]["message"], run
    assert node_400(proxy.since(mark, "/v1/responses"))["code"] == "context_length_exceeded"


# --- opencode (OpenAI chat completions) ----------------------------------------------------


def opencode_answer(run) -> tuple[str, dict]:
    """The answer's text and its step's token figures."""
    events = run.events()
    errors = [e for e in events if e["type"] == "error"]
    assert not errors, run
    text = "".join(e["part"]["text"] for e in events if e["type"] == "text")
    steps = [e["part"] for e in events if e["type"] == "step_finish"]
    assert text.strip() and steps, run
    return text, steps[-1]["tokens"]


def later_id(opencode_id: str, k: int) -> str:
    """An opencode id ``k`` steps after ``opencode_id`` (``msg_``/``prt_``, 12 hex digits of
    time, a random tail): the messages of a session are read in id order."""
    prefix, rest = opencode_id.split("_", 1)
    return f"{prefix}_{int(rest[:12], 16) + k:012x}{rest[12:]}"


def test_opencode_answers_a_session_of_5_turns_that_reads_the_prefix_cache(ring, proxy, sandbox):
    """Each turn answers (the first with the very text the API streamed), ``-c`` continues
    the session, and later turns read the prefix cache."""
    opencode_config(sandbox, proxy.url)
    turns, session = [], None
    for n, question in enumerate(QUESTIONS):
        mark = proxy.mark()
        run = sandbox.run(opencode("run", *(("-c",) if n else ()), "--format", "json", question), OPENCODE_ENV)
        assert run.returncode == 0, run
        text, tokens = opencode_answer(run)
        if n == 0:
            streamed = [e for e in proxy.since(mark, "/v1/chat/completions") if e.status == 200]
            assert streamed and streamed[-1].text() == text, run
        ids = {e["sessionID"] for e in run.events()}
        assert len(ids) == 1 and session in (None, *ids), "-c did not continue the session"
        session = ids.pop()
        turns.append((tokens["input"] + tokens["cache"]["read"] + tokens["cache"]["write"], tokens["cache"]["read"]))
    assert_cached(turns, "opencode")


def test_opencode_sends_a_tool_result_back(ring, proxy, sandbox):
    secret = uuid.uuid4().hex[:12]
    opencode_config(sandbox, proxy.url, tools=("read",), prompt="You are a coding agent.")
    run = sandbox.run(opencode("run", "--format", "json", "Hello"), OPENCODE_ENV)
    assert run.returncode == 0, run
    sid = run.events()[0]["sessionID"]
    # the session, exported, gains a hand-written read call and its result, and comes back
    export = sandbox.run(opencode("export", sid), OPENCODE_ENV)
    assert export.returncode == 0, export
    session = json.loads(export.stdout[export.stdout.index("{"):])
    user, answer = session["messages"][-2:]
    t = answer["info"]["time"]["completed"]
    ask_id, call_id = later_id(answer["info"]["id"], 1), later_id(answer["info"]["id"], 2)
    part = answer["parts"][-1]["id"]
    ask = {"info": {**user["info"], "id": ask_id, "time": {"created": t + 1}},
           "parts": [{**user["parts"][0], "id": later_id(part, 1), "messageID": ask_id, "text": "Read notes.txt"}]}
    call = {"info": {**answer["info"], "id": call_id, "parentID": ask_id, "finish": "tool-calls",
                     "time": {"created": t + 2, "completed": t + 3}},
            "parts": [{"type": "tool", "id": later_id(part, 2), "sessionID": sid, "messageID": call_id,
                       "callID": "call_handwritten_1", "tool": "read",
                       "state": {"status": "completed", "input": {"filePath": str(sandbox.project / "notes.txt")},
                                 "output": f"1: The secret word is {secret}.", "title": "notes.txt", "metadata": {},
                                 "time": {"start": t + 2, "end": t + 3}}}]}
    session["messages"] += [ask, call]
    (sandbox.root / "session.json").write_text(json.dumps(session))
    imported = sandbox.run(opencode("import", str(sandbox.root / "session.json")), OPENCODE_ENV)
    assert imported.returncode == 0, imported
    mark = proxy.mark()
    run = sandbox.run(opencode("run", "--session", sid, "--format", "json", "What is the secret word?"), OPENCODE_ENV)
    assert run.returncode == 0, run
    opencode_answer(run)
    sent = proxy.since(mark, "/v1/chat/completions")[0].body
    calls = [c for m in sent["messages"] if m["role"] == "assistant" for c in m.get("tool_calls") or ()]
    assert [c["id"] for c in calls] == ["call_handwritten_1"] and calls[0]["function"]["name"] == "read", sent
    results = [m for m in sent["messages"] if m["role"] == "tool"]
    assert results and results[0]["tool_call_id"] == "call_handwritten_1" and secret in results[0]["content"], sent


def test_opencodes_default_prompt_gets_the_over_context_error(ring, proxy, sandbox):
    # opencode's default prompt (~7,600 tokens with its tools) fits in 8,192: a long
    # message tips it over
    opencode_config(sandbox, proxy.url, small=False)
    message = "Summarise these notes. " + "The quick brown fox jumps over the lazy dog. " * 120
    mark = proxy.mark()
    run = sandbox.run(opencode("run", "--format", "json", message), OPENCODE_ENV)
    assert run.returncode == 1, run
    errors = [e["error"] for e in run.events() if e["type"] == "error"]
    assert errors and errors[0]["name"] == "ContextOverflowError", run
    assert_over_context(errors[0]["data"]["message"])
    assert node_400(proxy.since(mark, "/v1/chat/completions"))["code"] == "context_length_exceeded"
