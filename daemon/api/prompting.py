"""From a :class:`GenerationRequest` to prompt token ids and the constraint on the output.

Tools reach the model in one of two ways:

- **The model's own format.** When the chat template renders ``tools`` and mlx-lm has
  a tool parser for the model (``mlx_lm.tool_parsers``, picked from the template as
  ``mlx_lm.tokenizer_utils`` does), the template gets the tools, the assistant
  ``tool_calls`` and the ``tool`` messages, and the output is parsed with that parser.
- **ringlet's JSON format**, for every other model (the bundled SmolLM2 has no tool
  markup) and whenever a call is *forced* (``tool_choice`` ``required`` or a named
  function): the tools are rendered into the system message with an instruction to
  answer ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (the format of
  mlx-lm's ``json_tools`` parser, Hermes and Qwen's), earlier calls and results are
  rendered in the same format, and a forced call is enforced by a grammar on the last
  stage (:mod:`ringlet.daemon.engine.grammar`).
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from typing import Any

from mlx_lm.tool_parsers import json_tools

from ringlet.daemon.api.errors import ApiError
from ringlet.daemon.api.request import CUSTOM_INPUT, GenerationRequest, Tool
from ringlet.daemon.engine import grammar as grammars

JSON_CALL_START, JSON_CALL_END = json_tools.tool_call_start, json_tools.tool_call_end
#: template variables a request may not set through ``chat_template_kwargs``
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt", "tokenize", "conversation",
                                      "return_dict", "chat_template", "documents"})


@dataclass(frozen=True)
class ToolFormat:
    """How tool calls look in the output and how they are parsed.

    Attributes:
        start, end: the markers around one call ("" end: the call runs to the end).
        parse: ``(text between the markers, tools) -> {"name", "arguments"}`` or a list
            of them; raises on text that is not a call.
        native: the model's own format (through its template), not ringlet's.
    """

    start: str
    end: str
    parse: Any
    native: bool


#: ringlet's format is mlx-lm's json_tools one; its parser reads the calls
JSON_FORMAT = ToolFormat(JSON_CALL_START, JSON_CALL_END, json_tools.parse_tool_call, native=False)


def native_format(tokenizer) -> ToolFormat | None:
    """The model's own tool-call format, when its template renders tools and mlx-lm
    has a parser for it; else ``None``."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or "tools" not in template:
        return None
    if getattr(tokenizer, "tool_parser", None) is not None and getattr(tokenizer, "tool_call_start", None):
        return ToolFormat(tokenizer.tool_call_start, tokenizer.tool_call_end or "", tokenizer.tool_parser, True)
    try:  # a tokenizer built from a GGUF file: infer the parser as mlx-lm's loader does
        from mlx_lm.tokenizer_utils import _infer_tool_parser

        name = _infer_tool_parser(tokenizer._tokenizer)
    except Exception:  # noqa: BLE001 - no parser known: ringlet's format
        return None
    if name is None:
        return None
    module = importlib.import_module(f"mlx_lm.tool_parsers.{name}")
    return ToolFormat(module.tool_call_start, getattr(module, "tool_call_end", "") or "", module.parse_tool_call, True)


def forced_custom(request: GenerationRequest) -> Tool | None:
    """The custom tool with a grammar that the request forces a call to, if any: its call
    is written raw (``<tool_call>name`` newline, the input, ``</tool_call>``) so the
    grammar can apply to the input itself."""
    if not forced(request):
        return None
    tool = next((t for t in request.tools if t.name == request.tool_choice), None)
    return tool if tool is not None and tool.custom and tool.grammar else None


def parse_custom_call(body: str, tools: list[Tool]) -> tuple[str, str] | None:
    """``(name, arguments JSON)`` of a raw custom call body (``name`` newline input),
    or ``None`` when ``body`` is not one."""
    name, newline, text = body.partition("\n")
    tool = next((t for t in tools if t.custom and t.name == name), None)
    if tool is None or not newline:
        return None
    return name, json.dumps({CUSTOM_INPUT: text}, ensure_ascii=False)


def tool_instructions(tools: list[Tool], choice: str, raw: Tool | None = None) -> str:
    """The system-prompt text that teaches a model ringlet's tool-call format (``raw``:
    a forced custom tool whose input is written raw)."""
    lines = [json.dumps(t.as_openai()["function"]) for t in tools]
    must = {"auto": "Call a function only when it helps to answer.",
            "required": "You must call one of these functions."}.get(choice, f"You must call the function {choice}.")
    if raw is not None:
        must = (f"You must call the function {raw.name}, writing its input as it is, not as JSON:\n"
                f"{JSON_CALL_START}{raw.name}\n<its input>{JSON_CALL_END}")
    return ("You can call these functions. Their signatures, in JSON Schema:\n<tools>\n" + "\n".join(lines)
            + "\n</tools>\nTo call a function, answer with\n" + JSON_CALL_START
            + '{"name": "<function name>", "arguments": <an object of its arguments>}' + JSON_CALL_END
            + "\n" + must)


def _json_calls(message: dict[str, Any]) -> str:
    calls = [JSON_CALL_START + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
             + JSON_CALL_END for c in message.get("tool_calls") or ()]
    return "\n".join(filter(None, [message.get("content") or "", *calls]))


def _in_json_format(messages: list[dict[str, Any]], tools: list[Tool], choice: str,
                    raw: Tool | None = None) -> list[dict[str, Any]]:
    """The conversation with tools, calls and results as text in ringlet's format."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            out.append({"role": "assistant", "content": _json_calls(m)})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
        else:
            out.append({"role": m["role"], "content": m.get("content") or ""})
    if tools and choice != "none":
        text = tool_instructions(tools, choice, raw)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def forced(request: GenerationRequest) -> bool:
    """Whether the request forces a tool call (``required`` or a named function)."""
    return bool(request.tools) and request.tool_choice not in ("auto", "none")


def chat_prompt(tokenizer, request: GenerationRequest) -> tuple[list[int], ToolFormat | None]:
    """The chat's prompt token ids, and the tool format its output is parsed with
    (``None``: no tools, or ``tool_choice`` ``none``). A request with ``prefill`` ends
    inside its last message (Hugging Face's ``continue_final_message``).

    Raises:
        ApiError: the template rejected the messages (400, naming the template's error).
    """
    messages = request.messages or []
    tools_on = bool(request.tools) and request.tool_choice != "none"
    native = None if forced(request) else native_format(tokenizer)
    kwargs = dict(request.template_kwargs)
    if native is not None:  # the template renders tools, calls and results itself
        if tools_on:
            kwargs["tools"] = [t.as_openai() for t in request.tools]
        rendered, fmt = messages, (native if tools_on else None)
    else:
        rendered = _in_json_format(messages, request.tools if tools_on else [], request.tool_choice,
                                   forced_custom(request))
        fmt = JSON_FORMAT if tools_on else None
    if request.prefill:  # the answer continues the last (assistant) message: no new turn, that one left open
        kwargs["continue_final_message"] = True
    try:
        ids = tokenizer.apply_chat_template(rendered, add_generation_prompt=request.generation_prompt
                                            and not request.prefill, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the template raises jinja2 errors of many kinds
        raise ApiError(400, f"the chat template rejected the messages: {exc}", param="messages") from None
    return list(ids), fmt


def output_grammar(request: GenerationRequest) -> str:
    """The llguidance grammar the output must follow ("" for none).

    Raises:
        ApiError: a schema that cannot be compiled (400, naming the field), or a
            forced tool call combined with ``response_format``.
    """
    if forced(request):
        if request.response_format is not None:
            raise ApiError(400, "response_format cannot be combined with a forced tool call "
                                "(tool_choice 'required' or a named function)", param="response_format")
        if (raw := forced_custom(request)) is not None:
            try:
                return grammars.custom_call_grammar(raw.name, raw.grammar, JSON_CALL_START, JSON_CALL_END)
            except grammars.GrammarError as exc:
                raise ApiError(400, f"the custom tool's grammar cannot be used: {exc}", param="tools") from None
        tools = request.tools if request.tool_choice == "required" else \
            [t for t in request.tools if t.name == request.tool_choice]
        calls = [(t.name, t.parameters) for t in tools]
        try:
            return grammars.lark_grammar(grammars.tool_call_lark(calls, JSON_CALL_START, JSON_CALL_END,
                                                                 request.parallel_tool_calls))
        except grammars.GrammarError as exc:
            raise ApiError(400, f"a tool's parameters schema cannot be used: {exc}", param="tools") from None
    fmt = request.response_format
    if fmt is None:
        return ""
    schema = {"type": "object"} if fmt.kind == "json_object" else fmt.schema
    try:
        return grammars.json_schema_grammar(schema)
    except grammars.GrammarError as exc:
        raise ApiError(400, f"response_format: {exc}", param="response_format") from None
