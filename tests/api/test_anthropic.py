"""Anthropic's Messages API through the official ``anthropic`` client against real
daemons on the bundled model: text, system prompts, stop sequences, streaming, tools
(a forced call validates against its schema; a tool result yields an answer), thinking
blocks in the history, structured output, a final assistant message continued (prefill),
count_tokens, ``x-api-key``, and a 400 in
Anthropic's shape naming the field for each bad input."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest
from conftest import keyed_cluster

from ringlet.daemon.ops.demo import LocalCluster

MODEL = "smollm2-135m"
KEY = "anthropic-test-key-" + "k" * 24
GREEDY = {"temperature": 0}  # the 2.x SDK takes sampling settings through extra_body
WEATHER = {"name": "get_weather", "description": "The current weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                            "additionalProperties": False}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with keyed_cluster(tmp_path_factory.mktemp("keys"), KEY) as c:
        yield c


def client(cluster: LocalCluster, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=cluster.api_urls[0], api_key=key, max_retries=0)


def test_a_message_answers_with_text_and_usage(cluster):
    m = client(cluster).messages.create(model=MODEL, max_tokens=12, extra_body=GREEDY,
                                        messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens")
    assert m.usage.output_tokens >= 1 and m.usage.input_tokens + m.usage.cache_read_input_tokens > 10


def test_system_as_text_or_blocks_and_the_stream_equal_the_plain_reply(cluster):
    c = client(cluster)
    question = [{"role": "user", "content": "Name a colour."}]
    plain = c.messages.create(model=MODEL, max_tokens=10, system="Answer in one word.", messages=question,
                              extra_body=GREEDY)
    blocks = c.messages.create(model=MODEL, max_tokens=10, messages=question, extra_body=GREEDY,
                               system=[{"type": "text", "text": "Answer in one word.",
                                        "cache_control": {"type": "ephemeral"}}])
    assert blocks.content[0].text == plain.content[0].text
    with c.messages.stream(model=MODEL, max_tokens=10, system="Answer in one word.", messages=question,
                           extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == plain.content[0].text == final.content[0].text
    assert final.usage.output_tokens == plain.usage.output_tokens and final.stop_reason == plain.stop_reason


def test_a_stop_sequence_ends_the_text_and_is_named(cluster):
    c = client(cluster)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    free = c.messages.create(model=MODEL, max_tokens=12, messages=question, extra_body=GREEDY).content[0].text
    word = free.split()[2]  # a word in the middle of the greedy answer
    m = c.messages.create(model=MODEL, max_tokens=12, messages=question, stop_sequences=[word, "zzz"],
                          extra_body=GREEDY)
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", word)
    assert m.content[0].text == free[:free.index(word)]


def test_a_forced_tool_use_validates_also_streamed(cluster):
    c = client(cluster)
    m = c.messages.create(model=MODEL, max_tokens=40, tools=[WEATHER], tool_choice={"type": "any"}, messages=ASK,
                          extra_body=GREEDY)
    assert m.stop_reason == "tool_use"
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER["input_schema"])
    with c.messages.stream(model=MODEL, max_tokens=40, tools=[WEATHER], messages=ASK, extra_body=GREEDY,
                           tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        partial = "".join(e.delta.partial_json for e in stream
                          if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert json.loads(partial) == final.content[-1].input
    jsonschema.validate(final.content[-1].input, WEATHER["input_schema"])


def test_a_tool_result_in_the_history_yields_an_answer(cluster):
    """(A thinking block in the history is checked in test_agent_fields.py: its
    signature must be one the cluster sealed.)"""
    history = [*ASK,
               {"role": "assistant", "content": [
                   {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
               {"role": "user", "content": [
                   {"type": "tool_result", "tool_use_id": "toolu_1", "content": "21 C and sunny"}]}]
    m = client(cluster).messages.create(model=MODEL, max_tokens=20, tools=[WEATHER], messages=history,
                                        extra_body=GREEDY)
    assert m.content and m.content[0].type == "text" and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens")


def test_output_config_format_is_enforced(cluster):
    schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 16}},
              "required": ["colour"], "additionalProperties": False}
    m = client(cluster).messages.create(model=MODEL, max_tokens=30, extra_body=GREEDY,
                                        messages=[{"role": "user", "content": "Name a colour."}],
                                        output_config={"format": {"type": "json_schema", "schema": schema}})
    assert m.stop_reason == "end_turn"
    jsonschema.validate(json.loads(m.content[0].text), schema)


def test_count_tokens_is_the_rendered_prompts_length(cluster):
    from ringlet.daemon.engine.model_info import load_tokenizer
    from ringlet.daemon.engine.sources import resolve

    tok = load_tokenizer(resolve(None))
    messages = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi!"},
                {"role": "user", "content": "How are you?"}]
    expected = len(tok.apply_chat_template([{"role": "system", "content": "Be kind."}, *messages],
                                           add_generation_prompt=True))
    counted = client(cluster).messages.count_tokens(model=MODEL, system="Be kind.", messages=messages)
    assert counted.input_tokens == expected


def test_a_final_assistant_message_is_continued(cluster):
    """Anthropic's prefill: the answer continues the final assistant message's text (the
    prompt ends inside that turn, as Hugging Face's ``continue_final_message`` renders it),
    so the prefill and the answer make one JSON object; without it this model answers
    ``{"city": "Paris"}``, a turn of its own."""
    from ringlet.daemon.engine.model_info import load_tokenizer
    from ringlet.daemon.engine.sources import resolve

    prefill = '{"capital": "'
    messages = [{"role": "user", "content": "What is the capital of France? Answer in JSON."},
                {"role": "assistant", "content": prefill}]
    m = client(cluster).messages.create(model=MODEL, max_tokens=12, messages=messages, extra_body=GREEDY)
    assert json.loads(prefill + m.content[0].text) == {"capital": "Paris"}
    assert m.stop_reason == "end_turn"
    rendered = load_tokenizer(resolve(None)).apply_chat_template(messages, continue_final_message=True,
                                                                 add_generation_prompt=False)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == len(rendered)
    assert client(cluster).messages.count_tokens(model=MODEL, messages=messages).input_tokens == len(rendered)


def test_x_api_key_is_checked(cluster):
    with pytest.raises(anthropic.AuthenticationError):
        client(cluster, key="wrong-key-" + "w" * 24).messages.create(model=MODEL, max_tokens=2, messages=ASK)
    r = httpx.post(f"{cluster.api_urls[0]}/v1/messages", headers={"x-api-key": KEY}, timeout=60,
                   json={"model": MODEL, "max_tokens": 2, "messages": ASK})
    assert r.status_code == 200 and r.json()["type"] == "message"


@pytest.mark.parametrize(("body", "field"), [
    ({"frobnicate": 1}, "frobnicate"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
    ({"messages": [{"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]}]},
     "redacted_thinking"),
    ({"tools": [{"description": "no name", "input_schema": {"type": "object"}}]}, "tools.0.name"),
    ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": [WEATHER]}, "tool_choice"),
    ({"temperature": 1.5}, "temperature"),
    ({"messages": [*ASK, {"role": "assistant", "content": "It is "}]}, "trailing whitespace"),
    ({"messages": [*ASK, {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather",
                                                             "input": {"city": "Paris"}}]}], "tools": [WEATHER]},
     "tool_use"),
    ({"max_tokens": None}, "max_tokens"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}}}, "output_config.format"),
])
def test_bad_input_gets_a_400_naming_the_field_and_the_node_keeps_serving(cluster, body, field):
    payload = {"model": MODEL, "max_tokens": 4, "messages": ASK, **body}
    payload = {k: v for k, v in payload.items() if v is not None}
    r = httpx.post(f"{cluster.api_urls[0]}/v1/messages", headers={"x-api-key": KEY}, json=payload, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert field in error["error"]["message"], error
    assert client(cluster).messages.create(model=MODEL, max_tokens=2, messages=ASK).content is not None

