"""Tool calls and reasoning in real models' output formats.

Each format ringlet selects from a model's chat template (as mlx-lm's loader does) is
fed the text such a model writes, as its model card shows it, in small streamed pieces;
the calls expected are written by hand. Reasoning is split from the answer by mlx-lm's
think-token detection, on a tokenizer that has DeepSeek R1 / Qwen3's ``<think>`` tokens.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from ringlet.daemon.api import prompting
from ringlet.daemon.api.call_stream import CallStream, parse_calls
from ringlet.daemon.api.pipeline import Pipeline
from ringlet.daemon.api.request import GenerationRequest, ReasoningDelta, TextDelta, Tool, ToolCall
from ringlet.daemon.api.text import TextSplitter
from ringlet.daemon.api.tokenizer import LazyTokenizer

WEATHER = Tool("get_weather", "weather of a city", {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]})

#: (template fragment that selects the format, model output, expected (name, arguments) calls)
FORMATS = {
    "json_tools": (  # Qwen2.5 / Hermes
        "{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>{{ tool_call.name }}</tool_call>",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>',
        [("get_weather", {"city": "Paris", "days": 2})]),
    "qwen3_coder": (
        "{% if tools %}{{ tools }}{% endif %}<tool_call>\n<function=",
        "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
        [("get_weather", {"city": "Paris", "days": 2})]),
    "kimi_k2": (
        "{% if tools %}{{ tools }}{% endif %}<|tool_calls_section_begin|>",
        "Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Paris", "days": 2}<|tool_call_end|><|tool_call_begin|>'
        'functions.get_weather:1<|tool_call_argument_begin|>{"city": "Rome"}<|tool_call_end|>'
        "<|tool_calls_section_end|>",
        [("get_weather", {"city": "Paris", "days": 2}), ("get_weather", {"city": "Rome"})]),
    "glm47": (
        "{% if tools %}{{ tools }}{% endif %}<tool_call>{{ name }}<arg_key>",
        "Let me check.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
        "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>",
        [("get_weather", {"city": "Paris", "days": 2})]),
    "minimax_m2": (
        "{% if tools %}{{ tools }}{% endif %}<minimax:tool_call>",
        'Let me check.<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
        '<parameter name="days">2</parameter>\n</invoke>\n</minimax:tool_call>',
        [("get_weather", {"city": "Paris", "days": 2})]),
    "mistral": (
        "{% if tools %}{{ tools }}{% endif %}[TOOL_CALLS]",
        'Let me check.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}',
        [("get_weather", {"city": "Paris", "days": 2})]),
}


@pytest.fixture(scope="module")
def tokenizer():
    from ringlet.daemon.engine.model_info import load_tokenizer
    from ringlet.daemon.engine.sources import resolve

    return load_tokenizer(resolve(None))


def merged(parts: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Adjacent text parts joined (the splitter emits text as soon as it is decided), and
    a call's streamed ``body`` pieces left out once checked against its whole body."""
    out: list[tuple[str, str]] = []
    body = ""
    for kind, text in parts:
        if kind == "body":
            body += text
            continue
        if kind in ("call", "cut"):
            assert text == body, "the body's pieces make up the call's body"
            body = ""
        if out and kind == "text" and out[-1][0] == "text":
            out[-1] = ("text", out[-1][1] + text)
        else:
            out.append((kind, text))
    return out


def split(text: str, fmt: prompting.ToolFormat, piece: int = 3) -> list[tuple[str, str]]:
    splitter = TextSplitter([], (fmt.start, fmt.end))
    parts = []
    for i in range(0, len(text), piece):
        parts += splitter.feed(text[i:i + piece])
    return merged(parts + splitter.flush())


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_each_selected_parser_reads_its_models_output(tokenizer, name):
    template, output, expected = FORMATS[name]
    original = tokenizer._tokenizer.chat_template
    tokenizer._tokenizer.chat_template = template
    try:
        fmt = prompting.native_format(tokenizer)
    finally:
        tokenizer._tokenizer.chat_template = original
    assert fmt is not None and fmt.native
    parts = split(output, fmt)
    text = "".join(t for kind, t in parts if kind == "text")
    assert text.strip() == "Let me check."
    calls = []
    for kind, body in parts:
        if kind == "call":
            calls += parse_calls(fmt, body, [WEATHER])
    assert [(n, json.loads(a)) for n, a in calls] == expected


def test_a_template_without_tool_markup_gets_ringlets_json_format(tokenizer):
    assert prompting.native_format(tokenizer) is None  # SmolLM2's template renders no tools
    request = GenerationRequest(messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER])
    ids, fmt = prompting.chat_prompt(tokenizer, request)
    assert fmt is prompting.JSON_FORMAT
    prompt = tokenizer.decode(ids)
    assert "get_weather" in prompt and "<tool_call>" in prompt  # the tools are in the system message


def test_stop_strings_and_markers_split_across_pieces():
    fmt = prompting.JSON_FORMAT
    splitter = TextSplitter(["STOP"], (fmt.start, fmt.end))
    text = 'Hi <tool_ca' + 'll>{"name": "f", "arguments": {}}</tool' + '_call> then ST' + 'OP and more'
    parts = []
    for piece in ('Hi <tool_ca', 'll>{"name": "f", "arguments": {}}</tool', '_call> then ST', 'OP and more'):
        parts += splitter.feed(piece)
    parts += splitter.flush()
    assert splitter.stopped and splitter.seen == text
    assert merged(parts) == [("text", "Hi "), ("call", '{"name": "f", "arguments": {}}'), ("text", " then ")]


def test_an_unclosed_call_stays_text():
    fmt = prompting.JSON_FORMAT
    splitter = TextSplitter([], (fmt.start, fmt.end))
    parts = splitter.feed('ok <tool_call>{"name": "f"') + splitter.flush()
    assert merged(parts) == [("text", "ok "), ("cut", '{"name": "f"')]
    calls = CallStream(fmt, [], 0)  # no call started (no arguments yet): the body is text again
    events = [e for kind, text in parts if kind != "text" for e in calls.take(kind, text)]
    assert events == [TextDelta('<tool_call>{"name": "f"')] and calls.count == 0


class ScriptedRing:
    """Yields a fixed token sequence for any request: the ring's place in a unit test of
    the pipeline's splitting (a model that thinks cannot run here)."""

    def __init__(self, ids: list[int]):
        self.ids = ids

    async def generate(self, prompt, max_tokens, sampling, stop_ids, cache_scope="", info=None, prediction=None):
        for t in self.ids[:max_tokens]:
            yield t


def thinking_tokenizer():
    """The bundled tokenizer with ``<think>`` / ``</think>`` as special tokens, and a
    template that opens a think block after the generation prompt (as Qwen3 and
    DeepSeek R1 do)."""
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from ringlet.daemon.engine.gguf import open_gguf, tokenizer_dict
    from ringlet.daemon.engine.sources import resolve

    base = Tokenizer.from_str(load_base().backend_tokenizer.to_str())
    base.add_special_tokens(["<think>", "</think>"])
    _, config = tokenizer_dict(open_gguf(resolve(None).path))
    hf = PreTrainedTokenizerFast(tokenizer_object=base, **config)
    hf.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                        "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")
    return TokenizerWrapper(hf, BPEStreamingDetokenizer)


def load_base():
    return load_tokenizer_wrapper()._tokenizer


def test_reasoning_is_split_from_the_answer_by_the_think_tokens():
    from ringlet.daemon.wire.limits import ApiLimits

    tok = thinking_tokenizer()
    assert tok.has_thinking
    answer = "The capital is Paris."
    ids = tok.encode("\nParis is the capital of France.\n", add_special_tokens=False) + [tok.think_end_id] \
        + tok.encode(answer, add_special_tokens=False) + [tok.eos_token_id]
    pipeline = Pipeline(ScriptedRing(ids), LazyTokenizer(lambda: tok), "m", 4096, ApiLimits())

    async def run():
        request = GenerationRequest(messages=[{"role": "user", "content": "Capital of France?"}], temperature=0)
        prepared = await pipeline.admit(None, lambda: request, "")
        assert prepared.thinking  # the template left a think block open
        return [e async for e in pipeline.run(prepared)]

    events = asyncio.run(run())
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert reasoning == "\nParis is the capital of France.\n"
    assert text == answer and not any(isinstance(e, ToolCall) for e in events)


@pytest.mark.parametrize(("parallel", "calls"), [(True, ["f", "g"]), (False, ["f"])])
def test_parallel_tool_calls_false_ends_the_reply_at_its_first_call(parallel, calls):
    """With ``auto`` no grammar limits the calls: ``parallel_tool_calls: false`` ends the
    reply once its first call is complete (a model that writes two gets one)."""
    from ringlet.daemon.wire.limits import ApiLimits

    tok = load_tokenizer_wrapper()
    text = ('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>\n'
            '<tool_call>{"name": "g", "arguments": {}}</tool_call> and text')
    ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    pipeline = Pipeline(ScriptedRing(ids), LazyTokenizer(lambda: tok), "m", 4096, ApiLimits())
    tools = [Tool("f", parameters={"type": "object", "properties": {"a": {"type": "integer"}}}), Tool("g")]

    async def run():
        request = GenerationRequest(messages=[{"role": "user", "content": "Call f and g."}], tools=tools,
                                    parallel_tool_calls=parallel, temperature=0)
        return [e async for e in pipeline.run(await pipeline.admit(None, lambda: request, ""))]

    events = asyncio.run(run())
    assert [e.name for e in events if isinstance(e, ToolCall)] == calls
    assert "".join(e.text for e in events if isinstance(e, TextDelta)).strip() == ("and text" if parallel else "")
    finished = next(e for e in events if type(e).__name__ == "Finished")
    assert finished.reason == "tool_calls"


def load_tokenizer_wrapper():
    from ringlet.daemon.engine.model_info import load_tokenizer
    from ringlet.daemon.engine.sources import resolve

    return load_tokenizer(resolve(None))
