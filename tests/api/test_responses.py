"""OpenAI's Responses API (``POST /v1/responses``) on a real daemon, driven by the
official ``openai`` client.

Expected values come from outside ringlet: the greedy reference continuation computed
by transformers (tests/smollm2_135m_instruct_greedy.json), the API reference's object
shapes, and jsonschema for structured output and tool arguments.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest
from conftest import REFERENCE
from openai._models import construct_type_unchecked
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent

from ringlet.daemon.api.request import ReasoningDelta, TextDelta
from ringlet.daemon.api.responses_api import OutputBuilder, _stream
from ringlet.daemon.errors import GenerationError
from ringlet.daemon.ops.demo import LocalCluster

CHAT = next(c for c in REFERENCE if "messages" in c)
QUESTION = CHAT["messages"][0]["content"]  # "What is the capital of France?"
ANSWER = CHAT["completion_text"]  # greedy: "The capital of France is Paris."
#: SmolLM2's chat template inserts this system prompt when a chat has none
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
MODEL = "smollm2-135m"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The current weather in a city.",
          "parameters": WEATHER, "strict": True}]


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(1, dtype="float32") as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.api_urls[0] + "/v1", api_key="unused", max_retries=0, timeout=300)


def greedy(client: openai.OpenAI, **kwargs):
    return client.responses.create(model=MODEL, temperature=0, **kwargs)


def test_string_input(client):
    resp = greedy(client, input=QUESTION, max_output_tokens=30)
    assert resp.output_text == ANSWER
    assert resp.object == "response" and resp.id.startswith("resp_")
    assert resp.status == "completed" and resp.incomplete_details is None and resp.error is None
    assert resp.model == MODEL
    [message] = resp.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert message.id.startswith("msg_")
    assert [(p.type, p.text, p.annotations) for p in message.content] == [("output_text", ANSWER, [])]
    # the reference counts: its prompt, and its completion (the end token included)
    assert resp.usage.input_tokens == CHAT["prompt_tokens"] == 37
    assert resp.usage.output_tokens == len(CHAT["completion_ids"]) == 8
    assert resp.usage.total_tokens == 45
    assert resp.usage.output_tokens_details.reasoning_tokens == 0
    assert 0 <= resp.usage.input_tokens_details.cached_tokens <= 37
    # the echoed settings
    assert resp.temperature == 0 and resp.top_p == 1 and resp.max_output_tokens == 30
    assert resp.tool_choice == "auto" and resp.tools == [] and resp.parallel_tool_calls is True
    assert resp.text.format.type == "text"


@pytest.mark.parametrize("shape", ["instructions", "developer"])
def test_instructions_and_list_input(client, shape):
    """The template's default system prompt, given as instructions or a developer
    message, renders the reference prompt exactly: the same 37 tokens and answer."""
    user = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]}
    if shape == "instructions":
        resp = greedy(client, instructions=DEFAULT_SYSTEM, input=[user], max_output_tokens=30)
        assert resp.instructions == DEFAULT_SYSTEM
    else:
        resp = greedy(client, input=[{"role": "developer", "content": DEFAULT_SYSTEM}, user], max_output_tokens=30)
    assert resp.output_text == ANSWER
    assert resp.usage.input_tokens == 37


def test_stream_equals_whole(client):
    with client.responses.stream(model=MODEL, input=QUESTION, max_output_tokens=30, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert types.index("response.output_item.added") < types.index("response.content_part.added") \
        < types.index("response.output_text.delta")
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in deltas) == ANSWER
    assert all(e.logprobs == [] and e.output_index == 0 and e.content_index == 0 for e in deltas)
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == ANSWER and done.item_id == deltas[0].item_id
    assert final.output_text == ANSWER and final.status == "completed"
    assert final.usage.output_tokens == 8 and final.usage.input_tokens == 37
    assert events[-1].response.id == events[0].response.id == final.id


def test_max_output_tokens_cut(client):
    # the reference's first 3 tokens: "The", " capital", " of"
    resp = greedy(client, input=QUESTION, max_output_tokens=3)
    assert resp.status == "incomplete"
    assert resp.incomplete_details.reason == "max_output_tokens"
    assert resp.output_text == "The capital of"
    assert resp.output[0].status == "incomplete"
    assert resp.usage.output_tokens == 3

    stream = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=3, temperature=0, stream=True)
    events = list(stream)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.output_text == "The capital of"
    assert events[-1].response.usage.output_tokens == 3


def test_required_tool_call(client):
    resp = greedy(client, input="What is the weather in Paris?", tools=TOOLS, tool_choice="required",
                  max_output_tokens=40)
    assert resp.status == "completed"
    calls = [item for item in resp.output if item.type == "function_call"]
    assert calls and all(c.name == "get_weather" and c.status == "completed" for c in calls)
    for call in calls:
        assert call.call_id.startswith("call_") and call.id.startswith("fc_")
        jsonschema.validate(json.loads(call.arguments), WEATHER)
    assert resp.tool_choice == "required"
    assert [t.name for t in resp.tools] == ["get_weather"]


def test_named_tool_call_streamed(client):
    choice = {"type": "function", "name": "get_weather"}
    with client.responses.stream(model=MODEL, input="Weather in Rome?", tools=TOOLS, tool_choice=choice,
                                 max_output_tokens=40, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    added = [e for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
    assert added and added[0].item.arguments == ""
    index = added[0].output_index
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"
              and e.output_index == index]
    [done] = [e for e in events if e.type == "response.function_call_arguments.done" and e.output_index == index]
    assert "".join(deltas) == done.arguments
    jsonschema.validate(json.loads(done.arguments), WEATHER)
    [item_done] = [e for e in events if e.type == "response.output_item.done" and e.output_index == index]
    assert item_done.item.arguments == done.arguments and item_done.item.call_id == added[0].item.call_id
    call = final.output[index]
    assert call.type == "function_call" and call.arguments == done.arguments
    assert call.parsed_arguments == json.loads(done.arguments)  # the SDK parses strict tools' arguments


def test_tool_result_round_trip(client):
    question = {"role": "user", "content": "What is the weather in Paris?"}
    first = greedy(client, input=[question], tools=TOOLS, tool_choice="required", max_output_tokens=40)
    call = next(item for item in first.output if item.type == "function_call")
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature_c": 18}'}
    # the SDK's own output objects go back as input, as its docs show
    resp = greedy(client, input=[question, *first.output, result], tools=TOOLS, tool_choice="none",
                  max_output_tokens=20)
    assert resp.output[-1].type == "message"
    assert resp.output_text.strip()
    # hand-written items: a call's arguments as a JSON string, its result
    written = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'}
    resp = greedy(client, input=[question, written, {**result, "call_id": "call_1"}], tools=TOOLS,
                  max_output_tokens=5)
    assert resp.status in ("completed", "incomplete")


def test_json_schema_output(client):
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 16}},
              "required": ["capital"], "additionalProperties": False}
    resp = greedy(client, input=QUESTION, max_output_tokens=40,
                  text={"format": {"type": "json_schema", "name": "capital", "schema": schema, "strict": True}})
    assert resp.status == "completed"
    jsonschema.validate(json.loads(resp.output_text), schema)
    assert resp.text.format.type == "json_schema" and resp.text.format.name == "capital"

    resp = greedy(client, input=QUESTION, max_output_tokens=40, text={"format": {"type": "json_object"}})
    assert isinstance(json.loads(resp.output_text), dict)


def test_reasoning_input_and_effort_accepted(client):
    thought = {"type": "reasoning", "id": "rs_1", "summary": [],
               "content": [{"type": "reasoning_text", "text": "The user wants a greeting."}]}
    answer = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]}
    resp = greedy(client, input=[{"role": "user", "content": "Hi"}, thought, answer,
                                 {"role": "user", "content": QUESTION}],
                  reasoning={"effort": "minimal"}, max_output_tokens=3, store=False, metadata={"k": "v"}, user="u")
    assert resp.status == "incomplete" and resp.usage.output_tokens == 3


def test_previous_response_id_is_refused(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input="Hi", previous_response_id="resp_123")
    assert err.value.status_code == 400
    assert "previous_response_id" in err.value.message and "stateless" in err.value.message
    assert err.value.body["param"] == "previous_response_id"


@pytest.mark.parametrize(("kwargs", "param", "needle"), [
    ({"extra_body": {"frobnicate": 1}}, "frobnicate", "frobnicate"),
    ({"tools": [{"type": "frobnicator_tool"}]}, "tools[0].type", "frobnicator_tool"),
    ({"tools": [{"type": "function", "parameters": WEATHER}]}, "tools[0].name", "name"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "What is this?"},
                                             {"type": "input_image", "image_url": "https://x/y.png"}]}]},
     "input[0].content[1]", "input_image"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]}]},
     "input[0].content[0]", "input_file"),
    ({"store": True}, "store", "ringlet keeps no responses"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "Zm9yZ2Vk"},
                {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Hi"}]},
     "input[0].encrypted_content", "does not open"),
    ({"background": True}, "background", "background"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS}, "tool_choice", "nope"),
    ({"input": [{"type": "function_call_output", "call_id": "call_9", "output": "x"}]}, "input[0].call_id", "call_9"),
])
def test_bad_input_is_a_400_naming_the_field(cluster, client, kwargs, param, needle):
    kwargs = {"input": "Hi", **kwargs}
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, max_output_tokens=2, **kwargs)
    assert err.value.body["param"] == param
    assert needle in err.value.message
    assert err.value.body["type"] == "invalid_request_error"
    # the node keeps serving
    assert httpx.get(f"{cluster.api_urls[0]}/healthz", timeout=10).json()["status"] == "ok"


def test_node_serves_after_bad_input(client):
    resp = greedy(client, input=QUESTION, max_output_tokens=3)
    assert resp.output_text == "The capital of"


def test_reasoning_events_are_what_the_sdk_accumulates():
    """No bundled model thinks, so the reasoning item is checked on hand-made events:
    the SDK's stream accumulator takes the events and yields the expected output."""
    out = OutputBuilder()
    head = {"id": "resp_1", "object": "response", "created_at": 0, "model": MODEL, "output": [],
            "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "status": "in_progress"}
    raw = [out.event("response.created", response=head)]
    for event in (ReasoningDelta("Paris is "), ReasoningDelta("the capital."), TextDelta("\n\n"), TextDelta("Paris.")):
        raw += out.feed(event)
    raw += out.finish("stop")
    types = [e["type"] for e in raw]
    assert types == ["response.created",
                     "response.output_item.added", "response.content_part.added",
                     "response.reasoning_text.delta", "response.reasoning_text.delta",
                     "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
                     "response.output_item.added", "response.content_part.added", "response.output_text.delta",
                     "response.output_text.done", "response.content_part.done", "response.output_item.done"]
    reasoning, message = out.items
    assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_")
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Paris is the capital."}]
    assert message["content"][0]["text"] == "\n\nParis."  # the space before the text joins it
    raw.append(out.event("response.completed", response={**head, "status": "completed", "output": out.items}))
    state = ResponseStreamState(input_tools=[], text_format=openai.omit)
    for event in raw:
        state.handle_event(construct_type_unchecked(type_=ResponseStreamEvent, value=event))
    final = state._completed_response
    assert final.output_text == "\n\nParis."
    assert final.output[0].content[0].text == "Paris is the capital."


def test_a_failed_generation_mid_stream_is_response_failed():
    """A ring failure after some text: the open item ends ``incomplete`` and the stream
    ends with ``response.failed`` carrying the message (checked on hand-made events)."""

    async def events():
        yield TextDelta("Par")
        raise GenerationError("stage 2 is gone")

    class Connected:
        async def is_disconnected(self) -> bool:
            return False

    async def collect() -> list[str]:
        head = {"id": "resp_1", "object": "response", "created_at": 0, "model": MODEL}
        echo = {"parallel_tool_calls": True, "tool_choice": "auto", "tools": []}
        return [f async for f in _stream(events(), head, echo, Connected(), OutputBuilder())]

    frames = asyncio.run(collect())
    parsed = []
    for f in frames:
        name, data = f.removesuffix("\n\n").split("\n")
        parsed.append(json.loads(data.removeprefix("data: ")))
        assert name == "event: " + parsed[-1]["type"]
    assert [p["sequence_number"] for p in parsed] == list(range(len(parsed)))
    last = parsed[-1]
    assert last["type"] == "response.failed" and last["response"]["status"] == "failed"
    assert last["response"]["error"] == {"code": "server_error", "message": "generation failed: stage 2 is gone"}
    assert last["response"]["output"][0]["status"] == "incomplete"
    assert last["response"]["output"][0]["content"][0]["text"] == "Par"
    state = ResponseStreamState(input_tools=[], text_format=openai.omit)
    for p in parsed:
        fired = state.handle_event(construct_type_unchecked(type_=ResponseStreamEvent, value=p))
    assert fired[-1].type == "response.failed" and fired[-1].response.error.message.endswith("stage 2 is gone")
