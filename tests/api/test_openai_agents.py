"""What agents ask of the OpenAI API, through the official ``openai`` client against
real daemons on the bundled model: tools (a forced call validates against its schema,
also streamed; a tool result yields an answer), structured output (``json_schema`` and
``json_object`` valid by ``jsonschema``), log-probabilities (equal to a softmax of the
model's logits computed here, in numpy), ``n``, logit bias and penalties, and a 400
naming the field for each bad input, after which the node still serves."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import openai
import pytest

from ringlet.daemon.ops.demo import LocalCluster

MODEL = "smollm2-135m"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def clusters():
    """``clusters(stages)``: a float32 cluster of 1 or 3 stages, started on first use."""
    started: dict[int, LocalCluster] = {}

    def get(stages: int) -> LocalCluster:
        if stages not in started:
            started[stages] = LocalCluster(stages, dtype="float32").start()
        return started[stages]

    try:
        yield get
    finally:
        for c in started.values():
            c.stop()


def client(cluster: LocalCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.api_urls[0] + "/v1", api_key="none", max_retries=0)


@pytest.mark.parametrize("stages", [1, 3])
def test_a_required_tool_call_names_a_given_function_with_valid_arguments(clusters, stages):
    r = client(clusters(stages)).chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False,
        max_tokens=60, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    assert call.function.name in schemas
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_a_named_function_is_called_and_streams_as_tool_call_deltas(clusters):
    stream = client(clusters(1)).chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=60, temperature=0, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    deltas, finish = [], None
    for chunk in stream:
        delta = chunk.choices[0].delta
        assert not delta.content, "a forced call has no text"
        deltas.extend(delta.tool_calls or [])
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert deltas and deltas[0].index == 0 and deltas[0].id.startswith("call_")
    assert all(d.function.name == "get_time" for d in deltas if d.function.name)
    arguments = "".join(d.function.arguments or "" for d in deltas if d.index == 0)
    jsonschema.validate(json.loads(arguments), TIME["function"]["parameters"])


def test_a_tool_result_sent_back_yields_an_answer(clusters):
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "sunny"}'}]
    r = client(clusters(1)).chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                                    max_tokens=30, temperature=0)
    choice = r.choices[0]
    assert choice.message.content and not choice.message.tool_calls
    assert choice.finish_reason in ("stop", "length")


def test_tool_choice_none_answers_in_text(clusters):
    r = client(clusters(1)).chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none",
                                                    max_tokens=12, temperature=0)
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls


@pytest.mark.parametrize("stages", [1, 3])
def test_json_schema_output_validates(clusters, stages):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = client(clusters(stages)).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a person."}], response_format=fmt,
        max_tokens=60, temperature=0)
    assert r.choices[0].finish_reason == "stop", r.choices[0]
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


def test_json_object_output_parses_also_streamed(clusters):
    stream = client(clusters(1)).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "List three colours."}],
        response_format={"type": "json_object"}, max_tokens=60, temperature=0.7, seed=3, stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    if chunks[-1].choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_tokens: the only other outcome the grammar allows
        assert chunks[-1].choices[0].finish_reason == "length"


@pytest.fixture(scope="module")
def whole_model():
    """The bundled model as one in-process float32 stage: the logits the test checks against."""
    from ringlet.daemon.engine.sources import resolve
    from ringlet.daemon.engine.stage import load_stage

    return load_stage(resolve(None), 0, None, "float32")


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    return x - (x.max() + np.log(np.exp(x - x.max()).sum()))


@pytest.mark.parametrize("stages", [1, 3])
def test_top_logprobs_equal_a_softmax_of_the_models_logits(clusters, whole_model, stages):
    import mlx.core as mx

    r = client(clusters(stages)).completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0, logprobs=3,
        extra_body={"return_token_ids": True})
    choice = r.choices[0]
    prompt_ids, ids = choice.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]
    # the logits as the ring computes them: the prompt's prefill, then one decode step per token
    cache = whole_model.make_cache()
    steps = [whole_model(mx.array([prompt_ids]), cache)[0, -1]]
    steps += [whole_model(mx.array([[t]]), cache)[0, -1] for t in ids[:-1]]
    lp = choice.logprobs
    assert len(lp.token_logprobs) == len(ids) == 4
    for k, token in enumerate(ids):
        expected = log_softmax(np.array(steps[k].astype(mx.float32)))
        assert lp.token_logprobs[k] == pytest.approx(expected[token], abs=1e-4)
        top = np.argsort(-expected)[:3]
        assert top[0] == token  # greedy
        assert sorted(lp.top_logprobs[k].values(), reverse=True) == pytest.approx(expected[top].tolist(), abs=1e-4)


def test_chat_logprobs_and_n_choices(clusters):
    r = client(clusters(1)).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi"}], max_tokens=5, temperature=0.9, seed=11,
        logprobs=True, top_logprobs=2, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for c in r.choices:
        content = c.logprobs.content
        assert 1 <= len(content) <= 5
        for item in content:
            assert item.logprob <= 0 and len(item.top_logprobs) == 2
            assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
            assert item.logprob <= item.top_logprobs[0].logprob + 1e-6
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)


def test_logit_bias_forces_and_forbids_tokens(clusters, whole_model):
    import mlx.core as mx

    from ringlet.daemon.engine.model_info import load_tokenizer
    from ringlet.daemon.engine.sources import resolve

    tok = load_tokenizer(resolve(None))
    prompt = "One, two, three,"
    ids = tok.encode(prompt)
    greedy = int(np.argmax(np.array(whole_model(mx.array([ids]), whole_model.make_cache())[0, -1])))
    c = client(clusters(1))
    forced = c.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                  logit_bias={str(tok.encode(" seven")[0]): 100}, extra_body={"return_token_ids": True})
    assert forced.choices[0].model_extra["token_ids"] == [tok.encode(" seven")[0]] * 3
    banned = c.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                  logit_bias={str(greedy): -100}, extra_body={"return_token_ids": True})
    assert banned.choices[0].model_extra["token_ids"][0] != greedy
    # penalties and min_p are honoured (accepted, and a huge repetition penalty changes a repetitive answer)
    plain = c.completions.create(model=MODEL, prompt="a a a a a a a a", max_tokens=6, temperature=0)
    penalised = c.completions.create(model=MODEL, prompt="a a a a a a a a", max_tokens=6, temperature=0,
                                     presence_penalty=2.0, frequency_penalty=2.0,
                                     extra_body={"repetition_penalty": 5.0, "min_p": 0.05})
    assert plain.choices[0].text != penalised.choices[0].text


@pytest.mark.parametrize(("body", "field"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "not a schema"}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"n": 9}, "n"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"frobnicate": True}, "frobnicate"),
    ({"messages": [{"role": "user", "content": "x", "audio": {}}]}, "messages.0.audio"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ({"continue_final_message": True, "add_generation_prompt": True}, "add_generation_prompt"),
])
def test_bad_agent_fields_get_a_400_naming_them_and_the_node_keeps_serving(clusters, body, field):
    c = client(clusters(1))
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model=MODEL, messages=body.pop("messages", ASK), max_tokens=4, extra_body=body)
    error = info.value.body
    assert field in (error.get("param") or "") or field in error["message"], error
    assert c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2).choices[0].message.content is not None
