"""Tool calls stream while they are generated (issue #32, point 5).

Unit tests of the incremental scanner of ringlet's call format and of the call events
(hand-made pieces split at every position; the expected names and arguments texts are
written by hand from the JSON spec), then real float32 daemons of the bundled model
driven by the official ``openai`` and ``anthropic`` clients: a forced call streamed at
temperature 0 arrives in several arguments pieces, the first long before the call's
last token, and the pieces joined equal the non-streamed call's arguments (the same
greedy request), non-ASCII arguments included.
"""

from __future__ import annotations

import importlib
import json

import anthropic
import jsonschema
import openai
import pytest

from ringlet.daemon.api import prompting
from ringlet.daemon.api.call_stream import CallScanner, CallStream
from ringlet.daemon.api.pipeline import Pipeline
from ringlet.daemon.api.request import TextDelta, ToolCall, ToolCallDelta, ToolCallStart
from ringlet.daemon.api.text import TextSplitter
from ringlet.daemon.ops.demo import LocalCluster

# --- the scanner, on hand-made pieces ------------------------------------------------------

BODY = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
ARGS = '{"city": "Paris", "unit": "celsius"}'


def scan(pieces: list[str]) -> tuple[list[tuple[str, str]], CallScanner]:
    scanner = CallScanner()
    events = []
    for piece in pieces:
        events += scanner.feed(piece)
    return events, scanner


def streamed(events: list[tuple[str, str]]) -> tuple[str | None, str]:
    """(the started name, the arguments joined), checking the start comes first, once."""
    if not events:
        return None, ""
    assert events[0][0] == "start" and all(kind == "arguments" for kind, _ in events[1:])
    return events[0][1], "".join(text for _, text in events[1:])


def test_every_split_in_three_streams_the_name_then_the_arguments():
    for i in range(len(BODY) + 1):
        for j in range(i, len(BODY) + 1):
            events, scanner = scan([BODY[:i], BODY[i:j], BODY[j:]])
            assert streamed(events) == ("get_weather", ARGS), (i, j)
            assert scanner.closed and not scanner.failed


def test_the_call_starts_when_its_arguments_object_begins_and_nothing_in_it_is_held():
    opening = BODY.index('{"city"')  # where the arguments object begins
    events, _ = scan([BODY[:opening]])
    assert events == []  # the name alone does not start a call
    scanner = CallScanner()
    assert scanner.feed(BODY[:opening + 1]) == [("start", "get_weather"), ("arguments", "{")]
    sent = "{"
    for k in range(opening + 1, opening + len(ARGS)):  # one character at a time: each given out at once
        assert scanner.feed(BODY[k]) == [("arguments", BODY[k])]
        sent += BODY[k]
    assert sent == ARGS and scanner.closed
    assert scanner.feed("}") == []  # the body's own closing brace


def check_every_split(body: str, name: str, arguments: str) -> None:
    """Fed whole, one character at a time, and split in two at every position."""
    assert streamed(scan([body])[0]) == (name, arguments)
    assert streamed(scan(list(body))[0]) == (name, arguments)
    for i in range(len(body) + 1):
        assert streamed(scan([body[:i], body[i:]])[0]) == (name, arguments), i


def test_escapes_and_strings_holding_braces_brackets_and_quotes():
    arguments = r'{"q": "say \"hi\" \\ {not} [x] }", "r": "\\", "s": "\"}"}'
    check_every_split('{"name": "f", "arguments": ' + arguments + "}", "f", arguments)
    assert json.loads(arguments) == {"q": 'say "hi" \\ {not} [x] }', "r": "\\", "s": '"}'}


def test_nested_objects_and_arrays():
    arguments = '{"a": {"b": [1, {"c": []}, "]"]}, "d": {}, "e": [[], [{}]]}'
    check_every_split('{"name": "f", "arguments": ' + arguments + "}", "f", arguments)


def test_non_ascii_arguments_pass_as_written():
    arguments = '{"city": "東京", "alt": "São Paulo", "esc": "Z\\u00fcrich"}'
    check_every_split('{"name": "book", "arguments": ' + arguments + "}", "book", arguments)
    assert json.loads(arguments) == {"city": "東京", "alt": "São Paulo", "esc": "Zürich"}


def test_a_name_with_escapes_is_decoded():
    assert streamed(scan(['{"name": "f\\u00e9\\"", "arguments": {}}'])[0]) == ('fé"', "{}")


def test_whitespace_and_other_keys_before_the_name():
    body = '{ "type" : "function" , "id": -7.5e1, "flag": true, "x": [1, "]"],\n "name" : "f" ,\n "arguments" :\t{ } }'
    check_every_split(body, "f", "{ }")


def test_arguments_written_first_start_the_call_when_the_name_is_read():
    body = '{"arguments": {"x": [1, 2]}, "name": "f"}'
    named = body.index('"f"') + 2  # the name's closing quote
    scanner = CallScanner()
    for k, ch in enumerate(body):
        events = scanner.feed(ch)
        if k == named:
            assert events == [("start", "f"), ("arguments", '{"x": [1, 2]}')]
        else:
            assert events == [], k


@pytest.mark.parametrize("body", [
    '[{"name": "f", "arguments": {}}]',  # a list of calls: parsed whole at the end
    "I would call f",
    '{"name": null, "arguments": {}}',
    '{"name": "f", "arguments": "{\\"x\\": 1}"}',  # arguments as a JSON string: parsed whole at the end
    '{"name" "f", "arguments": {}}',
])
def test_a_body_of_another_shape_starts_no_call(body):
    for pieces in ([body], list(body)):
        events, scanner = scan(pieces)
        assert events == [] and scanner.failed and not scanner.started


def test_arguments_without_a_name_start_no_call():
    events, scanner = scan(list('{"arguments": {"x": 1}}'))
    assert events == [] and scanner.closed and not scanner.started


# --- the events of a choice: splitter, call stream and the pipeline's assembly -------------


def events_of(text: str, fmt: prompting.ToolFormat = prompting.JSON_FORMAT, piece: int = 3,
              flush: bool = True) -> list[list]:
    """The pipeline's events for ``text`` fed in ``piece``-character pieces: one list per feed."""
    splitter = TextSplitter([], (fmt.start, fmt.end))
    calls = CallStream(fmt, [], 0)
    out = [Pipeline._split(splitter.feed(text[i:i + piece]), calls, 0, []) for i in range(0, len(text), piece)]
    if flush:
        out.append(Pipeline._split(splitter.flush(), calls, 0, []))
    return out


def flat(feeds: list[list]) -> list:
    return [e for feed in feeds for e in feed]


def calls_in(events: list) -> list[tuple[str, str, str]]:
    """(name, arguments joined from the deltas, completion's arguments) of each call,
    checking each call's events are start, deltas, completion, with one index and id."""
    out, current = [], None
    for e in events:
        if isinstance(e, ToolCallStart):
            assert current is None
            current = [e, ""]
        elif isinstance(e, ToolCallDelta):
            assert current is not None and e.index == current[0].index
            current[1] += e.arguments
        elif isinstance(e, ToolCall):
            start, joined = current
            assert (e.index, e.id, e.name) == (start.index, start.id, start.name)
            out.append((e.name, joined, e.arguments))
            current = None
    assert current is None
    return out


def test_a_call_streams_between_text_and_its_pieces_equal_the_completion():
    feeds = events_of('Sure. <tool_call>{"name": "f", "arguments": {"a": "xyz", "b": [1, 2]}}</tool_call>')
    events = flat(feeds)
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert text == "Sure. "
    assert calls_in(events) == [("f", '{"a": "xyz", "b": [1, 2]}', '{"a": "xyz", "b": [1, 2]}')]
    with_deltas = [k for k, feed in enumerate(feeds) if any(isinstance(e, ToolCallDelta) for e in feed)]
    done = next(k for k, feed in enumerate(feeds) if any(isinstance(e, ToolCall) for e in feed))
    assert len(with_deltas) >= 5 and with_deltas[-1] <= done  # 25 characters of arguments in 3-character feeds
    assert [e.index for e in events if isinstance(e, ToolCallStart)] == [0]


def test_two_calls_in_a_row_are_numbered():
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>{"name": "g", "arguments": {"k": 1}}' \
           '</tool_call>'
    events = flat(events_of(text, piece=1))
    assert calls_in(events) == [("f", "{}", "{}"), ("g", '{"k": 1}', '{"k": 1}')]
    assert [e.index for e in events if isinstance(e, ToolCall)] == [0, 1]
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "\n"


def test_arguments_as_a_string_come_whole_at_the_end_marker():
    text = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    feeds = events_of(text, piece=len(text) - 2)  # the end marker's last characters come last
    assert flat(feeds[:1]) == []
    assert calls_in(flat(feeds)) == [("f", '{"a": 1}', '{"a": 1}')]


def test_a_list_of_calls_comes_whole_with_its_characters_unescaped():
    text = '<tool_call>[{"name": "f", "arguments": {"a": "é"}}, {"name": "g", "arguments": {}}]</tool_call>'
    assert calls_in(flat(events_of(text))) == [("f", '{"a": "é"}', '{"a": "é"}'), ("g", "{}", "{}")]


def test_a_body_that_is_not_a_call_stays_text():
    events = flat(events_of("a <tool_call>hello {}</tool_call> b"))
    assert all(isinstance(e, TextDelta) for e in events)
    assert "".join(e.text for e in events) == "a <tool_call>hello {}</tool_call> b"


def test_a_call_cut_by_the_token_cap_is_completed_with_what_was_written():
    events = flat(events_of('<tool_call>{"name": "f", "arguments": {"a": "Zü'))
    assert calls_in(events) == [("f", '{"a": "Zü', '{"a": "Zü')]
    assert [e.cut for e in events if isinstance(e, ToolCall)] == [True]


def test_a_native_format_call_comes_at_its_end_in_one_piece():
    module = importlib.import_module("mlx_lm.tool_parsers.mistral")
    fmt = prompting.ToolFormat(module.tool_call_start, "", module.parse_tool_call, native=True)
    feeds = events_of('ok[TOOL_CALLS]get_weather[ARGS]{"city": "Zürich"}', fmt)
    assert not any(isinstance(e, ToolCallStart | ToolCallDelta | ToolCall) for e in flat(feeds[:-1]))
    assert [type(e) for e in feeds[-1]] == [ToolCallStart, ToolCallDelta, ToolCall]
    assert calls_in(feeds[-1]) == [("get_weather", '{"city": "Zürich"}', '{"city": "Zürich"}')]


# --- real daemons, official clients -------------------------------------------------------

MODEL = "smollm2-135m"
WEATHER = {"name": "get_weather", "description": "The current weather of a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 20},
               "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
               "required": ["city", "unit"], "additionalProperties": False}}
CITIES = ["Zürich", "São Paulo", "東京"]
TRIP = {"name": "book_trip", "description": "Book a trip to a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": CITIES}},
                       "required": ["city"], "additionalProperties": False}}
ASK = {"get_weather": "What is the weather in Paris?", "book_trip": "Book me a trip to Tokyo."}
TOOLS = {"get_weather": WEATHER, "book_trip": TRIP}
MIN_PIECES = 4  # the arguments objects here take 8 to 20 tokens


@pytest.fixture(scope="module")
def cluster():
    """A float32 one-stage cluster (the agents' tests stream forced calls through two)."""
    c = LocalCluster(1, dtype="float32").start()
    try:
        yield c
    finally:
        c.stop()


def check_arguments(name: str, arguments: str) -> None:
    """Valid against the tool's schema; non-ASCII values as raw characters."""
    value = json.loads(arguments)
    jsonschema.validate(value, TOOLS[name]["parameters"])
    if name == "book_trip":
        assert value["city"] in CITIES and value["city"] in arguments and "\\u" not in arguments


def chat(cluster: LocalCluster, name: str, **extra):
    c = openai.OpenAI(base_url=cluster.api_urls[0] + "/v1", api_key="none", max_retries=0, timeout=300)
    return c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": ASK[name]}], max_tokens=80, temperature=0,
        tools=[{"type": "function", "function": TOOLS[name]}], parallel_tool_calls=False,
        tool_choice={"type": "function", "function": {"name": name}} if name == "book_trip" else "required",
        **extra)


def check_chat_stream(cluster: LocalCluster, name: str) -> None:
    whole = chat(cluster, name).choices[0]
    assert whole.finish_reason == "tool_calls"
    [call] = whole.message.tool_calls
    assert call.function.name == name
    check_arguments(name, call.function.arguments)

    chunks = list(chat(cluster, name, stream=True))
    pieces = [(k, d) for k, ch in enumerate(chunks) for d in ch.choices[0].delta.tool_calls or ()]
    finish = [k for k, ch in enumerate(chunks) if ch.choices[0].finish_reason]
    assert [chunks[k].choices[0].finish_reason for k in finish] == ["tool_calls"]
    _, first = pieces[0]  # names the call, with empty arguments, as OpenAI's first piece does
    assert (first.index, first.type, first.function.name, first.function.arguments) == (0, "function", name, "")
    assert first.id.startswith("call_")
    rest = [d for _, d in pieces[1:]]
    assert all(d.index == 0 and d.id is None and d.function.name is None and d.function.arguments for d in rest)
    assert len(rest) >= MIN_PIECES and all(k < finish[0] for k, _ in pieces)
    assert len({k for k, _ in pieces}) == len(pieces)  # one piece a chunk: each from its own token
    assert "".join(d.function.arguments for d in rest) == call.function.arguments

    # with the token ids (vLLM's extension): each token's chunk follows its pieces, so the
    # ids counted when a piece arrives tell which token it came from
    ids, first_at, last_at = 0, None, None
    for ch in chat(cluster, name, stream=True, extra_body={"return_token_ids": True}):
        choice = ch.choices[0]
        if any(d.function.arguments for d in choice.delta.tool_calls or ()):
            first_at = ids if first_at is None else first_at
            last_at = ids
        if not choice.finish_reason:
            ids += len((choice.model_extra or {}).get("token_ids") or ())
    assert first_at is not None and last_at - first_at >= MIN_PIECES - 1
    assert ids - first_at > MIN_PIECES  # the tokens written after the first piece (the call's rest, its end marker)


@pytest.mark.parametrize("name", ["get_weather", "book_trip"])
def test_chat_completions_stream_a_forced_call_as_it_is_written(cluster, name):
    check_chat_stream(cluster, name)


@pytest.mark.parametrize("name", ["book_trip"])  # its arguments are non-ASCII; get_weather's stream as chat's
def test_anthropic_input_json_streams_and_parses_to_the_whole_input(cluster, name):
    c = anthropic.Anthropic(base_url=cluster.api_urls[0], api_key="none", max_retries=0, timeout=300)
    tool = {"name": name, "description": TOOLS[name]["description"], "input_schema": TOOLS[name]["parameters"]}
    kwargs = {"model": MODEL, "max_tokens": 80, "tools": [tool], "extra_body": {"temperature": 0},
              "tool_choice": {"type": "tool", "name": name}, "messages": [{"role": "user", "content": ASK[name]}]}
    whole = c.messages.create(**kwargs)
    assert whole.stop_reason == "tool_use"
    [use] = [b for b in whole.content if b.type == "tool_use"]
    with c.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    raw = [e for e in events if e.type.startswith("content_block") or e.type.startswith("message")]
    [start] = [k for k, e in enumerate(raw) if e.type == "content_block_start" and e.content_block.type == "tool_use"]
    block = raw[start].content_block
    assert (block.name, block.input) == (name, {}) and block.id.startswith("toolu_")
    deltas = [k for k, e in enumerate(raw) if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
    [stop] = [k for k, e in enumerate(raw) if e.type == "content_block_stop" and e.index == raw[start].index]
    assert len(deltas) >= MIN_PIECES and start < deltas[0] and deltas[-1] < stop
    assert all(raw[k].index == raw[start].index for k in deltas)
    partial = "".join(raw[k].delta.partial_json for k in deltas)
    check_arguments(name, partial)
    assert json.loads(partial) == use.input == final.content[-1].input
    assert final.stop_reason == "tool_use"


@pytest.mark.parametrize("name", ["book_trip"])
def test_responses_function_call_arguments_stream(cluster, name):
    c = openai.OpenAI(base_url=cluster.api_urls[0] + "/v1", api_key="none", max_retries=0, timeout=300)
    kwargs = {"model": MODEL, "input": ASK[name], "temperature": 0, "max_output_tokens": 80,
              "tools": [{"type": "function", "strict": True, **TOOLS[name]}],
              "tool_choice": {"type": "function", "name": name}}
    whole = c.responses.create(**kwargs)
    [call] = [item for item in whole.output if item.type == "function_call"]
    assert call.status == "completed"
    check_arguments(name, call.arguments)
    events = list(c.responses.create(**kwargs, stream=True))
    [added] = [k for k, e in enumerate(events) if e.type == "response.output_item.added"
               and e.item.type == "function_call"]
    assert events[added].item.arguments == "" and events[added].item.name == name
    index = events[added].output_index
    deltas = [k for k, e in enumerate(events) if e.type == "response.function_call_arguments.delta"
              and e.output_index == index]
    [done] = [k for k, e in enumerate(events) if e.type == "response.function_call_arguments.done"]
    assert len(deltas) >= MIN_PIECES and added < deltas[0] and deltas[-1] < done
    joined = "".join(events[k].delta for k in deltas)
    assert joined == events[done].arguments == call.arguments
    assert events[-1].type == "response.completed"
    [streamed_call] = [item for item in events[-1].response.output if item.type == "function_call"]
    assert streamed_call.arguments == joined and streamed_call.status == "completed"
