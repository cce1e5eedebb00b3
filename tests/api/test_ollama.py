"""Ollama's API through the official clients against a real daemon on the bundled model:
the ``ollama`` Python client (PyPI, pinned in requirements.lock) and the ``ollama``
JavaScript client (npm, pinned in tests/agents/npm; ``make agents`` installs it).

The expected values are the OpenAI surface's answers to the same request (same messages,
same token cap, greedy): chat and generate, whole and streamed, raw generate against
``/v1/completions``, a forced tool call, a JSON-schema ``format``, and generate's
``context`` against the OpenAI surface's ``return_token_ids``. Then ``list``, ``show``,
``ps``, ``/api/version``, embeddings refused with the reason, and bad input answered in
Ollama's shape (``{"error": "..."}``, 400 naming the field, 404 for another model, 401
without the key). All tests share one daemon.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import httpx
import jsonschema
import ollama
import openai
import pytest
from conftest import keyed_cluster

from ringlet.daemon.ops.demo import LocalCluster

MODEL = "smollm2-135m"
KEY = "ollama-test-key-" + "k" * 24
AUTH = {"Authorization": f"Bearer {KEY}"}
GREEDY = {"temperature": 0}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The current weather of a city",
                                            "parameters": WEATHER_SCHEMA}}
#: where ``make agents`` installs the pinned npm packages (tests/agents/agent_harness.py)
NODE_MODULES = Path(__file__).resolve().parents[2] / ".venv" / "agents" / "node_modules"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with keyed_cluster(tmp_path_factory.mktemp("keys"), KEY) as c:
        yield c


def client(cluster: LocalCluster, **kwargs) -> ollama.Client:
    return ollama.Client(host=cluster.api_urls[0], headers=AUTH, timeout=120, **kwargs)


def reference(cluster: LocalCluster) -> openai.OpenAI:
    """The OpenAI surface of the same daemon: the expected values."""
    return openai.OpenAI(base_url=cluster.api_urls[0] + "/v1", api_key=KEY, max_retries=0, timeout=120)


def finish(done_reason: str) -> set[str]:
    """The OpenAI finish reasons an Ollama ``done_reason`` stands for."""
    return {"length"} if done_reason == "length" else {"stop", "tool_calls"}


def check_figures(r) -> None:
    """Ollama's figures: whole nanoseconds, and the parts add up to the total."""
    parts = (r.load_duration, r.prompt_eval_duration, r.eval_duration)
    assert all(isinstance(p, int) and p >= 0 for p in parts) and r.total_duration > 0
    assert sum(parts) == r.total_duration


def test_chat_whole_and_streamed_equal_the_openai_answer(cluster):
    ref = reference(cluster).chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0)
    whole = client(cluster).chat(MODEL, messages=QUESTION, options={**GREEDY, "num_predict": 24})
    assert whole.done and whole.message.role == "assistant"
    assert whole.message.content == ref.choices[0].message.content
    assert ref.choices[0].finish_reason in finish(whole.done_reason)
    assert (whole.prompt_eval_count, whole.eval_count) == (ref.usage.prompt_tokens, ref.usage.completion_tokens)
    check_figures(whole)
    chunks = list(client(cluster).chat(f"{MODEL}:latest", messages=QUESTION, stream=True,
                                       options={**GREEDY, "num_predict": 24}))
    assert len(chunks) > 2 and not any(c.done for c in chunks[:-1]) and chunks[-1].done
    assert "".join(c.message.content for c in chunks) == whole.message.content
    assert chunks[-1].message.content == "" and chunks[-1].done_reason == whole.done_reason
    assert chunks[-1].model == f"{MODEL}:latest"  # Ollama echoes the name the request used
    check_figures(chunks[-1])


def test_generate_equals_the_openai_answer_and_its_context_carries_on(cluster):
    system = "Answer in one short sentence."
    ref = reference(cluster).chat.completions.create(
        model=MODEL, max_tokens=20, temperature=0, extra_body={"return_token_ids": True},
        messages=[{"role": "system", "content": system}, *QUESTION])
    choice = ref.choices[0]
    first = client(cluster).generate(MODEL, QUESTION[0]["content"], system=system,
                                     options={**GREEDY, "num_predict": 20})
    assert first.response == choice.message.content and first.prompt_eval_count == ref.usage.prompt_tokens
    # context: the prompt's ids and the answer's (without the end token), as the reference's ids
    answer = choice.token_ids[:-1] if choice.finish_reason == "stop" else choice.token_ids
    assert first.context == [*choice.prompt_token_ids, *answer]
    streamed = client(cluster).generate(MODEL, QUESTION[0]["content"], system=system, stream=True,
                                        options={**GREEDY, "num_predict": 20})
    chunks = list(streamed)
    assert "".join(c.response for c in chunks) == first.response and chunks[-1].context == first.context
    # the next turn runs after the context's tokens
    follow = "And of Italy?"
    second = client(cluster).generate(MODEL, follow, context=first.context, options={**GREEDY, "num_predict": 8})
    alone = reference(cluster).chat.completions.create(model=MODEL, max_tokens=1,
                                                       messages=[{"role": "user", "content": follow}])
    assert second.prompt_eval_count == len(first.context) + alone.usage.prompt_tokens
    assert second.context[:len(first.context)] == first.context


def test_raw_generate_equals_the_completions_answer(cluster):
    prompt = "The three primary colours are"
    ref = reference(cluster).completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    r = client(cluster).generate(MODEL, prompt, raw=True, options={**GREEDY, "num_predict": 12})
    assert r.response == ref.choices[0].text and r.context is None  # raw mode returns no context
    assert r.prompt_eval_count == ref.usage.prompt_tokens


class ForceTools(httpx.HTTPTransport):
    """Adds ringlet's ``tool_choice`` extension (``required``) to ``/api/chat`` bodies with
    tools: Ollama has no way to force a call, the official client sends no such field, and
    the bundled SmolLM2-135M does not call tools unforced."""

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/api/chat":
            body = json.loads(request.content)
            if body.get("tools"):
                body["tool_choice"] = "required"
                headers = {k: v for k, v in request.headers.items() if k.lower() != "content-length"}
                request = httpx.Request(request.method, request.url, headers=headers, content=json.dumps(body))
        return super().handle_request(request)


def test_a_forced_tool_call_comes_in_ollamas_shape_and_its_result_yields_an_answer(cluster):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    ref = reference(cluster).chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER],
                                                     tool_choice="required", max_tokens=40, temperature=0)
    forced = client(cluster, transport=ForceTools())
    r = forced.chat(MODEL, messages=ask, tools=[WEATHER], options={**GREEDY, "num_predict": 40})
    (call,) = r.message.tool_calls
    assert call.function.name == "get_weather" and isinstance(call.function.arguments, dict)
    jsonschema.validate(call.function.arguments, WEATHER_SCHEMA)
    assert call.function.arguments == json.loads(ref.choices[0].message.tool_calls[0].function.arguments)
    assert r.done_reason == "stop" and r.message.content == ""
    streamed = [c for c in forced.chat(MODEL, messages=ask, tools=[WEATHER], stream=True,
                                       options={**GREEDY, "num_predict": 40}) if c.message.tool_calls]
    assert [c.message.tool_calls for c in streamed] == [r.message.tool_calls]  # one chunk, the whole call
    # the call and its result in the history (Ollama's shape: tool_name, no id) give a text answer,
    # the OpenAI surface's for the same history
    history = [*ask, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": call.function.arguments}}]},
        {"role": "tool", "content": "21 C and sunny", "tool_name": "get_weather"}]
    answer = client(cluster).chat(MODEL, messages=history, tools=[WEATHER], options={**GREEDY, "num_predict": 20})
    expected = reference(cluster).chat.completions.create(
        model=MODEL, tools=[WEATHER], max_tokens=20, temperature=0, messages=[
            *ask, {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": json.dumps(call.function.arguments)}}]},
            {"role": "tool", "content": "21 C and sunny", "tool_call_id": "call_1"}])
    assert answer.message.content and answer.message.content == expected.choices[0].message.content


def test_a_json_schema_format_gives_valid_json_equal_to_the_openai_answer(cluster):
    schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 16}},
              "required": ["colour"], "additionalProperties": False}
    ask = [{"role": "user", "content": "Name a colour."}]
    r = client(cluster).chat(MODEL, messages=ask, format=schema, options={**GREEDY, "num_predict": 30})
    jsonschema.validate(json.loads(r.message.content), schema)
    ref = reference(cluster).chat.completions.create(
        model=MODEL, messages=ask, max_tokens=30, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}})
    assert r.message.content == ref.choices[0].message.content
    g = client(cluster).generate(MODEL, "What is the capital of France? Answer in JSON.", format="json",
                                 options={**GREEDY, "num_predict": 40})
    assert g.done_reason == "stop" and isinstance(json.loads(g.response), dict)


def test_list_show_ps_and_version(cluster):
    c = client(cluster)
    (model,) = c.list().models
    assert model.model == f"{MODEL}:latest" and model.size > 50_000_000 and len(model.digest) == 64
    assert (model.details.format, model.details.family, model.details.quantization_level) == ("gguf", "llama", "Q4_1")
    assert model.details.parameter_size.endswith("M")
    shown = c.show(MODEL)
    assert {"completion", "tools"} <= set(shown.capabilities) and "thinking" not in shown.capabilities
    assert shown.modelinfo["general.architecture"] == "llama" and shown.modelinfo["llama.context_length"] == 8192
    assert "<|im_start|>" in shown.template  # the model's own chat template
    assert c.show(f"{MODEL}:latest").details == shown.details
    (running,) = c.ps().models
    assert running.model == f"{MODEL}:latest" and running.context_length == 8192 and running.size == model.size
    version = c._client.get("/api/version").json()  # the client has no call for it; its own HTTP client
    assert version["version"].count(".") == 2 and version["ringlet"]


def test_embeddings_are_refused_with_the_reason(cluster):
    for call in (lambda c: c.embed(MODEL, "hello"), lambda c: c.embeddings(MODEL, "hello")):
        with pytest.raises(ollama.ResponseError) as err:
            call(client(cluster))
        assert err.value.status_code == 501 and "ringlet serves no embedding model" in err.value.error


def test_bad_input_is_answered_in_ollamas_shape(cluster):
    c = client(cluster)
    with pytest.raises(ollama.ResponseError) as err:
        c.chat("llama3.2", messages=QUESTION)
    assert err.value.status_code == 404 and err.value.error.startswith("model 'llama3.2' not found")
    with pytest.raises(ollama.ResponseError) as err:
        c.chat(MODEL, messages=[{**QUESTION[0], "images": [b"\x89PNG not really"]}])
    assert err.value.status_code == 400 and "messages[0].images" in err.value.error
    with pytest.raises(ollama.ResponseError) as err:
        c.generate(MODEL, "Describe this.", images=[b"\x89PNG not really"])
    assert err.value.status_code == 400 and "'images'" in err.value.error
    with pytest.raises(ollama.ResponseError) as err:
        c.generate(MODEL, "Hi", options={"mirostat": 2})
    assert err.value.status_code == 400 and "options.mirostat" in err.value.error
    with pytest.raises(ollama.ResponseError) as err:  # Ollama's answer for a model that does not think
        c.chat(MODEL, messages=QUESTION, think=True)
    assert err.value.status_code == 400 and err.value.error == f'"{MODEL}" does not support thinking'
    url = cluster.api_urls[0]
    r = httpx.post(f"{url}/api/chat", headers=AUTH, content=b'{"model": "smollm2-135m", messages: [}', timeout=30)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]
    r = httpx.post(f"{url}/api/chat", json={"model": MODEL, "messages": QUESTION}, timeout=30)
    assert r.status_code == 401 and "API key" in r.json()["error"]
    # curl -d sends a form's Content-Type; Ollama reads the body as JSON all the same
    r = httpx.post(f"{url}/api/generate", headers={**AUTH, "Content-Type": "application/x-www-form-urlencoded"},
                   content=json.dumps({"model": MODEL, "prompt": "Hi", "stream": False, "options": {"num_predict": 2}}),
                   timeout=60)
    assert r.status_code == 200 and r.json()["done"] is True


def test_hints_are_named_and_a_stream_is_newline_delimited_json(cluster):
    r = httpx.post(f"{cluster.api_urls[0]}/api/chat", headers=AUTH, timeout=60, json={
        "model": MODEL, "messages": QUESTION, "keep_alive": "5m", "options": {"num_ctx": 4096, "num_predict": 4}})
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson"
    assert r.headers["ringlet-ignored"] == "options.num_ctx, keep_alive"
    lines = [json.loads(line) for line in r.text.splitlines()]  # Ollama streams unless "stream": false
    assert [line["done"] for line in lines] == [False] * (len(lines) - 1) + [True]
    assert lines[-1]["done_reason"] == "length" and lines[-1]["eval_count"] == 4
    loaded = client(cluster).generate(MODEL)  # no prompt: Ollama's "load the model"
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""


JS_CLIENT = """
const { Ollama } = require(process.argv[2]);
(async () => {
  const client = new Ollama({ host: process.argv[3], headers: { Authorization: process.argv[4] } });
  const stream = await client.chat({ model: process.argv[5], messages: JSON.parse(process.argv[6]), stream: true,
                                     options: { temperature: 0, num_predict: 24 } });
  let text = ''; let last = null;
  for await (const part of stream) { text += part.message.content; last = part; }
  const list = await client.list();
  console.log(JSON.stringify({ text, done_reason: last.done_reason, eval_count: last.eval_count,
                               models: list.models.map((m) => m.name) }));
})().catch((err) => { console.error(err); process.exit(1); });
"""


def test_the_javascript_client_streams_the_python_clients_answer(cluster, tmp_path):
    package = NODE_MODULES / "ollama"
    if shutil.which("node") is None or not package.is_dir():
        pytest.skip(f"node or the ollama npm package is missing ({package}): `make agents` installs it "
                    "(apt-get install nodejs npm where npm is missing)")
    script = tmp_path / "chat.js"
    script.write_text(JS_CLIENT)
    run = subprocess.run(["node", str(script), str(package), cluster.api_urls[0], AUTH["Authorization"], MODEL,
                          json.dumps(QUESTION)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    js = json.loads(run.stdout.strip().splitlines()[-1])
    py = client(cluster).chat(MODEL, messages=QUESTION, options={**GREEDY, "num_predict": 24})
    assert (js["text"], js["done_reason"], js["eval_count"]) == (py.message.content, py.done_reason, py.eval_count)
    assert js["models"] == [f"{MODEL}:latest"]
